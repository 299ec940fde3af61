"""Fault injection on real runs: `python -m areal_async.run` as a child process, and the processes it starts (found
through its run directory), killed or stopped at chosen moments. Used by tests/test_faults.py and
benchmarks/faults.py. No torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from areal_async.net.rank_registry import rank_file, rank_files_dir
from areal_async.rollout import ledger


class RunProcess:
    """One controller process on `run_dir` (its output goes to `run_dir/../<name>.out`)."""

    def __init__(self, args: list[str], run_dir: str, *, name: str = "controller") -> None:
        self.args = args
        self.run_dir = run_dir
        self.out_path = os.path.join(os.path.dirname(os.path.abspath(run_dir)), f"{name}-{time.time_ns()}.out")
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> RunProcess:
        out = open(self.out_path, "w")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "areal_async.run", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        finally:
            out.close()
        self.started = time.monotonic()
        return self

    # ---- observing ----------------------------------------------------------------------------------------------

    def output(self) -> str:
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ledger_lines(self) -> list[dict[str, Any]]:
        path = os.path.join(self.run_dir, ledger.FILE_NAME)
        out = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        break  # a line being written
        return out

    def version(self) -> int:
        """The last version in trained_index.jsonl (0 before the first step)."""
        versions = [r["version"] for r in self.ledger_lines() if "version" in r]
        return versions[-1] if versions else 0

    def recoveries(self) -> list[dict[str, Any]]:
        path = os.path.join(self.run_dir, "recoveries.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def wait_for(self, cond: Callable[[], Any], what: str, timeout: float = 180.0, poll_s: float = 0.05) -> Any:
        """Poll `cond` until it is truthy; fail (with the run's output tail) if the run exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            got = cond()
            if got:
                return got
            if not self.alive():
                raise AssertionError(
                    f"the run exited (rc {self.proc.poll() if self.proc else None}) while waiting "
                    f"for {what}:\n{self.output()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:.0f}s:\n{self.output()[-4000:]}")
            time.sleep(poll_s)

    def wait_version(self, version: int, timeout: float = 180.0) -> None:
        self.wait_for(lambda: self.version() >= version, f"version {version}", timeout)

    def wait_recovery(self, event: str, count: int = 1, timeout: float = 180.0) -> list[dict[str, Any]]:
        return self.wait_for(
            lambda: (lambda r: r if len(r) >= count else None)(
                [r for r in self.recoveries() if r.get("event") == event]
            ),
            f"{count} {event} record(s)",
            timeout,
        )

    def server_pid(self, name: str) -> int:
        """The newest process started as `name` (servers are restarted under their old name)."""
        with open(os.path.join(self.run_dir, "run.log")) as f:
            pids = re.findall(rf"started {re.escape(name)} \(pid (\d+)\)", f.read())
        assert pids, f"no {name} in run.log"
        return int(pids[-1])

    def trainer_rank_pid(self, rank: int = 0) -> int:
        with open(rank_file(self.run_dir, rank)) as f:
            return int(json.load(f)["pid"])

    def log_count(self, text: str) -> int:
        """How often `text` appears in the run's log (e.g. "server1 healthy at": once per start)."""
        with open(os.path.join(self.run_dir, "run.log")) as f:
            return f.read().count(text)

    @contextlib.contextmanager
    def training_frozen(self, rank: int = 0) -> Iterator[None]:
        """SIGSTOP a trainer rank for the duration (SIGCONT after): the run makes no step meanwhile, so a short
        run cannot end before a recovery it is waiting for, however fast this machine is today."""
        pid = self.trainer_rank_pid(rank)
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            signal_pid(pid, signal.SIGCONT)

    # ---- ending -------------------------------------------------------------------------------------------------

    def wait(self, timeout: float = 300.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the run did not end within {timeout:.0f}s:\n{self.output()[-4000:]}") from None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, sig)
            if sig == signal.SIGKILL:
                self.proc.wait(timeout=30)


def signal_pid(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: list[int], timeout: float = 60.0) -> list[int]:
    """The pids still alive after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if pid_alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def run_children(run_dir: str) -> list[int]:
    """Every process the controllers of `run_dir` started (from run.log) and the trainer ranks (rank files)."""
    pids: list[int] = []
    path = os.path.join(run_dir, "run.log")
    if os.path.exists(path):
        with open(path) as f:
            pids = [int(p) for p in re.findall(r"started \w+ \(pid (\d+)\)", f.read())]
    rank_dir = rank_files_dir(run_dir)
    if os.path.isdir(rank_dir):
        for name in os.listdir(rank_dir):
            if name.endswith(".json"):
                try:
                    with open(os.path.join(rank_dir, name)) as f:
                        pids.append(int(json.load(f)["pid"]))
                except (OSError, ValueError, KeyError):
                    pass
    return pids


def accounting(run_dir: str) -> dict[str, Any]:
    """What the final trained_index.jsonl says: steps, draws trained/dropped/unfinished, and the invariant's
    verdict (`lost`: draw indices that appear nowhere; `twice`: more than once)."""
    lines = ledger.read(os.path.join(run_dir, ledger.FILE_NAME))
    seen: dict[int, int] = {}
    for rec in lines:
        for i in (*rec.get("trained", []), *(d["index"] for d in rec.get("dropped", [])), *rec.get("unfinished", [])):
            seen[i] = seen.get(i, 0) + 1
    top = max(seen, default=-1)
    return {
        "versions": [r["version"] for r in lines if "version" in r],
        "ended": bool(lines) and bool(lines[-1].get("end")),
        "trained": sum(len(r.get("trained", [])) for r in lines),
        "dropped": sum(len(r.get("dropped", [])) for r in lines),
        "lost": sorted(set(range(top + 1)) - set(seen)),
        "twice": sorted(i for i, c in seen.items() if c > 1),
    }


def assert_exact_accounting(run_dir: str, steps: int, groups: int, samples: int) -> dict[str, Any]:
    """The run's ledger after a fault: every step 1..`steps` exactly once, ended, no draw lost or trained twice,
    `groups` prompt groups of `samples` samples trained per step, and summary.json agreeing. Returns the summary.
    Why one helper: every fault test asserts the same invariant, and a copy that drifts checks less."""
    acc = accounting(run_dir)
    assert acc["versions"] == list(range(1, steps + 1)), acc["versions"]
    assert acc["ended"] and not acc["lost"] and not acc["twice"], acc
    assert acc["trained"] == steps * groups
    s = summary(run_dir)
    assert s["completed"] and s["steps"] == steps and s["trained_samples"] == steps * groups * samples, s
    return s


def summary(run_dir: str) -> dict[str, Any]:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def metrics(run_dir: str, kind: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]
