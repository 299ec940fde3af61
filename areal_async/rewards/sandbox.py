"""Run untrusted programs (model-written code) in a contained subprocess.

Why this shape: code rewards execute whatever the policy wrote, thousands of times per run, on the same machine as
the controller. A reward must never hang the run, fill the disk, exhaust memory or processes, reach the network,
read the project, its checkpoints or logs, or leave anything behind. Containers would be the strongest tool, but
they are rarely available inside a training job; Linux gives us enough, applied in a small bootstrap process
(sandbox_boot.py) between fork and exec:

    host (this module)                       wall clock, output and message caps, cgroup, kill on timeout
      `- bootstrap  python -I -S sandbox_boot.py   new pid/net/mount/ipc/uts namespaces; minimal read-only root
           `- reaper    pid 1 of the new pid namespace; a /proc that shows only the sandbox; reaps everything
                `- program  cgroup (memory incl. memfd/tmpfs, tasks); rlimits (CPU, AS, NPROC, FSIZE, NOFILE);
                            a fresh random uid; no_new_privs; seccomp; no fds but 0-2 (and 3/4 for a session)

What the program sees (full isolation): a root of read-only bind mounts of /usr, /bin, /lib*, /sbin, a few files of
/etc and the interpreter's prefix; /dev with null, zero, full, random, urandom; its own /proc; and one writable
place, a tmpfs of `tmpfs_bytes` on /tmp whose /tmp/sandbox is its working directory (and HOME; /var/tmp and /dev/shm
point into /tmp). Nothing of it touches the host's disk: the files given to `write()` travel to the bootstrap
in a memfd and are written into that tmpfs, and every run starts from them afresh. When the run ends, the pid
namespace dies, the mount namespace with it, and the tmpfs is gone whatever happened to the host process.

How each part degrades (`SandboxResult.isolation` says what was achieved, `probe_isolation()` asks before running
anything untrusted, and the code reward warns or refuses on a weak result):
- As root: all of the above. Without root, an unprivileged user namespace gives the same namespaces and root
  (the program keeps the caller's uid, but in a user namespace without capabilities). Without either, the program
  runs in a fresh host directory (deleted after the run, leftovers swept at start-up), sees the host's filesystem,
  and seccomp keeps it in its process group (setsid/setpgid refused) so that killing the group takes everything.
- Memory: a cgroup (v2 or v1) per run bounds the whole tree, memfd and tmpfs pages included; without one, seccomp
  refuses memfd_create, RLIMIT_AS bounds each process, the tmpfs size bounds files, and the aggregate bound is
  max_processes x memory_bytes + tmpfs_bytes.
- Network: a new network namespace has only a downed loopback; seccomp also refuses socket() (every family, so
  host unix sockets too) unless `allow_network`.

Limits: Linux only (x86_64 and aarch64 for seccomp); macOS would need another mechanism and is refused explicitly.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import math
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence

import msgspec

from areal_async.rewards import cgroups
from areal_async.rewards.sandbox_proc import LiveRun, SandboxResult

__all__ = [
    "IsolationReport",
    "LiveRun",
    "MECHANISMS",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "default_python",
    "host_leftovers",
    "kill_uid",
    "probe_isolation",
    "run_python",
]

log = logging.getLogger(__name__)

MECHANISMS = ("namespaces", "userns", "rootfs", "cgroup", "seccomp", "uid")  # what `disable=` may switch off
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = (
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
    "/etc/hosts",
    "/etc/os-release",
    "/etc/mime.types",
)
_BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py")


class SandboxLimits(msgspec.Struct, kw_only=True, frozen=True):
    """Resource limits for one program run. Defaults suit small competitive-programming style solutions."""

    wall_s: float = 10.0  # wall clock for one run; the whole process tree is killed after it
    cpu_s: int = 5  # RLIMIT_CPU per process (SIGXCPU at the soft limit, SIGKILL one second later)
    memory_bytes: int = 512 << 20  # RLIMIT_AS per process
    total_memory_bytes: int | None = None  # cgroup bound on the whole run; None: memory_bytes + tmpfs_bytes
    max_processes: int = 8  # tasks (processes and threads) of the run, the program itself included
    output_bytes: int = 1 << 20  # stdout and stderr are each captured up to this; more kills the run
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file the program may write
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_bytes: int = 64 << 20  # all the program may write (working directory, /tmp) when mounts are isolated
    message_bytes: int = 4 << 20  # longest line a session program may send on its channel
    allow_network: bool = False

    def __post_init__(self) -> None:
        if not (self.wall_s > 0 and self.cpu_s > 0):
            raise ValueError("wall_s and cpu_s must be > 0")
        if self.memory_bytes < (16 << 20):
            raise ValueError("memory_bytes must be at least 16 MiB (an interpreter needs that much to start)")
        if self.total_memory_bytes is not None and self.total_memory_bytes < (16 << 20):
            raise ValueError("total_memory_bytes must be at least 16 MiB")
        if self.max_processes < 1 or self.output_bytes < 1 or self.max_open_files < 8 or self.tmpfs_bytes < 1 << 20:
            raise ValueError("max_processes and output_bytes must be >= 1, max_open_files >= 8, tmpfs_bytes >= 1 MiB")

    @property
    def cgroup_bytes(self) -> int:
        return self.total_memory_bytes or self.memory_bytes + self.tmpfs_bytes


class IsolationReport(msgspec.Struct, kw_only=True, frozen=True):
    """What a sandbox on this machine achieves, and what it lacks for full isolation."""

    achieved: list[str]
    missing: list[str]
    notes: list[str] = []

    @property
    def weak(self) -> bool:
        return bool(self.missing)

    def summary(self) -> str:
        why = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"missing {', '.join(self.missing)}{why}" if self.missing else "full isolation"


def required_isolation(allow_network: bool = False, as_root: bool | None = None) -> list[str]:
    """Mechanisms without which the sandbox counts as weak."""
    need = ["pidns", "mountns", "rootfs"] + ([] if allow_network else ["netns"])
    if os.geteuid() == 0 if as_root is None else as_root:
        need.append("uid")  # never run untrusted code as root, namespaces or not
    return need


def _report(isolation: Sequence[str], notes: Sequence[str], allow_network: bool) -> IsolationReport:
    missing = [m for m in required_isolation(allow_network) if m not in isolation]
    if "cgroup" not in isolation and "seccomp" not in isolation:
        missing.append("memory bound (cgroup or seccomp)")
    return IsolationReport(achieved=list(isolation), missing=missing, notes=list(notes))


# ---- host-side helpers ---------------------------------------------------------------------------------------


def _world_executable(path: str) -> bool:
    """True when an unprivileged uid can execute `path` (every directory on the way searchable, file o+x)."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
        if not (st.st_mode & stat.S_IXOTH) or not stat.S_ISREG(st.st_mode):
            return False
        d = os.path.dirname(real)
        while True:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            parent = os.path.dirname(d)
            if parent == d:
                return True
            d = parent
    except OSError:
        return False


