"""One running sandboxed program, seen from the host: its pipes, its deadline, its output caps, its verdict.

Why a module of its own: the same plumbing serves a one-shot run (feed stdin, wait, collect) and a live session
(a grader talks to the program over a line-based channel on fds 3/4 while it runs). Both need every pipe drained all
the time (a program blocked on a full stderr pipe never answers), a wall clock that kills the whole tree, and caps
on everything the program can make the host hold in memory. A session pumps in a background thread; a one-shot run
pumps on the caller's thread.
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import signal
import subprocess
import threading
import time

import msgspec


class SandboxResult(msgspec.Struct, kw_only=True):
    """What one run did. `reason` is None exactly when the program exited 0 and nothing was cut short."""

    ok: bool
    reason: str | None  # "timeout", "cpu_limit", "memory_limit", "output_limit", "message_limit", "exit_code N",
    # "signal NAME", "killed", or "sandbox_error: ..."
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    isolation: list[str] = []  # what containment was achieved: "uid", "pidns", "netns", "mountns", "rootfs", ...
    notes: list[str] = []  # why a mechanism was not achieved


class LiveRun:
    """The host's end of one bootstrap process. Create through `Sandbox.run` / `Sandbox.start`, not directly."""

    def __init__(
        self,
        proc: subprocess.Popen,
        info_r: int,
        chan: tuple[int, int] | None,
        stdin: bytes,
        wall_s: float,
        output_bytes: int,
        message_bytes: int,
        cleanup,
    ) -> None:
        self.proc = proc
        self.info_r = info_r
        self.chan_r, self.chan_w = chan if chan else (None, None)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + wall_s
        self.output_bytes = output_bytes
        self.message_bytes = message_bytes
        self._cleanup = cleanup  # called once, after the process tree is gone: cgroup, scratch, uid sweep
        self.cut: str | None = None
        self.out, self.err, self.info = bytearray(), bytearray(), bytearray()
        self._partial = bytearray()
        self.messages: collections.deque[bytes] = collections.deque()
        self._queued = 0  # bytes of messages received and not yet taken
        self.cond = threading.Condition()
        self.done = False
        self._stdin = memoryview(stdin)
        self._thread: threading.Thread | None = None
        self._finished: SandboxResult | None = None

    # ---- pumping -------------------------------------------------------------------------------------------

    def pump(self) -> None:
        """Drain every pipe until the program's tree has closed them all, the wall clock runs out, or a cap is hit."""
        assert self.proc.stdout and self.proc.stderr and self.proc.stdin
        sel = selectors.DefaultSelector()
        bufs = {self.proc.stdout.fileno(): self.out, self.proc.stderr.fileno(): self.err, self.info_r: self.info}
        if self.chan_r is not None:
            bufs[self.chan_r] = self._partial
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        win = self.proc.stdin.fileno()
        if self._stdin:
            os.set_blocking(win, False)
            sel.register(win, selectors.EVENT_WRITE)
        else:
            self.proc.stdin.close()
        open_reads = len(bufs)
        ended = False  # the reaper reported the program's end and exited
        try:
            while (open_reads or self._stdin) and not self.cut:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    if not ended:
                        self.cut = "timeout"
                    else:  # orphans (no pid namespace) still hold the pipes: the program's own status stands
                        self.kill()
                    break
                for key, _ in sel.select(timeout=min(left, 0.25)):
                    fd = key.fd
                    if fd == win:
                        try:
                            n = os.write(fd, self._stdin[:65536])
                            self._stdin = self._stdin[n:]
                        except BlockingIOError:
                            continue
                        except OSError:
                            self._stdin = memoryview(b"")
                        if not self._stdin:
                            sel.unregister(fd)
                            self.proc.stdin.close()
                        continue
                    try:
                        chunk = os.read(fd, 65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        chunk = b""
                    if not chunk:
                        sel.unregister(fd)
                        open_reads -= 1
                        if fd == self.info_r:
                            # the reaper reported and exited; without a pid namespace an orphan may still hold
                            # stdout open, so the pipes get only a short grace
                            ended = True
                            self.deadline = min(self.deadline, time.monotonic() + 1.0)
                        continue
                    if fd == self.chan_r:
                        self._take_messages(chunk)
                    elif fd == self.info_r:
                        self.info += chunk[: max(0, (1 << 20) - len(self.info))]
                    else:
                        buf = bufs[fd]
                        room = self.output_bytes - len(buf)
                        buf += chunk[: max(room, 0)]
                        if len(chunk) > room:
                            self.cut = "output_limit"
                    if self.cut:
                        break
        finally:
            sel.close()
            if self.cut:
                self.kill()
                self._drain_info()
            if not self.proc.stdin.closed:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def _take_messages(self, chunk: bytes) -> None:
        self._partial += chunk
        lines = []
        while True:
            i = self._partial.find(b"\n")
            if i < 0:
                break
            lines.append(bytes(self._partial[:i]))
            del self._partial[: i + 1]
        if len(self._partial) > self.message_bytes or any(len(x) > self.message_bytes for x in lines):
            self.cut = "message_limit"
            return
        if lines:
            with self.cond:
                self.messages.extend(lines)
                self._queued += sum(len(x) for x in lines)
                self.cond.notify_all()
            if self._queued > 2 * self.message_bytes:  # a flood of small messages nobody asked for
                self.cut = "message_limit"

    def _drain_info(self) -> None:
        try:
            while chunk := os.read(self.info_r, 65536):
                self.info += chunk
        except OSError:
            pass

    def start_thread(self) -> None:
        self._thread = threading.Thread(target=self.pump, name="sandbox-pump", daemon=True)
        self._thread.start()

    # ---- the channel (sessions) ----------------------------------------------------------------------------------

    def send(self, line: bytes, timeout_s: float) -> bool:
        """Write one message (a line without newlines); False when the program does not take it in time."""
        if self.chan_w is None:
            raise RuntimeError("this run has no channel")
        data = memoryview(line + b"\n")
        end = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.chan_w, selectors.EVENT_WRITE)
            while data:
                if self.done or time.monotonic() > end:
                    return False
                if not sel.select(timeout=min(0.25, max(0.0, end - time.monotonic()))):
                    continue
                try:
                    data = data[os.write(self.chan_w, data) :]
                except BlockingIOError:
                    continue
                except OSError:
                    return False
        return True

    def recv(self, timeout_s: float) -> bytes | None:
        """The next message from the program; None on timeout or when the program has ended."""
        end = time.monotonic() + timeout_s
        with self.cond:
            while not self.messages:
                left = end - time.monotonic()
                if self.done or left <= 0:
                    return None
                self.cond.wait(timeout=min(left, 0.25))
            line = self.messages.popleft()
            self._queued -= len(line)
            return line

    # ---- ending ----------------------------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL the bootstrap's process group; parent-death signals and the pid namespace take the rest."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def finish(self, grace_s: float = 1.0, reason_if_killed: str | None = None) -> SandboxResult:
        """Close the channel, give the program `grace_s` to exit, kill it otherwise, clean up, return the verdict."""
        if self._finished is not None:
            return self._finished
        if self.chan_w is not None:
            os.close(self.chan_w)
            self.chan_w = None
        if self._thread is not None:
            self._thread.join(timeout=grace_s)
            if self._thread.is_alive():
                if self.cut is None and reason_if_killed:
                    self.cut = reason_if_killed
                self.kill()
                self._thread.join()
        try:
            if self.proc.poll() is None:
                self.kill()
            self.proc.wait()
        finally:
            for fd in (self.info_r, self.chan_r):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            for f in (self.proc.stdout, self.proc.stderr):
                if f is not None:
                    f.close()
            oom = self._cleanup()
        self._finished = _verdict(
            self.proc.returncode, self.out, self.err, self.info, self.cut, time.monotonic() - self.t0, oom
        )
        return self._finished


