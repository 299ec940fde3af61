"""What a run leaves behind when nothing went wrong, or when it never really started: flags and overrides in any
order, usage lines that name the command typed, no run directory for a run that failed its checks, no false crash
record after an interrupted start-up, a trainer.log without torchrun's SignalException traceback after a clean
run, and a trainer rank that leaves promptly when signalled in the middle of a call that cannot finish."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from areal_async import run as run_module
from areal_async.launch.recovery import LOCK_FILE, RunLock
from areal_async.net.rank_registry import rank_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = [
    "schedule.batch_size=4",
    "rollout.group_size=4",
    "eval.num_prompts=8",
    "eval.max_new_tokens=16",
    "data.num_train=200",
    "data.num_eval=8",
    "schedule.eval_every=0",
    "server.device=cpu",
    "train.device=cpu",
]
HANG_S = 300  # hang guards, far above what any machine needs: never speed bars


def controller(args: list[str], out_path: str) -> subprocess.Popen:
    with open(out_path, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "areal_async.run", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
        )


def wait_for_text(path: str, text: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        with open(path) as f:
            if text in f.read():
                return
        assert proc.poll() is None, open(path).read()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} within {HANG_S}s")


# ---- the command line ---------------------------------------------------------------------------------------------


def test_flags_and_overrides_mix_in_any_order(capsys):
    import yaml

    assert run_module.main(["mode=sync", "--print-config", "eta=0", "schedule.batch_size=4"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["schedule"]["mode"] == "sync" and printed["schedule"]["eta"] == 0
    assert printed["schedule"]["batch_size"] == 4
    args = run_module.parse_args(["eta=1", "--print-config", "eta=2"])
    assert args.print_config and args.overrides == ["eta=1", "eta=2"]  # their order decides a repeated key


def test_usage_names_the_command_that_was_typed(monkeypatch, capsys):
    assert run_module.program_name("/venv/bin/areal-run") == "areal-run"
    assert run_module.program_name(os.path.join(ROOT, "areal_async", "run.py")) == "python -m areal_async.run"
    monkeypatch.setattr(sys, "argv", ["/venv/bin/areal-run", "--no-such-flag"])
    with pytest.raises(SystemExit):
        run_module.parse_args(["--no-such-flag"])
    assert capsys.readouterr().err.startswith("usage: areal-run ")


def test_console_script_usage_line(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "areal-run")
    if not os.path.exists(script):
        pytest.skip(f"{script} is not installed (pip install -e .)")
    p = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.startswith("usage: areal-run "), p.stdout[:300] + p.stderr


# ---- a run that fails its checks, or is interrupted while starting ------------------------------------------------


def test_a_failed_check_leaves_no_run_dir(tmp_path, capsys):
    run_dir = tmp_path / "new"
    assert run_module.main([f"run_dir={run_dir}", f"model.path={tmp_path / 'no_such_model'}"]) == 2
    assert capsys.readouterr().err.startswith("config error: model.path: ")
    assert not run_dir.exists()
    kept = tmp_path / "kept"  # a run directory that was there before stays as it was
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert run_module.main([f"run_dir={kept}", "data.reward=no_such_reward"]) == 2
    assert sorted(os.listdir(kept)) == ["notes.txt"]


@pytest.mark.slow
def test_ctrl_c_during_start_up_leaves_no_crash_record(tmp_path):
    run_dir = str(tmp_path / "run")
    out = str(tmp_path / "first.out")
    proc = controller([f"run_dir={run_dir}", "total_steps=1000", *SMALL], out)
    try:
        wait_for_text(out, "started trainer", proc)  # servers and trainers on their way up
        proc.send_signal(signal.SIGINT)
        assert proc.wait(HANG_S) == 130, open(out).read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    with open(os.path.join(run_dir, LOCK_FILE)) as f:
        assert json.load(f)["state"] != "running"
    lock = RunLock(run_dir)
    assert lock.acquire() is None  # the next controller finds no crash to report
    lock.release("stopped")


# ---- a clean run's logs -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_clean_run_leaves_no_traceback_in_the_trainer_log(tmp_path):
    run_dir = str(tmp_path / "run")
    out = str(tmp_path / "run.out")
    proc = controller([f"run_dir={run_dir}", "total_steps=2", *SMALL], out)
    try:
        assert proc.wait(HANG_S) == 0, open(out).read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    with open(os.path.join(run_dir, "logs", "trainer.log")) as f:
        trainer_log = f.read()
    assert "rank 0/1 serving" in trainer_log
    assert "Traceback" not in trainer_log and "SignalException" not in trainer_log, trainer_log[-3000:]
    assert "closing signal" not in trainer_log  # torchrun's agent was not signalled: its ranks left on request
    with open(os.path.join(run_dir, LOCK_FILE)) as f:
        assert json.load(f)["state"] == "stopped"


# ---- a trainer rank stopped in the middle of a call ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_signalled_rank_leaves_promptly_mid_call(tiny_ckpt, tmp_path):
    """Two ranks; rank 1 stopped (SIGSTOP), rank 0 asked for a checkpoint, whose barriers then cannot complete.
    SIGTERM to rank 0 must end it after a few seconds of grace, not after the minute a call was once given."""
    import secrets as secrets_mod

    from areal_async.launch import Processes
    from areal_async.net.rpc import RpcClient
    from areal_async.train import worker
    from areal_async.train.client import TrainerGroup
    from areal_async.types import CheckpointRequest, CheckpointResult

    secret = secrets_mod.token_bytes(32)
    procs = Processes(str(tmp_path / "job"))
    child = procs.start_trainers(
        model=tiny_ckpt,
        nproc=2,
        config_json=json.dumps({"device": "cpu"}),
        seed=3,
        secret_hex=secret.hex(),
        torch_threads=1,
    )
    stopped: list[int] = []
    client = None
    try:
        group = await TrainerGroup.connect(procs.run_dir, 2, secret, timeout=HANG_S)
        pids = []
        for r in range(2):
            with open(rank_file(procs.run_dir, r)) as f:
                pids.append(json.load(f)["pid"])
        with open(rank_file(procs.run_dir, 0)) as f:
            address = json.load(f)["address"]
        await group.close()
        os.kill(pids[1], signal.SIGSTOP)
        stopped.append(pids[1])
        client = await RpcClient.connect(address, secret, timeout=60)
        call = asyncio.ensure_future(
            client.call("save_checkpoint", CheckpointRequest(path=str(tmp_path / "ck")), CheckpointResult)
        )
        await asyncio.sleep(1.0)  # the call has reached rank 0's barrier, where it waits for rank 1
        assert not call.done()
        os.kill(pids[0], signal.SIGTERM)
        # well below the former 60 s grace, well above the few seconds the rank takes now
        deadline = time.monotonic() + 40
        while _alive(pids[0]) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not _alive(pids[0]), "rank 0 still running 40 s after SIGTERM"
        call.cancel()
        with open(child.log_path) as f:
            text = f.read()
        assert f"still busy {worker._STOP_GRACE_S:.0f}s after the stop; exiting" in text
    finally:
        if client is not None:
            await client.close()
        for pid in stopped:
            with_suppress_kill(pid, signal.SIGKILL)
        procs.shutdown(grace_s=5)


def with_suppress_kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False