def _base_interpreter() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def default_python(unprivileged: bool) -> str:
    """An interpreter for programs without a private root: this one when the sandbox uid can run it, else a
    system python3 (with a private root the interpreter's prefix is mounted, see `Sandbox.python`)."""
    if not unprivileged:
        return _base_interpreter()
    for cand in (
        sys.executable,
        getattr(sys, "_base_executable", ""),
        "/usr/bin/python3",
        "/usr/local/bin/python3",
        shutil.which("python3") or "",
    ):
        if cand and _world_executable(cand):
            return os.path.realpath(cand)
    raise RuntimeError("no python interpreter is executable by an unprivileged uid; pass interpreter= explicitly")


def _pick_uid() -> int:
    """A random uid far above real accounts, inside this user namespace's mapped range."""
    ranges: list[tuple[int, int]] = []
    try:
        with open("/proc/self/uid_map") as f:
            for line in f:
                inside, _outside, count = (int(x) for x in line.split())
                ranges.append((inside, inside + count - 1))
    except OSError:
        ranges = [(0, 65535)]
    for lo_pref in (100_000, 60_000, 1000):
        top = 2**31 - 2
        ok = [(max(lo, lo_pref), min(hi, top)) for lo, hi in ranges if min(hi, top) - max(lo, lo_pref) > 100]
        if ok:
            lo, hi = random.choice(ok)
            return random.randint(lo, hi)
    raise RuntimeError(f"no usable uid range in the user namespace: {ranges}")


