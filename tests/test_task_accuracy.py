"""Smoke test: benchmarks/task_accuracy.py measures a model through the embedded server end to end and writes a
report whose figures follow from its own graded samples (no speed asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from areal_async.tasks.arith import reward as arith_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_task_accuracy_greedy_and_sampled(tmp_path, tiny_ckpt):
    out = tmp_path / "acc.json"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "task_accuracy.py"),
        "--model",
        tiny_ckpt,
        "--datasets",
        "arith,word_problems",
        "--reward",
        "arith",
        "--num",
        "6",
        "--max-new-tokens",
        "6",
        "--no-chat-template",
        "--threads",
        "1",
        "--samples",
        "3",
        "--temperature",
        "1.0",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["model_dir"] == tiny_ckpt and [r["dataset"] for r in report["results"]] == ["arith", "word_problems"]
    for res in report["results"]:
        rows = res["samples"]
        assert res["num"] == len(rows) == 6 and all(len(r["completions"]) == 3 for r in rows)
        for r in rows:  # every recorded reward is the reward of its recorded completion
            assert r["rewards"] == [arith_reward(c, r["answer"]) for c in r["completions"]]
            assert all(1 <= t <= 6 for t in r["completion_tokens"])
        flat = [x for r in rows for x in r["rewards"]]
        assert res["accuracy"] == pytest.approx(sum(flat) / len(flat))
        assert res["pass_at_k"] == pytest.approx(sum(max(r["rewards"]) for r in rows) / len(rows))
    assert {r.get("level") for r in report["results"][1]["samples"]} <= {1, 2, 3}
    assert "| arith | 6 |" in proc.stdout and "| word_problems | 6 |" in proc.stdout
