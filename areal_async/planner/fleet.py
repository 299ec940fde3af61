"""The simulated inference fleet: what the controller and the workflow see in place of `InferenceClient`.

It implements the controller's `InferenceAdmin` seam (rollout/controller.py: `agenerate`, `pause`, `resume`,
`update_weights_from_disk`) in process, over `SimServer`s on the virtual clock, so the real schedule code drives it
exactly as it drives the HTTP client. What the real client does on top of the servers is modelled, not run:
requests go to the least-loaded server (the client's least-outstanding routing), a prompt group's samples go to one
server together (they share the prompt's KV), and an abort pause's resubmission is the server recomputing the
partial answers' KV when it continues (the client resubmits prompt + tokens so far, under the new weights).
"""

from __future__ import annotations

import asyncio
import heapq
from typing import Any

from areal_async.planner.server_model import ServerCosts, SimServer
from areal_async.types import GenerationResult, SamplingParams


class SimFleet:
    """`servers` identical servers with `costs`. `generate_group(lengths, prompt)` is the fast path the planner's
    workflow uses: one call per prompt group, answered with {version: tokens} once its last sample finished."""

    def __init__(self, costs: ServerCosts, servers: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if servers < 1:
            raise ValueError("a fleet needs at least one server")
        self.loop = loop or asyncio.get_running_loop()
        self.costs = costs
        self.servers = [SimServer(costs, self.loop, i) for i in range(servers)]
        self._heap = [(0, i) for i in range(servers)]  # (load, index), lazily corrected
        self.paused = False
        self.pauses = 0
        self.loads = 0
        self.pause_wait_s = 0.0  # the controller's time in pause / continue calls and weight loads

    # ---- routing ----------------------------------------------------------------------------------------------

    def _least_loaded(self) -> SimServer:
        heap = self._heap
        servers = self.servers
        while True:
            load, i = heap[0]
            s = servers[i]
            queued = s.n + s._unstarted  # SimServer.queued, inline
            if load == queued:
                return s
            heapq.heapreplace(heap, (queued, i))

    async def generate_group(self, lengths: list[int], prompt: int) -> dict[int, int]:
        """Generate a prompt group's answers (lengths known to the simulation, not to the server's scheduler)."""
        server = self._least_loaded()
        fut = server.submit(lengths, prompt)
        heapq.heapreplace(self._heap, (server.n + server._unstarted, server.index))
        try:
            return await fut
        finally:
            # finished sequences lowered the server's load: let the router see it
            heapq.heappush(self._heap, (server.n + server._unstarted, server.index))
            if len(self._heap) > 4 * len(self.servers):
                self._heap = sorted({(s.queued, s.index) for s in self.servers})

    async def agenerate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        session_key: str | None = None,
        return_text: bool = False,
        priority: int | None = None,
    ) -> GenerationResult:
        """The `Generator` seam for a workflow that generates one answer at a time; its length is
        `sampling.max_new_tokens` (a planner workflow decides lengths before it asks)."""
        n = sampling.max_new_tokens
        versions = await self.generate_group([n], len(input_ids))
        out_versions = [v for v, k in sorted(versions.items()) for _ in range(k)]
        return GenerationResult(
            input_ids=list(input_ids),
            output_ids=[0] * len(out_versions),
            output_logprobs=[0.0] * len(out_versions),
            output_versions=out_versions,
            finish_reason="length",
        )

    # ---- the admin seam ---------------------------------------------------------------------------------------

    async def pause(self, mode: str = "abort") -> dict[str, Any]:
        self.paused = True
        self.pauses += 1
        abort = mode == "abort"
        for s in self.servers:
            s.pause(abort)
        await self._admin_call(self.costs.pause_s)
        return {}

    async def resume(self) -> dict[str, Any]:
        await self._admin_call(self.costs.pause_s)
        self.paused = False
        for s in self.servers:
            s.resume()
        return {}

    async def update_weights_from_disk(self, path: str, version: int, *, flush_cache: bool = True) -> dict[str, Any]:
        await self.load_weights(version)
        return {}

    async def load_weights(self, version: int) -> None:
        """Every server loads `version` (in parallel; unpaused servers first let their running sequences end)."""
        t0 = self.loop.time()
        self.loads += 1
        if self.paused:  # every server loads at once, in the same time: one timer for the fleet
            await asyncio.sleep(self.costs.load_s)
            for s in self.servers:
                s.set_version(version, self.costs.load_s)
        else:
            await asyncio.gather(*(s.load(version) for s in self.servers))
        self.pause_wait_s += self.loop.time() - t0

    async def _admin_call(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)
            self.pause_wait_s += seconds

    def release(self) -> None:
        """Drop every server's groups and timers once a run is over. Why: a server, its timer and the loop refer to
        one another, so what the servers still hold (their last groups, with futures and answers) would otherwise
        wait for a full garbage collection over the whole run's leftovers, a noticeable share of a large plan."""
        for s in self.servers:
            s.release()

    # ---- what it did ------------------------------------------------------------------------------------------

    def stats(self, wall_s: float) -> dict[str, float]:
        n = len(self.servers)
        busy = sum(s.busy_s for s in self.servers)
        return {
            "servers": n,
            "busy_frac": busy / (n * wall_s) if wall_s > 0 else 0.0,
            "load_frac": sum(s.load_busy_s for s in self.servers) / (n * wall_s) if wall_s > 0 else 0.0,
            "generated_tokens": float(sum(s.generated_tokens for s in self.servers)),
            "recomputed_tokens": float(sum(s.recomputed_tokens for s in self.servers)),
            "pauses": float(self.pauses),
        }
