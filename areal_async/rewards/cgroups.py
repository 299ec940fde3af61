"""Per-run cgroups for the sandbox: a real bound on the memory and the tasks of everything a program starts.

Why: RLIMIT_AS bounds one process's address space, but pages in memfds, tmpfs files and pipes are not address
space, and eight processes get eight budgets. A memory cgroup charges all of it (anonymous memory, page cache,
shmem/memfd/tmpfs pages) to one counter per run, and the kernel's OOM killer acts inside the group only.

Where: always below the caller's own cgroup (never beside it), so whatever limit the machine's operator set on the
trainer or the reward worker still applies on top. Both hierarchies are handled:

- cgroup v2 (one tree): the child gets memory.max, memory.swap.max = 0, memory.oom.group = 1, pids.max. Needs the
  memory controller enabled in the parent's cgroup.subtree_control; the kernel refuses that for a non-root cgroup
  that itself holds processes (the "no internal processes" rule), so on a systemd machine this works only in a
  delegated cgroup, and we report why when it does not.
- cgroup v1 (one tree per controller): memory.limit_in_bytes plus memory.memsw.limit_in_bytes (no swap escape)
  in the memory tree, pids.max in the pids tree.

Children are named areal-sbx-<creator pid>-<random>; a worker that was SIGKILLed leaves empty ones behind, and
`sweep` (run once per process by the sandbox) removes those whose creator is gone.
"""

from __future__ import annotations

import functools
import os
import secrets
import signal
import time

import msgspec

PREFIX = "areal-sbx-"


class CgroupSupport(msgspec.Struct, frozen=True, kw_only=True):
    version: int | None  # 2, 1, or None when no usable memory cgroup
    memory_parent: str | None = None
    pids_parent: str | None = None
    reason: str | None = None  # why the memory cgroup is unavailable


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) >= 5 and len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                    out.append((fields[4].encode().decode("unicode_escape"), rfields[0], rfields[2]))
    except OSError:
        pass
    return out


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3:
                    for ctl in parts[1].split(",") if parts[1] else [""]:
                        out[ctl] = parts[2]
    except OSError:
        pass
    return out


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _probe(parent: str, limit_file: str, value: int) -> None:
    """Create a child, set a limit, remove it: raises OSError when any of that is refused."""
    probe = os.path.join(parent, f"{PREFIX}{os.getpid()}-probe")
    os.mkdir(probe)
    try:
        _write(os.path.join(probe, limit_file), str(value))
    finally:
        os.rmdir(probe)


def _detect_v2(mount: str, own: str) -> tuple[CgroupSupport | None, str]:
    parent = os.path.normpath(mount + own)
    try:
        available = _read(os.path.join(parent, "cgroup.controllers")).split()
        if "memory" not in available:
            return None, f"cgroup v2 at {mount}: no memory controller in {parent}"
        enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
        want = [c for c in ("memory", "pids") if c in available and c not in enabled]
        if want:
            _write(os.path.join(parent, "cgroup.subtree_control"), " ".join("+" + c for c in want))
        _probe(parent, "memory.max", 64 << 20)
    except OSError as e:
        return None, f"cgroup v2 at {parent}: {e.strerror or e}"
    pids = parent if "pids" in available else None
    return CgroupSupport(version=2, memory_parent=parent, pids_parent=pids), ""


def _detect_v1(mounts: list[tuple[str, str, str]], own: dict[str, str]) -> tuple[CgroupSupport | None, str]:
    def tree(ctl: str) -> str | None:
        for point, fstype, opts in mounts:
            if fstype == "cgroup" and ctl in opts.split(",") and ctl in own:
                return os.path.normpath(point + own[ctl])
        return None

    mem = tree("memory")
    if mem is None:
        return None, "no cgroup v1 memory hierarchy"
    try:
        _probe(mem, "memory.limit_in_bytes", 64 << 20)
    except OSError as e:
        return None, f"cgroup v1 memory at {mem}: {e.strerror or e}"
    pids = tree("pids")
    if pids is not None:
        try:
            _probe(pids, "pids.max", 8)
        except OSError:
            pids = None
    return CgroupSupport(version=1, memory_parent=mem, pids_parent=pids), ""


