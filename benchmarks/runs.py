"""Shared by the end-to-end benchmarks: run `python -m areal_async.run` with overrides in its own run directory and
collect what it wrote (summary.json, metrics.jsonl), plus what the machine did meanwhile (load average, and the CPU
seconds each part of the run got).

Why the CPU seconds: on a shared machine a run's wall time says as much about the other jobs as about the run. The
CPU time each process of the run got (from /proc, sampled while it runs) separates the two: a trainer that needed
30 CPU-s for a step that took 90 s of wall time was held off its core for 60 of them. Linux only; elsewhere the
figures are left out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a process of the run belongs to the first role whose marker is in its command line
ROLES = (
    ("server", ("areal_async.serve", "sglang.launch_server")),
    ("trainer", ("areal_async.train.worker",)),
    ("reward", ("areal_async.rewards",)),
    ("torchrun", ("torch.distributed.run",)),
    ("controller", ("areal_async.run",)),
)


def run_one(
    name: str, run_dir: str, overrides: list[str], *, config: str | None = None, timeout_s: float = 3600
) -> dict[str, Any]:
    """One training run as a child process; returns its summary plus the eval and train records, the load average
    during the run (`load`) and the CPU seconds each role's processes got (`cpu_s`)."""
    cmd = [sys.executable, "-m", "areal_async.run"]
    if config:
        cmd += ["--config", config]
    cmd += [f"run_dir={run_dir}", "resume=false", *overrides]
    print(f"[{name}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.monotonic()
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "stdout.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        monitor = ProcessMonitor(proc.pid)
        monitor.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"[{name}] did not finish within {timeout_s:.0f} s; see {run_dir}/stdout.log") from None
        finally:
            monitor.stop()
    if code != 0:
        raise RuntimeError(f"[{name}] run failed with code {code}; see {run_dir}/stdout.log")
    summary = load_run(name, run_dir)
    summary["process_s"] = time.monotonic() - t0
    summary.update(monitor.report())
    with open(os.path.join(run_dir, "machine.json"), "w") as f:  # load_run reads it back for --report-only
        json.dump(monitor.report(), f, indent=2)
    return summary


def load_run(name: str, run_dir: str) -> dict[str, Any]:
    """What a finished run wrote: its summary plus the eval and train records (for re-reporting without a rerun)."""
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    records = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    summary["name"] = name
    summary["train_records"] = [r for r in records if r["kind"] == "train"]
    summary["eval_records"] = [r for r in records if r["kind"] == "eval"]
    machine = os.path.join(run_dir, "machine.json")
    if os.path.exists(machine):
        with open(machine) as f:
            summary.update(json.load(f))
    return summary


class ProcessMonitor:
    """Samples the 1-minute load average and the CPU time of every process under `root_pid` every `interval_s`.

    A process's CPU time only grows, so the last sample of each pid is what it got (less at most one interval before
    it exited); roles are summed over their pids."""

    def __init__(self, root_pid: int, interval_s: float = 2.0) -> None:
        self.root_pid = root_pid
        self.interval_s = interval_s
        self.loads: list[float] = []
        self.cpu: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds at its last sample)
        self.series: list[tuple[float, float, dict[str, float]]] = []  # (epoch s, load, CPU s per role so far)
        self.t0 = time.monotonic()
        self.t1 = self.t0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="process-monitor", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.t1 = time.monotonic()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        try:
            with open("/proc/loadavg") as f:
                load = float(f.read().split()[0])
        except OSError:
            return  # not Linux: no figures
        self.loads.append(load)
        for pid in self._tree(self.root_pid):
            got = self._cpu_seconds(pid)
            if got is not None:
                role = self.cpu[pid][0] if pid in self.cpu else self._role(pid)
                self.cpu[pid] = (role, got)
        self.series.append((round(time.time(), 2), load, self._by_role()))

    def _by_role(self) -> dict[str, float]:
        cpu: dict[str, float] = {}
        for role, secs in self.cpu.values():
            cpu[role] = round(cpu.get(role, 0.0) + secs, 2)
        return cpu

    def _tree(self, pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                threads = os.listdir(f"/proc/{p}/task")
            except OSError:
                continue
            for t in threads:  # a child belongs to the thread that started it
                try:
                    with open(f"/proc/{p}/task/{t}/children") as f:
                        todo += [int(c) for c in f.read().split()]
                except OSError:
                    pass
        return out

    def _cpu_seconds(self, pid: int) -> float | None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime (fields 14 and 15)

    def _role(self, pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return "other"
        for role, markers in ROLES:
            if any(m in cmdline for m in markers):
                return role
        return "other"

    def report(self) -> dict[str, Any]:
        """{"load": {mean, min, max, samples}, "cpu_s": {role: CPU seconds}, "monitored_s": wall seconds,
        "machine_series": [[epoch s, load, {role: CPU s so far}], ...]}; empty where nothing could be read."""
        if not self.loads:
            return {}
        return {
            "load": {
                "mean": round(sum(self.loads) / len(self.loads), 2),
                "min": min(self.loads),
                "max": max(self.loads),
                "samples": len(self.loads),
            },
            "cpu_s": self._by_role(),
            "monitored_s": round(self.t1 - self.t0, 1),
            "machine_series": self.series,
        }


def window(series: list, t_from: float, t_to: float) -> dict[str, Any]:
    """Load and CPU seconds per role between two epoch times (e.g. a run's first and last train step), from a
    ProcessMonitor series: the samples nearest inside the window."""
    inside = [s for s in series if t_from <= s[0] <= t_to]
    if len(inside) < 2:
        return {}
    (ta, _, ca), (tb, _, cb) = inside[0], inside[-1]
    loads = [s[1] for s in inside]
    return {
        "seconds": round(tb - ta, 1),
        "load_mean": round(sum(loads) / len(loads), 2),
        "load_max": max(loads),
        "cpu_s": {r: round(cb.get(r, 0.0) - ca.get(r, 0.0), 1) for r in cb},
    }


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec)."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = []
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("n/a" if v is None else format(v, fmt) if fmt else str(v))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])


def plot_accuracy(
    rows: list[dict[str, Any]], path: str, *, label: str = "name", xlabel: str = "training wall time (s)"
) -> None:
    """Held-out accuracy against wall time, one line per row (its `eval_curve`: [(wall s, accuracy), ...]),
    labelled by the row's `label` key; a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        if r["eval_curve"]:
            xs, ys = zip(*r["eval_curve"])
            ax.plot(xs, [100 * y for y in ys], "o-", label=str(r[label]))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
