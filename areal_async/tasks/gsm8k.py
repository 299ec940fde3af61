"""GSM8K as the JSONL files `configs/qwen2.5-1.5b-gsm8k.yaml` reads: `python -m areal_async.tasks.gsm8k --out DIR`.

Writes `DIR/train.jsonl` (7,473 problems) and `DIR/test.jsonl` (1,319), one `{"question": ..., "answer": ...}`
record per line, the answer being GSM8K's whole solution ending in `#### <number>` (the `math` and `gsm8k` rewards
read the number after `####`; the rest is kept so nothing is lost).

Where the problems come from, first that applies:
- `--from DIR`: files already on disk, either the Hugging Face dataset's parquet files (`main/train-00000-of-00001.
  parquet` and `main/test-...`, e.g. from `hf download openai/gsm8k --repo-type dataset --local-dir DIR`; needs the
  `parquet` extra) or the original release's `train.jsonl` / `test.jsonl` (github.com/openai/grade-school-math,
  `grade_school_math/data/`);
- otherwise the two parquet files are downloaded from the Hugging Face hub (`openai/gsm8k`, through
  `huggingface_hub`, which comes with transformers; `HF_ENDPOINT` and `HF_TOKEN` apply as usual).

Every record is checked (a question, an answer with `####`) before anything is written, and the files are written
atomically, so a half-written dataset never sits where a run would read it. No torch here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable

from areal_async.atomic_write import write_text_atomic

HUB_REPO = "openai/gsm8k"
SPLITS = ("train", "test")
_PARQUET = "main/{split}-00000-of-00001.parquet"  # the layout of the hub dataset's "main" configuration


class Gsm8kError(ValueError):
    """The source files are missing or are not GSM8K; the message names the file."""


def find_split(source_dir: str, split: str) -> str:
    """The file of `split` under `source_dir`: the hub's parquet layout, a flat parquet, or the original JSONL."""
    candidates = [
        os.path.join(source_dir, _PARQUET.format(split=split)),
        os.path.join(source_dir, f"{split}-00000-of-00001.parquet"),
        os.path.join(source_dir, f"{split}.parquet"),
        os.path.join(source_dir, f"{split}.jsonl"),
        os.path.join(source_dir, "grade_school_math", "data", f"{split}.jsonl"),
    ]
    for path in candidates:
        if os.path.isfile(path):
            return path
    looked = ", ".join(os.path.relpath(c, source_dir) for c in candidates)
    raise Gsm8kError(f"{source_dir}: no {split} split (looked for {looked})")


def download_split(split: str, cache_dir: str | None = None) -> str:
    """The hub's parquet file of `split`, downloaded (or found in huggingface_hub's cache)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:  # pragma: no cover - transformers depends on huggingface_hub
        raise Gsm8kError(f"downloading GSM8K needs huggingface_hub ({e}); or pass --from DIR") from None
    return hf_hub_download(HUB_REPO, _PARQUET.format(split=split), repo_type="dataset", cache_dir=cache_dir)


def read_split(path: str) -> list[dict[str, str]]:
    """The records of one GSM8K file (parquet or JSONL), each checked: a non-empty question and a `####` answer."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            hint = "pip install areal_async[parquet]"
            raise Gsm8kError(f"{path}: reading parquet needs the parquet extra ({hint})") from None
        rows: Iterable[dict] = pq.read_table(path).to_pylist()
    else:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    records = []
    for i, row in enumerate(rows):
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not question.strip():
            raise Gsm8kError(f"{path}: record {i} has no question (fields: {sorted(row)})")
        if not isinstance(answer, str) or "####" not in answer:
            raise Gsm8kError(f"{path}: record {i}'s answer has no '#### <number>' line")
        records.append({"question": question, "answer": answer})
    if not records:
        raise Gsm8kError(f"{path}: no records")
    return records


def prepare(out_dir: str, source_dir: str | None = None, cache_dir: str | None = None) -> dict[str, int]:
    """Write `out_dir/{train,test}.jsonl`; returns the record count of each split."""
    splits = {}
    for split in SPLITS:
        path = find_split(source_dir, split) if source_dir else download_split(split, cache_dir)
        splits[split] = read_split(path)
    os.makedirs(out_dir, exist_ok=True)
    for split, records in splits.items():
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        write_text_atomic(os.path.join(out_dir, f"{split}.jsonl"), text)
    return {split: len(records) for split, records in splits.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m areal_async.tasks.gsm8k",
        description="Write GSM8K as train.jsonl / test.jsonl records {question, answer} for data.name / eval_path.",
    )
    ap.add_argument("--out", required=True, help="directory to write train.jsonl and test.jsonl to")
    ap.add_argument("--from", dest="source", help="read these files instead of downloading (see the module docs)")
    ap.add_argument("--cache-dir", help="huggingface_hub's cache directory for the download")
    args = ap.parse_args(argv)
    try:
        counts = prepare(args.out, args.source, args.cache_dir)
    except (Gsm8kError, OSError, ValueError) as e:
        print(f"gsm8k: {e}", file=sys.stderr)
        return 1
    for split, n in counts.items():
        print(f"{os.path.join(args.out, split + '.jsonl')}: {n} problems")
    train, test = (os.path.join(args.out, f"{split}.jsonl") for split in SPLITS)
    print(f"use: data.name={train} data.eval_path={test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
