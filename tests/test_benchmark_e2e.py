"""Smoke tests: the end-to-end benchmarks run on tiny settings (a random tiny checkpoint; no speed or accuracy
assertion), so they cannot rot."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
TINY = [
    "data.num_train=100",
    "data.num_eval=8",
    "server.max_total_tokens=8192",
    "server.device=cpu",
    "train.device=cpu",
]


def test_sync_vs_async_quick(tiny_ckpt, tmp_path):
    out = tmp_path / "sva.json"
    subprocess.run(
        [
            sys.executable,
            os.path.join(BENCH, "sync_vs_async.py"),
            f"model.path={tiny_ckpt}",
            *TINY,
            "--out",
            str(out),
            "--quick",
        ],
        check=True,
        timeout=300,
    )
    runs = json.loads(out.read_text())["runs"]
    assert [r["mode"] for r in runs] == ["sync", "async"]
    assert all(r["trained_samples"] == 2 * 2 * 2 for r in runs)
    assert runs[0]["max_staleness_seen"] == 0
    # the async row's speedup is the sync run's wall time over its own, from the same output
    assert runs[1]["speedup_vs_sync"] == pytest.approx(runs[0]["wall_s"] / runs[1]["wall_s"])
    assert (tmp_path / "sva.md").exists() and (tmp_path / "sva.png").exists()


def test_staleness_ablation_quick(tiny_ckpt, tmp_path):
    out = tmp_path / "st.json"
    subprocess.run(
        [
            sys.executable,
            os.path.join(BENCH, "staleness_ablation.py"),
            f"model.path={tiny_ckpt}",
            *TINY,
            "--out",
            str(out),
            "--quick",
            "--etas",  # one eta, both objectives: the sync path runs in test_sync_vs_async_quick
            "none",
        ],
        check=True,
        timeout=400,
    )
    rows = json.loads(out.read_text())["rows"]
    assert {(r["eta"], r["objective"]) for r in rows} == {("none", "naive"), ("none", "decoupled")}
    assert (tmp_path / "st.md").read_text().count("\n") == 3
