"""The default task learns: short runs of the real default setup (the project's own base model, embedded server,
torchrun trainer, controller) in both modes raise the training reward and the held-out greedy accuracy.

The base model is built once per machine by `ensure_base_model()` (a few minutes on one CPU core; cached under
~/.cache/areal_async, so later runs and `make run` reuse it). Ten steps are enough: with the default settings
held-out accuracy goes from about 40% to about 90% within the first ten (measured; see README.md), so the margins
asserted here are wide and the test is not a coin toss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SHORT = ["total_steps=10", "schedule.eval_every=10", "schedule.checkpoint_every=0",
         "server.device=cpu", "train.device=cpu"]  # the thresholds below were measured on the CPU paths


@pytest.fixture(scope="module")
def base_model() -> str:
    from areal_async.tasks.base_model import ensure_base_model

    return ensure_base_model()


def _run(base_model: str, run_dir: str, *overrides: str) -> tuple[dict, list[dict]]:
    p = subprocess.run([sys.executable, "-m", "areal_async.run", f"model.path={base_model}", f"run_dir={run_dir}",
                        *SHORT, *overrides], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, f) if r["kind"] == "train"]
    return summary, train


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_default_task_learns(base_model, tmp_path, mode):
    summary, train = _run(base_model, str(tmp_path / mode), f"mode={mode}")
    assert summary["mode"] == mode and len(train) == 10
    assert summary["final_accuracy"] >= summary["base_accuracy"] + 0.20, summary
    first = sum(r["reward_mean"] for r in train[:3]) / 3
    last = sum(r["reward_mean"] for r in train[-3:]) / 3
    assert last > first + 0.1, [round(r["reward_mean"], 3) for r in train]
    # the model learns to work problems out instead of guessing: responses grow
    assert train[-1]["response_len_mean"] > train[0]["response_len_mean"]
    if mode == "sync":
        assert summary["max_staleness_seen"] == 0