@functools.lru_cache(maxsize=1)
def detect() -> CgroupSupport:
    """What this process may use; probed once (a child is created and removed)."""
    mounts, own = _mounts(), _own_paths()
    reasons = []
    v2 = [m for m, t, _ in mounts if t == "cgroup2"]
    if v2 and "" in own:
        got, why = _detect_v2(v2[0], own[""])
        if got:
            return got
        reasons.append(why)
    got, why = _detect_v1(mounts, own)
    if got:
        return got
    reasons.append(why)
    return CgroupSupport(version=None, reason="; ".join(r for r in reasons if r) or "no cgroup filesystem")


class SandboxCgroup:
    """One run's cgroup(s). Create before the program starts; `remove()` after it has ended."""

    def __init__(self, support: CgroupSupport, memory_bytes: int, max_tasks: int) -> None:
        if support.version is None or support.memory_parent is None:
            raise OSError(f"no memory cgroup: {support.reason}")
        self.version = support.version
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.dirs: list[str] = []
        try:
            mem = os.path.join(support.memory_parent, name)
            os.mkdir(mem)
            self.dirs.append(mem)
            self.memory_dir = mem
            if self.version == 2:
                _write(os.path.join(mem, "memory.max"), str(memory_bytes))
                for fname, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                    if os.path.exists(os.path.join(mem, fname)):
                        _write(os.path.join(mem, fname), value)
                if support.pids_parent is not None:
                    _write(os.path.join(mem, "pids.max"), str(max_tasks))
            else:
                _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
                if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                if support.pids_parent is not None:
                    pids = os.path.join(support.pids_parent, name)
                    os.mkdir(pids)
                    self.dirs.append(pids)
                    _write(os.path.join(pids, "pids.max"), str(max_tasks))
        except OSError:
            self.remove()
            raise

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def oom_killed(self) -> bool:
        """Did the kernel kill a task of this group for exceeding the memory limit?"""
        try:
            text = _read(os.path.join(self.memory_dir, "memory.events" if self.version == 2 else "memory.oom_control"))
        except OSError:
            return False
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                return True
        return False

    def kill(self) -> None:
        for d in self.dirs:
            kill_file = os.path.join(d, "cgroup.kill")
            try:
                if self.version == 2 and os.path.exists(kill_file):
                    _write(kill_file, "1")
                    continue
                for pid in _read(os.path.join(d, "cgroup.procs")).split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            except OSError:
                pass

    def remove(self, timeout_s: float = 2.0) -> bool:
        """Kill what is left and rmdir; True when every directory is gone."""
        deadline = time.monotonic() + timeout_s
        left = list(self.dirs)
        while left:
            for d in list(left):
                try:
                    os.rmdir(d)
                    left.remove(d)
                except FileNotFoundError:
                    left.remove(d)
                except OSError:
                    pass
            if not left or time.monotonic() > deadline:
                break
            self.kill()
            time.sleep(0.01)
        self.dirs = left
        return not left


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(support: CgroupSupport | None = None) -> int:
    """Remove cgroups that a dead process of ours left behind; returns how many were removed."""
    support = support or detect()
    removed = 0
    for parent in {p for p in (support.memory_parent, support.pids_parent) if p}:
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if not name.startswith(PREFIX):
                continue
            pid = name[len(PREFIX) :].split("-", 1)[0]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            d = os.path.join(parent, name)
            leftover = SandboxCgroup.__new__(SandboxCgroup)
            leftover.version, leftover.dirs, leftover.memory_dir = support.version or 1, [d], d
            if leftover.remove(timeout_s=1.0):
                removed += 1
    return removed
