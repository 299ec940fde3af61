"""The synthetic task (generator, split, answers, reward) and the dataset loaders (registry, JSONL, Parquet)."""

from __future__ import annotations

import json
import random
import re

import pytest

from areal_async.config import DataConfig
from areal_async.tasks import arith
from areal_async.tasks.datasets import DatasetError, load_samples, register_dataset, registered_datasets
from areal_async.types import Sample

# ---- generator and split ---------------------------------------------------------------------------------------


def test_generator_is_deterministic_and_seed_dependent():
    a_train, a_eval = arith.load_arith(300, 50, seed=3)
    b_train, b_eval = arith.load_arith(300, 50, seed=3)
    c_train, _ = arith.load_arith(300, 50, seed=4)
    assert [s.prompt for s in a_train] == [s.prompt for s in b_train]
    assert [s.prompt for s in a_eval] == [s.prompt for s in b_eval]
    assert [s.answer for s in a_train] == [s.answer for s in b_train]
    assert [s.prompt for s in a_train] != [s.prompt for s in c_train]


def test_eval_split_is_disjoint_from_every_seeds_training_data():
    evals = {s.prompt for seed in (0, 1) for s in arith.generate(200, seed, "eval")}
    trains = {s.prompt for seed in (0, 1, 2) for s in arith.generate(3000, seed, "train")}
    assert len(evals) > 300  # unique within a seed; two seeds share only some
    assert not evals & trains
    # membership is a pure function of the prompt text
    assert all(arith.is_eval_problem(p) for p in evals) and not any(arith.is_eval_problem(p) for p in trains)


def test_eval_split_has_no_duplicates_and_a_larger_request_extends_a_smaller_one():
    small = arith.generate(100, 7, "eval")
    big = arith.generate(300, 7, "eval")
    assert len({s.prompt for s in big}) == 300
    assert [s.prompt for s in big[:100]] == [s.prompt for s in small]


def _simulate(prompt: str) -> tuple[int, int]:
    """Solve a prompt independently of the generator: (answer, number of steps)."""
    m = re.fullmatch(r"(Add|Subtract) (\d+) (?:to|from) (\d+) until (above|below) (\d+)\.\n", prompt)
    assert m, prompt
    verb, k, v, rel, t = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4), int(m.group(5))
    assert (verb == "Add") == (rel == "above")
    steps = 0
    while steps == 0 or (v <= t if verb == "Add" else v >= t):
        v, steps = (v + k if verb == "Add" else v - k), steps + 1
    return v, steps


def test_problems_are_well_formed_and_difficulty_is_long_tailed():
    spec = arith.ArithSpec()
    rng = random.Random(0)
    counts = {k: 0 for k in range(spec.min_steps, spec.max_steps + 1)}
    lens = []
    for _ in range(3000):
        p = arith.random_problem(rng, spec)
        counts[p.num_steps] += 1
        answer, steps = _simulate(arith.prompt_of(p))
        assert (answer, steps) == (p.answer, p.num_steps)
        assert all(0 <= v <= spec.max_value for v in [p.start, *p.values()])
        assert p.threshold not in p.values()  # comparisons in the worked solution are strict
        sol = arith.worked_solution(p)
        assert sol.count("\n") == p.num_steps
        assert arith.extract_answer(sol) == str(p.answer)
        assert arith.reward(sol, str(p.answer)) == 1.0
        lens.append(len(sol))
    ordered = [counts[k] for k in sorted(counts)]
    assert ordered == sorted(ordered, reverse=True) and ordered[-1] > 0  # more easy than hard, hard present
    assert max(lens) >= 6 * min(lens)


def test_worked_solution_format():
    p = arith.Problem(start=12, op="+", step=7, threshold=30)
    assert arith.prompt_of(p) == "Add 7 to 12 until above 30.\n"
    assert arith.worked_solution(p) == "12+7=19\n19+7=26\n26+7=33\n#### 33"
    q = arith.Problem(start=25, op="-", step=9, threshold=10)
    assert arith.prompt_of(q) == "Subtract 9 from 25 until below 10.\n"
    assert arith.worked_solution(q) == "25-9=16\n16-9=7\n#### 7"


def test_samples_carry_answer_and_difficulty():
    train, evals = arith.load_arith(20, 5, seed=0)
    assert [s.id for s in train] == list(range(20))
    for s in train + evals:
        assert isinstance(s, Sample) and s.prompt.endswith("\n")
        assert s.answer == str(_simulate(s.prompt)[0])
        assert s.meta["num_steps"] == _simulate(s.prompt)[1]


