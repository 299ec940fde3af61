"""End to end: `python -m areal_async.run` with real servers, a real torchrun trainer and the real controller.

These use a random tiny checkpoint, so they check the machinery (staleness bound, interruption, in-place weight
updates, resume after a normal stop and after a SIGKILL, the sample accounting, outputs, crash handling, the checks
before launch), not learning; tests/test_learning.py checks that the default task learns.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from areal_async.rollout import ledger

pytestmark = pytest.mark.slow

COMMON = [
    "schedule.batch_size=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=200",
    "eval.num_prompts=8",
    "eval.max_new_tokens=16",
    "data.num_train=200",
    "data.num_eval=8",
    "train.micro_batch_tokens=1024",
    "server.max_total_tokens=16384",
    # the CPU paths and their fp32 numerics on any host (device=auto is CUDA and bf16 where there is a GPU;
    # tests/test_gpu_e2e.py runs the same on CUDA)
    "server.device=cpu",
    "train.device=cpu",
]


def run_cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "areal_async.run", *args], capture_output=True, text=True, timeout=timeout
    )


def records(run_dir: str, kind: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def index_lines(run_dir: str) -> list[dict]:
    return ledger.read(os.path.join(run_dir, ledger.FILE_NAME))


def resolved(lines: list[dict]) -> set[int]:
    return (
        {i for r in lines for i in r.get("trained", [])}
        | {d["index"] for r in lines for d in r.get("dropped", [])}
        | {i for r in lines for i in r.get("unfinished", [])}
    )


def child_pids(run_dir: str) -> list[int]:
    """Every process the run started, read while it runs: the launched children from run.log (the server and the
    torchrun agent) and the trainer ranks from their rank files (grandchildren, removed when a rank exits)."""
    with open(os.path.join(run_dir, "run.log")) as f:
        pids = [int(p) for p in re.findall(r"started \w+ \(pid (\d+)\)", f.read())]
    trainer_dir = os.path.join(run_dir, "trainer")
    if os.path.isdir(trainer_dir):
        for name in os.listdir(trainer_dir):
            if name.endswith(".json"):
                with open(os.path.join(trainer_dir, name)) as f:
                    pids.append(json.load(f)["pid"])
    return pids


def running_children(run_dir: str, expected: int) -> list[int]:
    """The run's processes, all `expected` of them alive now: an orphan check over an empty list would pass
    whatever happened."""
    pids = child_pids(run_dir)
    assert len(set(pids)) >= expected and all(alive(p) for p in pids), (pids, [alive(p) for p in pids])
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="module")
def async_run(tiny_ckpt, tmp_path_factory) -> str:
    run_dir = str(tmp_path_factory.mktemp("e2e") / "async")
    # eta=1 over 4 steps: the bound can bite (tokens of version 0 trained at step 4 would be 3 versions stale).
    # Requests are in flight at an update only while the groups eta admits take longer to generate than a train
    # step: two running requests and up to 400 new tokens keep it so on a loaded machine (with four and 200, a
    # whole run under xdist load once had no request in flight at any update)
    p = run_cli(
        [
            f"model.path={tiny_ckpt}",
            f"run_dir={run_dir}",
            "mode=async",
            "eta=1",
            "total_steps=4",
            "schedule.eval_every=2",
            "schedule.checkpoint_every=2",
            "server.max_running_requests=2",
            *[a for a in COMMON if not a.startswith("rollout.max_new_tokens=")],
            "rollout.max_new_tokens=400",
        ]
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run_dir


def test_async_run_outputs_and_staleness_bound(async_run):
    with open(os.path.join(async_run, "summary.json")) as f:
        s = json.load(f)
    for key in (
        "base_accuracy",
        "final_accuracy",
        "wall_s",
        "mode",
        "eta",
        "trained_samples",
        "max_staleness_seen",
        "interrupt_mode",
        "dropped",
    ):
        assert key in s
    assert s["mode"] == "async" and s["eta"] == 1 and s["steps"] == 4 and s["interrupt_mode"] == "abort"
    assert s["trained_samples"] == 4 * 4 * 4
    train = records(async_run, "train")
    assert [r["version"] for r in train] == [1, 2, 3, 4]
    # every trained token was produced by a policy at most eta versions old (computed from per-token versions)
    assert all(r["staleness_max"] <= 1 for r in train)
    assert s["max_staleness_seen"] <= 1
    assert sum(s["staleness_hist"].values()) > 0 and set(map(int, s["staleness_hist"])) <= {0, 1}
    # interruption is real: some trajectories were interrupted and carry tokens of two versions
    assert any(r["interrupted_frac"] > 0 for r in train), train
    assert any(r["multi_version_frac"] > 0 for r in train), train
    evals = records(async_run, "eval")
    assert [r["version"] for r in evals] == [0, 2, 4]
    # the eval at version 2 runs beside the train step that makes version 3, and that step's weight sync waits for
    # it: every eval token comes from the version the eval reports
    assert all(r["min_version"] == r["max_version"] == r["version"] for r in evals), evals
    for path in (
        "progress.png",
        "final/config.json",
        "final/model.safetensors",
        "final/tokenizer.json",
        "checkpoints/latest.json",
        "logs/server0.log",
        "logs/trainer.log",
        "trained_index.jsonl",
    ):
        assert os.path.exists(os.path.join(async_run, path)), path
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(os.path.join(async_run, "tensorboard")))
    # the final checkpoint is the last published version, linked rather than written a second time
    assert s["final_checkpoint"] == os.path.join(async_run, "final")
    assert os.path.samefile(
        os.path.join(async_run, "final", "model.safetensors"),
        os.path.join(async_run, "weights", "v4", "model.safetensors"),
    )
    # the accounting: one line per step with its B groups, an end line, every draw exactly once
    lines = index_lines(async_run)
    assert [r.get("version") for r in lines[:-1]] == [1, 2, 3, 4] and lines[-1]["end"]
    assert all(len(r["trained"]) == 4 for r in lines[:-1])
    ledger.check_invariant(lines)


def test_resume_continues_version_and_data_position(async_run, tiny_ckpt, tmp_path):
    # a copy: the other tests read the finished run as it is, in any order (its checkpoint path stays absolute)
    run_dir = str(tmp_path / "resumed")
    shutil.copytree(async_run, run_dir)
    with open(os.path.join(run_dir, "checkpoints", "latest.json")) as f:
        before = json.load(f)
    assert before["version"] == 4
    # what the final checkpoint had not seen resolved: what the end line names (written after the checkpoint)
    end = index_lines(run_dir)[-1]
    assert set(before["pending"]) == resolved([end]) and before["pending"]
    p = run_cli(
        [
            f"model.path={tiny_ckpt}",
            f"run_dir={run_dir}",
            "mode=async",
            "eta=1",
            "total_steps=6",
            "schedule.eval_every=0",
            *COMMON,
        ]
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resuming from" in p.stdout
    train = records(run_dir, "train")
    assert [r["version"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness_max"] <= 1 for r in train)
    with open(os.path.join(run_dir, "checkpoints", "latest.json")) as f:
        after = json.load(f)
    assert after["version"] == 6
    assert after["trained_samples"] == 6 * 16
    lines = index_lines(run_dir)
    assert [r.get("version") for r in lines[:-1]] == [1, 2, 3, 4, 5, 6]  # the first run's end line was cut
    ledger.check_invariant(lines)
    assert set(before["pending"]) <= resolved(lines[4:])  # drawn again after the resume
    # the resumed run went on drawing where the first stopped: every draw 0..data_position-1 is accounted for
    # exactly once over both runs, and it drew fresh samples beyond the first run's
    assert resolved(lines) == set(range(after["data_position"]))
    assert after["data_position"] > before["data_position"]
    assert set(after["pending"]) == resolved([lines[-1]])


def test_killed_controller_resumes_with_exact_accounting(tiny_ckpt, tmp_path):
    """SIGKILL the controller between two checkpoints: its children go with it, and a rerun with the same run_dir
    cuts the records back to the checkpoint and draws every sample the checkpoint had not resolved again, once."""
    run_dir = str(tmp_path / "killed")
    args = [
        f"model.path={tiny_ckpt}",
        f"run_dir={run_dir}",
        "mode=async",
        "eta=2",
        "total_steps=6",
        "schedule.eval_every=0",
        "schedule.checkpoint_every=2",
        *COMMON,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_async.run", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    path = os.path.join(run_dir, ledger.FILE_NAME)
    try:
        deadline = time.monotonic() + 180
        while not (os.path.exists(path) and sum(1 for _ in open(path)) >= 3):  # past the checkpoint at 2
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no third train step within 180 s"
            time.sleep(0.05)
        children = running_children(run_dir, 3)  # the server, the torchrun agent, trainer rank 0
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not wait_gone(children), "the controller's children outlived it"
    with open(os.path.join(run_dir, "checkpoints", "latest.json")) as f:
        ckpt = json.load(f)
    killed = index_lines(run_dir)
    assert ckpt["version"] == 2 and [r["version"] for r in killed][:3] == [1, 2, 3] and "end" not in killed[-1]

    p = run_cli(args)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resuming from" in p.stdout
    lines = index_lines(run_dir)
    assert [r.get("version") for r in lines[:-1]] == [1, 2, 3, 4, 5, 6] and lines[-1]["end"]
    assert lines[:2] == killed[:2]  # what the checkpoint had seen stays as it was
    ledger.check_invariant(lines)
    assert set(ckpt["pending"]) <= resolved(lines[2:])
    assert [r["version"] for r in records(run_dir, "train")] == [1, 2, 3, 4, 5, 6]  # metrics cut back too
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["trained_samples"] == 6 * 16


@functools.lru_cache(maxsize=1)
def embedded_server_reports_version_spans(ckpt: str) -> bool:
    """Whether a response says where its weight version changed (meta_info weight_version_spans)."""
    import asyncio

    import aiohttp

    from areal_async.server.app import start_server

    async def probe() -> bool:
        async with await start_server(ckpt, port=0, device="cpu") as server, aiohttp.ClientSession() as s:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
            async with s.post(server.url + "/generate", json=body) as r:
                return "weight_version_spans" in (await r.json())["meta_info"]

    return asyncio.run(probe())


@pytest.fixture(scope="module", params=["disk", "broadcast"])
def in_place_run(request, tiny_ckpt, tmp_path_factory) -> str:
    run_dir = str(tmp_path_factory.mktemp("inplace") / request.param)
    p = run_cli(
        [
            f"model.path={tiny_ckpt}",
            f"run_dir={run_dir}",
            "mode=async",
            "eta=2",
            # steps 1 and 2 train tokens made before any update; a span needs a request in flight at an update.
            # One request at a time makes generation ~10x slower than a train step (16 answers of ~100 tokens in
            # turn against 0.3 s), so the trainer always waits for batches and every update finds one running; with
            # 4 at a time a loaded machine's slow trainer once let generation run ahead to the staleness limit and
            # stop, and no update met a request (CI at load 5)
            "total_steps=6",
            "schedule.interrupt_mode=in_place",
            f"train.weight_sync={request.param}",
            "schedule.eval_every=0",
            "server.max_running_requests=1",
            *COMMON,
        ]
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run_dir


def test_in_place_weight_updates_never_abort(in_place_run):
    """pause(in_place) + a load without a cache flush, for disk and broadcast: requests in flight stay on the
    server and continue (no abort, no resubmission), and the staleness bound holds."""
    with open(os.path.join(in_place_run, "summary.json")) as f:
        s = json.load(f)
    assert s["interrupt_mode"] == "in_place" and s["trained_samples"] == 6 * 4 * 4
    train = records(in_place_run, "train")
    assert [r["version"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert all(r["interrupted_frac"] == 0 for r in train), train
    assert all(r["staleness_max"] <= 2 for r in train)
    ledger.check_invariant(index_lines(in_place_run))


def test_in_place_tokens_carry_exact_versions(in_place_run, tiny_ckpt):
    """With the server reporting where a response's version changed, one response spans two versions without
    being interrupted."""
    if not embedded_server_reports_version_spans(tiny_ckpt):
        pytest.skip("the embedded server does not report weight_version_spans yet")
    train = records(in_place_run, "train")
    assert any(r["multi_version_frac"] > 0 for r in train), train
    assert all(r["interrupted_frac"] == 0 for r in train)


def test_sync_mode_never_trains_stale_tokens(tiny_ckpt, tmp_path):
    """Also the broadcast weight path: trainer rank 0 -> the server over torch.distributed (gloo here)."""
    run_dir = str(tmp_path / "sync")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:  # an older run's records in the same folder
        f.write(json.dumps({"kind": "train", "step": 7, "time": 0.0, "version": 7}) + "\n")
    p = run_cli(
        [
            f"model.path={tiny_ckpt}",
            f"run_dir={run_dir}",
            "mode=sync",
            "total_steps=3",
            "schedule.eval_every=0",
            "train.weight_sync=broadcast",
            *COMMON,
        ]
    )
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
    """Without trainer restarts (recovery.max_trainer_restarts=0; tests/test_faults.py covers the restarts)."""
    run_dir = str(tmp_path / "crash")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_async.run",
            f"model.path={tiny_ckpt}",
            f"run_dir={run_dir}",
            "total_steps=10000",
            "schedule.eval_every=0",
            "recovery.max_trainer_restarts=0",
            *COMMON,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        metrics = os.path.join(run_dir, "metrics.jsonl")
        while not (os.path.exists(metrics) and records(run_dir, "train")):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no train step within 180 s"
            time.sleep(0.5)
        children = running_children(run_dir, 3)  # the server, the torchrun agent, trainer rank 0
        with open(os.path.join(run_dir, "trainer", "rank0.json")) as f:
            os.kill(json.load(f)["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "trainer" in out and ("exited" in out or "connection" in out.lower()), out[-3000:]
    assert not wait_gone(children, timeout=30), "orphans"


def served(url: str) -> float:
    """Seconds of model compute the embedded server at `url` has done (its /server_info busy_s); -1 if down."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/server_info", timeout=5) as r:
            return float(json.loads(r.read())["busy_s"])
    except (OSError, ValueError, KeyError):
        return -1.0


