"""Prompt datasets: the built-in synthetic task, or {prompt, answer} records from JSONL / Parquet files.

`load_samples(cfg)` is the one entry point the controller uses. `DataConfig.name` is looked up in a small registry
first, then treated as a file path ending in `.jsonl` or `.parquet`. Built in (`register_dataset` adds more):

    arith                 the tiny base model's task (areal_async.tasks.arith)
    word_problems         arithmetic word problems for real instruct models (areal_async.tasks.word_problems);
                          held out: unseen problems in the training phrasings
    word_problems_other   the same training data; held out: the same unseen problems in phrasings never trained on

File records: `cfg.prompt_key` holds either a string or a chat (a list of {"role", "content"} messages) and
`cfg.answer_key` the reference answer, kept verbatim (a GSM8K solution ending in `#### 72` stays whole; the reward
function extracts what it needs); numeric answers are turned into strings. Other scalar fields are carried in
`Sample.meta`.

Malformed records are an error, not a silent skip: training on a quietly shrunken dataset is worse than failing
early. Every bad record in the file is found first, then one `DatasetError` names the file, the first few offending
lines (JSONL, 1-based) or rows (Parquet, 0-based) with what is wrong, and the total count. Blank JSONL lines are
allowed.

Held-out split for files: `cfg.eval_path` when given (all its records; `EvalConfig.num_prompts` decides how many are
scored); otherwise a seeded random slice of `min(num_eval, 10% of the file)` records (at least 1), and training
records whose prompt also appears in that slice are dropped so the split is disjoint even when the file repeats a
prompt. `num_train` applies to the synthetic task only; a file is used whole.

Sample ids are the record's position in its file (0-based, blank lines not counted), unique within a split.

Wording, for every source alike (`shape_prompts`): `data.prompt_template` wraps each prompt (the last user message
of a chat) and `data.system_prompt` puts a system message first in each chat that has none.
No torch here: the controller imports this module.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from typing import Any

from areal_async.config import DataConfig
from areal_async.tasks.arith import load_arith
from areal_async.tasks.word_problems import load_word_problems
from areal_async.types import Sample

Loader = Callable[[DataConfig], "tuple[list[Sample], list[Sample]]"]

_MAX_REPORTED = 5  # bad records named in the error message; the total is always given


class DatasetError(ValueError):
    """A dataset file or record is unusable; the message names the file and the line or row. `key` is the config
    key to change when one is to blame (a field name that no record has is `data.prompt_key`'s, not the file's)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def _field_key(cfg: DataConfig, field: str) -> str:
    return "data.prompt_key" if field == cfg.prompt_key else "data.answer_key"


def _load_arith(cfg: DataConfig) -> tuple[list[Sample], list[Sample]]:

    train, evals = load_arith(cfg.num_train, cfg.num_eval, cfg.seed)
    if cfg.apply_chat_template:
        for s in train + evals:
            s.messages = [{"role": "user", "content": s.prompt}]
    return train, evals


def _word_problems_loader(eval_split: str) -> Loader:
    def load(cfg: DataConfig) -> tuple[list[Sample], list[Sample]]:

        train, evals = load_word_problems(cfg.num_train, cfg.num_eval, cfg.seed, eval_split)
        if cfg.apply_chat_template:
            for s in train + evals:
                s.messages = [{"role": "user", "content": s.prompt}]
        return train, evals

    return load


_REGISTRY: dict[str, Loader] = {
    "arith": _load_arith,
    "word_problems": _word_problems_loader("eval"),
    "word_problems_other": _word_problems_loader("other"),
}