def test_spec_validation():
    with pytest.raises(ValueError):
        arith.ArithSpec(min_steps=3, max_steps=2)
    with pytest.raises(ValueError):
        arith.ArithSpec(eval_permille=0)


# ---- answers and reward ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("12+3=15\n#### 15", "15"),
        ("#### 1,200", "1200"),
        ("####-7", "-7"),
        ("#### 07", "7"),
        ("#### 2.50", "2.5"),
        ("#### 3\n#### 4", "4"),  # only the last answer counts
        ("the answer is 15", None),
        ("####", None),
        ("#### abc", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert arith.extract_answer(text) == expected


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("3+4=7\n#### 7", "7", 1.0),
        ("3+4=8\n#### 8", "7", 0.0),
        ("#### 7", "Janet has 3+4=<<3+4=7>>7 eggs.\n#### 7", 1.0),  # GSM8K-style reference
        ("#### 1200", "1,200", 1.0),
        ("#### 7.0", "7", 1.0),
        ("7", "7", 0.0),  # no final-answer line
        ("####" * 1000, "7", 0.0),
        ("\x00\xff garbage #### \n", "7", 0.0),
        ("#### 7", "not a number", 0.0),
        ("#### 7", "", 0.0),
    ],
)
def test_reward(completion, answer, expected):
    assert arith.reward(completion, answer) == expected


def test_reward_never_raises_on_wrong_types():
    for bad in (None, 7, b"#### 7", ["#### 7"], object()):
        assert arith.reward(bad, "7") == 0.0  # type: ignore[arg-type]
        assert arith.reward("#### 7", bad) == 0.0  # type: ignore[arg-type]
        assert arith.extract_answer(bad) is None  # type: ignore[arg-type]


# ---- datasets ---------------------------------------------------------------------------------------------------


def test_load_samples_arith_matches_generator():
    cfg = DataConfig(name="arith", num_train=30, num_eval=10, seed=5)
    train, evals = load_samples(cfg)
    ref_train, ref_eval = arith.load_arith(30, 10, seed=5)
    assert [s.prompt for s in train] == [s.prompt for s in ref_train]
    assert [s.prompt for s in evals] == [s.prompt for s in ref_eval]
    assert train[0].messages is None
    chat_train, _ = load_samples(DataConfig(name="arith", num_train=3, num_eval=2, apply_chat_template=True))
    assert chat_train[0].messages == [{"role": "user", "content": chat_train[0].prompt}]


def _write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _gsm_records(n: int) -> list[dict]:
    return [
        {"question": f"What is {i}+1?", "answer": f"{i}+1=<<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}", "level": i % 3}
        for i in range(n)
    ]


def test_jsonl_with_eval_file(tmp_path):
    train_path = _write_jsonl(tmp_path / "train.jsonl", _gsm_records(8))
    eval_path = _write_jsonl(tmp_path / "test.jsonl", _gsm_records(3))
    cfg = DataConfig(name=train_path, eval_path=eval_path, prompt_key="question", answer_key="answer")
    train, evals = load_samples(cfg)
    assert len(train) == 8 and len(evals) == 3
    assert train[2].prompt == "What is 2+1?"
    assert train[2].answer.endswith("#### 3")  # raw answer kept; the reward extracts
    assert arith.reward("#### 3", train[2].answer) == 1.0
    assert train[2].meta == {"level": 2}
    assert [s.id for s in train] == list(range(8))


def test_jsonl_held_out_slice_is_seeded_and_disjoint(tmp_path):
    recs = _gsm_records(100) + _gsm_records(10)  # the first 10 prompts appear twice
    path = _write_jsonl(tmp_path / "d.jsonl", recs)
    cfg = DataConfig(name=path, prompt_key="question", num_eval=50, seed=1)
    train, evals = load_samples(cfg)
    assert len(evals) == 11  # capped at 10% of the file
    assert not {s.prompt for s in train} & {s.prompt for s in evals}
    again, evals2 = load_samples(cfg)
    assert [s.prompt for s in evals2] == [s.prompt for s in evals]
    _, evals3 = load_samples(DataConfig(name=path, prompt_key="question", num_eval=50, seed=2))
    assert [s.prompt for s in evals3] != [s.prompt for s in evals]


def test_jsonl_chat_prompts_numeric_answers_and_blank_lines(tmp_path):
    path = _write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "answer": 4},
            "",
            {"prompt": "3+3?", "answer": "6"},
        ],
    )
    eval_path = _write_jsonl(tmp_path / "e.jsonl", [{"prompt": "1+1?", "answer": 2.5}])
    train, evals = load_samples(DataConfig(name=path, eval_path=eval_path, apply_chat_template=True))
    assert train[0].messages[1] == {"role": "user", "content": "2+2?"} and train[0].prompt == "2+2?"
    assert train[0].answer == "4" and evals[0].answer == "2.5"
    assert train[1].messages == [{"role": "user", "content": "3+3?"}]


