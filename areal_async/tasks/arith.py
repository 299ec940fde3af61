"""The built-in synthetic reasoning task: repeated addition or subtraction until a threshold is crossed.

    Add 7 to 12 until above 50.             <- prompt (plain text; the model continues after the newline)
    12+7=19
    19+7=26
    26+7=33
    33+7=40
    40+7=47
    47+7=54
    #### 54                                 <- final-answer line in GSM8K's format, then EOS

Each line is one addition or subtraction; the model compares the result with the threshold itself to decide
whether to write another line or the answer, so the worked solution's length is the number of steps, drawn from a
long-tailed distribution (1 to 10 steps, easy ones most common): solution lengths vary about ten-fold within a
batch, as in real reasoning RL.

Why this task and not free-form chains like `37+8-5+12`: each line depends only on the line before and on two
numbers stated once in the prompt. A chain needs the model to find "the i-th operand" in the prompt, which a model
of a few hundred thousand parameters learns far too slowly for a warm-up of about a minute on a CPU (measured: 12%
greedy accuracy after 600 steps, against 80% for this local procedure). The problem space is still large (about
50,000 problems), so evaluation measures the procedure, not memorised problems.

The held-out split is disjoint from training by construction: a problem belongs to the evaluation split iff a hash
of its prompt falls in a fixed bucket, independent of the seed, so no seed's training data contains any seed's
evaluation problems. Generation is deterministic given the seed (`random.Random` seeded with a string is stable
across runs and platforms). No torch here: the controller uses this module.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from areal_async.types import Sample

ANSWER_PREFIX = "####"
_ANSWER_RE = re.compile(r"####[ \t]*([-+]?[0-9][0-9,]*(?:\.[0-9]+)?)")


@dataclass(frozen=True)
class ArithSpec:
    """The problem distribution. The defaults are the project's default task; change them only together with the
    base model, whose warm-up is trained on this distribution."""

    min_steps: int = 1
    max_steps: int = 10
    steps_decay: float = 0.8  # P(s steps) ~ steps_decay**(s - min_steps): a long tail of hard problems
    min_step: int = 2  # the amount added or subtracted each step, in [min_step, max_step]
    max_step: int = 9
    threshold_round: int = 10  # thresholds are multiples of this (easy comparisons)
    max_value: int = 99  # every number in a problem and its solution stays in [0, max_value]
    eval_permille: int = 100  # share of the problem space (per mille, by hash) held out for evaluation

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.steps_decay <= 0:
            raise ValueError(f"steps_decay must be > 0, got {self.steps_decay}")
        if not 1 <= self.min_step <= self.max_step:
            raise ValueError(f"need 1 <= min_step <= max_step, got {self.min_step}, {self.max_step}")
        if self.max_steps * self.max_step > self.max_value:
            raise ValueError("max_steps * max_step must not exceed max_value")
        if not 0 < self.eval_permille < 1000:
            raise ValueError(f"eval_permille must be in (0, 1000), got {self.eval_permille}")


@dataclass(frozen=True)
class Problem:
    start: int
    op: str  # "+" (add until above threshold) or "-" (subtract until below threshold)
    step: int
    threshold: int

    def values(self) -> list[int]:
        """The running value after each step; the last one is the answer."""
        out, v = [], self.start
        while not out or (v <= self.threshold if self.op == "+" else v >= self.threshold):
            v = v + self.step if self.op == "+" else v - self.step
            out.append(v)
        return out

    @property
    def num_steps(self) -> int:
        return len(self.values())

    @property
    def answer(self) -> int:
        return self.values()[-1]


def prompt_of(problem: Problem) -> str:
    """The plain-text prompt; it ends where the worked solution starts."""
    if problem.op == "+":
        return f"Add {problem.step} to {problem.start} until above {problem.threshold}.\n"
    return f"Subtract {problem.step} from {problem.start} until below {problem.threshold}.\n"


def worked_solution(problem: Problem) -> str:
    """One step per line, then the final-answer line (no EOS: the tokenizer's EOS follows it)."""
    lines, v = [], problem.start
    for r in problem.values():
        lines.append(f"{v}{problem.op}{problem.step}={r}")
        v = r
    lines.append(f"{ANSWER_PREFIX} {v}")
    return "\n".join(lines)


def random_problem(rng: random.Random, spec: ArithSpec = ArithSpec(), num_steps: int | None = None) -> Problem:
    """Draw the number of steps first (long-tailed), then numbers that make the solution take exactly that many."""
    if num_steps is None:
        ks = list(range(spec.min_steps, spec.max_steps + 1))
        s = rng.choices(ks, [spec.steps_decay ** (k - spec.min_steps) for k in ks])[0]
    else:
        s = num_steps
    k = rng.randint(spec.min_step, spec.max_step)
    span = s * k  # distance from start to answer
    while True:
        t = rng.randrange(spec.threshold_round, spec.max_value + 1, spec.threshold_round)
        if rng.random() < 0.5:
            # the answer a + s*k is the first value above t: a + (s-1)*k <= t < a + s*k
            lo, hi = max(0, t - span + 1), min(t - (s - 1) * k, spec.max_value - span)
            if lo <= hi:
                prob = Problem(rng.randint(lo, hi), "+", k, t)
                if t not in prob.values():  # no ties: every comparison in the solution is strict
                    return prob
        else:
            # the answer a - s*k is the first value below t: a - s*k < t <= a - (s-1)*k
            lo, hi = max(span, t + (s - 1) * k), min(t + span - 1, spec.max_value)
            if lo <= hi:
                prob = Problem(rng.randint(lo, hi), "-", k, t)
                if t not in prob.values():
                    return prob


def is_eval_problem(prompt: str, spec: ArithSpec = ArithSpec()) -> bool:
    """True iff the problem belongs to the held-out split. Depends only on the prompt text, never on a seed."""
    h = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little")
    return h % 1000 < spec.eval_permille


def generate(
    num: int, seed: int, split: str = "train", spec: ArithSpec = ArithSpec(), *, unique: bool | None = None
) -> list[Sample]:
    """`num` samples of one split, deterministic in (seed, split, spec); ids are 0..num-1.

    The evaluation split has no duplicates (each problem counts once); training may repeat easy problems, as a
    stream would. Raises when the split's problem space is too small for `num` unique problems.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    want_eval = split == "eval"
    unique = want_eval if unique is None else unique
    rng = random.Random(f"areal_async.arith/{split}/{seed}")
    out: list[Sample] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < num:
        tries += 1
        if tries > 200 * num + 10_000:
            raise ValueError(f"could not draw {num} {'unique ' if unique else ''}{split} problems from {spec}")
        p = random_problem(rng, spec)
        prompt = prompt_of(p)
        if is_eval_problem(prompt, spec) != want_eval or (unique and prompt in seen):
            continue
        seen.add(prompt)
        out.append(
            Sample(id=len(out), prompt=prompt, answer=str(p.answer), meta={"num_steps": p.num_steps, "task": "arith"})
        )
    return out


def load_arith(
    num_train: int, num_eval: int, seed: int = 0, spec: ArithSpec = ArithSpec()
) -> tuple[list[Sample], list[Sample]]:
    """(train, eval) samples. The seed picks which held-out problems are drawn; none is any seed's training one."""
    return generate(num_train, seed, "train", spec), generate(num_eval, seed, "eval", spec)


# ---- answers and reward ----------------------------------------------------------------------------------------


def _normalise_number(s: str) -> str | None:
    s = s.replace(",", "").strip()
    try:
        d = Decimal(s)
    except (InvalidOperation, ValueError):
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The number on the last `#### N` line, normalised (`"#### 1,200"` -> `"1200"`, `"#### 07"` -> `"7"`), or None.

    Only the last marker counts, so a model cannot hedge by writing several answers and being graded on the best.
    """
    if not isinstance(text, str):
        return None
    matches = _ANSWER_RE.findall(text)
    if not matches:
        return None
    return _normalise_number(matches[-1])


def reference_answer(answer: str) -> str | None:
    """The gold answer of a dataset record: a bare number (`"52"`) or a GSM8K-style solution ending `#### 52`."""
    if not isinstance(answer, str):
        return None
    got = extract_answer(answer)
    return got if got is not None else _normalise_number(answer)


def reward(completion: str, answer: str, *, prompt: str = "", **meta: object) -> float:
    """1.0 iff the completion's final answer parses and equals the reference answer, else 0.0. Never raises.

    `prompt` and `meta` are accepted (and unused) so this function has the reward registry's full signature and
    can be called the same way as any custom reward."""
    try:
        got = extract_answer(completion)
        if got is None:
            return 0.0
        gold = reference_answer(answer)
        return 1.0 if gold is not None and got == gold else 0.0
    except Exception:  # garbage in must never crash a rollout worker
        return 0.0
