"""Shared by the end-to-end benchmarks: run `python -m areal_async.run` with overrides in its own run directory and
collect what it wrote (summary.json, metrics.jsonl)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_one(name: str, run_dir: str, overrides: list[str], *, config: str | None = None,
            timeout_s: float = 3600) -> dict[str, Any]:
    """One training run as a child process; returns its summary plus the eval and train records."""
    cmd = [sys.executable, "-m", "areal_async.run"]
    if config:
        cmd += ["--config", config]
    cmd += [f"run_dir={run_dir}", "resume=false", *overrides]
    print(f"[{name}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.monotonic()
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "stdout.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"[{name}] run failed with code {proc.returncode}; see {run_dir}/stdout.log")
    summary = load_run(name, run_dir)
    summary["process_s"] = time.monotonic() - t0
    return summary


def load_run(name: str, run_dir: str) -> dict[str, Any]:
    """What a finished run wrote: its summary plus the eval and train records (for re-reporting without a rerun)."""
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    records = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    summary["name"] = name
    summary["train_records"] = [r for r in records if r["kind"] == "train"]
    summary["eval_records"] = [r for r in records if r["kind"] == "eval"]
    return summary


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec)."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = []
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("n/a" if v is None else format(v, fmt) if fmt else str(v))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])