def test_jsonl_malformed_records_are_all_reported(tmp_path):
    path = _write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"prompt": "ok", "answer": "1"},
            "{not json",
            {"prompt": "no answer"},
            {"prompt": 5, "answer": "1"},
            "[1, 2]",
            {"prompt": "ok", "answer": {"x": 1}},
            {"prompt": "ok", "answer": None},
        ],
    )
    with pytest.raises(DatasetError) as e:
        load_samples(DataConfig(name=path, eval_path=path))
    msg = str(e.value)
    assert "6 malformed record(s)" in msg and "bad.jsonl:line 2: bad JSON" in msg
    assert "line 3: missing key 'answer'" in msg and "line 4: 'prompt' must be a string" in msg
    assert "line 5: expected an object" in msg and "line 6: 'answer' must be" in msg
    assert "and 1 more" in msg


def test_missing_files_and_unknown_names(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_samples(DataConfig(name=str(tmp_path / "nope.jsonl")))
    with pytest.raises(DatasetError, match="not a registered dataset"):
        load_samples(DataConfig(name="gsm9k"))
    empty = _write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DatasetError, match="no records"):
        load_samples(DataConfig(name=empty, eval_path=empty))


def test_parquet_loading_and_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "d.parquet"
    pq.write_table(
        pa.table({"q": [f"p{i}" for i in range(20)], "a": [str(i) for i in range(20)], "src": ["x"] * 20}), good
    )
    train, evals = load_samples(DataConfig(name=str(good), prompt_key="q", answer_key="a", num_eval=5))
    assert len(evals) == 2 and len(train) == 18
    assert {s.prompt for s in train + evals} == {f"p{i}" for i in range(20)}
    assert train[0].meta == {"src": "x"}

    with pytest.raises(DatasetError, match=r"missing column\(s\) \['answer'\]"):
        load_samples(DataConfig(name=str(good), prompt_key="q"))

    nulls = tmp_path / "n.parquet"
    pq.write_table(pa.table({"prompt": ["a", None, "c"], "answer": ["1", "2", None]}), nulls)
    with pytest.raises(DatasetError) as e:
        load_samples(DataConfig(name=str(nulls)))
    assert "n.parquet:row 1: 'prompt' is null" in str(e.value) and "row 2: 'answer' is null" in str(e.value)

    corrupt = tmp_path / "c.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        load_samples(DataConfig(name=str(corrupt)))


def test_registry():
    def tiny(cfg: DataConfig):
        s = Sample(id=0, prompt="x", answer="1")
        return [s] * cfg.num_train, [s]

    name = "test_tasks_tiny"
    register_dataset(name, tiny)
    assert name in registered_datasets() and "arith" in registered_datasets()
    with pytest.raises(ValueError, match="already registered"):
        register_dataset(name, tiny)
    train, evals = load_samples(DataConfig(name=name, num_train=4))
    assert len(train) == 4 and len(evals) == 1


# ---- word problems (the real model's task) ----------------------------------------------------------------------

from areal_async.tasks import word_problems as wp  # noqa: E402


def _phrasing_regexes(group: str) -> dict[str, list[re.Pattern]]:
    """Each phrasing of `group` as a regex capturing a, b, c: solving prompts from their text alone."""
    out: dict[str, list[re.Pattern]] = {}
    for kind, groups in wp.PHRASINGS.items():
        pats = []
        for t in groups[group]:
            rx = re.escape(t + " " + wp.INSTRUCTION)
            for name in ("a", "b", "c"):
                rx = rx.replace(re.escape("{" + name + "}"), f"(?P<{name}>\\d+)", 1)
                rx = rx.replace(re.escape("{" + name + "}"), f"(?P={name})")
            rx = re.sub(r"\\\{[a-zA-Z]+\\\}", r"[A-Za-z']+", rx)
            pats.append(re.compile(rx))
        out[kind] = pats
    return out


def _parse(prompt: str, group: str) -> tuple[str, tuple[int, ...]]:
    """(kind, (a, b[, c])) of a prompt, found by matching it against the phrasings of `group` only."""
    hits = [(kind, m) for kind, pats in _phrasing_regexes(group).items() for p in pats if (m := p.fullmatch(prompt))]
    assert len({k for k, _ in hits}) == 1, (prompt, hits)
    kind, m = hits[0]
    return kind, tuple(int(m.group(n)) for n in ("a", "b", "c") if m.groupdict().get(n) is not None)