def _pids_of_uid(uid: int, count_threads: bool = False) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                threads, mine = 1, False
                for line in f:
                    if line.startswith("State:") and line.split()[1] in ("Z", "X"):
                        break  # a zombie waiting for init to reap it holds nothing
                    if line.startswith("Uid:"):
                        mine = int(line.split()[1]) == uid
                        if not mine:
                            break
                    elif line.startswith("Threads:"):
                        threads = int(line.split()[1])
                if mine:
                    out += [int(entry)] * (threads if count_threads else 1)
        except (OSError, ValueError):
            continue
    return out


def kill_uid(uid: int, attempts: int = 50) -> int:
    """SIGKILL every process of `uid` until none is left; returns how many were still there on the last pass."""
    left: list[int] = []
    for _ in range(attempts):
        left = _pids_of_uid(uid)
        if not left:
            return 0
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    return len(left)


def _base_dir() -> str:
    """This uid's directory for per-run scratch (only used without a private root) and the new root's mount point.

    Created 0711 (a dropped uid must reach its own run directory, but not list the others); refused when it exists
    and is not ours or is writable by others, so nobody can plant it in a shared /tmp."""
    base = os.path.join(tempfile.gettempdir(), f"areal-sandbox-{os.geteuid()}")
    try:
        os.mkdir(base, 0o711)
    except FileExistsError:
        pass
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{base} is not a private directory of uid {os.geteuid()}; remove it")
    mnt = os.path.join(base, "mnt")
    try:
        os.mkdir(mnt, 0o700)
    except FileExistsError:
        pass
    return base


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def host_leftovers() -> list[str]:
    """Scratch directories and cgroups that sandboxes of this uid hold right now (alive or left behind)."""
    found = glob.glob(os.path.join(_base_dir(), "run-*"))
    support = cgroups.detect()
    for parent in {p for p in (support.memory_parent, support.pids_parent) if p}:
        found += [p for p in glob.glob(os.path.join(parent, cgroups.PREFIX + "*")) if "-probe" not in p]
    return sorted(found)


_swept = False


