"""Score rewards off the event loop, in a small pool of worker processes that can be killed.

Why not concurrent.futures.ProcessPoolExecutor: it cannot kill one hung task (a reward stuck in sympy, a regex
blow-up, a wedged sandbox) without breaking the whole pool, and it pickles function objects. Here each worker is a
plain `python` subprocess speaking length-prefixed msgpack over its stdin/stdout; it receives the reward's
"module:function" path and imports the function itself. A call that overruns its timeout gets its worker killed
(SIGKILL to the worker's process group; the code sandbox's own parent-death chain takes its children down too) and
scores 0.0 with reason "timeout"; the next call starts a fresh worker. Exceptions score 0.0 with the exception as
the reason. `score` never raises for anything the reward function does.

Timeouts count only the reward call itself: the worker first imports the function (which may take a second for
sympy) and acknowledges, and only then does `timeout_s` start. Imports have their own, generous bound. The worker
tells the reward its deadline (`registry.time_left()`), so a reward that runs programs (the code sandbox) ends and
cleans up before it; a reward that overruns anyway first gets SIGTERM (its `finally` blocks and context managers
run: the sandbox closes) and `term_grace_s` later SIGKILL.

    controller (event loop)                     worker processes (max_workers of them, started on demand)
      score(spec, ...) --frame--> [worker] import fn --"started"--> call fn --"done"(reward|error)-->
          \\__ timeout -> SIGKILL worker's group, replace on next call
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import sys
from typing import Any

import msgspec

from areal_async.rewards.registry import call_reward, load, resolve, reward_deadline

_LEN = struct.Struct(">I")
_MAX_FRAME = 64 << 20


class ScoreRequest(msgspec.Struct, kw_only=True):
    fn: str  # "module:function"
    completion: str
    answer: str
    prompt: str = ""
    meta: dict[str, Any] = {}
    timeout_s: float | None = None  # the caller's deadline for the call, for registry.time_left()


class ScoreReply(msgspec.Struct, kw_only=True):
    kind: str  # "started" | "done"
    reward: float | None = None
    error: str | None = None


class RewardStats(msgspec.Struct, kw_only=True):
    calls: int = 0
    inline_calls: int = 0
    errors: int = 0
    timeouts: int = 0
    workers_started: int = 0
    workers_killed: int = 0


def _describe(e: BaseException) -> str:
    msg = str(e)
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self.stdin = proc.stdin
        self.stdout = proc.stdout

    async def send(self, req: ScoreRequest) -> None:
        data = msgspec.msgpack.encode(req)
        self.stdin.write(_LEN.pack(len(data)) + data)
        await self.stdin.drain()

    async def recv(self) -> ScoreReply:
        (n,) = _LEN.unpack(await self.stdout.readexactly(_LEN.size))
        if n > _MAX_FRAME:
            raise ValueError(f"worker frame of {n} bytes")
        return msgspec.msgpack.decode(await self.stdout.readexactly(n), type=ScoreReply)

    async def terminate(self, grace_s: float) -> None:
        """SIGTERM the worker so the reward's cleanup runs; SIGKILL its group if it has not exited in `grace_s`."""
        if self.proc.returncode is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(self.proc.wait(), grace_s)
            except (TimeoutError, ProcessLookupError):
                pass
        await self.kill()

    async def kill(self) -> None:
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.stdin.close()
        except Exception:
            pass
        await self.proc.wait()


