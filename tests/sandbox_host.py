"""Test helper: record the host's state before sandboxed code runs and assert afterwards that nothing was left.

"Nothing" means: no live process of any uid a sandbox picked (in this process), no scratch directory or cgroup created
by this process or by one that has died, no new mount in the host's namespace, an empty mount point for the new
root, and no process whose command line carries a marker a test planted.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from areal_async.rewards import sandbox as sbmod


def mine(paths: list[str]) -> list[str]:
    """Leftovers created by this process or by a process that is gone (not another live process's sandbox)."""
    out = []
    for p in paths:
        name = os.path.basename(p)
        pid = name.split("-")[1] if name.startswith("run-") else name.rsplit("sbx-", 1)[-1].split("-")[0]
        if not pid.isdigit() or int(pid) == os.getpid() or not sbmod._pid_alive(int(pid)):
            out.append(p)
    return out


def mountinfo() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {" ".join(line.split()[3:5]) for line in f}


def procs_with(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


@contextlib.contextmanager
def watched_host(settle_s: float = 5.0) -> Iterator[list[int]]:
    """Yields the list of sandbox uids picked inside the block; asserts the host is clean when it ends."""
    uids: list[int] = []
    real_pick = sbmod._pick_uid

    def pick() -> int:
        uids.append(real_pick())
        return uids[-1]

    sbmod._pick_uid = pick
    mounts = mountinfo()
    try:
        yield uids
    finally:
        sbmod._pick_uid = real_pick
    deadline = time.monotonic() + settle_s
    # wait for the sandboxes' own clean-up (their processes, then their scratch directories and cgroups), which
    # trails the last reward by more than a moment on a slow or throttled machine; a real leak still fails below
    while (any(sbmod._pids_of_uid(u) for u in uids) or mine(sbmod.host_leftovers())) and time.monotonic() < deadline:
        time.sleep(0.05)
    for uid in uids:
        assert sbmod._pids_of_uid(uid) == [], f"a process of sandbox uid {uid} survived"
    assert mine(sbmod.host_leftovers()) == [], "a scratch directory or cgroup was left behind"
    assert mountinfo() <= mounts, "a mount leaked into the host's namespace"
    assert os.listdir(os.path.join(sbmod._base_dir(), "mnt")) == [], "the new root's mount point must stay empty"