def sweep_leftovers() -> int:
    """Remove run directories and cgroups whose creating process is dead (a SIGKILLed reward worker); returns
    how many. Done once per process by the first Sandbox; safe to call any time."""
    removed = 0
    for path in glob.glob(os.path.join(_base_dir(), "run-*")):
        pid = os.path.basename(path).split("-")[1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: never follows a planted symlink
            removed += not os.path.exists(path)
    return removed + cgroups.sweep()


def _ro_binds(extra: Iterable[str], argv0: str) -> list[str]:
    """Host paths the private root shows read-only: system directories, a few /etc files, the interpreter."""
    paths = list(_SYSTEM_DIRS) + list(_ETC) + sorted(glob.glob("/etc/python3*"))
    prefix = os.path.realpath(sys.base_prefix)
    tool_prefix = os.path.dirname(os.path.dirname(os.path.realpath(argv0)))
    for p in [prefix, tool_prefix, *extra]:
        p = os.path.realpath(p)
        if p != "/" and not any(p == q or p.startswith(q.rstrip("/") + "/") for q in paths if not os.path.islink(q)):
            paths.append(p)
    return paths


# ---- the sandbox -----------------------------------------------------------------------------------------------


class Sandbox:
    """Files plus a way to run programs on them in isolation.

    `write()` records files; every `run()` / `start()` gets a fresh private copy of them in its own tmpfs, so one
    sandbox may run several programs in turn (one solution against many stdin cases) and nothing a run writes is
    seen by the next or left on the host. Runs share the uid. `close()` kills whatever still runs.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        drop_privileges: bool | None = None,
        disable: Iterable[str] = (),
        ro_paths: Iterable[str] = (),
    ) -> None:
        global _swept
        if not sys.platform.startswith("linux"):
            raise RuntimeError("the code sandbox needs Linux (rlimits and namespaces)")
        self.limits = limits or SandboxLimits()
        self.disable = frozenset(disable)
        unknown = self.disable - set(MECHANISMS)
        if unknown:
            raise ValueError(f"unknown sandbox mechanisms {sorted(unknown)}; known: {', '.join(MECHANISMS)}")
        is_root = os.geteuid() == 0
        drop = (is_root if drop_privileges is None else drop_privileges) and "uid" not in self.disable
        if drop and not is_root:
            raise PermissionError("drop_privileges needs root")
        self.uid: int | None = _pick_uid() if drop else None
        if "namespaces" in self.disable:
            self.mode = "none"
        else:
            self.mode = "root" if is_root else ("none" if "userns" in self.disable else "userns")
        self.ro_paths = [os.path.realpath(p) for p in ro_paths]
        self._files: dict[str, bytes] = {}
        self._live: list[LiveRun] = []
        self._base = _base_dir()
        if not _swept:
            _swept = True
            sweep_leftovers()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every run still going and clean up after it; idempotent."""
        for live in list(self._live):
            live.kill()
            live.finish(grace_s=0.0)
        self._live.clear()
        if self.uid is not None and self.mode == "none":
            kill_uid(self.uid)

    def python(self) -> str:
        """The interpreter for candidate programs, as a path inside the sandbox."""
        if self.mode != "none" and "rootfs" not in self.disable:
            return _base_interpreter()  # its prefix is mounted into the private root
        return default_python(self.uid is not None)

    def write(self, name: str, content: str | bytes) -> str:
        """Record a file for the runs' working directory (relative names only); returns the name."""
        parts = name.split("/")
        if not name or os.path.isabs(name) or "\0" in name or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"sandbox file names must be relative and stay inside: {name!r}")
        self._files[name] = content.encode() if isinstance(content, str) else bytes(content)
        return name

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | str = b"",
        env: dict[str, str] | None = None,
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """Run `argv` (argv[0] an absolute path) inside the sandbox and wait for it, within the limits."""
        stdin_b = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        live = self._launch(argv, env, limits or self.limits, stdin_b, channel=False)
        if isinstance(live, SandboxResult):
            return live
        try:
            live.pump()
        finally:
            result = self.finish(live, grace_s=0.0)
        return result

    def start(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None, limits: SandboxLimits | None = None
    ) -> LiveRun | SandboxResult:
        """Start a session: the program reads messages on fd 3 and writes them on fd 4 (one JSON line each) while
        the host talks to it through `send`/`recv`; `finish()` ends it. A SandboxResult means it did not start."""
        live = self._launch(argv, env, limits or self.limits, b"", channel=True)
        if isinstance(live, LiveRun):
            live.start_thread()
        return live

    def finish(self, live: LiveRun, **kw) -> SandboxResult:
        try:
            return live.finish(**kw)
        finally:
            if live in self._live:
                self._live.remove(live)

    @staticmethod
    def _rlimits(lim: SandboxLimits) -> dict[str, tuple[int, int]]:
        return {
            "RLIMIT_CPU": (lim.cpu_s, lim.cpu_s + 1),
            "RLIMIT_AS": (lim.memory_bytes, lim.memory_bytes),
            "RLIMIT_FSIZE": (lim.file_bytes, lim.file_bytes),
            "RLIMIT_NOFILE": (lim.max_open_files, lim.max_open_files),
            "RLIMIT_CORE": (0, 0),
        }

    def _nproc(self, lim: SandboxLimits) -> dict[str, int] | None:
        """RLIMIT_NPROC counts every task of the uid (inside a user namespace: of the uid in that namespace) and
        binds only for non-root, hence the fresh uid as root. Without one, the bootstrap adds the tasks that share
        the uid: itself and the reaper in a user namespace, and the caller's own tasks too without one."""
        if self.uid is None and os.geteuid() == 0:
            return None  # root is exempt: only the cgroup's pids.max and the pid namespace bound it
        host_tasks = 0 if self.uid is not None else len(_pids_of_uid(os.getuid(), True))
        return {"base": lim.max_processes, "shared": 0 if self.uid is not None else 2, "host_tasks": host_tasks}

    def _launch(
        self, argv: Sequence[str], env: dict[str, str] | None, lim: SandboxLimits, stdin_b: bytes, *, channel: bool
    ) -> LiveRun | SandboxResult:
        if not argv or not os.path.isabs(argv[0]):
            raise ValueError("argv[0] must be an absolute path to the executable")
        base_env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "PYTHONIOENCODING": "utf-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        cg = None
        if "cgroup" not in self.disable:
            support = cgroups.detect()
            if support.version is not None:
                try:
                    cg = cgroups.SandboxCgroup(support, lim.cgroup_bytes, lim.max_processes)
                except OSError as e:
                    log.warning("sandbox cgroup not created: %s", e)
        host_dir = tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=self._base)
        if self.uid is not None:
            os.chown(host_dir, self.uid, self.uid)
        fds: list[int] = []

        def cleanup() -> bool:
            if self.uid is not None and self.mode == "none":
                kill_uid(self.uid)  # no pid namespace: the uid sweep is the safety net
            oom = False
            if cg is not None:
                oom = cg.oom_killed()
                cg.remove()
            shutil.rmtree(host_dir, ignore_errors=True)
            return oom

        try:
            info_r, info_w = os.pipe()
            fds += [info_r, info_w]
            chan_host = chan_prog = None
            if channel:
                to_r, to_w = os.pipe()
                from_r, from_w = os.pipe()
                fds += [to_r, to_w, from_r, from_w]
                chan_host, chan_prog = (from_r, to_w), [to_r, from_w]
                os.set_blocking(to_w, False)
            cfg = {
                "argv": list(argv),
                "env": {**base_env, **(env or {})},
                "uid": self.uid,
                "mode": self.mode,
                "rlimits": self._rlimits(lim),
                "nproc": self._nproc(lim),
                "allow_network": lim.allow_network,
                "tmpfs_bytes": lim.tmpfs_bytes,
                "info_fd": info_w,
                "parent_pid": os.getpid(),
                "host_dir": host_dir,
                "newroot": os.path.join(self._base, "mnt"),
                "rootfs": "rootfs" not in self.disable,
                "ro_binds": _ro_binds(self.ro_paths, argv[0]),
                "seccomp": "seccomp" not in self.disable,
                "cgroup_procs": cg.procs_files if cg else [],
                "chan": chan_prog,
                "files": [[n, _b64(c)] for n, c in self._files.items()],
            }
            cfg_fd = os.memfd_create("areal-sandbox-cfg", os.MFD_CLOEXEC)
            fds.append(cfg_fd)
            os.write(cfg_fd, json.dumps(cfg).encode())
            os.set_inheritable(cfg_fd, False)
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _BOOT, str(cfg_fd)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=[info_w, cfg_fd, *(chan_prog or [])],
                start_new_session=True,
                env={"PATH": base_env["PATH"], "LANG": "C.UTF-8"},
                cwd="/",
                close_fds=True,
            )
        except OSError as e:
            for fd in fds:
                os.close(fd)
            cleanup()
            return SandboxResult(ok=False, reason=f"sandbox_error: {e}")
        for fd in [info_w, cfg_fd, *(chan_prog or [])]:
            os.close(fd)
        live = LiveRun(proc, info_r, chan_host, stdin_b, lim.wall_s, lim.output_bytes, lim.message_bytes, cleanup)
        self._live.append(live)
        return live


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


