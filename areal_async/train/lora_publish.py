"""Adapter-only disk sync (train.lora): each version is published as its adapters alone, with the identity of the
merged weights the servers must then serve.

`root/v<k>` is a peft adapter directory (areal_async/weights/lora_adapter.py: `adapter_config.json`,
`adapter_model.safetensors`), written into `root/.tmp-v<k>` and renamed into place like a full checkpoint (readers
never see half of one); all but the newest `keep` versions are pruned. Only the adapters leave FSDP (an all-gather
of the A and B shards, some MB), never the frozen base. By broadcast (`prepare_broadcast`, then `take` for rank 0's
send) the same adapters go as one bucket of fp32 tensors under peft's names.

Identity (protocol/weight_identity.py): what a server serves after loading `v<k>` is its kept base W0 with every
adapted weight replaced by `merge_weight(W0, A, B, scale)`, bit for bit the same on every device. So rank 0 keeps,
from one gather of the base at the first publish of the process, the served bits of the adapted weights (the W0 it
merges from) and the digest and probe row of every other parameter (they never change); each version then costs
the merges of the adapted weights and their digests, on rank 0's host. A server that did not take the adapter
(still on the base, or on another version's merge) differs in every adapted weight.
"""

from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist
from torch import Tensor, nn

from areal_async.protocol.weight_identity import Identity, combine, probe_names
from areal_async.train.lora import adapter_tensors, lora_param_names
from areal_async.train.messages import DeltaBroadcastPlan, DeltaPublishResult
from areal_async.train.publish import _fsync_dir, _prune, iter_full_tensors, settle_publish, version_dir
from areal_async.types import WeightSpec
from areal_async.weights.digest import dtype_name, probe_row, served_dtype, tensor_digest
from areal_async.weights.lora_adapter import adapter_config, merge_weight, write_adapter

__all__ = ["AdapterPublisher"]


