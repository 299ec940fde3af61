"""Getting the trainer's weights onto the inference servers, and what happens to requests in flight meanwhile.

Two transports (`train.weight_sync`):
- `DiskSync`: the trainer publishes an HF checkpoint (`prepare`, while generation goes on), the servers load it
  (`apply`: POST /update_weights_from_disk).
- `BroadcastSync`: nothing to prepare; `apply` sends every tensor from trainer rank 0 to the servers over
  torch.distributed (POST /update_weights_from_distributed, bucket by bucket).

Three ways to treat requests in flight (`schedule.interruptible` and `schedule.interrupt_mode`), applied by
`update_weights` around either transport:
- abort (interruptible, the default): pause(mode="abort") returns every in-flight request with its partial tokens;
  the weights load; continue; the client resubmits each request (prompt + tokens so far), so the KV cache is
  recomputed under the new weights and every token carries the version that sampled it.
- in_place: pause(mode="in_place") stops the scheduler with every request and its KV cache where it is; the weights
  load WITHOUT a cache flush; continue; the requests go on decoding under the new weights over the KV their earlier
  tokens left (PipelineRL's and prime-rl's in-flight updates). Nothing is recomputed, and each response says where
  its version changed (meta_info `weight_version_spans`, read by the client), so per-token versions stay exact.
- wait (not interruptible): the update is sent without a pause and waits on the server until the requests in flight
  have finished under the old weights. Disk sync only: a broadcast goes bucket by bucket, and SGLang takes its
  model-update writer lock per bucket, so unpaused, queued requests would run between buckets on a mix of old and
  new weights (labelled old). The config refuses the combination; `update_weights` refuses it too.

What real SGLang 0.5.x does with an update while paused in place (read in its tokenizer manager and scheduler):
`pause_generation(mode="in_place")` only sets the scheduler's `_engine_paused`; the running batch, its KV cache and
the chunked request stay as they are, and the event loop keeps receiving requests but launches no batch.
`update_weights_from_disk` / `update_weights_from_distributed` in the tokenizer manager skip the model-update writer
lock while paused (unpaused, that lock waits for every in-flight request, which holds it as a reader), so the load
happens at once. After loading, the scheduler flushes the cache if `flush_cache` is set and ASSERTS that the flush
succeeded; a flush refuses while requests hold KV, so `flush_cache=true` with an in-place pause kills the scheduler.
Hence in_place always loads with flush_cache=false. On continue the kept requests decode with the new weights over
their old KV. SGLang stamps a response with one `weight_version` (the server's at the time the response is built),
so against real SGLang the tokens generated before the update are labelled with the new version: the staleness
bound still holds (it is enforced on start versions), but staleness statistics undercount until SGLang reports
version spans.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from areal_async.types import PublishResult

InterruptMode = Literal["abort", "in_place", "wait"]


class Publisher(Protocol):
    async def publish(self, version: int, root: str, keep: int = 2) -> PublishResult: ...


class Broadcaster(Protocol):
    async def broadcast_weights(self, servers: Any, version: int, *, flush_cache: bool = True) -> Any: ...


class DiskServers(Protocol):
    async def update_weights_from_disk(self, path: str, version: int, *, flush_cache: bool = True) -> Any: ...


class PausableServers(Protocol):
    async def pause(self, mode: str = "abort") -> Any: ...

    async def resume(self) -> Any: ...


class WeightSync(Protocol):
    """One transport. `prepare` runs while generation goes on; `apply` makes the servers hold `version`."""

    latest_checkpoint: str | None  # an HF checkpoint of the last prepared version, when the transport writes one

    async def prepare(self, version: int) -> None: ...

    async def apply(self, version: int, *, flush_cache: bool) -> None: ...


class DiskSync:
    def __init__(self, trainer: Publisher, servers: DiskServers, root: str, keep_versions: int = 2) -> None:
        self.trainer = trainer
        self.servers = servers
        self.root = root
        self.keep_versions = keep_versions
        self.latest_checkpoint: str | None = None
        self._published: dict[int, str] = {}

    async def prepare(self, version: int) -> None:
        pub = await self.trainer.publish(version, self.root, self.keep_versions)
        self._published = {version: pub.path}
        self.latest_checkpoint = pub.path

    async def apply(self, version: int, *, flush_cache: bool) -> None:
        if version not in self._published:
            raise RuntimeError(f"version {version} was not prepared (published) before it was applied")
        await self.servers.update_weights_from_disk(self._published[version], version, flush_cache=flush_cache)


class BroadcastSync:
    bucketed = True  # the servers take the weights over several calls: only safe while paused (see above)

    def __init__(self, trainer: Broadcaster, servers: Any) -> None:
        self.trainer = trainer
        self.servers = servers
        self.latest_checkpoint: str | None = None

    async def prepare(self, version: int) -> None:
        del version

    async def apply(self, version: int, *, flush_cache: bool) -> None:
        await self.trainer.broadcast_weights(self.servers, version, flush_cache=flush_cache)


def interrupt_mode(interruptible: bool, mode: str) -> InterruptMode:
    return "wait" if not interruptible else ("in_place" if mode == "in_place" else "abort")


async def update_weights(sync: WeightSync, servers: PausableServers, version: int, mode: InterruptMode) -> None:
    """`sync.apply(version)` under the in-flight treatment `mode` (see the module docstring). The caller has
    `prepare`d the version already (that part overlaps generation and is timed apart)."""
    if mode == "wait":
        if getattr(sync, "bucketed", False):
            raise ValueError("a bucketed (broadcast) weight update needs the servers paused: interruptible=false "
                             "is for disk sync")
        await sync.apply(version, flush_cache=True)
        return
    await servers.pause(mode)
    try:
        # never flush with an in-place pause: the kept requests hold KV (and SGLang asserts on the refused flush)
        await sync.apply(version, flush_cache=mode != "in_place")
    finally:
        await servers.resume()
