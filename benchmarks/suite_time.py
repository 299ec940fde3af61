"""The test suite's wall time on this machine, or on an emulated slower one: what `make test` costs a user.

The slower machine is emulated two ways at once, because no such machine may be at hand:
- its code paths: torch held to AVX2 (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`)
  and the C kernels built for x86-64-v3 (`AREAL_KERNEL_MARCH`), as on an AVX2-only CPU (`--avx2`);
- its throughput: the whole process tree capped at `--cpus` CPUs by a CFS quota (cgroup v1 `cpu` or cgroup v2;
  needs root). On a 2-core machine `--cpus 1.25` is 1.6x less throughput. A quota cuts throughput, not the speed of
  a single thread, and what Slurm starts runs in Slurm's own cgroups, outside the cap: an emulation, not the machine.

    python benchmarks/suite_time.py --out /tmp/suite.json                      # this machine as it is
    python benchmarks/suite_time.py --avx2 --cpus 1.25 --out /tmp/slow.json    # the emulated slower machine
    python benchmarks/suite_time.py --out /tmp/x.json -- -k test_imports      # arguments after -- go to pytest

Writes JSON (wall seconds, pytest's own seconds and counts, the CPU-seconds the tree used, how often the quota
throttled it, the CPU model and load) and prints a one-row table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "AREAL_KERNEL_MARCH": "x86-64-v3",
}
PERIOD_US = 100_000


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())


def make_cgroup(cpus: float) -> tuple[str, str]:
    """A cgroup capped at `cpus` CPUs; returns (the file a pid is written to, its cpu.stat). cgroup v2 where it is
    mounted at /sys/fs/cgroup with the cpu controller, else v1's cpu hierarchy."""
    quota = int(cpus * PERIOD_US)
    v2 = "/sys/fs/cgroup/cgroup.controllers"
    if os.path.exists(v2) and "cpu" in open(v2).read().split():
        path = f"/sys/fs/cgroup/areal-suite-{os.getpid()}"
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "cpu.max"), "w") as f:
            f.write(f"{quota} {PERIOD_US}")
        return os.path.join(path, "cgroup.procs"), os.path.join(path, "cpu.stat")
    path = f"/sys/fs/cgroup/cpu/areal-suite-{os.getpid()}"
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
        f.write(str(PERIOD_US))
    with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
        f.write(str(quota))
    return os.path.join(path, "tasks"), os.path.join(path, "cpu.stat")


def join_cgroup(procs: str) -> None:
    """In the child before exec: move this process (and so all it starts) into the capped cgroup."""
    with open(procs, "w") as f:
        f.write(str(os.getpid()))


def read_stat(path: str) -> dict[str, int]:
    with open(path) as f:
        return {k: int(v) for k, v in (line.split() for line in f if line.strip())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpus", type=float, default=None, help="cap the suite at this many CPUs (root)")
    ap.add_argument("--avx2", action="store_true", help="hold torch to AVX2 and build the kernels for x86-64-v3")
    ap.add_argument("--workers", type=int, default=None, help="pytest-xdist workers (default: the Makefile's)")
    ap.add_argument("--seed", type=int, default=4243, help="the random test order's seed")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = ap.parse_args()
    if args.cpus is not None and (args.cpus <= 0 or os.geteuid() != 0):
        ap.error("--cpus must be > 0 and needs root (a cgroup of its own)")

    env = {**os.environ, **(AVX2_ENV if args.avx2 else {})}
    pytest_args = f"-p random_order --random-order-bucket=module --random-order-seed={args.seed} "
    cmd = ["make", "-C", REPO, "test", f"PYTEST_ARGS={pytest_args}{' '.join(args.pytest_args)}"]
    if args.workers is not None:
        cmd.append(f"TEST_WORKERS={args.workers}")
    procs = stat = None
    if args.cpus is not None:
        procs, stat = make_cgroup(args.cpus)
    load_start = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=(lambda: join_cgroup(procs)) if procs else None,
    )
    summary = ""
    for line in proc.stdout:  # type: ignore[union-attr]
        sys.stdout.write(line)
        if re.search(r"\d+ (passed|failed)", line) and " in " in line:
            summary = line.strip()
    rc = proc.wait()
    wall = time.monotonic() - t0
    throttle = read_stat(stat) if stat else None
    if procs:
        try:
            os.rmdir(os.path.dirname(procs))  # empty once the tree has exited
        except OSError:
            pass
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    m = re.search(r" in ([\d.]+)s", summary)
    result = {
        "rc": rc,
        "wall_s": round(wall, 1),
        "pytest_s": float(m.group(1)) if m else None,
        "counts": counts,
        "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
        "cpus_cap": args.cpus,
        "avx2": args.avx2,
        "workers": args.workers,
        "seed": args.seed,
        "throttle": throttle,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "command": cmd,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    cap = f"{args.cpus} CPUs" if args.cpus else "uncapped"
    print("| machine | paths | rc | pytest s | wall s | CPU s | passed | failed |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {result['cpu']}, {cap} | {'AVX2 held' if args.avx2 else 'native'} | {rc} | {result['pytest_s']} | "
        f"{result['wall_s']} | {result['cpu_s']} | {counts.get('passed', 0)} | {counts.get('failed', 0)} |"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
