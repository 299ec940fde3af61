"""End to end: `python -m areal_async.run` with real servers, a real torchrun trainer and the real controller.

These use a random tiny checkpoint, so they check the machinery (staleness bound, interruption, resume, outputs,
crash handling), not learning; tests/test_learning.py checks that the default task learns.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

COMMON = ["rollout.batch_size=4", "rollout.group_size=4", "rollout.max_new_tokens=200", "eval.num_prompts=8",
          "eval.max_new_tokens=16", "data.num_train=200", "data.num_eval=8", "train.micro_batch_tokens=1024",
          "server.max_total_tokens=16384"]


def run_cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_async.run", *args], capture_output=True, text=True,
                          timeout=timeout)


def records(run_dir: str, kind: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def child_pids(run_dir: str) -> list[int]:
    with open(os.path.join(run_dir, "run.log")) as f:
        pids = [int(p) for p in re.findall(r"started \w+ \(pid (\d+)\)", f.read())]
    trainer_dir = os.path.join(run_dir, "trainer")
    if os.path.isdir(trainer_dir):
        for name in os.listdir(trainer_dir):
            if name.endswith(".json"):
                with open(os.path.join(trainer_dir, name)) as f:
                    pids.append(json.load(f)["pid"])
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def async_run(tiny_ckpt, tmp_path_factory) -> str:
    run_dir = str(tmp_path_factory.mktemp("e2e") / "async")
    p = run_cli([f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "mode=async", "eta=3", "total_steps=4",
                 "eval.every_steps=2", "train.checkpoint_every=2", "server.max_running_requests=4", *COMMON])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run_dir


def test_async_run_outputs_and_staleness_bound(async_run):
    with open(os.path.join(async_run, "summary.json")) as f:
        s = json.load(f)
    for key in ("base_accuracy", "final_accuracy", "wall_s", "mode", "eta", "trained_samples", "max_staleness_seen"):
        assert key in s
    assert s["mode"] == "async" and s["eta"] == 3 and s["steps"] == 4
    assert s["trained_samples"] == 4 * 4 * 4
    train = records(async_run, "train")
    assert [r["version"] for r in train] == [1, 2, 3, 4]
    # every trained token was produced by a policy at most eta versions old (computed from per-token versions)
    assert all(r["staleness_max"] <= 3 for r in train)
    assert s["max_staleness_seen"] <= 3
    # interruption is real: some trajectories were interrupted and carry tokens of two versions
    assert any(r["interrupted_frac"] > 0 for r in train), train
    assert any(r["multi_version_frac"] > 0 for r in train), train
    evals = records(async_run, "eval")
    assert [r["version"] for r in evals] == [0, 2, 4]
    # the eval at version 2 runs beside the train step that makes version 3, and that step's weight sync waits for
    # it: every eval token comes from the version the eval reports
    assert all(r["min_version"] == r["max_version"] == r["version"] for r in evals), evals
    for path in ("progress.png", "final/config.json", "final/model.safetensors", "final/tokenizer.json",
                 "checkpoints/latest.json", "logs/server0.log", "logs/trainer.log"):
        assert os.path.exists(os.path.join(async_run, path)), path
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(os.path.join(async_run, "tensorboard")))


def test_resume_continues_version_and_data_position(async_run, tiny_ckpt):
    with open(os.path.join(async_run, "checkpoints", "latest.json")) as f:
        before = json.load(f)
    assert before["version"] == 4
    p = run_cli([f"model.path={tiny_ckpt}", f"run_dir={async_run}", "mode=async", "eta=3", "total_steps=6",
                 "eval.every_steps=0", *COMMON])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resuming from" in p.stdout
    train = records(async_run, "train")
    assert [r["version"] for r in train][-2:] == [5, 6]
    assert all(r["staleness_max"] <= 3 for r in train)
    with open(os.path.join(async_run, "checkpoints", "latest.json")) as f:
        after = json.load(f)
    assert after["version"] == 6
    assert after["data_position"] > before["data_position"]
    assert after["trained_samples"] == 6 * 16


def test_sync_mode_never_trains_stale_tokens(tiny_ckpt, tmp_path):
    """Also the broadcast weight path: trainer rank 0 -> the server over torch.distributed (gloo here)."""
    run_dir = str(tmp_path / "sync")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:  # an older run's records in the same folder
        f.write(json.dumps({"kind": "train", "step": 7, "time": 0.0, "version": 7}) + "\n")
    p = run_cli([f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "mode=sync", "total_steps=3",
                 "eval.every_steps=0", "train.weight_sync=broadcast", *COMMON])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    train = records(run_dir, "train")
    assert len(train) == 3 and [r["version"] for r in train] == [1, 2, 3]  # only this run's
    kept = [n for n in os.listdir(run_dir) if n.startswith("metrics.before-")]
    assert len(kept) == 1
    with open(os.path.join(run_dir, kept[0])) as f:
        assert json.loads(f.readline())["version"] == 7
    assert all(r["staleness_max"] == 0 and r["multi_version_frac"] == 0 for r in train)
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["eta"] == 0
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))  # published at the end


def test_crashed_trainer_ends_the_run_cleanly(tiny_ckpt, tmp_path):
    run_dir = str(tmp_path / "crash")
    proc = subprocess.Popen([sys.executable, "-m", "areal_async.run", f"model.path={tiny_ckpt}",
                             f"run_dir={run_dir}", "total_steps=10000", "eval.every_steps=0", *COMMON],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        metrics = os.path.join(run_dir, "metrics.jsonl")
        while not (os.path.exists(metrics) and records(run_dir, "train")):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no train step within 180 s"
            time.sleep(0.5)
        with open(os.path.join(run_dir, "trainer", "rank0.json")) as f:
            os.kill(json.load(f)["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "trainer" in out and ("exited" in out or "connection" in out.lower()), out[-3000:]
    time.sleep(1.0)
    leftovers = [pid for pid in child_pids(run_dir) if alive(pid)]
    assert not leftovers, f"orphans: {leftovers}"


def test_bad_config_names_the_key(tmp_path):
    p = run_cli([f"run_dir={tmp_path / 'bad'}", "rollout.bogus_key=1"], timeout=60)
    assert p.returncode == 2
    assert "rollout.bogus_key" in p.stderr
    p = run_cli([f"run_dir={tmp_path / 'bad'}", "train.optim.lr=fast"], timeout=60)
    assert p.returncode == 2 and "train.optim.lr" in p.stderr


EMBED_SCRIPT = """
import sys
from areal_async.rollout.workflows import build_workflow
from areal_async.run import main

class Counting:
    def __init__(self, inner, path):
        self.inner, self.path = inner, path
    async def run(self, client, sample):
        with open(self.path, "a") as f:
            f.write(f"{sample.id}\\n")
        return await self.inner.run(client, sample)

def factory(cfg, tokenizer, score):
    return Counting(build_workflow(cfg, tokenizer, score), cfg.run_dir + "/calls.txt")

sys.exit(main(sys.argv[1:], workflow=factory))
"""


def test_python_api_takes_a_workflow_factory(tiny_ckpt, tmp_path):
    """`main(argv, workflow=...)`: the run drives a workflow handed in from Python, not named in the config."""
    run_dir = str(tmp_path / "embed")
    p = subprocess.run([sys.executable, "-c", EMBED_SCRIPT, f"model.path={tiny_ckpt}", f"run_dir={run_dir}",
                        "mode=sync", "total_steps=2", "eval.every_steps=0", *COMMON],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(run_dir, "calls.txt")) as f:
        calls = f.read().split()
    assert len(calls) >= 2 * 4  # every trained group came through the custom workflow (batch_size 4, 2 steps)
    assert len(records(run_dir, "train")) == 2
