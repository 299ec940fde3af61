"""Run untrusted programs (model-written code) in a contained subprocess.

Why this shape: code rewards execute whatever the policy wrote, thousands of times per run, on the same machine as
the controller. A reward must never hang the run, fill the disk, exhaust memory or processes, reach the network,
or touch files outside its scratch directory. Containers would be the strongest tool, but they are rarely available
inside a training job; Linux gives us enough with rlimits and namespaces, applied in a tiny bootstrap process:

    parent (this module)                      wall clock, output caps, kill on timeout
      `- bootstrap   python -I -S -c _BOOTSTRAP   unshare(net, mount, pid, ipc); private tmpfs on /tmp
           `- reaper     pid 1 of the new pid namespace; reaps everything, reports the program's exit status
                `- program   rlimits (CPU, AS, NPROC, FSIZE, NOFILE, CORE); a fresh unprivileged uid;
                             no_new_privs; parent-death signal; minimal environment; cwd = the scratch directory

Containment, and how each part degrades:
- Processes: as root, each sandbox runs under a fresh random uid, so RLIMIT_NPROC counts only the sandbox's own
  processes (root is exempt from RLIMIT_NPROC, which is why we never run the program as root). When the program
  exits or is killed, the reaper (pid 1 of a private pid namespace) exits and the kernel kills every process left
  in the namespace, including any that escaped with setsid(). Every link of the chain carries a parent-death
  signal, so even a SIGKILLed parent leaves nothing behind. Without root we try an unprivileged user namespace
  (same pid/net containment, same uid as the caller); without namespaces we kill the process group and, when a
  uid was dropped, sweep /proc for that uid.
- Memory: RLIMIT_AS per process. The aggregate bound is max_processes x memory_bytes; a hard aggregate cap needs
  cgroups (run the trainer in a container), which we do not manage.
- Files: the fresh uid owns only the scratch directory; everything root-owned is read-only to it, and /tmp,
  /var/tmp and /dev/shm are private tmpfs mounts that vanish with the sandbox. RLIMIT_FSIZE bounds single files.
- Network: a new network namespace has only a downed loopback. Where unshare is not permitted the program has the
  caller's network; `SandboxResult.isolation` says what was achieved, so callers can refuse to run without it.

Limits: Linux only (rlimits and namespaces); macOS would need another mechanism and is refused explicitly.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from typing import Sequence

import msgspec


class SandboxLimits(msgspec.Struct, kw_only=True, frozen=True):
    """Resource limits for one program run. Defaults suit small competitive-programming style solutions."""

    wall_s: float = 10.0  # wall clock for one run; the whole process tree is killed after it
    cpu_s: int = 5  # RLIMIT_CPU per process (SIGXCPU at the soft limit, SIGKILL one second later)
    memory_bytes: int = 512 << 20  # RLIMIT_AS per process
    max_processes: int = 8  # RLIMIT_NPROC for the sandbox uid (the program itself counts)
    output_bytes: int = 1 << 20  # stdout and stderr are each captured up to this; more kills the run
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file the program may write
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_bytes: int = 64 << 20  # size of each private tmpfs (/tmp, /var/tmp, /dev/shm) when mounts are isolated
    allow_network: bool = False

    def __post_init__(self) -> None:
        if self.wall_s <= 0 or self.cpu_s <= 0:
            raise ValueError("wall_s and cpu_s must be > 0")
        if self.memory_bytes < (16 << 20):
            raise ValueError("memory_bytes must be at least 16 MiB (an interpreter needs that much to start)")
        if self.max_processes < 1 or self.output_bytes < 1 or self.max_open_files < 8:
            raise ValueError("max_processes and output_bytes must be >= 1, max_open_files >= 8")


class SandboxResult(msgspec.Struct, kw_only=True):
    """What one run did. `reason` is None exactly when the program exited 0 and nothing was cut short."""

    ok: bool
    reason: str | None  # "timeout", "cpu_limit", "memory_limit", "output_limit", "exit_code N", "signal NAME",
    # "killed", or "sandbox_error: ..."
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    isolation: list[str] = []  # what containment was achieved: "uid", "pidns", "netns", "mountns", "userns", ...


# ---- the bootstrap: stdlib only, runs as `python -I -S -c _BOOTSTRAP <json>` ------------------------------------

_BOOTSTRAP = r'''
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
INFO = cfg["info_fd"]
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18

def note(**kw):
    os.write(INFO, (json.dumps(kw) + "\n").encode())

def die_with_parent():
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

def unshare(flags):
    return libc.unshare(ctypes.c_int(flags)) == 0

def mount(src, dst, fstype, flags, data):
    enc = lambda s: None if s is None else s.encode()
    return libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)) == 0

die_with_parent()
if os.getppid() != cfg["parent_pid"]:
    os._exit(111)  # the parent died before we could tie our fate to it
iso, cwd, uid = [], cfg["cwd"], cfg["uid"]
if os.geteuid() == 0:
    for name, flag in (("pidns", NEWPID), ("netns", 0 if cfg["allow_network"] else NEWNET), ("mountns", NEWNS),
                       ("ipcns", NEWIPC), ("utsns", NEWUTS)):
        if flag and unshare(flag):
            iso.append(name)
else:
    flags = NEWUSER | NEWPID | NEWIPC | (0 if cfg["allow_network"] else NEWNET)
    real_uid, real_gid = os.getuid(), os.getgid()
    if unshare(flags):
        try:
            for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{real_uid} {real_uid} 1"),
                               ("/proc/self/gid_map", f"{real_gid} {real_gid} 1")):
                with open(path, "w") as f:
                    f.write(text)
            iso += ["userns", "pidns", "ipcns"] + ([] if cfg["allow_network"] else ["netns"])
        except OSError:
            pass
if "mountns" in iso and mount(None, "/", None, MS_REC | MS_PRIVATE, None):
    keep = os.open(cwd, os.O_RDONLY | os.O_DIRECTORY)
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(d):
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmpfs_bytes']},mode=1777")
    os.mkdir("/tmp/sandbox", 0o700)
    if uid is not None:
        os.chown("/tmp/sandbox", uid, uid)
    if mount(f"/proc/self/fd/{keep}", "/tmp/sandbox", None, MS_BIND, None):
        cwd = "/tmp/sandbox"
        iso.append("private_tmp")
    os.close(keep)
if uid is not None:
    iso.append("uid")
note(isolation=iso)

reaper = os.fork()
if reaper:
    _, status = os.waitpid(reaper, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)

# reaper: pid 1 of the new pid namespace when there is one
die_with_parent()
if "pidns" in iso and "mountns" in iso:
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
child = os.fork()
if child == 0:
    try:
        for name, (soft, hard) in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        die_with_parent()  # a credential change clears the parent-death signal: set it again
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        os.closerange(3, 65536)
        os.chdir(cwd)
        env = dict(cfg["env"], HOME=cwd, TMPDIR="/tmp")
        os.execve(cfg["argv"][0], cfg["argv"], env)
    except BaseException as e:
        os.write(2, f"sandbox: cannot start {cfg['argv'][0]}: {e}\n".encode())
        os._exit(127)
while True:  # reap every orphan; report when the program itself ends
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    if pid == child:
        if os.WIFSIGNALED(status):
            note(signal=os.WTERMSIG(status))
        else:
            note(exit_code=os.WEXITSTATUS(status))
        break
os._exit(0)  # as pid 1, our exit makes the kernel kill whatever the program left behind
'''


# ---- the parent side ------------------------------------------------------------------------------------------


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


def default_python(unprivileged: bool) -> str:
    """The interpreter for candidate programs: this one when the sandbox uid can run it, else a system python3."""
    if not unprivileged:
        return sys.executable
    for cand in (sys.executable, getattr(sys, "_base_executable", ""), "/usr/bin/python3", "/usr/local/bin/python3",
                 shutil.which("python3") or ""):
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


def _pids_of_uid(uid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            out.append(int(entry))
                        break
        except OSError:
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


class Sandbox:
    """A private scratch directory plus a way to run programs in it; the directory is deleted on close().

    One sandbox may run several programs in turn (for example one solution against many stdin test cases); each
    run gets fresh limits and a fresh process tree, and all of them share the uid and the directory.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, drop_privileges: bool | None = None) -> None:
        if not sys.platform.startswith("linux"):
            raise RuntimeError("the code sandbox needs Linux (rlimits and namespaces)")
        self.limits = limits or SandboxLimits()
        is_root = os.geteuid() == 0
        self.uid: int | None = _pick_uid() if (is_root if drop_privileges is None else drop_privileges) else None
        if self.uid is not None and not is_root:
            raise PermissionError("drop_privileges needs root")
        self.dir = tempfile.mkdtemp(prefix="areal_sbx_")
        if self.uid is not None:
            os.chown(self.dir, self.uid, self.uid)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.uid is not None:
            kill_uid(self.uid)
        shutil.rmtree(self.dir, ignore_errors=True)

    def python(self) -> str:
        return default_python(self.uid is not None)

    def write(self, name: str, content: str | bytes) -> str:
        """Put a file into the scratch directory (relative names only) and return its relative path."""
        if os.path.isabs(name) or ".." in name.split("/"):
            raise ValueError(f"sandbox file names must be relative and stay inside: {name!r}")
        path = os.path.join(self.dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
        if self.uid is not None:
            os.chown(path, self.uid, self.uid)
        return name

    def run(self, argv: Sequence[str], *, stdin: bytes | str = b"", env: dict[str, str] | None = None,
            limits: SandboxLimits | None = None) -> SandboxResult:
        """Run `argv` (argv[0] an absolute path) inside the sandbox and wait for it, within the limits."""
        lim = limits or self.limits
        if not argv or not os.path.isabs(argv[0]):
            raise ValueError("argv[0] must be an absolute path to the executable")
        stdin_b = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        rl = {
            "RLIMIT_CPU": (lim.cpu_s, lim.cpu_s + 1),
            "RLIMIT_AS": (lim.memory_bytes, lim.memory_bytes),
            "RLIMIT_FSIZE": (lim.file_bytes, lim.file_bytes),
            "RLIMIT_NOFILE": (lim.max_open_files, lim.max_open_files),
            "RLIMIT_CORE": (0, 0),
        }
        if self.uid is not None or os.geteuid() != 0:
            # NPROC counts every process of the real uid; it binds only for non-root, hence the fresh uid
            extra = 0 if self.uid is not None else len(_pids_of_uid(os.getuid()))
            rl["RLIMIT_NPROC"] = (lim.max_processes + extra, lim.max_processes + extra)
        base_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8",
                    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        info_r, info_w = os.pipe()
        cfg = {"argv": list(argv), "cwd": self.dir, "uid": self.uid, "env": {**base_env, **(env or {})},
               "rlimits": rl, "allow_network": lim.allow_network, "tmpfs_bytes": lim.tmpfs_bytes,
               "info_fd": info_w, "parent_pid": os.getpid()}
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(cfg)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(info_w,),
                start_new_session=True, env={"PATH": base_env["PATH"], "LANG": "C.UTF-8"}, cwd=self.dir,
                close_fds=True)
        except OSError as e:
            os.close(info_r)
            os.close(info_w)
            return SandboxResult(ok=False, reason=f"sandbox_error: {e}")
        os.close(info_w)
        try:
            out, err, info, cut = self._pump(proc, stdin_b, info_r, lim, t0)
        finally:
            os.close(info_r)
            if proc.poll() is None:
                _kill_tree(proc)
            proc.wait()
            if self.uid is not None:
                kill_uid(self.uid)  # no-op with a pid namespace; the safety net without one
        return _verdict(proc.returncode, out, err, info, cut, time.monotonic() - t0, lim)

    @staticmethod
    def _pump(proc: subprocess.Popen, stdin_b: bytes, info_r: int, lim: SandboxLimits, t0: float
              ) -> tuple[bytearray, bytearray, bytearray, str | None]:
        """Feed stdin, drain stdout/stderr/info until all close, enforcing the wall clock and output caps."""
        assert proc.stdin and proc.stdout and proc.stderr
        sel = selectors.DefaultSelector()
        bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), info_r: bytearray()}
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        win = proc.stdin.fileno()
        pending = memoryview(stdin_b)
        if pending:
            os.set_blocking(win, False)
            sel.register(win, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        open_reads, cut = 3, None
        deadline = t0 + lim.wall_s
        while open_reads or pending:
            left = deadline - time.monotonic()
            if left <= 0:
                cut = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                fd = key.fd
                if fd == win:
                    try:
                        n = os.write(fd, pending[:65536])
                        pending = pending[n:]
                    except (BrokenPipeError, OSError):
                        pending = memoryview(b"")
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    open_reads -= 1
                    if fd == info_r:
                        # the program has ended (the reaper reported and exited); without a pid namespace an
                        # orphan may still hold stdout open, so give the pipes only a short grace
                        deadline = min(deadline, time.monotonic() + 1.0)
                    continue
                buf = bufs[fd]
                room = lim.output_bytes - len(buf) if fd != info_r else len(chunk)
                buf += chunk[:max(room, 0)]
                if fd != info_r and len(chunk) > room:
                    cut = "output_limit"
                    break
            if cut:
                break
        sel.close()
        if cut:
            _kill_tree(proc)
            # pick up the bootstrap's notes written before the kill
            try:
                while chunk := os.read(info_r, 65536):
                    bufs[info_r] += chunk
            except (BlockingIOError, OSError):
                pass
        if not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
        return bufs[proc.stdout.fileno()], bufs[proc.stderr.fileno()], bufs[info_r], cut


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill the bootstrap's process group; parent-death signals and the pid namespace take care of the rest."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _verdict(returncode: int | None, out: bytes, err: bytes, info: bytes, cut: str | None, wall: float,
             lim: SandboxLimits) -> SandboxResult:
    notes: dict = {}
    for line in bytes(info).decode(errors="replace").splitlines():
        try:
            notes.update(json.loads(line))
        except ValueError:
            continue
    stdout, stderr = bytes(out).decode(errors="replace"), bytes(err).decode(errors="replace")
    common = dict(stdout=stdout, stderr=stderr, wall_s=wall, isolation=list(notes.get("isolation", [])))
    code, sig = notes.get("exit_code"), notes.get("signal")
    if cut:
        return SandboxResult(ok=False, reason=cut, exit_code=code, signal=sig, **common)
    if code is None and sig is None:
        why = stderr.strip().splitlines()[-1] if stderr.strip() else f"bootstrap exit status {returncode}"
        return SandboxResult(ok=False, reason=f"sandbox_error: {why}", **common)
    if sig is not None:
        if sig == signal.SIGXCPU:
            reason = "cpu_limit"
        elif sig == signal.SIGKILL:
            reason = "killed"  # the hard CPU limit, or the kernel's OOM killer
        else:
            try:
                reason = f"signal {signal.Signals(sig).name}"
            except ValueError:
                reason = f"signal {sig}"
        return SandboxResult(ok=False, reason=reason, signal=sig, **common)
    if code == 0:
        return SandboxResult(ok=True, reason=None, exit_code=0, **common)
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        reason = "memory_limit"
    elif code == 127 and stderr.startswith("sandbox: cannot start"):
        reason = "sandbox_error: " + stderr.strip()
    else:
        reason = f"exit_code {code}"
    return SandboxResult(ok=False, reason=reason, exit_code=code, **common)


def run_python(source: str, *, stdin: bytes | str = b"", limits: SandboxLimits | None = None,
               interpreter: str | None = None) -> SandboxResult:
    """Convenience: run one Python program in a fresh sandbox and delete the sandbox afterwards."""
    with Sandbox(limits) as sb:
        sb.write("main.py", source)
        return sb.run([interpreter or sb.python(), "-I", "main.py"], stdin=stdin)
