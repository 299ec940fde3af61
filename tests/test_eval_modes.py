"""eval.mode: pinned evals run on a server of their own at exactly one version while training goes on; stop
holds the train loop and new rollouts; the keys are checked before anything starts. Real runs over real HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from areal_async.config import ConfigError, load_config

pytestmark = pytest.mark.slow

COMMON = [
    "schedule.batch_size=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=64",
    "eval.num_prompts=16",
    "eval.max_new_tokens=16",
    "data.num_train=200",
    "data.num_eval=16",
    "train.micro_batch_tokens=1024",
    "server.max_total_tokens=16384",
    "server.device=cpu",
    "train.device=cpu",
    "total_steps=4",
    "schedule.eval_every=2",
]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "areal_async.run", *args, *COMMON], capture_output=True, text=True, timeout=300
    )


def _evals(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "eval"]


@pytest.mark.parametrize("sync", ["disk", "broadcast"])
def test_pinned_evals_run_on_their_own_server_at_one_version(tiny_ckpt, tmp_path, sync):
    run_dir = str(tmp_path / "run")
    p = _run([f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "eval.mode=pinned", f"train.weight_sync={sync}"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    evals = _evals(run_dir)
    assert [e["version"] for e in evals] == [0, 2, 4]  # base, the periodic one at v2, final
    pinned = evals[1]
    # every token of the eval came from version 2, loaded on the eval server (load_s: pinned_eval.py)
    assert (pinned["min_version"], pinned["max_version"]) == (2, 2) and "load_s" in pinned, pinned
    assert pinned["num"] == 16
    assert os.path.getsize(os.path.join(run_dir, "logs", "eval_server.log")) > 0  # the run started its own
    # the snapshot is gone after its eval; the eval server is gone after the run
    assert os.listdir(os.path.join(run_dir, "eval_weights")) == []
    train = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if r["kind"] == "train"]
    assert len(train) == 4


def test_stop_mode_evaluates_the_version_it_stopped_at(tiny_ckpt, tmp_path):
    run_dir = str(tmp_path / "run")
    p = _run([f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "eval.mode=stop"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    evals = _evals(run_dir)
    assert [e["version"] for e in evals] == [0, 2, 4]
    assert (evals[1]["min_version"], evals[1]["max_version"]) == (2, 2)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["eval.server_url=http://127.0.0.1:1"], "eval.server_url"),
        (["eval.mode=pinned", "eval.server_url=127.0.0.1:1"], "eval.server_url"),
        (["eval.device=cpu"], "eval.device"),
        (["eval.mode=pinned", "server.backend=external", "server.urls=[http://127.0.0.1:1]"], "eval.mode"),
        (["eval.mode=sometimes"], "eval.mode"),
        (["eval.server_nice=5"], "eval.server_nice"),
        (["eval.mode=pinned", "eval.server_nice=20"], "eval.server_nice"),
        (["eval.mode=pinned", "eval.server_url=http://127.0.0.1:1", "eval.server_nice=5"], "eval.server_nice"),
    ],
)
def test_eval_keys_are_checked_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)