def test_waiting_updates_with_two_servers_and_two_trainer_ranks(tiny_ckpt, tmp_path):
    """schedule.interruptible=false, server.num_servers=2 and train.nproc=2 in one run: every weight update waits
    on each server for the requests running there (nothing aborted, no response spans two versions), both servers
    generate, the two ranks train every step, and the staleness bound holds."""
    run_dir = str(tmp_path / "wait")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_async.run",
            f"model.path={tiny_ckpt}",
            f"run_dir={run_dir}",
            "mode=async",
            "eta=1",
            "total_steps=3",
            "schedule.eval_every=0",
            "schedule.interruptible=false",
            "server.num_servers=2",
            "train.nproc=2",
            *COMMON,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    busy: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            log_path = os.path.join(run_dir, "run.log")
            text = open(log_path).read() if os.path.exists(log_path) else ""
            for url in re.findall(r"server\d healthy at (\S+)", text):
                busy[url] = max(busy.get(url, 0.0), served(url))
            time.sleep(0.5)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert len(busy) == 2 and all(b > 0 for b in busy.values()), busy  # both servers generated
    assert re.search(r"and 2 trainer rank\(s\) ready", out), out[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    assert s["interrupt_mode"] == "wait" and s["num_servers"] == 2 and s["trained_samples"] == 3 * 4 * 4
    train = records(run_dir, "train")
    assert [r["version"] for r in train] == [1, 2, 3]
    assert all(r["interrupted_frac"] == 0 and r["multi_version_frac"] == 0 for r in train), train
    assert all(r["staleness_max"] <= 1 for r in train)
    ledger.check_invariant(index_lines(run_dir))


def step_lines(run_dir: str) -> int:
    """How many train steps the controller has started: it logs this line as it sends a step to the trainers."""
    with open(os.path.join(run_dir, "run.log")) as f:
        return len(re.findall(r"train step \d+ -> \d+: ", f.read()))


def train_records(run_dir: str) -> int:
    """How many train steps have ended (their metrics record is written once the step and its weight sync are
    done)."""
    count = 0
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                try:
                    count += json.loads(line)["kind"] == "train"
                except ValueError:  # the line being written
                    break
    except OSError:
        pass
    return count


def wait_for(proc: subprocess.Popen, cond, what: str, timeout: float = 600):
    """Poll `cond` while the run is alive; `timeout` is a hang guard (far above what any machine needs)."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, f"the run exited (rc {proc.returncode}) before {what}:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(0.01)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_signal_stops_the_run_cleanly_and_it_resumes(tiny_ckpt, tmp_path, sig):
    """Ctrl-C or SIGTERM (a time limit, `kill`) of `python -m areal_async.run` itself with the local launcher, in
    the middle of a train step: it exits 130 with its usual message and no traceback, its trainer rank is gone by
    the time it has exited, nothing else it started keeps running, and the checkpoint it left resumes the run
    (SIGINT: the rerun finishes with every draw accounted for once).

    Deterministic on any machine: the run is far too long to end by itself, and the signal goes out only once the
    run is provably inside a step that cannot end: the trainer rank is stopped (SIGSTOP) the moment the controller
    logs a step, and stays stopped through the teardown, as a rank deep in a long step would be (the run must
    neither wait for it nor leave it behind)."""
    run_dir = str(tmp_path / "sig")
    args = [
        f"model.path={tiny_ckpt}",
        f"run_dir={run_dir}",
        "mode=async",
        "eta=1",
        "total_steps=1000",
        "schedule.eval_every=0",
        "schedule.checkpoint_every=1",
        *COMMON,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_async.run", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    latest = os.path.join(run_dir, "checkpoints", "latest.json")
    rank = None
    try:
        wait_for(proc, lambda: os.path.exists(latest) and json.load(open(latest))["version"] >= 1, "a checkpoint")
        children = running_children(run_dir, 3)
        with open(os.path.join(run_dir, "trainer", "rank0.json")) as f:
            rank = json.load(f)["pid"]
        started = step_lines(run_dir)
        wait_for(proc, lambda: step_lines(run_dir) > started, "another train step")
        os.kill(rank, signal.SIGSTOP)
        # inside a step: started (logged) and not ended (no record), and it cannot end while the rank is stopped
        wait_for(proc, lambda: (lambda n: n > train_records(run_dir))(step_lines(run_dir)), "a step in progress")
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        if rank is not None and alive(rank):  # a failed test leaves no stopped rank behind
            os.kill(rank, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted; children stopped" in out and "Traceback" not in out, out[-3000:]
    assert not alive(rank), "the trainer rank outlived the run"
    assert not wait_gone(children, timeout=600), "processes outlived the run"
    with open(latest) as f:
        ckpt = json.load(f)
    assert ckpt["version"] >= 1 and os.path.isdir(os.path.join(ckpt["checkpoint"], "trainer"))
    if sig != signal.SIGINT:
        return
    end = ckpt["version"] + 2
    p = run_cli([*args, f"total_steps={end}"], timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"resuming from {ckpt['checkpoint']} at version {ckpt['version']}" in p.stdout
    lines = index_lines(run_dir)
    assert [r.get("version") for r in lines[:-1]] == list(range(1, end + 1)) and lines[-1]["end"]
    ledger.check_invariant(lines)
    assert set(ckpt["pending"]) <= resolved(lines[ckpt["version"] :])


def test_bad_config_names_the_key(tmp_path):
    p = run_cli([f"run_dir={tmp_path / 'bad'}", "rollout.bogus_key=1"], timeout=60)
    assert p.returncode == 2
    assert "rollout.bogus_key" in p.stderr
    p = run_cli([f"run_dir={tmp_path / 'bad'}", "train.optim.lr=fast"], timeout=60)
    assert p.returncode == 2 and "train.optim.lr" in p.stderr


@pytest.mark.parametrize(
    "override,key",
    [
        ("data.reward=no_such_reward", "data.reward"),
        ("data.reward=no_such_module:fn", "data.reward"),
        ("rollout.workflow=no_such_module:make", "rollout.workflow"),
        ("rollout.workflow=bogus", "rollout.workflow"),
        ("data.name=/nowhere/train.jsonl", "data.name"),
        ("model.path=/nowhere", "model.path"),
    ],
)
def test_problems_are_found_before_anything_is_launched(tiny_ckpt, tmp_path, override, key):
    run_dir = tmp_path / "pre"
    p = run_cli([f"model.path={tiny_ckpt}", f"run_dir={run_dir}", override], timeout=60)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stderr.startswith(f"config error: {key}"), p.stderr
    assert not (run_dir / "logs").exists()  # nothing was started


def test_missing_chat_template_is_found_before_launch(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "no_template"
    shutil.copytree(tiny_ckpt, ckpt)
    cfg_path = ckpt / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.pop("chat_template")
    cfg_path.write_text(json.dumps(tok_cfg))
    for override, key in (
        ("data.apply_chat_template=true", "data.apply_chat_template"),
        ("rollout.multi_turn.chat=true", "rollout.multi_turn.chat"),
    ):
        p = run_cli(
            [f"model.path={ckpt}", f"run_dir={tmp_path / 'r'}", "rollout.workflow=multi_turn", override], timeout=60
        )
        assert p.returncode == 2 and p.stderr.startswith(f"config error: {key}: the chat template"), p.stderr
    assert not (tmp_path / "r" / "logs").exists()


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
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            EMBED_SCRIPT,
            f"model.path={tiny_ckpt}",
            f"run_dir={run_dir}",
            "mode=sync",
            "total_steps=2",
            "schedule.eval_every=0",
            *COMMON,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(run_dir, "calls.txt")) as f:
        calls = f.read().split()
    assert len(calls) >= 2 * 4  # every trained group came through the custom workflow (batch_size 4, 2 steps)
    assert len(records(run_dir, "train")) == 2
