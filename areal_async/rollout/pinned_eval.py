"""eval.mode=pinned: held-out evals of exact weight versions on a server of their own, while training goes on.

    train loop, after the weight sync of v          the eval worker (one task, one eval at a time)
    ----------------------------------------       -----------------------------------------------
    snapshot(v): a full HF checkpoint of v   --->   the eval server loads it as version v
      (disk sync: hard links to v's own;            greedy eval of the held-out prompts (evaluate.py)
       otherwise the trainer writes one)            every token must say version v, or the eval fails
    carry on: nothing waits for the eval            the snapshot is deleted; the figure is logged as v's

Why a server of its own. The other two ways to evaluate v without stopping were weighed:
- Keeping one rollout server back at v: its share of generation is lost for the eval's length and it must catch
  up afterwards, and the fleet's rule (a server serves only on the current weights, inference/fleet.py) would need
  an exception; with one server (the default) it is the same as stopping generation.
- A second copy of v inside a server, with eval requests batched apart: halves the batch both kinds see, and
  SGLang cannot do it at all.
A dedicated server holds no rollout and takes no weight update except the version it is about to evaluate, so its
requests are never interrupted and never mix versions, with SGLang as with the embedded server. Between evals it
idles. What it saves next to eval.mode=stop: benchmarks/eval_modes.py (docs/design.md, "Evaluation").

An eval that fails (its server died, a load failed, a version mismatch) is logged and counted, never fatal: the
next one starts the server again. Evals that fall behind queue up to `max_pending`; one more is skipped, logged.
No torch here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Any

from areal_async.rollout.workflow_api import Generator

log = logging.getLogger(__name__)

Snapshot = Callable[[int], Awaitable[str]]  # version -> a full HF checkpoint of it, deleted after its eval
EvalFn = Callable[[Generator], Awaitable[dict[str, float]]]  # evaluate.py's evaluate, bound to the held-out set
OnResult = Callable[[int, float, dict[str, float]], None]  # (version, run wall time at v, the eval's figures)


class PinnedVersionError(RuntimeError):
    """A pinned eval's tokens did not all come from the version it evaluates."""


class PinnedEvals:
    """The queue of pinned evals and its worker. `server_url` is awaited before each eval: it returns the eval
    server's URL, starting it again if it is gone (launch/eval_server.py), or a fixed URL (eval.server_url)."""

    def __init__(
        self,
        *,
        server_url: Callable[[], Awaitable[str]],
        make_client: Callable[[str], Any],
        snapshot: Snapshot,
        evaluate: EvalFn,
        on_result: OnResult | None = None,
        max_pending: int = 4,
    ) -> None:
        self.server_url = server_url
        # url -> an InferenceClient (passed in: the planner imports the controller, and must not import the client)
        self.make_client = make_client
        self.snapshot = snapshot
        self.evaluate = evaluate
        self.on_result = on_result  # the controller sets its own (AsyncRLController._pinned_result)
        self.max_pending = max_pending
        self.counts = {"done": 0, "failed": 0, "skipped": 0}
        self.snapshot_s = 0.0  # time the train loop spent making snapshots (the only time it spends on evals)
        self._queue: asyncio.Queue[tuple[int, float, str, float]] | None = None
        self._worker: asyncio.Task | None = None
        self._client: Any = None

    async def submit(self, version: int, wall_s: float) -> bool:
        """Take the snapshot of `version` now (the trainer holds exactly it) and queue its eval; False if the
        queue is full and this eval is skipped."""
        if self._queue is None:
            self._queue = asyncio.Queue()
        if self._queue.qsize() >= self.max_pending:
            self.counts["skipped"] += 1
            log.warning(
                "pinned eval of version %d skipped: %d evals are still waiting for the eval server",
                version,
                self._queue.qsize(),
            )
            return False
        t0 = time.monotonic()
        path = await self.snapshot(version)
        self.snapshot_s += time.monotonic() - t0
        self._queue.put_nowait((version, wall_s, path, time.monotonic()))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work(), name="pinned-evals")
        return True

    async def drain(self) -> None:
        """Wait until every queued eval has ended (before the run's final eval)."""
        if self._queue is not None:
            await self._queue.join()

    async def close(self) -> None:
        """Cancel the worker (queued evals are dropped: their snapshots are deleted) and close the client."""
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        while self._queue is not None and not self._queue.empty():
            _, _, path, _ = self._queue.get_nowait()
            _remove(path)
            self._queue.task_done()
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            version, wall_s, path, queued_at = await self._queue.get()
            try:
                ev = await self._one(version, path)
            except asyncio.CancelledError:
                _remove(path)
                self._queue.task_done()
                raise
            except Exception as e:  # an eval never fails the run: it is logged and counted
                self.counts["failed"] += 1
                log.error("pinned eval of version %d failed: %s: %s", version, type(e).__name__, e)
                ev = None
            _remove(path)
            if ev is not None:
                self.counts["done"] += 1
                ev["pinned_lag_s"] = time.monotonic() - queued_at  # from the snapshot to the figure
                if self.on_result is not None:
                    self.on_result(version, wall_s, ev)
            self._queue.task_done()

    async def _eval_client(self) -> Any:
        url = (await self.server_url()).rstrip("/")
        if self._client is not None and list(self._client.urls) != [url]:
            await self._client.close()  # a restarted server, on another port
            self._client = None
        if self._client is None:
            self._client = self.make_client(url)
        return self._client

    async def _one(self, version: int, path: str) -> dict[str, float]:
        client = await self._eval_client()
        t0 = time.monotonic()
        await client.update_weights_from_disk(path, version, flush_cache=True)
        load_s = time.monotonic() - t0
        ev = await self.evaluate(client)
        generated = ev.get("min_version", -1) >= 0
        if generated and (ev["min_version"], ev["max_version"]) != (version, version):
            raise PinnedVersionError(
                f"tokens of versions {ev['min_version']:.0f}..{ev['max_version']:.0f} in the eval of {version}"
            )
        return {**ev, "load_s": load_s}


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def link_checkpoint(src: str, dest: str) -> str:
    """`dest` as a copy of the checkpoint directory `src` made of hard links (a copy where the file system
    refuses them): free, and it outlives the weight sync's pruning of `src`. Written beside `dest` and renamed."""
    tmp = f"{dest}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=_link_or_copy)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
