"""How a running engine takes new weights: the swap protocol, disk and broadcast updates, weight-update groups.

Apart from engine.py because it is one protocol of its own (SGLang 0.5's, described in engine.py's docstring):
tensors are loaded and validated first, the swap then waits at a step boundary until no request is running unless
generation is paused, admissions are held meanwhile, and an in-place pause with `flush_cache` is refused before
anything changes. `AsyncEngine` inherits these methods; they use its scheduler, its loop <-> thread plumbing
(`_post`, `_call`, `_resolve`, `_seal`) and its weight state (`model`, `spec`, `weight_version`, `_groups`,
`_weights_lock`, `_pending_swap`), and run on the threads the engine's docstring assigns.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import torch

from areal_async.host.torch_threads import single_torch_thread, to_side_thread
from areal_async.protocol.weight_identity import Identity
from areal_async.server.delta_load import (
    DeltaError,
    apply_broadcast_delta,
    is_delta_dir,
    load_delta,
    served_identity,
)
from areal_async.server.lora_load import AdapterError, adapter_pairs, is_adapter_dir, load_adapter, merge_adapter
from areal_async.server.model import UnsupportedModelError
from areal_async.server.scheduler import abort_reason
from areal_async.server.weights import (
    DTYPES,
    WeightError,
    check_tensors,
    destroy_group,
    init_custom_group,
    load_checkpoint,
    receive_tensors,
)

log = logging.getLogger("areal_async.server.engine")  # the engine's log, as before this part had a module

IN_PLACE_FLUSH_REFUSED = (
    "flush_cache=true cannot be honoured: generation is paused in place and {n} running request(s) hold KV cache "
    "(SGLang's scheduler fails the same flush). Update with flush_cache=false to continue them under the new "
    "weights, or pause with mode 'abort' or 'retract' first."
)


class WeightUpdates:
    """The weight-update half of `AsyncEngine` (a mixin: all state lives on the engine)."""

    def _flush_refusal(self, flush_cache: bool) -> str | None:
        """Why a swap with `flush_cache` cannot happen now (engine thread, or a loop-side early check)."""
        n = len(self._sched.running) if threading.current_thread() is self._thread else self._n_running
        if flush_cache and self._paused and n:
            return IN_PLACE_FLUSH_REFUSED.format(n=n)
        return None

    async def _swap(
        self,
        load: Callable[[], None],
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool = False,
        identity: Identity | None = None,
    ) -> int:
        """Swap in new weights (module docstring): at once while paused, else once no request is running; new
        admissions wait meanwhile. Returns how many requests were paused across the swap. Raises WeightError
        (nothing changed) for an in-place pause with flush_cache."""
        done: asyncio.Future = self._loop.create_future()

        def swap() -> int:
            self._sched.admit_blocked = False
            refusal = self._flush_refusal(flush_cache)
            if refusal is not None:
                raise WeightError(refusal)
            held = len(self._sched.running) + len(self._sched.waiting) if self._paused else 0
            self._seal()  # chunks made by the old weights keep the old version
            load()
            # every weight change forgets the prefix cache, flush_cache or not: KV of cached prefixes was made by
            # the old weights (the running requests of an in-place pause keep theirs, by design)
            self._sched.forget_prefixes()
            self.weight_version = next_version(self.weight_version, weight_version)
            self._identity = identity  # None: computed on the next ask
            return held

        def cmd() -> None:
            if abort_all_requests:
                for r in self._sched.all_requests():
                    self._sched.finish(r, abort_reason("aborted for a weight update"))
            self._sched.admit_blocked = True
            self._pending_swap = lambda: self._resolve(done, swap)

        self._post(cmd, urgent=abort_all_requests or self._paused)
        return await done

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None, abort_all_requests: bool = False, flush_cache: bool = True
    ) -> tuple[bool, str, int]:
        assert self._weights_lock is not None, "engine not started"
        async with self._weights_lock:
            refusal = None if abort_all_requests else self._flush_refusal(flush_cache)
            if refusal is not None:
                return False, refusal, 0
            identity: Identity | None = None
            how = ""
            base = None
            try:
                if is_adapter_dir(model_path):  # train.lora: merged into the kept base (server/lora_load.py)
                    tensors, base, how = await to_side_thread(
                        load_adapter, model_path, self.spec, self.model, getattr(self, "_lora_base", None)
                    )
                elif is_delta_dir(model_path):
                    held_identity = await self._held_identity()
                    tensors, identity, how = await to_side_thread(
                        load_delta, model_path, self.spec, self.model, held_identity
                    )
                else:
                    _, tensors = await to_side_thread(load_checkpoint, model_path, self.spec)
            except (WeightError, DeltaError, AdapterError, UnsupportedModelError, OSError) as e:
                return False, f"failed to load weights from {model_path}: {e}", 0
            if identity is not None:
                identity.version = _label_number(next_version(self.weight_version, weight_version))

            def load() -> None:
                self.model.load_tensors(tensors)
                self._lora_base = base  # None after a full or delta load: those weights are the new base
                if not how:  # a delta changes the weights, not the model directory they came from
                    self.model_path = model_path

            try:
                held = await self._swap(load, weight_version, flush_cache, abort_all_requests, identity)
            except WeightError as e:
                return False, str(e), 0
        how = f" ({how})" if how else ""
        return True, f"Succeeded to update model weights from {model_path}{how}.", held

    async def _held_identity(self) -> Identity:
        """The identity of the served weights (cached until the next swap). Callers hold `_weights_lock`, so no
        swap interleaves with the digests."""
        cached = getattr(self, "_identity", None)
        if cached is None:
            cached = await to_side_thread(served_identity, self.model, _label_number(self.weight_version))
            self._identity = cached
        return cached

    async def weights_identity(self) -> Identity:
        """What `GET /weights_fingerprint` answers: the digests of the weights served now, under their label."""
        assert self._weights_lock is not None, "engine not started"
        async with self._weights_lock:
            identity = await self._held_identity()
            identity.version = _label_number(self.weight_version)  # a relabel changes the label, not the bits
            return identity

    async def weights_by_name(self, name: str, truncate_size: int) -> list | None:
        """SGLang's /get_weights_by_name: `param[:truncate_size]` as nested lists of fp32 values; None for a name
        the model does not have (a tied head is the embedding, as SGLang answers it)."""
        assert self._weights_lock is not None, "engine not started"
        params = self.model.params
        if name == "lm_head.weight" and name not in params and self.spec.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        t = params.get(name)
        if t is None:
            return None
        async with self._weights_lock:
            return await to_side_thread(lambda: t[:truncate_size].detach().to("cpu", torch.float32).tolist())

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> tuple[bool, str]:
        """Join the trainer's broadcast group as rank `rank_offset` (SGLang's receiving side; see weight_sync)."""
        if group_name in self._groups:
            return False, f"weight update group {group_name!r} already exists"
        if backend == "nccl" and self.device.type != "cuda":
            return False, "backend nccl needs a CUDA device; this engine runs on CPU (use gloo)"
        try:
            group = await asyncio.to_thread(
                init_custom_group,
                backend,
                f"tcp://{master_address}:{master_port}",
                world_size,
                rank_offset,
                group_name,
                self.device,
            )
        except Exception as e:  # rendezvous timeouts and connection errors come as several types
            return False, f"failed to join weight update group {group_name!r}: {type(e).__name__}: {e}"
        self._groups[group_name] = group
        return True, f"Succeeded to initialize weight update group {group_name!r}."

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        """Leave weight-update group `group_name` (SGLang's /destroy_weights_update_group, same answers): a run
        that ends, or re-forms its group, frees the communicator here and may reuse the name."""
        assert self._weights_lock is not None, "engine not started"
        async with self._weights_lock:  # never in the middle of a bucket's receive
            group = self._groups.pop(group_name, None)
            if group is None:
                return False, "The group to be destroyed does not exist."
            try:
                await asyncio.to_thread(destroy_update_group, group, True)
            except Exception as e:
                return False, f"Failed to destroy custom process group: {type(e).__name__}: {e}."
        return True, "Succeeded to destroy custom process group."

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        flush_cache: bool = True,
        delta=None,
        lora=None,
    ) -> tuple[bool, str]:
        """Receive each tensor by broadcast(src=0), in order, then swap them in like a disk update: at once while
        paused, else once the running requests have finished."""
        group = self._groups.get(group_name)
        if group is None:
            return False, f"no weight update group {group_name!r}; call init_weights_update_group first"
        if not len(names) == len(dtypes) == len(shapes):
            return False, "names, dtypes and shapes must have the same length"
        bad = [d for d in dtypes if d not in DTYPES or (d == "uint8") != (delta is not None)]
        if bad:
            return False, f"unsupported dtypes {bad[:3]}"
        assert self._weights_lock is not None, "engine not started"
        async with self._weights_lock:
            try:
                # Receive everything first, even names we will reject or a swap we will refuse: the trainer's
                # broadcasts must all be matched.
                tensors = await to_side_thread(receive_tensors, group, names, dtypes, shapes, self.device)
                if delta is not None:
                    return await self._apply_broadcast_delta(tensors, delta, weight_version, flush_cache)
                if lora is not None:  # train.lora: adapters under peft's names (server/lora_load.py)
                    return await self._apply_broadcast_adapter(tensors, lora, weight_version, flush_cache)
                expected = self.spec.param_shapes()
                if self.spec.tie_word_embeddings and "lm_head.weight" in tensors:
                    expected = {**expected, "lm_head.weight": expected["model.embed_tokens.weight"]}
                with single_torch_thread():  # on the event loop's thread
                    check_tensors(tensors, expected, where="update_weights_from_distributed", require_all=False)
            except Exception as e:
                return False, f"failed to update weights from distributed: {type(e).__name__}: {e}"
            try:
                # as SGLang: a bucket without a version (every bucket of a broadcast but the last) keeps the label
                label = weight_version if weight_version is not None else self.weight_version
                await self._swap(lambda: self._load_full(tensors), label, flush_cache)
            except WeightError as e:
                return False, str(e)
        return True, "Succeeded to update parameter online from distributed."

    async def _apply_broadcast_delta(
        self, payloads: dict[str, torch.Tensor], delta, weight_version: str | None, flush_cache: bool
    ) -> tuple[bool, str]:
        """A delta received by broadcast (train/delta_broadcast.py): applied only to weights whose identity is its
        base, and swapped in only when the result's digests are the trainer's. Caller holds `_weights_lock`."""
        served = str(self.model.dtype).removeprefix("torch.")
        if delta.dtype != served:
            return False, f"the delta holds {delta.dtype} bits; this server serves {served}: a full update is needed"
        held = await self._held_identity()
        if held.combined != delta.base:
            return False, (
                f"the delta applies to weights with fingerprint {delta.base[:12]}; this server holds "
                f"{held.combined[:12]} (version {self.weight_version}): a full update is needed"
            )
        cpu = {n: t.cpu() for n, t in payloads.items()}
        try:
            changed, identity = await to_side_thread(apply_broadcast_delta, self.model, held, cpu)
        except DeltaError as e:
            return False, f"failed to apply the delta: {e}"
        if identity.combined != delta.result:
            return False, (
                f"the delta gives weights with fingerprint {identity.combined[:12]}, the trainer's are "
                f"{delta.result[:12]}: refused"
            )
        label = weight_version if weight_version is not None else self.weight_version
        identity.version = _label_number(next_version(self.weight_version, label))
        try:
            await self._swap(lambda: self._load_full(changed), label, flush_cache, identity=identity)
        except WeightError as e:
            return False, str(e)
        return True, f"Succeeded to update parameter online from distributed (delta of {len(changed)} tensors)."

    async def _apply_broadcast_adapter(
        self, tensors: dict[str, torch.Tensor], lora, weight_version: str | None, flush_cache: bool
    ) -> tuple[bool, str]:
        """Adapters received by broadcast, merged into the kept base like an adapter directory. Caller holds
        `_weights_lock`."""
        where = "update_weights_from_distributed"
        try:
            pairs = await to_side_thread(adapter_pairs, tensors, lora.r, where)
            merged, base, how = await to_side_thread(
                lambda: merge_adapter(
                    pairs, lora.r, lora.lora_alpha, self.spec, self.model, self._lora_base, where=where
                )
            )
        except AdapterError as e:
            return False, f"failed to apply the adapters: {e}"

        def load() -> None:
            self.model.load_tensors(merged)
            self._lora_base = base

        label = weight_version if weight_version is not None else self.weight_version
        try:
            await self._swap(load, label, flush_cache)
        except WeightError as e:
            return False, str(e)
        return True, f"Succeeded to update parameter online from distributed ({how})."

    def _load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        """Weights that are not an adapter: they become the base the next adapter merges into."""
        self.model.load_tensors(tensors)
        self._lora_base = None

    async def set_weight_version(self, version: str) -> None:
        def cmd() -> None:
            self._seal()
            self.weight_version = version

        await self._call(cmd)


def _label_number(label: str) -> int:
    """An identity's version: the label as a number (-1 for a label that is not one, such as SGLang's "default")."""
    return int(label) if label.isdigit() else -1


def next_version(current: str, given: str | None) -> str:
    """The version after an update: the given one, else the current one plus one when it is a number."""
    if given is not None:
        return given
    return str(int(current) + 1) if current.isdigit() else current


def destroy_update_group(group, raise_errors: bool = False) -> None:
    try:
        destroy_group(group)
    except Exception:  # best effort at shutdown
        if raise_errors:
            raise
        log.warning("failed to destroy a weight update group", exc_info=True)
