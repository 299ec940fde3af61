"""Arithmetic word problems for a real instruct model: mixed difficulty, a held-out split, and other phrasings.

    Mia has 14 stickers. She buys 9 more stickers. How many stickers does Mia have now?
    Give the final answer as a number after 'The answer is'.

Each problem is a kind (add, subtract, multiply, divide, add-then-subtract, multiply-then-add), its numbers, and a
story: a name, an object and one of several phrasings. Kinds and number ranges set the difficulty: level 1 is an
arithmetic fact (one-digit operands), level 2 one operation on a small two-digit number (or a larger product, or a
quotient), level 3 two two-digit numbers or two operations. The ranges and the mix come from SmolLM2-135M-Instruct's
measured greedy accuracy (benchmarks/task_accuracy.py): it knows small facts and times tables but often picks the
wrong operation or buries the result, adds and subtracts poorly beyond small numbers, and gets almost no
two-operation problem right. Answers are non-negative integers, graded with the `math` reward (math-verify).

Splits, all deterministic in the seed:
- `train`: training phrasings, problems (kind and numbers) outside the held-out set;
- `eval`: the held-out problems in the training phrasings (does RL improve on unseen problems?);
- `other`: the held-out problems in phrasings never used for training (does what RL teaches generalise beyond the
  training wording?).
A problem is held out iff a hash of its kind and numbers falls in a fixed bucket, independent of the seed and of the
story, so no seed's training data contains any held-out problem under any name, object or phrasing.

Why this task for SmolLM2-135M-Instruct: it reads and answers simple word problems, but often miscalculates or buries
the number, so its greedy accuracy starts well below what it can reach (headroom for RL), and the level mix gives
every batch some problems it can solve (a learning signal) and some it cannot yet. No torch here.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from areal_async.types import Sample

INSTRUCTION = "Give the final answer as a number after 'The answer is'."
SPLITS = ("train", "eval", "other")

NAMES = [
    ("Mia", "she"),
    ("Tom", "he"),
    ("Anna", "she"),
    ("Leo", "he"),
    ("Sara", "she"),
    ("Ben", "he"),
    ("Lily", "she"),
    ("Sam", "he"),
    ("Emma", "she"),
    ("Jack", "he"),
    ("Zoe", "she"),
    ("Max", "he"),
]
OBJECTS = [
    "apples",
    "pencils",
    "marbles",
    "stickers",
    "cookies",
    "books",
    "cards",
    "shells",
    "coins",
    "flowers",
    "stamps",
    "balloons",
]

# Phrasings per kind: {name} {he} {He} {his} {obj} and the numbers {a} {b} {c}. "train" phrasings are the only ones
# training ever sees; "other" phrasings are reserved for the generalisation split.
PHRASINGS: dict[str, dict[str, list[str]]] = {
    "add": {
        "train": [
            "{name} has {a} {obj}. {He} buys {b} more {obj}. How many {obj} does {name} have now?",
            "There are {a} {obj} in a box. {name} puts {b} more {obj} in the box. How many {obj} are in the box now?",
            "{name} collected {a} {obj} on Monday and {b} {obj} on Tuesday. How many {obj} did {name} collect in all?",
        ],
        "other": [
            "After getting {b} more {obj}, how many {obj} does {name} own if {he} started with {a}?",
            "A jar holds {a} {obj}. Someone drops in another {b}. What is the new number of {obj} in the jar?",
        ],
    },
    "sub": {
        "train": [
            "{name} has {a} {obj}. {He} gives {b} {obj} to a friend. How many {obj} does {name} have left?",
            "A shop had {a} {obj}. It sold {b} of them. How many {obj} does the shop have left?",
            "{name} had {a} {obj} and lost {b} of them. How many {obj} does {name} have now?",
        ],
        "other": [
            "Out of {a} {obj}, {b} were taken away. How many {obj} remain?",
            "{name}'s collection of {a} {obj} shrank by {b}. What is the size of the collection now?",
        ],
    },
    "mul": {
        "train": [
            "{name} buys {a} bags of {obj}. Each bag has {b} {obj}. How many {obj} does {name} buy?",
            "There are {a} rows with {b} {obj} in each row. How many {obj} are there?",
            "{name} has {a} boxes with {b} {obj} in each box. How many {obj} does {name} have?",
        ],
        "other": [
            "How many {obj} are in {a} crates if every crate contains {b}?",
            "{b} {obj} fit on one shelf. {name} fills {a} shelves. What is the total number of {obj}?",
        ],
    },
    "div": {
        "train": [
            "{name} shares {a} {obj} equally among {b} friends. How many {obj} does each friend get?",
            "{a} {obj} are packed into {b} boxes with the same number in each box. How many {obj} are in each box?",
        ],
        "other": [
            "If {b} children split {a} {obj} evenly, what is each child's share?",
            "{name} puts {a} {obj} into {b} equal piles. What is the size of one pile?",
        ],
    },
    "add_sub": {
        "train": [
            "{name} has {a} {obj}. {He} buys {b} more and then gives {c} away. How many {obj} does {name} have now?",
            "A basket holds {a} {obj}. {name} adds {b} {obj} and then takes out {c}. How many {obj} are in the basket?",
        ],
        "other": [
            "Starting with {a} {obj}, {name} gets {b} more but loses {c}. How many {obj} does {he} end up with?",
            "What is left of {a} {obj} once {b} are added and {c} are removed?",
        ],
    },
    "mul_add": {
        "train": [
            "{name} buys {a} packs of {obj} with {b} {obj} in each pack, and {c} single {obj}. How many "
            "{obj} does {name} buy in total?",
            "There are {a} boxes with {b} {obj} each and {c} more {obj} on the table. How many {obj} are "
            "there altogether?",
        ],
        "other": [
            "{c} {obj} lie loose next to {a} bags that hold {b} {obj} each. Count all the {obj}.",
            "What is the total if {name} owns {a} sets of {b} {obj} plus {c} extra {obj}?",
        ],
    },
}


@dataclass(frozen=True)
class WordProblemSpec:
    """The problem distribution: how often each level appears, and the held-out share."""

    level_weights: tuple[float, float, float] = (0.4, 0.4, 0.2)
    eval_permille: int = 150  # share of the problems (by hash of kind and numbers) held out for evaluation
    max_repeats: int = 3  # times one held-out problem may be posed (in different stories): level 1 has few

    def __post_init__(self) -> None:
        if len(self.level_weights) != 3 or min(self.level_weights) < 0 or sum(self.level_weights) <= 0:
            raise ValueError(f"level_weights must be 3 non-negative weights, got {self.level_weights}")
        if not 0 < self.eval_permille < 1000:
            raise ValueError(f"eval_permille must be in (0, 1000), got {self.eval_permille}")
        if self.max_repeats < 1:
            raise ValueError(f"max_repeats must be >= 1, got {self.max_repeats}")


@dataclass(frozen=True)
class WordProblem:
    kind: str
    numbers: tuple[int, ...]
    level: int

    @property
    def answer(self) -> int:
        a, b, *rest = self.numbers
        c = rest[0] if rest else 0
        return {"add": a + b, "sub": a - b, "mul": a * b, "div": a // b, "add_sub": a + b - c, "mul_add": a * b + c}[
            self.kind
        ]


def random_problem(rng: random.Random, level: int) -> WordProblem:
    """A problem of `level` (1 to 3): a kind and numbers in the level's ranges; every answer is a whole number >= 0."""
    r = rng.randint
    if level == 1:  # arithmetic facts: one-digit operands
        kind = rng.choice(["add", "sub", "mul"])
        if kind == "add":
            nums = (r(2, 9), r(2, 9))
        elif kind == "sub":
            b = r(2, 9)
            nums = (r(b + 1, 18), b)
        else:
            nums = (r(2, 9), r(2, 5))
    elif level == 2:  # one operation on a small two-digit number, a larger product, or a quotient
        kind = rng.choice(["add", "sub", "mul", "div"])
        if kind == "add":
            nums = (r(10, 40), r(2, 9))
        elif kind == "sub":
            nums = (r(11, 40), r(2, 9))
        elif kind == "mul":
            nums = (r(2, 9), r(6, 9))
        else:
            b, q = r(2, 9), r(2, 9)
            nums = (b * q, b)
    elif level == 3:  # two two-digit numbers, or two operations
        kind = rng.choice(["add", "sub", "add_sub", "mul_add"])
        if kind == "add":
            nums = (r(21, 99), r(11, 99))
        elif kind == "sub":
            a = r(40, 99)
            nums = (a, r(11, a - 5))
        elif kind == "add_sub":
            a, b = r(10, 40), r(2, 20)
            nums = (a, b, r(2, a + b - 1))
        else:
            nums = (r(2, 9), r(2, 9), r(2, 20))
    else:
        raise ValueError(f"level must be 1, 2 or 3, got {level}")
    return WordProblem(kind, nums, level)