def _verdict(
    returncode: int | None, out: bytes, err: bytes, info: bytes, cut: str | None, wall: float, oom: bool
) -> SandboxResult:
    iso: list[str] = []
    notes: list[str] = []
    status: dict = {}
    for line in bytes(info).decode(errors="replace").splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if not isinstance(msg, dict):
            continue
        for key in ("iso", "reaper_iso", "child_iso"):
            iso += [x for x in msg.get(key, []) if x not in iso]
        for key in ("notes", "reaper_notes", "child_notes"):
            notes += [x for x in msg.get(key, []) if x not in notes]
        for key in ("exit_code", "signal", "error"):
            if key in msg:
                status[key] = msg[key]
    stdout, stderr = bytes(out).decode(errors="replace"), bytes(err).decode(errors="replace")
    common = dict(stdout=stdout, stderr=stderr, wall_s=wall, isolation=iso, notes=notes)
    code, sig = status.get("exit_code"), status.get("signal")
    if oom and cut in (None, "timeout"):
        return SandboxResult(ok=False, reason="memory_limit", exit_code=code, signal=sig, **common)
    if cut:
        return SandboxResult(ok=False, reason=cut, exit_code=code, signal=sig, **common)
    if "error" in status:
        return SandboxResult(ok=False, reason=f"sandbox_error: {status['error']}", **common)
    if code is None and sig is None:
        why = stderr.strip().splitlines()[-1] if stderr.strip() else f"bootstrap exit status {returncode}"
        return SandboxResult(ok=False, reason=f"sandbox_error: {why}", **common)
    if sig is not None:
        if sig == signal.SIGXCPU:
            reason = "cpu_limit"
        elif sig == signal.SIGKILL:
            reason = "killed"  # the hard CPU limit (SIGKILL one second after SIGXCPU) or an OOM kill outside a cgroup
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