class RewardRunner:
    """`async with RewardRunner(max_workers=2) as rr: reward, why = await rr.score("math", text, answer)`."""

    def __init__(
        self,
        max_workers: int = 2,
        *,
        import_timeout_s: float = 120.0,
        term_grace_s: float = 3.0,
        env: dict[str, str] | None = None,
    ) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        self.max_workers = max_workers
        self.import_timeout_s = import_timeout_s
        self.term_grace_s = term_grace_s
        self._extra_env = dict(env or {})
        self._sem: asyncio.Semaphore | None = None
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._closed = False
        self.stats = RewardStats()

    async def __aenter__(self) -> RewardRunner:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def score(
        self, fn_spec: str, completion: str, answer: str, *, prompt: str = "", timeout_s: float = 10.0, **meta: Any
    ) -> tuple[float, str | None]:
        """(reward, None) on success; (0.0, reason) on any failure: unknown reward, exception, timeout, crash."""
        self.stats.calls += 1
        try:
            entry = resolve(fn_spec)
        except (KeyError, ValueError) as e:
            self.stats.errors += 1
            return 0.0, _describe(e)
        if entry.inline:
            self.stats.inline_calls += 1
            try:
                return call_reward(load(entry.target), completion, answer, prompt, meta), None
            except Exception as e:
                self.stats.errors += 1
                return 0.0, _describe(e)
        try:
            req = ScoreRequest(
                fn=entry.target, completion=completion, answer=answer, prompt=prompt, meta=meta, timeout_s=timeout_s
            )
            msgspec.msgpack.encode(req)  # fail here, not in the worker, on meta that cannot travel
        except (TypeError, msgspec.ValidationError) as e:
            self.stats.errors += 1
            return 0.0, f"bad arguments: {_describe(e)}"
        reward, reason = await self._remote(req, timeout_s)
        if reason is not None:
            if reason == "timeout":
                self.stats.timeouts += 1
            else:
                self.stats.errors += 1
        return reward, reason

    async def _remote(self, req: ScoreRequest, timeout_s: float) -> tuple[float, str | None]:
        if self._closed:
            return 0.0, "runner closed"
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_workers)
        async with self._sem:
            if self._closed:
                return 0.0, "runner closed"
            try:
                worker = self._idle.pop() if self._idle else await self._spawn()
            except OSError as e:
                return 0.0, f"worker failed to start: {_describe(e)}"
            reusable = False
            try:
                await worker.send(req)
                first = await asyncio.wait_for(worker.recv(), self.import_timeout_s)
                if first.kind == "started":
                    first = await asyncio.wait_for(worker.recv(), timeout_s)
                reusable = first.kind == "done"
                if first.error is not None:
                    return 0.0, first.error
                if first.reward is None:
                    return 0.0, "worker sent no reward"
                return first.reward, None
            except TimeoutError:
                if not self._closed:
                    self.stats.workers_killed += 1
                    self._all.discard(worker)
                    await asyncio.shield(worker.terminate(self.term_grace_s))
                return 0.0, "timeout"
            except (
                asyncio.IncompleteReadError,
                ConnectionError,
                BrokenPipeError,
                ValueError,
                msgspec.DecodeError,
            ) as e:
                if self._closed:
                    return 0.0, "runner closed"
                await worker.kill()
                return 0.0, f"worker died (exit code {worker.proc.returncode}): {_describe(e)}"
            finally:
                # also reached on cancellation: a worker with a request in flight can never be reused
                if reusable and not self._closed:
                    self._idle.append(worker)
                else:
                    self._all.discard(worker)
                    if worker.proc.returncode is None:
                        self.stats.workers_killed += 1
                        await asyncio.shield(worker.terminate(0.0 if self._closed else self.term_grace_s))

    async def _spawn(self) -> _Worker:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.update(self._extra_env)
        # the package itself must be importable even when it is not installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from areal_async.rewards.runner import _worker_main; _worker_main()",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
            limit=_MAX_FRAME,
        )
        w = _Worker(proc)
        self._all.add(w)
        self.stats.workers_started += 1
        return w

    async def close(self) -> None:
        """Stop every worker (SIGTERM, so sandboxes clean up; SIGKILL a second later); calls in flight return
        (0.0, "runner closed")."""
        self._closed = True
        workers, self._all, self._idle = list(self._all), set(), []
        await asyncio.gather(*(w.terminate(1.0) for w in workers), return_exceptions=True)


# ---- the worker process ----------------------------------------------------------------------------------------


class _Terminated(SystemExit):
    """SIGTERM from the runner: unwind the reward (its cleanup runs), then exit."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated(128 + signum)


def _worker_main() -> None:
    """Serve ScoreRequests on stdin until EOF. Anything the reward prints goes to stderr, never into the protocol."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    out = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    enc = msgspec.msgpack.Encoder()

    def send(reply: ScoreReply) -> None:
        data = enc.encode(reply)
        os.write(out, _LEN.pack(len(data)) + data)

    while True:
        head = inp.read(_LEN.size)
        if len(head) < _LEN.size:
            return
        (n,) = _LEN.unpack(head)
        req = msgspec.msgpack.decode(inp.read(n), type=ScoreRequest)
        try:
            fn = load(req.fn)
        except BaseException as e:  # a broken module must not take the worker down
            send(ScoreReply(kind="done", error=f"cannot import {req.fn}: {_describe(e)}"))
            continue
        send(ScoreReply(kind="started"))
        try:
            with reward_deadline(req.timeout_s):
                value = call_reward(fn, req.completion, req.answer, req.prompt, req.meta)
            send(ScoreReply(kind="done", reward=value))
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, _Terminated)):
                raise
            send(ScoreReply(kind="done", error=_describe(e)))
