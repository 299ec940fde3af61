"""The GSM8K recipe end to end without the network: the data script, the prompt wording keys, the shipped configs,
and what a hub id as model.path says."""

from __future__ import annotations

import json
import os

import pytest

from areal_async.config import ConfigError, DataConfig, load_config
from areal_async.model_store import ModelPathError, resolve_model_path
from areal_async.tasks import gsm8k
from areal_async.tasks.datasets import DatasetError, load_samples

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBLEMS = [
    {"question": "Ann has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A box holds 1,200 pens; 200 are sold. Left?", "answer": "1200 - 200 = 1000\n#### 1,000"},
    {"question": "Tom reads 5 pages a day for 6 days. Pages?", "answer": "5*6=30\n#### 30"},
]


def _write_hub_layout(root: str) -> None:
    """The parquet files as `hf download openai/gsm8k --repo-type dataset` leaves them (with an extra column)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    os.makedirs(os.path.join(root, "main"))
    for split, rows in (("train", PROBLEMS[:2]), ("test", PROBLEMS[2:])):
        table = pa.table({"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]})
        pq.write_table(table, os.path.join(root, "main", f"{split}-00000-of-00001.parquet"))


def test_the_script_writes_the_files_the_config_reads_and_the_math_reward_scores_them(tmp_path):
    src, out = str(tmp_path / "hub"), str(tmp_path / "gsm8k")
    _write_hub_layout(src)
    assert gsm8k.main(["--from", src, "--out", out]) == 0
    with open(os.path.join(out, "train.jsonl")) as f:
        assert [json.loads(line) for line in f] == PROBLEMS[:2]  # kept whole: the reward reads after ####

    cfg = load_config(os.path.join(REPO, "configs", "qwen2.5-1.5b-gsm8k.yaml"))
    data = DataConfig(**{**_fields(cfg.data), "name": f"{out}/train.jsonl", "eval_path": f"{out}/test.jsonl"})
    train, evals = load_samples(data)
    assert [s.answer for s in train] == [p["answer"] for p in PROBLEMS[:2]] and len(evals) == 1
    # the recipe's wording: the question, then the ask for a boxed answer (braces kept, not format fields)
    ask = "\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert train[0].messages == [{"role": "user", "content": PROBLEMS[0]["question"] + ask}]
    from areal_async.rewards.math import math_reward

    assert math_reward("... so \\boxed{1000}", train[1].answer) == 1.0  # "#### 1,000": commas dropped
    assert math_reward("\\boxed{999}", train[1].answer) == 0.0


def test_the_original_releases_jsonl_is_read_too_and_bad_records_are_named(tmp_path):
    src = tmp_path / "grade_school_math" / "data"
    src.mkdir(parents=True)
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    assert gsm8k.prepare(str(tmp_path / "out"), str(tmp_path)) == {"train": 3, "test": 3}

    (src / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(gsm8k.Gsm8kError, match="record 0's answer has no '#### <number>'"):
        gsm8k.prepare(str(tmp_path / "out2"), str(tmp_path))
    assert not os.path.exists(tmp_path / "out2" / "train.jsonl")  # nothing written from a bad source
    with pytest.raises(gsm8k.Gsm8kError, match="no train split"):
        gsm8k.prepare(str(tmp_path / "out3"), str(tmp_path / "empty"))


def _fields(section) -> dict:
    return {f: getattr(section, f) for f in section.__struct_fields__}


def test_prompt_template_and_system_prompt_shape_every_source(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"prompt": "2+2?", "answer": "4"},
        {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "3+3?"}], "answer": "6"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(
        name=str(path),
        eval_path=str(path),
        apply_chat_template=True,
        prompt_template="Q: {prompt} {a} \\boxed{}",
        system_prompt="Be brief.",
    )
    train, _ = load_samples(data)
    assert train[0].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: 2+2? {a} \\boxed{}"},
    ]
    assert train[1].messages[0] == {"role": "system", "content": "own"}  # a record's own system message wins
    assert train[1].messages[1]["content"] == train[1].prompt == "Q: 3+3? {a} \\boxed{}"

    # the built-in task, as plain text: the template applies, a system prompt cannot
    arith, _ = load_samples(DataConfig(num_train=3, num_eval=2, prompt_template="{prompt}!"))
    plain, _ = load_samples(DataConfig(num_train=3, num_eval=2))
    assert [s.prompt for s in arith] == [s.prompt + "!" for s in plain]
    with pytest.raises(DatasetError, match="apply_chat_template") as err:
        load_samples(DataConfig(num_train=3, num_eval=2, system_prompt="x"))
    assert err.value.key == "data.system_prompt"


@pytest.mark.parametrize(
    "overrides, key",
    [({"prompt_template": "no placeholder"}, "data.prompt_template"), ({"system_prompt": " "}, "data.system_prompt")],
)
def test_wording_keys_are_validated_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        DataConfig(**overrides).validate("data")


def test_a_hub_id_as_model_path_says_how_to_fetch_it(tmp_path):
    with pytest.raises(ModelPathError) as err:
        resolve_model_path("Qwen/Qwen2.5-1.5B-Instruct", cache_dir=str(tmp_path))
    msg = str(err.value)
    assert "looks like a Hugging Face hub id" in msg
    assert "hf download Qwen/Qwen2.5-1.5B-Instruct --local-dir /models/Qwen2.5-1.5B-Instruct" in msg
    with pytest.raises(ModelPathError) as err:
        resolve_model_path(str(tmp_path / "a" / "b"), cache_dir=str(tmp_path))
    assert "hub id" not in str(err.value)  # a local path that is missing is just missing
