"""One HTTP call's engine requests: driven concurrently, their progress reported through one queue.

Apart from app.py because it is the one piece of the server with its own concurrency: a task per engine request,
a queue the handler reads, and a cleanup that must complete even while the handler is being cancelled by a client
disconnect. The handlers (app.py) only decide what to do with the progress (a JSON answer or a stream of events).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol

from areal_async.protocol import sglang as sglang_protocol
from areal_async.protocol.engine_api import Engine

_END = object()  # a driver task finished (queue sentinel)


class CallOwner(Protocol):
    """What a call uses of the server that started it (app.py's SGLangServer): named here, so that app.py imports
    this module and not the other way round."""

    engine: Engine

    async def shielded(self, coro: Awaitable[Any]) -> Any: ...

    async def abort_exact(self, rid: str) -> None: ...

    def release(self, rids: list[str]) -> None: ...


class EngineCall:
    """Drives the engine requests of one HTTP call concurrently and reports their progress through one queue.

    `progress()` yields the index of a request each time it has new tokens (or finished) and raises the first
    failure. `close()` cancels what is still running and aborts it in the engine: it is shielded, so it completes
    even when the handler itself is being cancelled by a client disconnect.
    """

    def __init__(self, server: CallOwner, accs: list[sglang_protocol.Accumulator]):
        self.server = server
        self.engine = server.engine
        self.accs = accs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._drive(i)) for i in range(len(accs))]

    async def _drive(self, i: int) -> None:
        acc = self.accs[i]
        try:
            gen = self.engine.generate(acc.req)
            try:
                async for chunk in gen:
                    acc.add(chunk)
                    self.queue.put_nowait((i, None))
                    if acc.finished:
                        break
            finally:
                aclose = getattr(gen, "aclose", None)
                if aclose is not None:
                    await aclose()
            if not acc.finished:
                acc.abort_reason("the engine ended the request without a finish reason")
                self.queue.put_nowait((i, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # reported to the handler, which decides between 400, 500 and a stream error
            self.queue.put_nowait((i, e))
        finally:
            self.queue.put_nowait((i, _END))

    async def progress(self) -> AsyncIterator[int]:
        ended = 0
        while ended < len(self.tasks):
            i, ev = await self.queue.get()
            if ev is _END:
                ended += 1
            elif ev is not None:
                raise ev
            else:
                yield i

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await self.server.shielded(self._cleanup())

    async def _cleanup(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for acc in self.accs:
            if not acc.finished:
                await self.server.abort_exact(acc.rid)
        self.server.release([a.rid for a in self.accs])
