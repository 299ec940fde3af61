"""Child processes and the launch seam: a crash is reported with its log tail, as an event the run's handler sees;
shutdown leaves no orphans (grandchildren included); `supervise` ends the run cleanly on a refused event."""

import asyncio
import os
import sys
import time

import pytest

from areal_async.config import load_config
from areal_async.launch import (
    ChildFailed,
    ExternalLauncher,
    LocalCluster,
    Processes,
    ProcessExited,
    ServerHandle,
    TrainerHandle,
    end_run_on_failure,
    supervise,
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return True


SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def crasher(msg: str, code: int, after_s: float = 0.0) -> list[str]:
    return [sys.executable, "-c", f"import sys, time; time.sleep({after_s}); print({msg!r}); sys.exit({code})"]


async def test_crashed_child_is_reported_with_log_tail(tmp_path):
    la = Processes(str(tmp_path))
    la.spawn("sleeper", SLEEP)
    la.spawn("crasher", crasher("boom happened", 3))
    try:
        with pytest.raises(ChildFailed, match="crasher exited with code 3") as e:
            await asyncio.wait_for(la.watch(0.05), 10)
        assert "boom happened" in str(e.value)
    finally:
        la.shutdown(grace_s=2)
    assert all(c.proc.poll() is not None for c in la.children)


def test_a_child_can_start_at_a_lower_cpu_priority(tmp_path):
    """`nice` (eval.server_nice: a pinned eval server on the cores the run uses) is added to ours in the child."""
    la = Processes(str(tmp_path))
    code = [sys.executable, "-c", "import os; print('nice', os.nice(0))"]
    ours = os.nice(0)
    try:
        low = la.spawn("low", code, nice=7)
        same = la.spawn("same", code)
        assert low.proc.wait(30) == 0 and same.proc.wait(30) == 0
    finally:
        la.shutdown(grace_s=2)
    assert f"nice {min(ours + 7, 19)}" in open(low.log_path).read()
    assert f"nice {ours}" in open(same.log_path).read()


def test_shutdown_kills_grandchildren(tmp_path):
    la = Processes(str(tmp_path))
    pidfile = tmp_path / "grandchild.pid"
    # the child ignores SIGTERM and starts a grandchild that does too: only the group SIGKILL ends them
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
        "signal.SIG_IGN); time.sleep(60)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    child = la.spawn("stubborn", [sys.executable, "-c", code])
    deadline = time.time() + 10
    while not pidfile.exists() or not pidfile.read_text():
        assert time.time() < deadline
        time.sleep(0.05)
    grandchild = int(pidfile.read_text())
    la.shutdown(grace_s=0.5)
    time.sleep(0.2)
    assert not alive(child.proc.pid)
    assert not alive(grandchild)


async def test_wait_healthy_fails_fast_when_server_dies(tmp_path):
    la = Processes(str(tmp_path))
    child = la.spawn(
        "server0",
        [sys.executable, "-c", "print('cannot load model'); raise SystemExit(1)"],
        role="server",
        url="http://127.0.0.1:9",
    )
    try:
        with pytest.raises(ChildFailed, match="cannot load model"):
            await la.wait_healthy([child], timeout_s=30)
    finally:
        la.shutdown(grace_s=1)


async def test_wait_healthy_fails_fast_when_the_trainer_dies(tmp_path):
    """The trainers load while the servers do: a trainer that dies meanwhile ends the wait with its own log."""
    la = Processes(str(tmp_path))
    server = la.spawn("server0", SLEEP, role="server", url="http://127.0.0.1:9")  # never healthy
    la.spawn("trainer", crasher("no GPU for rank 0", 2, 0.3), role="trainer")
    t0 = time.monotonic()
    try:
        with pytest.raises(ChildFailed, match="trainer exited with code 2") as e:
            await la.wait_healthy([server], timeout_s=60)
        assert "no GPU for rank 0" in str(e.value) and time.monotonic() - t0 < 20
    finally:
        la.shutdown(grace_s=1)


async def test_cluster_watch_reports_every_exit_once_as_an_event(tmp_path):
    procs = Processes(str(tmp_path))
    procs.spawn("server0", crasher("server gone", 4), role="server", url="http://127.0.0.1:9")
    procs.spawn("trainer", crasher("trainer gone", 5, 0.5), role="trainer")
    procs.spawn("sleeper", SLEEP)
    cluster = LocalCluster(
        procs,
        [ServerHandle("server0", "http://127.0.0.1:9")],
        TrainerHandle(1, str(tmp_path), b"x" * 32, "127.0.0.1"),
        poll_s=0.05,
    )
    events: list[ProcessExited] = []

    async def record(event):  # a handler that absorbs events: the watch goes on
        events.append(event)

    watch = asyncio.create_task(cluster.watch(record))
    try:
        for _ in range(200):
            if len(events) >= 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # more polls: nothing is reported twice
        assert not watch.done()
    finally:
        watch.cancel()
        await cluster.shutdown()
    assert [(e.name, e.role, e.exit_code) for e in events] == [("server0", "server", 4), ("trainer", "trainer", 5)]
    assert events[0].url == "http://127.0.0.1:9" and "server gone" in events[0].log_tail
    assert "trainer gone" in events[1].log_tail
    with pytest.raises(ChildFailed, match="trainer exited with code 5"):
        await end_run_on_failure(events[1])
    assert all(c.proc.poll() is not None for c in procs.children)


async def test_supervise_cancels_the_run_with_the_handlers_error(tmp_path):
    procs = Processes(str(tmp_path))
    procs.spawn("trainer", crasher("rank 0 died", 9, 0.3), role="trainer")
    cluster = LocalCluster(procs, [], TrainerHandle(1, str(tmp_path), b"x" * 32, "127.0.0.1"), poll_s=0.05)
    cleaned = []

    async def body():
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append(True)

    try:
        with pytest.raises(ChildFailed, match="trainer exited with code 9"):
            await asyncio.wait_for(supervise(body(), cluster, end_run_on_failure), 20)
        assert cleaned == [True]  # the run's own cleanup ran

        async def quick():
            return 42

        procs2 = Processes(str(tmp_path / "b"))
        procs2.spawn("sleeper", SLEEP)
        ok = LocalCluster(procs2, [], cluster.trainers, poll_s=0.05)
        assert await supervise(quick(), ok, end_run_on_failure) == 42
        await ok.shutdown()
    finally:
        await cluster.shutdown()


async def test_supervise_prefers_the_watch_diagnosis_over_the_body_error(tmp_path):
    """A dead trainer usually breaks the run's RPC before the watch polls: the error names the process instead."""
    procs = Processes(str(tmp_path))
    child = procs.spawn("trainer", crasher("CUDA out of memory", 1), role="trainer")
    cluster = LocalCluster(procs, [], TrainerHandle(1, str(tmp_path), b"x" * 32, "127.0.0.1"), poll_s=0.2)

    async def body():
        while child.proc.poll() is None:
            await asyncio.sleep(0.01)
        raise ConnectionError("trainer rank 0: peer closed the connection")

    try:
        with pytest.raises(ChildFailed, match="CUDA out of memory") as e:
            await supervise(body(), cluster, end_run_on_failure)
        assert isinstance(e.value.__cause__, ConnectionError)
    finally:
        await cluster.shutdown()


async def test_external_launcher_fails_naming_the_unreachable_server_and_stops_the_trainers(tmp_path):
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path}",
            "server.backend=external",
            "server.urls=[http://127.0.0.1:9]",
            "server.startup_timeout_s=1",
        ],
    )
    with pytest.raises(ChildFailed, match=r"http://127.0.0.1:9 not healthy after 1s"):
        await ExternalLauncher().launch(cfg, model_path=str(tmp_path / "no-model"))
    log = (tmp_path / "logs" / "trainer.log").read_text()
    assert "torch.distributed.run" in log  # the trainers were started ...
    # ... and stopped with the failed launch: no torchrun process of this run dir is left
    time.sleep(0.5)
    leftovers = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
            except OSError:
                continue
            if str(tmp_path) in cmd and "areal_async.train.worker" in cmd and alive(int(pid)):
                leftovers.append(pid)
    assert not leftovers
