"""Adapter sync to SGLang (`train.lora` with `server.backend=sglang`): each version's adapters are loaded next to
the ones before it, and every request names the adapter of the version it started under.

The embedded server merges one adapter version into its weights at a time, so an update there is a weight swap
inside a pause (weight_sync.py). SGLang applies adapters per request (S-LoRA), so here nothing in flight changes
weights: `prepare` has the trainers write `root/v<k>` (a peft directory, train/lora_publish.py); `apply` loads it
on every server under the name `areal-v<k>` (inference/lora_window.py), proves each server runs a generation under
it, makes it the adapter new requests name, relabels the servers' weight version, and unloads the versions that
fell out of the eta + 1 window. No pause, no abort, no KV recompute: a request runs start to end under one adapter
and each of its tokens records that adapter's version. Why eta + 1 versions suffice, and what a request at the
window's edge does: docs/weights.md, "LoRA on SGLang".
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from areal_async.inference.errors import AdminError
from areal_async.inference.lora_window import AdapterWindow, adapter_name
from areal_async.rollout.weight_sync import AdapterNotServed

__all__ = ["AdapterSync"]

log = logging.getLogger(__name__)


class AdapterPublisher(Protocol):
    async def publish_delta(
        self,
        version: int,
        root: str,
        keep: int = 2,
        *,
        served_dtype: str = "float32",
        force_full: bool = False,
        identity: bool = True,
    ) -> Any: ...


class AdapterServers(Protocol):
    def use_adapters(self, window: AdapterWindow) -> None: ...

    async def load_lora_adapter(self, version: int, path: str) -> dict[str, str]: ...

    async def unload_lora_adapters(self, versions: list[int]) -> dict[str, str]: ...

    async def update_weight_version(self, version: int, *, abort_all_requests: bool = False) -> dict[str, Any]: ...


class AdapterSync:
    """The `WeightSync` of a LoRA run on SGLang servers (disk: SGLang loads an adapter from a directory)."""

    pauseless = True  # update_weights applies it without pausing the servers (weight_sync.py)
    bucketed = False

    def __init__(
        self, trainer: AdapterPublisher, servers: AdapterServers, root: str, *, window: int, keep_versions: int = 2
    ) -> None:
        self.trainer = trainer
        self.servers = servers
        self.root = root
        self.window = AdapterWindow(window)
        # a server that comes back loads every adapter of the window from its directory: keep them all on disk
        self.keep_versions = max(keep_versions, window + 1)
        servers.use_adapters(self.window)
        self.latest_checkpoint: str | None = None  # adapters only: publish_final writes the merged model
        self.latest_adapter: str | None = None
        self._published: dict[int, Any] = {}
        self.stats: dict[str, float] = {
            "adapter_updates": 0,
            "published_bytes": 0,
            "full_bytes": 0,
            "changed_elements": 0,
            "total_elements": 0,
            "adapter_unload_failures": 0,
        }
        self._unloads: set[asyncio.Task] = set()

    async def prepare(self, version: int) -> None:
        """The trainers write version `version`'s adapters to `root/v<version>` (while generation goes on)."""
        # no identity of merged weights (the embedded server's proof, a gather of the base and a merge per
        # version): SGLang keeps its base and applies the adapter per request; the proof is the load answer and
        # a probe generation (apply)
        pub = await self.trainer.publish_delta(
            version, self.root, self.keep_versions, served_dtype="bfloat16", identity=False
        )
        if getattr(pub, "kind", "") != "adapter":
            raise RuntimeError(
                f"version {version} was published as {getattr(pub, 'kind', '?')!r}, not as adapters: the trainers "
                "do not train LoRA adapters (train.lora.rank), which SGLang's adapter sync needs"
            )
        self.stats["adapter_updates"] += 1
        self.stats["published_bytes"] += pub.num_bytes
        self.stats["full_bytes"] += pub.full_bytes
        self.stats["changed_elements"] += pub.changed
        self.stats["total_elements"] += pub.total
        self._published = {version: pub}
        self.latest_adapter = pub.path

    async def final_adapter(self, version: int) -> str | None:
        """The adapter directory of `version` (None: not the version last prepared)."""
        pub = self._published.get(version)
        return pub.path if pub is not None else None

    async def apply(self, version: int, *, flush_cache: bool) -> None:
        """Load version `version`'s adapter everywhere, prove it, make it the one new requests name; raises
        `AdapterNotServed` (the run stops in this update) when no server serves it."""
        del flush_cache  # the radix cache keys prefixes by adapter: nothing cached belongs to the new one
        pub = self._published.get(version)
        if pub is None:
            raise RuntimeError(f"version {version} was not prepared (published) before it was applied")
        stale = [v for v in self.window.loaded if v >= version]
        if stale:  # a rollback or resume publishes a version again: what the servers hold of it is another lineage's
            self.window.forget(stale)
            await self._unload(stale)
        results = await self.servers.load_lora_adapter(version, pub.path)
        served = [url for url, why in results.items() if not why]
        if not served:
            detail = "; ".join(f"{u}: {why}" for u, why in list(results.items())[:3]) or "no server is reachable"
            raise AdapterNotServed(
                f"the adapter of version {version} ({pub.path}) reached no server as {adapter_name(version)}: {detail}"
            )
        for url, why in results.items():
            if why:
                log.warning("inference server %s did not take the adapter of version %d: %s", url, version, why)
        evicted = self.window.admit(version, pub.path)  # from here on, new requests name version `version`
        try:
            await self.servers.update_weight_version(version)  # the label the fleet's catch-up compares
        except AdminError as e:  # a server that cannot be relabelled leaves rotation and catches up
            log.warning("relabelling the servers to version %d failed on some: %s", version, e)
        if evicted:  # in the background: SGLang answers once the requests under them finished (an eval, say)
            task = asyncio.get_running_loop().create_task(self._unload(evicted))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def drain(self) -> None:
        """Wait for the unloads still under way (tests; the end of a run does not need to)."""
        while self._unloads:
            await asyncio.gather(*self._unloads, return_exceptions=True)

    async def _unload(self, versions: list[int]) -> None:
        """Unload versions that left the window (no rollout runs under them: the staleness bound, docs/weights.md);
        a server that keeps one only holds a little more memory, so a failure is logged and counted."""
        try:
            results = await self.servers.unload_lora_adapters(versions)
        except Exception as e:  # the client closed meanwhile (the end of a run): nothing left to unload for
            log.warning("unloading adapter versions %s failed: %s: %s", versions, type(e).__name__, e)
            return
        for url, why in results.items():
            if why:
                self.stats["adapter_unload_failures"] += 1
                log.warning("inference server %s did not unload adapter versions %s: %s", url, versions, why)
