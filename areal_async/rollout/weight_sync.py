"""Getting the trainer's weights onto the inference servers, and what happens to requests in flight meanwhile.

Two transports (`train.weight_sync`), one `WeightSync` protocol: `DiskSync` (here: the trainer publishes an HF
checkpoint while generation goes on, the servers load it) and `ElasticBroadcastSync` (rollout/broadcast_sync.py:
torch.distributed from trainer rank 0, bucket by bucket, over a group that follows the fleet). `update_weights`
applies either under one of three treatments of the requests in flight (`schedule.interruptible`,
`schedule.interrupt_mode`): abort and resume, keep decoding in place, or wait (disk only). Why each works as it
does, SGLang's behaviour included: docs/weights.md.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from areal_async.types import PublishResult

InterruptMode = Literal["abort", "in_place", "wait"]


class Publisher(Protocol):
    async def publish(self, version: int, root: str, keep: int = 2) -> PublishResult: ...


class DiskServers(Protocol):
    async def update_weights_from_disk(self, path: str, version: int, *, flush_cache: bool = True) -> Any: ...


class PausableServers(Protocol):
    async def pause(self, mode: str = "abort") -> Any: ...

    async def resume(self) -> Any: ...


class WeightSync(Protocol):
    """One transport. `prepare` runs while generation goes on; `apply` makes the servers hold `version`."""

    latest_checkpoint: str | None  # an HF checkpoint of the last prepared version, when the transport writes one
    # a transport that sets `bucketed = True` loads over several calls, so it is only safe while the servers are
    # paused (`update_weights` refuses it with mode "wait")

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


def interrupt_mode(interruptible: bool, mode: str) -> InterruptMode:
    return "wait" if not interruptible else ("in_place" if mode == "in_place" else "abort")


async def update_weights(sync: WeightSync, servers: PausableServers, version: int, mode: InterruptMode) -> None:
    """`sync.apply(version)` under the in-flight treatment `mode`. The caller has
    `prepare`d the version already (that part overlaps generation and is timed apart). The modes: docs/weights.md."""
    if mode == "wait":
        if getattr(sync, "bucketed", False):
            raise ValueError(
                "a bucketed (broadcast) weight update needs the servers paused: interruptible=false is for disk sync"
            )
        await sync.apply(version, flush_cache=True)
        return
    await servers.pause(mode)
    try:
        # never flush with an in-place pause: the kept requests hold KV (and SGLang asserts on the refused flush)
        await sync.apply(version, flush_cache=mode != "in_place")
    finally:
        await servers.resume()
