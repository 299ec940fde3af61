"""The sandbox bootstrap: a stdlib-only script the host runs as `python -I -S sandbox_boot.py <cfg_fd>`.

Why a separate script: everything here happens between fork and exec of the untrusted program, partly as root,
inside fresh namespaces; it must not import the project (the project is hidden from the program, and importing it
would be slow). The host (sandbox.py) writes a JSON config into a memfd and passes its fd number; this script

    1. ties its fate to the host (parent-death signal) and enters new namespaces (as root: pid, net, mount, ipc,
       uts; as a normal user: the same inside a new user namespace);
    2. forks the reaper, pid 1 of the new pid namespace, which reaps everything and reports the program's end;
    3. (the reaper) builds a minimal read-only root: a small tmpfs with read-only bind mounts of the system
       directories and the interpreter's prefix, a /dev with null/zero/full/random/urandom only, a /proc that shows
       only the sandbox, a size-limited tmpfs on /tmp whose /tmp/sandbox is the program's working directory, no
       /sys, no /run, no /home, no project; then pivot_root into it and unmounts the host's root, so nothing of
       the host's filesystem but those directories exists;
    4. writes the program's files into the working directory (O_NOFOLLOW, O_EXCL, fchown on the fd);
    5. forks the program, which joins the run's cgroups, sets rlimits, drops to the sandbox uid, sets no_new_privs,
       installs a seccomp filter (memfd_create, namespaces, mount, ptrace, bpf, io_uring, keyrings, ... and sockets
       when the network is off; the filter and its syscall tables are in sandbox_seccomp.py, which this script
       loads from next to itself), closes every other fd and execs.

Every step that fails is reported through the info fd ("iso" lists what was achieved, "notes" why something was
not), never silently skipped; the host decides whether the result is strong enough. When this script is imported
(tests, linters) nothing runs.
"""

from __future__ import annotations

import base64
import ctypes
import fcntl
import json
import os
import resource
import signal
import sys
import types


def _load_sibling(name: str) -> types.ModuleType:
    """The stdlib-only module `name`.py that lies next to this script, run as the bootstrap.

    Run with `python -I -S`, this script's directory is not on sys.path and the project must not be imported, so the
    file is compiled and run directly: no import machinery to load, nothing written next to it (no bytecode cache).
    """
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    module = types.ModuleType(name)
    module.__file__ = path
    exec(code, module.__dict__)
    return module


if __package__:  # imported (tests, linters): a module of the package like any other
    import areal_async.rewards.sandbox_seccomp as seccomp
else:  # the bootstrap: loaded before anything else happens, while the host's filesystem is still in view
    seccomp = _load_sibling("sandbox_seccomp")

PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 38, 22
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
# statvfs f_flag bit -> the mount flag that must be kept when remounting a bind (locked flags in a user namespace)
_ST_TO_MS = (
    (1, MS_RDONLY),
    (2, MS_NOSUID),
    (4, MS_NODEV),
    (8, MS_NOEXEC),
    (1024, MS_NOATIME),
    (2048, MS_NODIRATIME),
    (4096, MS_RELATIME),
)