@functools.lru_cache(maxsize=16)
def _probe(euid: int, drop: bool | None, disable: frozenset[str], allow_network: bool) -> IsolationReport:
    del euid  # part of the cache key only
    lim = SandboxLimits(wall_s=20.0, cpu_s=5, allow_network=allow_network)
    with Sandbox(lim, drop_privileges=drop, disable=disable) as sb:
        r = sb.run([sb.python(), "-I", "-S", "-c", "pass"])
    notes = list(r.notes) + ([] if r.ok else [f"probe program: {r.reason}"])
    return _report(r.isolation, notes, allow_network)


def probe_isolation(
    *, drop_privileges: bool | None = None, disable: Iterable[str] = (), allow_network: bool = False
) -> IsolationReport:
    """Run a trivial program once (cached per process) and report the isolation this machine gives."""
    return _probe(os.geteuid(), drop_privileges, frozenset(disable), allow_network)


def session_limits(lim: SandboxLimits, wall_s: float) -> SandboxLimits:
    """Limits for a session process that lives `wall_s`: its CPU bound follows the session, not one test."""
    return msgspec.structs.replace(lim, wall_s=wall_s, cpu_s=max(lim.cpu_s, math.ceil(wall_s) + 1))


def run_python(
    source: str, *, stdin: bytes | str = b"", limits: SandboxLimits | None = None, interpreter: str | None = None
) -> SandboxResult:
    """Convenience: run one Python program in a fresh sandbox."""
    with Sandbox(limits) as sb:
        sb.write("main.py", source)
        return sb.run([interpreter or sb.python(), "-I", "main.py"], stdin=stdin)