def is_eval_problem(problem: WordProblem, spec: WordProblemSpec = WordProblemSpec()) -> bool:
    """True iff the problem is held out. Depends only on its kind and numbers, never on a seed or the story."""
    key = f"{problem.kind}:{','.join(map(str, problem.numbers))}"
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return h % 1000 < spec.eval_permille


def prompt_of(problem: WordProblem, rng: random.Random, phrasings: str) -> str:
    """The problem told as a story in one of the `phrasings` ("train" or "other") of its kind, then the instruction."""
    name, he = rng.choice(NAMES)
    a, b, *rest = problem.numbers
    text = rng.choice(PHRASINGS[problem.kind][phrasings]).format(
        name=name,
        he=he,
        He=he.capitalize(),
        his="her" if he == "she" else "his",
        obj=rng.choice(OBJECTS),
        a=a,
        b=b,
        c=rest[0] if rest else "",
    )
    return f"{text} {INSTRUCTION}"


def generate(num: int, seed: int, split: str = "train", spec: WordProblemSpec = WordProblemSpec()) -> list[Sample]:
    """`num` samples of `split` (see the module docstring), deterministic in (seed, split, spec); ids 0..num-1.

    Held-out splits pose each problem (kind and numbers) at most `spec.max_repeats` times, each time in another
    story, with the levels in the spec's proportions as far as the held-out pools allow (level 1's facts are few:
    about thirty are held out). `eval` and `other` pose the same held-out problems in the same order for a seed, told in
    different phrasings, so their accuracies differ by the wording alone."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    held_out = split != "train"
    problem_rng = random.Random(f"areal_async.word_problems/{'held_out' if held_out else 'train'}/{seed}")
    story_rng = random.Random(f"areal_async.word_problems/{split}/{seed}/story")
    phrasings = "other" if split == "other" else "train"
    out: list[Sample] = []
    seen: dict[WordProblem, int] = {}
    stories: set[str] = set()
    tries = 0
    while len(out) < num:
        tries += 1
        if tries > 200 * num + 10_000:
            raise ValueError(f"could not draw {num} {split} word problems from {spec}")
        level = problem_rng.choices((1, 2, 3), spec.level_weights)[0]
        p = random_problem(problem_rng, level)
        for _ in range(1000 if held_out else 0):  # keep the level: find one of its held-out problems with room
            if is_eval_problem(p, spec) and seen.get(p, 0) < spec.max_repeats:
                break
            p = random_problem(problem_rng, level)
        if is_eval_problem(p, spec) != held_out or (held_out and seen.get(p, 0) >= spec.max_repeats):
            continue
        seen[p] = seen.get(p, 0) + 1
        prompt = prompt_of(p, story_rng, phrasings)
        for _ in range(50 if held_out else 0):  # a repeated problem gets another story
            if prompt not in stories:
                break
            prompt = prompt_of(p, story_rng, phrasings)
        stories.add(prompt)
        out.append(
            Sample(
                id=len(out),
                prompt=prompt,
                answer=str(p.answer),
                meta={"task": "word_problems", "kind": p.kind, "level": p.level, "split": split},
            )
        )
    return out


def load_word_problems(
    num_train: int, num_eval: int, seed: int = 0, eval_split: str = "eval", spec: WordProblemSpec = WordProblemSpec()
) -> tuple[list[Sample], list[Sample]]:
    """(train, held-out) samples; `eval_split` is "eval" (training phrasings) or "other" (unseen phrasings)."""
    if eval_split not in ("eval", "other"):
        raise ValueError(f"eval_split must be 'eval' or 'other', got {eval_split!r}")
    return generate(num_train, seed, "train", spec), generate(num_eval, seed, eval_split, spec)