class _Boot:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.info = cfg["info_fd"]
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.iso: list[str] = []
        self.notes: list[str] = []
        self.pivoted = False  # past this point a failure cannot fall back to the host's view

    def prctl(self, option: int, arg2: int = 0) -> bool:
        z = ctypes.c_ulong(0)
        return self.libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), z, z, z) == 0

    # ---- small wrappers ----------------------------------------------------------------------------------------

    def note(self, **kw) -> None:
        try:
            os.write(self.info, (json.dumps(kw) + "\n").encode())
        except OSError:
            pass

    def fail(self, what: str) -> str:
        e = ctypes.get_errno()
        self.notes.append(f"{what}: {os.strerror(e) if e else 'failed'}")
        return what

    def die_with_parent(self) -> None:
        self.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def unshare(self, flags: int) -> bool:
        return self.libc.unshare(ctypes.c_int(flags)) == 0

    def mount(self, src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        enc = lambda s: None if s is None else s.encode()
        if self.libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"mount {src or fstype} on {dst}: {os.strerror(e)}")

    # ---- namespaces --------------------------------------------------------------------------------------------

    def enter_namespaces(self) -> None:
        cfg, net = self.cfg, self.cfg["allow_network"]
        if cfg["mode"] == "root":
            for name, flag in (
                ("pidns", seccomp.NEWPID),
                ("netns", 0 if net else seccomp.NEWNET),
                ("mountns", seccomp.NEWNS),
                ("ipcns", seccomp.NEWIPC),
                ("utsns", seccomp.NEWUTS),
            ):
                if not flag:
                    continue
                if self.unshare(flag):
                    self.iso.append(name)
                else:
                    self.fail(name)
        elif cfg["mode"] == "userns":
            real_uid, real_gid = os.getuid(), os.getgid()
            flags = (
                seccomp.NEWUSER
                | seccomp.NEWNS
                | seccomp.NEWPID
                | seccomp.NEWIPC
                | seccomp.NEWUTS
                | (0 if net else seccomp.NEWNET)
            )
            if not self.unshare(flags):
                self.fail("userns")
                return
            try:
                for path, text in (
                    ("/proc/self/setgroups", "deny"),
                    ("/proc/self/uid_map", f"{real_uid} {real_uid} 1"),
                    ("/proc/self/gid_map", f"{real_gid} {real_gid} 1"),
                ):
                    with open(path, "w") as f:
                        f.write(text)
            except OSError as e:
                self.notes.append(f"userns id map: {e}")
                return
            self.iso += ["userns", "pidns", "mountns", "ipcns", "utsns"] + ([] if net else ["netns"])
        if "utsns" in self.iso:
            name = b"sandbox"
            self.libc.sethostname(name, len(name))

    # ---- the minimal root --------------------------------------------------------------------------------------

    def _remount_ro(self, path: str) -> None:
        keep = 0
        try:
            st_flags = os.statvfs(path).f_flag
            keep = sum(ms for st, ms in _ST_TO_MS if st_flags & st)
        except OSError:
            pass
        self.mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)

    def _bind_ro(self, src: str, dst: str) -> None:
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if not os.path.exists(dst):
                os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
        self.mount(src, dst, None, MS_BIND | MS_REC)
        self._remount_ro(dst)
        # submounts came along (MS_REC, needed in a user namespace): make them read-only too, best effort
        prefix = dst.rstrip("/") + "/"
        try:
            with open("/proc/self/mountinfo") as f:
                subs = [ln.split()[4] for ln in f if ln.split()[4].startswith(prefix)]
        except OSError:
            subs = []
        for sub in subs:
            try:
                self._remount_ro(sub.encode().decode("unicode_escape"))
            except OSError:
                pass

    def build_root(self) -> str:
        """Assemble the minimal root at cfg["newroot"], pivot into it; returns the program's working directory."""
        cfg = self.cfg
        new = cfg["newroot"]
        self.mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
        for path in cfg["ro_binds"]:
            target = new + path
            if os.path.islink(path) and os.path.dirname(path) == "/":  # /bin -> usr/bin on merged-/usr systems
                os.symlink(os.readlink(path), target)
            elif os.path.exists(path):
                self._bind_ro(path, target)
        dev = new + "/dev"
        os.mkdir(dev, 0o755)
        self.mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
        for name in ("null", "zero", "full", "random", "urandom"):
            os.close(os.open(f"{dev}/{name}", os.O_WRONLY | os.O_CREAT, 0o666))
            self.mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
        for name, to in (
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
            ("shm", "/tmp"),
        ):
            os.symlink(to, f"{dev}/{name}")
        self.mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
        tmp = new + "/tmp"
        os.makedirs(tmp, exist_ok=True)
        self.mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmpfs_bytes']},mode=1777")
        for d in ("/proc", "/run", "/var"):
            os.makedirs(new + d, exist_ok=True)
        if "pidns" in self.iso:
            # before the pivot: in a user namespace the kernel lets us mount a proc only while a full one is visible
            try:
                self.mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                self.iso.append("proc")
            except OSError as e:
                self.notes.append(f"proc: {e.strerror}")
        if not os.path.lexists(new + "/var/tmp"):
            os.symlink("/tmp", new + "/var/tmp")
        old = new + "/.oldroot"
        os.mkdir(old, 0o700)
        nr = seccomp.SYSCALLS.get(os.uname().machine, {}).get("pivot_root")
        os.chdir(new)
        if nr is not None and self.libc.syscall(ctypes.c_long(nr), b".", b".oldroot") == 0:
            self.pivoted = True
            os.chdir("/")
            if self.libc.umount2(b"/.oldroot", MNT_DETACH) != 0:
                self.fail("umount old root")
                raise OSError("the host's root could not be detached")
            os.rmdir("/.oldroot")
        else:  # chroot is enough for an unprivileged program that seccomp keeps from calling chroot itself
            self.fail("pivot_root")
            os.chroot(".")
            self.pivoted = True
        os.chdir("/")
        self.mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        work = "/tmp/sandbox"
        os.mkdir(work, 0o700)
        if cfg["uid"] is not None:
            os.chown(work, cfg["uid"], cfg["uid"])
        self.iso += ["rootfs", "private_tmp"]
        return work

    # ---- files, without following anything the program could have planted -----------------------------------

    def write_files(self, cwd: str) -> None:
        uid = self.cfg["uid"]
        top = os.open(cwd, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for name, b64 in self.cfg["files"]:
                parts = name.split("/")
                d = os.dup(top)
                try:
                    for part in parts[:-1]:
                        try:
                            os.mkdir(part, 0o700, dir_fd=d)
                        except FileExistsError:
                            pass
                        nd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=d)
                        os.close(d)
                        d = nd
                        if uid is not None:
                            os.fchown(d, uid, uid)
                    fd = os.open(
                        parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=d
                    )
                    try:
                        data = base64.b64decode(b64)
                        view = memoryview(data)
                        while view:
                            view = view[os.write(fd, view) :]
                        if uid is not None:
                            os.fchown(fd, uid, uid)
                    finally:
                        os.close(fd)
                finally:
                    os.close(d)
        finally:
            os.close(top)

    # ---- seccomp -----------------------------------------------------------------------------------------------

    def seccomp_program(self) -> bytes | None:
        machine = os.uname().machine
        prog = seccomp.filter_program(machine, allow_network=self.cfg["allow_network"], pidns="pidns" in self.iso)
        if prog is None:
            self.notes.append(f"seccomp: no syscall table for {machine}")
        return prog

    def install_seccomp(self, prog: bytes) -> bool:
        class _Fprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        buf = ctypes.create_string_buffer(prog, len(prog))
        fprog = _Fprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
        z = ctypes.c_ulong(0)
        return self.libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(2), ctypes.byref(fprog), z, z) == 0

    # ---- the program -------------------------------------------------------------------------------------------

    def exec_program(self, cwd: str, cgroup_fds: list[int], chan: list[int] | None) -> None:
        cfg, done = self.cfg, []
        joined = 0
        for fd in cgroup_fds:
            try:
                os.write(fd, b"0")
                joined += 1
            except OSError as e:
                self.notes.append(f"cgroup join: {e}")
        if cgroup_fds and joined == len(cgroup_fds):
            done.append("cgroup")
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 200) for fd in (chan or [])]
        for name, (soft, hard) in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        nproc = cfg["nproc"]
        if nproc is not None:
            n = nproc["base"] + nproc["shared"] + (0 if "userns" in self.iso else nproc["host_tasks"])
            resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
        uid = cfg["uid"]
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        self.die_with_parent()  # a credential change clears the parent-death signal: set it again
        if not self.prctl(PR_SET_NO_NEW_PRIVS, 1):
            self.fail("no_new_privs")
        if cfg["seccomp"]:
            prog = self.seccomp_program()
            if prog is not None and self.install_seccomp(prog):
                done.append("seccomp")
            elif prog is not None:
                self.fail("seccomp")
        self.note(child_iso=done, child_notes=self.notes)
        for target, fd in zip((3, 4), high):
            os.dup2(fd, target)
        os.closerange(3 + len(high), 65536)
        os.chdir(cwd)
        env = dict(cfg["env"], HOME=cwd, TMPDIR="/tmp" if "private_tmp" in self.iso else cwd)
        os.execve(cfg["argv"][0], cfg["argv"], env)

    def main(self) -> None:
        cfg = self.cfg
        self.die_with_parent()
        if os.getppid() != cfg["parent_pid"]:
            os._exit(111)  # the host died before we could tie our fate to it
        self.enter_namespaces()
        cgroup_fds = []
        for path in cfg["cgroup_procs"]:
            try:
                cgroup_fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
            except OSError as e:
                self.notes.append(f"cgroup open: {e}")
        chan = cfg["chan"]
        reaper = os.fork()  # first child: pid 1 of the new pid namespace, so the /proc it mounts shows the sandbox
        if reaper:
            for fd in chan or []:
                os.close(fd)
            _, status = os.waitpid(reaper, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        self.die_with_parent()
        cwd = cfg["host_dir"]
        if "mountns" in self.iso:
            try:
                self.mount(None, "/", None, MS_REC | MS_PRIVATE)
                if cfg["rootfs"]:
                    cwd = self.build_root()
            except OSError as e:
                self.notes.append(f"rootfs: {e}")
                if self.pivoted:  # half inside the new root: refuse rather than run in an unknown state
                    self.note(iso=self.iso, notes=self.notes, error=f"rootfs: {e}")
                    os._exit(112)
        if cfg["uid"] is not None:
            self.iso.append("uid")
        self.write_files(cwd)
        self.note(iso=self.iso, notes=self.notes)
        child = os.fork()
        if child == 0:
            try:
                self.exec_program(cwd, cgroup_fds, chan)
            except BaseException as e:
                os.write(2, f"sandbox: cannot start {cfg['argv'][0]}: {e}\n".encode())
                os._exit(127)
        for fd in cgroup_fds + (chan or []):
            os.close(fd)
        while True:  # reap every orphan; report when the program itself ends
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == child:
                if os.WIFSIGNALED(status):
                    self.note(signal=os.WTERMSIG(status))
                else:
                    self.note(exit_code=os.WEXITSTATUS(status))
                break
        os._exit(0)  # as pid 1, our exit makes the kernel kill whatever the program left behind


def _read_config(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks))


if __name__ == "__main__":
    _Boot(_read_config(int(sys.argv[1]))).main()