def register_dataset(name: str, loader: Loader, *, overwrite: bool = False) -> None:
    """Make `DataConfig.name == name` load through `loader(cfg) -> (train, eval)`."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"dataset {name!r} is already registered")
    _REGISTRY[name] = loader


def registered_datasets() -> list[str]:
    return sorted(_REGISTRY)


def load_samples(cfg: DataConfig) -> tuple[list[Sample], list[Sample]]:
    """(train, eval) samples for `cfg`; see the module docstring for the rules."""
    train, evals = _load_unshaped(cfg)
    return shape_prompts(train, cfg), shape_prompts(evals, cfg)


def shape_prompts(samples: list[Sample], cfg: DataConfig) -> list[Sample]:
    """`samples` with `data.prompt_template` and `data.system_prompt` applied, in place (and returned).

    Shaped after loading, the same way for every source, so a registered task and a file get the same wording, and
    the train and held-out prompts never differ in it. The template is filled by plain replacement of `{prompt}`,
    not `str.format`: math prompts carry braces (`\\boxed{}`) that format would take for fields."""
    template, system = cfg.prompt_template, cfg.system_prompt
    if template is None and system is None:
        return samples
    for s in samples:
        if template is not None:
            if s.messages is None:
                s.prompt = template.replace("{prompt}", s.prompt)
            else:
                last_user = next((m for m in reversed(s.messages) if m["role"] == "user"), None)
                if last_user is not None:
                    last_user["content"] = template.replace("{prompt}", last_user["content"])
                    s.prompt = last_user["content"]
        if system is not None:
            if s.messages is None:
                raise DatasetError(
                    "a system prompt is a chat message: set data.apply_chat_template=true (or give chat records)",
                    "data.system_prompt",
                )
            if s.messages[0]["role"] != "system":
                s.messages.insert(0, {"role": "system", "content": system})
    return samples


def _load_unshaped(cfg: DataConfig) -> tuple[list[Sample], list[Sample]]:
    if cfg.name in _REGISTRY:
        return _REGISTRY[cfg.name](cfg)
    if not _is_file_name(cfg.name):
        raise DatasetError(
            f"data.name={cfg.name!r}: not a registered dataset ({', '.join(registered_datasets())}) "
            "and not a .jsonl or .parquet path"
        )
    train = read_records(cfg.name, cfg)
    if cfg.eval_path:
        if not _is_file_name(cfg.eval_path):
            raise DatasetError(f"data.eval_path={cfg.eval_path!r}: expected a .jsonl or .parquet path")
        return train, read_records(cfg.eval_path, cfg)
    return split_held_out(train, cfg.num_eval, cfg.seed)


def _is_file_name(name: str) -> bool:
    return name.endswith((".jsonl", ".parquet"))


def split_held_out(records: list[Sample], num_eval: int, seed: int) -> tuple[list[Sample], list[Sample]]:
    """A seeded random held-out slice; training drops every record whose prompt is in it."""
    if len(records) < 2:
        raise DatasetError(
            f"need at least 2 records to hold some out for evaluation, got {len(records)}; set data.eval_path"
        )
    n_eval = max(1, min(num_eval, len(records) // 10))
    order = list(range(len(records)))
    random.Random(f"areal_async.datasets/{seed}").shuffle(order)
    held = sorted(order[:n_eval])
    evals = [records[i] for i in held]
    eval_keys = {_prompt_key(s) for s in evals}
    train = [records[i] for i in sorted(order[n_eval:]) if _prompt_key(records[i]) not in eval_keys]
    if not train:
        raise DatasetError("every training record repeats a held-out prompt; set data.eval_path")
    return train, evals


def _prompt_key(s: Sample) -> str:
    return s.prompt if s.messages is None else json.dumps(s.messages, sort_keys=True)


# ---- files ------------------------------------------------------------------------------------------------------


def read_records(path: str, cfg: DataConfig) -> list[Sample]:
    """Every record of a .jsonl or .parquet file as a Sample, or a DatasetError listing the bad ones."""
    if not os.path.exists(path):
        raise DatasetError(f"{path}: no such file")
    if path.endswith(".jsonl"):
        where, rows = "line", _jsonl_rows(path)
    elif path.endswith(".parquet"):
        where, rows = "row", _parquet_rows(path, cfg)
    else:
        raise DatasetError(f"{path}: unsupported file type (use .jsonl or .parquet)")
    samples: list[Sample] = []
    errors: list[str] = []
    blamed: set[str | None] = set()  # the config keys the bad records point at
    n_bad = 0
    for loc, rec in rows:
        try:
            if isinstance(rec, _BadRecord):
                raise DatasetError(rec.reason)
            samples.append(_to_sample(len(samples), rec, cfg))
        except DatasetError as e:
            n_bad += 1
            blamed.add(e.key)
            if len(errors) < _MAX_REPORTED:
                errors.append(f"{path}:{where} {loc}: {e}")
    if n_bad:
        more = f"\n  ... and {n_bad - len(errors)} more" if n_bad > len(errors) else ""
        # every record lacking the same field: the key naming that field is what to change, not the records
        key = blamed.pop() if len(blamed) == 1 and not samples else None
        raise DatasetError(f"{path}: {n_bad} malformed record(s):\n  " + "\n  ".join(errors) + more, key)
    if not samples:
        raise DatasetError(f"{path}: no records")
    return samples


class _BadRecord:
    def __init__(self, reason: str) -> None:
        self.reason = reason


def _jsonl_rows(path: str):
    with open(path, encoding="utf-8", errors="strict") as f:
        lineno = 0
        while True:
            lineno += 1
            try:
                line = f.readline()
            except UnicodeDecodeError as e:
                yield lineno, _BadRecord(f"not UTF-8 ({e.reason})")
                return  # the stream position is unreliable after a decoding error
            if not line:
                return
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, _BadRecord(f"bad JSON: {e.msg} at column {e.colno}")


def _parquet_rows(path: str, cfg: DataConfig):
    try:
        import pyarrow.parquet as pq
    except ImportError:  # an optional dependency: JSONL needs nothing
        raise DatasetError(
            f"{path}: reading Parquet files needs pyarrow; pip install 'areal_async[parquet]' "
            "(or convert the file to .jsonl)"
        ) from None

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None
    names = pf.schema_arrow.names
    missing = [k for k in (cfg.prompt_key, cfg.answer_key) if k not in names]
    if missing:
        raise DatasetError(
            f"{path}: missing column(s) {missing}; columns are {names} (set data.prompt_key / data.answer_key)",
            _field_key(cfg, missing[0]),
        )
    row = 0
    for batch in pf.iter_batches(batch_size=4096):
        for rec in batch.to_pylist():
            yield row, rec
            row += 1


def _to_sample(idx: int, rec: Any, cfg: DataConfig) -> Sample:
    if not isinstance(rec, dict):
        raise DatasetError(f"expected an object, got {type(rec).__name__}")
    for key in (cfg.prompt_key, cfg.answer_key):
        if key not in rec:
            raise DatasetError(
                f"missing key {key!r} (keys: {sorted(rec)[:10]}; {_field_key(cfg, key)} names the "
                f"field that holds the {'prompt' if key == cfg.prompt_key else 'answer'})",
                _field_key(cfg, key),
            )
        if rec[key] is None:
            raise DatasetError(f"{key!r} is null")
    raw_prompt, raw_answer = rec[cfg.prompt_key], rec[cfg.answer_key]
    messages: list[dict] | None = None
    if isinstance(raw_prompt, str):
        prompt = raw_prompt
        if cfg.apply_chat_template:
            messages = [{"role": "user", "content": prompt}]
    elif isinstance(raw_prompt, list):
        messages = _check_messages(raw_prompt, cfg.prompt_key)
        prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
    else:
        raise DatasetError(
            f"{cfg.prompt_key!r} must be a string or a list of messages, got {type(raw_prompt).__name__}"
        )
    if not prompt.strip() and messages is None:
        raise DatasetError(f"{cfg.prompt_key!r} is empty")
    if isinstance(raw_answer, bool) or not isinstance(raw_answer, (str, int, float)):
        raise DatasetError(f"{cfg.answer_key!r} must be a string or a number, got {type(raw_answer).__name__}")
    meta = {
        k: v
        for k, v in rec.items()
        if k not in (cfg.prompt_key, cfg.answer_key) and isinstance(v, (str, int, float, bool))
    }
    return Sample(id=idx, prompt=prompt, answer=str(raw_answer), messages=messages, meta=meta)


def _check_messages(msgs: list, key: str) -> list[dict]:
    if not msgs:
        raise DatasetError(f"{key!r} is an empty message list")
    for i, m in enumerate(msgs):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DatasetError(f"{key!r}[{i}] must be {{'role': str, 'content': str}}")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]
