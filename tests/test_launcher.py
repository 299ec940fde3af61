"""Child processes: a crash is reported with its log tail; shutdown leaves no orphans (grandchildren included)."""

import asyncio
import os
import sys
import time

import pytest

from areal_async.launcher import ChildFailed, Launcher


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


async def test_crashed_child_is_reported_with_log_tail(tmp_path):
    la = Launcher(str(tmp_path))
    la.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    la.spawn("crasher", [sys.executable, "-c", "import sys; print('boom happened'); sys.exit(3)"])
    try:
        with pytest.raises(ChildFailed, match="crasher exited with code 3") as e:
            await asyncio.wait_for(la.watch(0.05), 10)
        assert "boom happened" in str(e.value)
    finally:
        la.shutdown(grace_s=2)
    assert all(c.proc.poll() is not None for c in la.children)


def test_shutdown_kills_grandchildren(tmp_path):
    la = Launcher(str(tmp_path))
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
    la = Launcher(str(tmp_path))
    child = la.spawn("server0", [sys.executable, "-c", "print('cannot load model'); raise SystemExit(1)"])
    try:
        with pytest.raises(ChildFailed, match="cannot load model"):
            await la.wait_healthy([(child, "http://127.0.0.1:9")], timeout_s=30)
    finally:
        la.shutdown(grace_s=1)
