"""Getting the trainer's weights onto the inference servers, and what happens to requests in flight meanwhile.

Two transports (`train.weight_sync`), one `WeightSync` protocol: `DiskSync` (here: the trainer publishes an HF
checkpoint while generation goes on, the servers load it) and `ElasticBroadcastSync` (rollout/broadcast_sync.py:
torch.distributed from trainer rank 0, bucket by bucket, over a group that follows the fleet). `update_weights`
applies either under one of three treatments of the requests in flight (`schedule.interruptible`,
`schedule.interrupt_mode`): abort and resume, keep decoding in place, or wait (disk only). Why each works as it
does, SGLang's behaviour included: docs/weights.md.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal, Protocol

from areal_async.types import PublishResult

log = logging.getLogger(__name__)

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
    """Disk sync: the trainers publish `root/v<k>`, every server loads it, and every server then proves it holds
    the published weights (policy identity, inference/identity.py).

    With a trainer that has `publish_delta` (TrainerGroup), `v<k>` is a full HF checkpoint or, with
    `train.delta_sync`, a delta of the served-dtype bits (train/delta_publish.py decides; docs/weights.md). A delta
    that a server refuses (wrong base, truncated or corrupt file, checksum mismatch: the server names the cause and
    keeps its weights) makes the version be published again in full and loaded: the run falls back to a full load.
    Real SGLang cannot load a delta, so a fleet with an SGLang server always gets full checkpoints."""

    def __init__(
        self, trainer: Publisher, servers: DiskServers, root: str, keep_versions: int = 2, *, verify: bool = True
    ) -> None:
        self.trainer = trainer
        self.servers = servers
        self.root = root
        self.keep_versions = keep_versions
        self.verify = verify
        self.latest_checkpoint: str | None = None
        self.latest_adapter: str | None = None  # train.lora: the peft directory of the last prepared version
        self._published: dict[int, Any] = {}
        self._served_dtype: str | None = None
        self._full_only = False  # an SGLang server in the fleet: deltas are never sent
        self._force_full = False
        self.stats: dict[str, float] = {
            "full_updates": 0,
            "delta_updates": 0,
            "adapter_updates": 0,  # train.lora: versions sent as their adapters alone (train/lora_publish.py)
            "delta_fallbacks": 0,
            "published_bytes": 0,
            "full_bytes": 0,
            "changed_elements": 0,
            "total_elements": 0,
            "identity_check_s": 0.0,
            "identity_mismatches": 0,
            "identity_unchecked": 0,  # server-updates whose identity could not be checked (no endpoint, unreadable)
        }

    async def _served(self) -> str:
        """The dtype the servers serve (asked once): an embedded server says it (/get_server_info `dtype`), and so
        does an SGLang server launched with --dtype (the launcher always gives one); "auto" is refused, since SGLang's
        auto depends on the checkpoint (an fp32 one is served as float16).
        Deltas go only to a fleet whose every server says it takes them (`weights_delta`, the embedded server)."""
        if self._served_dtype is not None:
            return self._served_dtype
        infos = await self.servers.server_info() if hasattr(self.servers, "server_info") else {}
        dtypes = set()
        for url, info in infos.items():
            if not isinstance(info, dict):
                continue
            if not info.get("weights_delta"):  # the embedded server says it takes deltas; SGLang cannot
                if not self._full_only:
                    log.warning("%s cannot load a delta (only the embedded server can): full checkpoints only", url)
                self._full_only = True
            d = info.get("dtype")
            if d == "auto":  # SGLang started without --dtype: what it serves depends on the model (never guessed)
                raise RuntimeError(
                    f"{url} serves dtype 'auto': start it with an explicit --dtype (e.g. bfloat16) so that the weights "
                    "it serves can be checked against the trainer's after every update"
                )
            dtypes.add("bfloat16" if d is None else str(d))
        if len(dtypes) > 1:
            log.warning("the servers serve different dtypes %s: full checkpoints only", sorted(dtypes))
            self._full_only = True
        self._served_dtype = sorted(dtypes)[0] if dtypes else "float32"
        return self._served_dtype

    async def _publish(self, version: int, *, force_full: bool) -> Any:
        if not hasattr(self.trainer, "publish_delta"):
            return await self.trainer.publish(version, self.root, self.keep_versions)
        dtype = await self._served()
        pub = await self.trainer.publish_delta(
            version, self.root, self.keep_versions, served_dtype=dtype, force_full=force_full or self._full_only
        )
        self.stats[{"delta": "delta_updates", "adapter": "adapter_updates"}.get(pub.kind, "full_updates")] += 1
        self.stats["published_bytes"] += pub.num_bytes
        self.stats["full_bytes"] += pub.full_bytes
        self.stats["changed_elements"] += pub.changed if pub.kind in ("delta", "adapter") else pub.total
        self.stats["total_elements"] += pub.total
        return pub

    async def prepare(self, version: int) -> None:
        pub = await self._publish(version, force_full=self._force_full)
        self._force_full = False
        self._published = {version: pub}
        # a delta directory is not an HF checkpoint: publish_final writes a full one at the end
        self.latest_checkpoint = pub.path if getattr(pub, "kind", "full") == "full" else None
        self.latest_adapter = pub.path if getattr(pub, "kind", "full") == "adapter" else None

    async def final_adapter(self, version: int) -> str | None:
        """train.lora: the adapter directory of `version` (None: not an adapter run, or another version)."""
        pub = self._published.get(version)
        return self.latest_adapter if pub is not None and getattr(pub, "kind", "") == "adapter" else None

    async def apply(self, version: int, *, flush_cache: bool) -> None:
        pub = self._published.get(version)
        if pub is None:
            raise RuntimeError(f"version {version} was not prepared (published) before it was applied")
        try:
            results = await self.servers.update_weights_from_disk(pub.path, version, flush_cache=flush_cache)
        except Exception as e:  # every server refused (the client's AdminError; nothing changed anywhere)
            if getattr(pub, "kind", "full") != "delta":
                raise
            results = {"*": e}
        refused = {u: r for u, r in (results or {}).items() if isinstance(r, BaseException)}
        if refused and getattr(pub, "kind", "full") == "delta":
            self.stats["delta_fallbacks"] += 1
            log.warning(
                "the delta of version %d was refused (%s): publishing it in full and loading that",
                version,
                "; ".join(f"{u}: {str(r).splitlines()[0]}" for u, r in refused.items()),
            )
            pub = await self._publish(version, force_full=True)
            self._published = {version: pub}
            self.latest_checkpoint = pub.path
            await self.servers.update_weights_from_disk(pub.path, version, flush_cache=flush_cache)
        identity = getattr(pub, "identity", None)
        if self.verify and identity is not None and hasattr(self.servers, "verify_weights"):
            t0 = time.perf_counter()
            verdicts = await self.servers.verify_weights(identity)
            self.stats["identity_check_s"] += time.perf_counter() - t0
            self.stats["identity_mismatches"] += sum(1 for v in verdicts.values() if not v.ok and not v.unknown)
            self.stats["identity_unchecked"] += sum(1 for v in verdicts.values() if v.unknown)
            if getattr(pub, "kind", "full") == "adapter":
                adapter_reached(version, pub.path, verdicts)


class AdapterNotServed(RuntimeError):
    """train.lora: no server serves the adapter version it says it loaded (the failure other async LoRA systems
    hit silently: rollouts keep coming from the base or an old adapter, labelled as the new version)."""


def adapter_reached(version: int, path: str, verdicts: dict[str, Any]) -> None:
    """Stop the run when every checked server holds other weights than the adapter version `version` merged
    (policy identity, inference/identity.py): a server that mismatches alone leaves rotation and reloads, as with
    full weights, but when none serves it, reloading the same directory cannot help and the run would train on
    rollouts of other weights."""
    checked = [v for v in verdicts.values() if not v.unknown]
    if checked and not any(v.ok for v in checked):
        detail = "; ".join(f"{v.url}: {', '.join(v.differs[:3])}" for v in checked[:3])
        raise AdapterNotServed(
            f"the adapter of version {version} ({path}) reached no server: every server that took it serves "
            f"other weights (parameters that differ: {detail})"
        )


def interrupt_mode(interruptible: bool, mode: str) -> InterruptMode:
    return "wait" if not interruptible else ("in_place" if mode == "in_place" else "abort")


async def update_weights(sync: WeightSync, servers: PausableServers, version: int, mode: InterruptMode) -> None:
    """`sync.apply(version)` under the in-flight treatment `mode`. The caller has
    `prepare`d the version already (that part overlaps generation and is timed apart). The modes: docs/weights.md.
    A `pauseless` transport (SGLang LoRA adapters, rollout/lora_sync.py: each request keeps the adapter it started
    under, so nothing in flight changes weights) applies without a pause, whatever the mode."""
    if getattr(sync, "pauseless", False):
        await sync.apply(version, flush_cache=False)
        return
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