def _solve(prompt: str, group: str) -> tuple[str, int]:
    """(kind, answer) of a prompt, computed from its text alone."""
    solve = {
        "add": lambda a, b, c: a + b,
        "sub": lambda a, b, c: a - b,
        "mul": lambda a, b, c: a * b,
        "div": lambda a, b, c: a / b,
        "add_sub": lambda a, b, c: a + b - c,
        "mul_add": lambda a, b, c: a * b + c,
    }
    kind, nums = _parse(prompt, group)
    value = solve[kind](nums[0], nums[1], nums[2] if len(nums) > 2 else 0)
    assert value == int(value) and value >= 0, prompt
    return kind, int(value)


def test_word_problems_answers_are_right_and_splits_use_their_phrasings():
    for split, group in (("train", "train"), ("eval", "train"), ("other", "other")):
        for s in wp.generate(400, 1, split):
            kind, answer = _solve(s.prompt, group)
            assert (kind, str(answer)) == (s.meta["kind"], s.answer) and s.meta["split"] == split
    # no training phrasing ever appears in the other-phrasings split, and vice versa
    train_rx = [p for ps in _phrasing_regexes("train").values() for p in ps]
    assert not any(p.fullmatch(s.prompt) for s in wp.generate(300, 2, "other") for p in train_rx)


def test_word_problems_held_out_problems_never_appear_in_training():
    def key(s):
        return _parse(s.prompt, "other" if s.meta["split"] == "other" else "train")

    held = {key(s) for seed in (0, 1) for split in ("eval", "other") for s in wp.generate(200, seed, split)}
    trains = [s for seed in (0, 1, 2) for s in wp.generate(3000, seed, "train")]
    assert not held & {key(s) for s in trains}
    assert all(wp.is_eval_problem(wp.WordProblem(k, n, 0)) for k, n in held)
    assert not any(wp.is_eval_problem(wp.WordProblem(*key(s), 0)) for s in trains)


def test_word_problems_eval_and_other_pose_the_same_problems_and_are_deterministic():
    e, o = wp.generate(200, 3, "eval"), wp.generate(200, 3, "other")
    assert [(s.answer, s.meta["kind"], s.meta["level"]) for s in e] == [
        (s.answer, s.meta["kind"], s.meta["level"]) for s in o
    ]
    assert len({s.prompt for s in e}) == len({s.prompt for s in o}) == 200
    assert [s.prompt for s in wp.generate(200, 3, "eval")] == [s.prompt for s in e]
    assert [s.prompt for s in wp.generate(200, 4, "eval")] != [s.prompt for s in e]
    assert [s.prompt for s in wp.generate(50, 3, "train")] != [s.prompt for s in wp.generate(50, 4, "train")]


def test_word_problems_difficulty_mix_follows_the_weights():
    levels = [s.meta["level"] for s in wp.generate(4000, 0, "train")]
    for level, weight in zip((1, 2, 3), wp.WordProblemSpec().level_weights):
        assert abs(levels.count(level) / len(levels) - weight) < 0.03
    hard_only = wp.generate(200, 0, "train", wp.WordProblemSpec(level_weights=(0, 0, 1)))
    assert {s.meta["level"] for s in hard_only} == {3}
    assert {s.meta["kind"] for s in hard_only} == {"add", "sub", "add_sub", "mul_add"}
    with pytest.raises(ValueError, match="level_weights"):
        wp.WordProblemSpec(level_weights=(1, 2))
    with pytest.raises(ValueError, match="split must be"):
        wp.generate(1, 0, "test")


def test_word_problems_datasets_and_the_math_reward():
    from areal_async.rewards.math import math_reward

    train, evals = load_samples(DataConfig(name="word_problems", num_train=50, num_eval=20, apply_chat_template=True))
    train2, other = load_samples(
        DataConfig(name="word_problems_other", num_train=50, num_eval=20, apply_chat_template=True)
    )
    assert [s.prompt for s in train] == [s.prompt for s in train2] and len(evals) == len(other) == 20
    assert [s.answer for s in evals] == [s.answer for s in other]
    assert {s.prompt for s in evals}.isdisjoint(s.prompt for s in other)
    assert all(s.messages == [{"role": "user", "content": s.prompt}] for s in train + evals + other)
    assert {"word_problems", "word_problems_other"} <= set(registered_datasets())
    plain, _ = load_samples(DataConfig(name="word_problems", num_train=3, num_eval=2))
    assert all(s.messages is None for s in plain)
    s = evals[0]
    assert math_reward(f"First I work it out. The answer is {s.answer}.", s.answer) == 1.0
    assert math_reward(f"The answer is {int(s.answer) + 1}.", s.answer) == 0.0