class AdapterPublisher:
    """One trainer rank's adapter publishing state; only rank 0 holds tensors."""

    def __init__(self) -> None:
        self.dtype: torch.dtype | None = None
        self.base: dict[str, Tensor] = {}  # rank 0: adapted weight name -> W0 in the served dtype (CPU)
        self.digests: dict[str, str] = {}  # rank 0: every other parameter's digest
        self.rows: dict[str, list[float]] = {}  # rank 0: every parameter's probe row (adapted ones per version)
        self.total = 0  # elements of the served model
        self._payloads: tuple[int, list[Tensor]] | None = None  # rank 0: the adapters prepared for a broadcast

    def _take_base(self, model: nn.Module, adapted: list[str], skip: set[str], dtype: torch.dtype) -> None:
        """The one gather of the base (collective)."""
        lora = set(lora_param_names(adapted))
        weights = {f"{m}.weight" for m in adapted}
        self.base, self.digests, self.rows, self.total = {}, {}, {}, 0
        for name, tensor in iter_full_tensors(model, skip=skip | lora, dtype=torch.float32, to_cpu=True):
            if tensor is None or not tensor.is_floating_point():
                continue
            bits = tensor.to(dtype)
            self.total += bits.numel()
            if name in weights:
                self.base[name] = bits.clone()
            else:
                self.digests[name] = tensor_digest(bits)
                self.rows[name] = probe_row(bits)
        self.dtype = dtype

    def publish(
        self,
        model: nn.Module,
        *,
        lora: dict[str, float],
        rank: int,
        alpha: float,
        dropout: float,
        source_dir: str,
        root: str,
        version: int,
        keep: int,
        served: str,
        skip: set[str],
        identity: bool = True,
    ) -> DeltaPublishResult:
        """Collective: write `root/v<version>` as the adapters of `model` (adapted module -> scale: `lora`) and
        return the identity of the merged weights as served in `served` (without `identity`: an empty one, and
        the base is never gathered; for servers that apply the adapters per request, such as SGLang)."""
        t0 = time.perf_counter()
        me = dist.get_rank() if dist.is_initialized() else 0
        dtype = served_dtype(served)
        adapted = sorted(lora)
        tensors = self._gather(model, adapted, skip, dtype, base=identity)
        total = self.total if identity else _served_elements(model, adapted, skip)
        error: BaseException | None = None
        num_bytes, spent = 0, 0.0
        ident = Identity(version=version, dtype=dtype_name(dtype), digests={}, combined="")
        if me == 0:
            try:
                t1 = time.perf_counter()
                if identity:
                    ident = self._identity(tensors, lora, version, dtype)
                spent = time.perf_counter() - t1
                config = adapter_config(
                    rank=rank,
                    alpha=alpha,
                    dropout=dropout,
                    target_modules=sorted({m.rsplit(".", 1)[-1] for m in adapted}),
                    base_model=os.path.abspath(source_dir),
                    version=version,
                )
                num_bytes = self._write(root, version, tensors, config)
                _prune(root, keep, version)
            except Exception as e:
                error = e
        settle_publish(
            error, me, os.path.join(root, f".tmp-v{version}"), f"the adapters of version {version} to {root}"
        )
        return DeltaPublishResult(
            path=os.path.abspath(version_dir(root, version)),
            seconds=time.perf_counter() - t0,
            num_bytes=num_bytes,
            kind="adapter",
            identity=ident,
            changed=sum(t.numel() for t in tensors.values()),
            total=total,
            full_bytes=total * dtype.itemsize,
            identity_s=spent,
        )

    def _gather(
        self, model: nn.Module, adapted: list[str], skip: set[str], dtype: torch.dtype, *, base: bool = True
    ) -> dict[str, Tensor]:
        """Collective: the adapters (peft key -> fp32 CPU tensor on rank 0; {} elsewhere), after the one gather of
        the base when the served dtype is new (with `base`: an identity is to be computed)."""
        if base and self.dtype != dtype:
            self._take_base(model, adapted, skip, dtype)
        names = set(lora_param_names(adapted))
        others = {n for n in model.state_dict() if n not in names}
        return adapter_tensors(iter_full_tensors(model, skip=others, dtype=torch.float32, to_cpu=True))

    def prepare_broadcast(
        self,
        model: nn.Module,
        *,
        lora: dict[str, float],
        rank: int,
        alpha: float,
        version: int,
        served: str,
        skip: set[str],
    ) -> DeltaBroadcastPlan:
        """Collective: gather the adapters of `version` for a broadcast (rank 0 keeps them for `take`) and return
        the plan: one bucket of fp32 tensors under peft's names, the identity of the merged weights."""
        t0 = time.perf_counter()
        me = dist.get_rank() if dist.is_initialized() else 0
        dtype = served_dtype(served)
        tensors = self._gather(model, sorted(lora), skip, dtype)
        spec = WeightSpec(names=[], dtypes=[], shapes=[])
        identity = None
        if me == 0:
            for key in sorted(tensors):
                spec.names.append(key)
                spec.dtypes.append("float32")
                spec.shapes.append(list(tensors[key].shape))
            identity = self._identity(tensors, lora, version, dtype)
            self._payloads = (version, [tensors[k] for k in spec.names])
        numel = sum(t.numel() for t in tensors.values())
        return DeltaBroadcastPlan(
            kind="adapter",
            version=version,
            spec=spec,
            identity=identity,
            num_bytes=numel * 4,
            full_bytes=self.total * dtype.itemsize,
            changed=numel,
            total=self.total,
            seconds=time.perf_counter() - t0,
            lora_rank=rank,
            lora_alpha=alpha,
        )

    def take(self, version: int) -> list[Tensor]:
        """Rank 0: the adapters prepared for `version`, in the plan's order (once); [] on other ranks."""
        if dist.is_initialized() and dist.get_rank() != 0:
            return []
        payloads = getattr(self, "_payloads", None)
        if payloads is None or payloads[0] != version:
            raise RuntimeError(f"no adapters of version {version} were prepared")
        self._payloads = None
        return payloads[1]

    def _identity(self, tensors: dict[str, Tensor], lora: dict[str, float], version: int, dtype: torch.dtype):
        """Rank 0: the identity of the base with every adapted weight merged (lora_adapter.merge_weight)."""
        from areal_async.weights.lora_adapter import peft_key

        digests = dict(self.digests)
        rows = dict(self.rows)
        for module, scale in lora.items():
            name = f"{module}.weight"
            merged = merge_weight(
                self.base[name], tensors[peft_key(module, "A")], tensors[peft_key(module, "B")], scale, dtype
            )
            digests[name] = tensor_digest(merged)
            rows[name] = probe_row(merged)
        probes = {n: rows[n] for n in probe_names(list(digests))}
        return Identity(
            version=version, dtype=dtype_name(dtype), digests=digests, combined=combine(digests), probes=probes
        )

    def _write(self, root: str, version: int, tensors: dict[str, Tensor], config: dict) -> int:
        tmp = os.path.join(root, f".tmp-v{version}")
        final = version_dir(root, version)
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        num_bytes = write_adapter(tmp, tensors, config)
        _fsync_dir(tmp)
        if os.path.exists(final):  # a version published again (after a resume): replace it
            old = os.path.join(root, f".old-v{version}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_dir(root)
        return num_bytes


def _served_elements(model: nn.Module, adapted: list[str], skip: set[str]) -> int:
    """Elements of the served model (every floating-point parameter and buffer but the adapters and `skip`), from
    the global shapes alone: what a publish without identity reports in place of the base gather's count."""
    lora = set(lora_param_names(adapted))
    return sum(
        t.numel() for n, t in model.state_dict().items() if n not in lora and n not in skip and t.is_floating_point()
    )
