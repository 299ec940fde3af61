"""The trainer's side of delta sync over broadcast: the XOR of the served bits, prepared, then sent as payloads.

A broadcast announces every tensor's shape before it is sent (the servers allocate from the announcement), and a
delta's size is known only once the new version is gathered and diffed. So a delta broadcast is two calls:
`prepare` (collective: gather every parameter, cast to the served dtype, XOR against the version prepared before,
deflate, as weights/delta.py does for disk; rank 0 keeps the payloads) returns the plan, one uint8 payload per
changed parameter; the controller announces it to the servers (one bucket: a delta is small) while `send`
broadcasts the payloads from rank 0, no gather. Each server checks the base (its identity must be the plan's
`base_combined`) and the result (its digests after the XOR must be the trainer's) before it swaps anything in;
one that refuses leaves rotation and catches up with a full load, as after a failed bucket.

There is no base to diff against for the first prepare of a process, after a checkpoint load, after a version
that does not follow the last, or in another dtype: the plan is "full" (the controller broadcasts the full weights)
and the bits are kept for the next version. Rank 0 holds one copy of the model in the served dtype.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from areal_async.train.messages import DeltaBroadcastPlan
from areal_async.train.publish import iter_full_tensors
from areal_async.types import WeightSpec
from areal_async.weights.delta import diff_tensor
from areal_async.weights.digest import IdentityBuilder, served_dtype

__all__ = ["DeltaSender"]


class DeltaSender:
    """One trainer rank's delta-broadcast state (version counters on every rank, bits and payloads on rank 0)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the lineage (a checkpoint load, a failed update): the next prepare is "full"."""
        self.version: int | None = None
        self.dtype: torch.dtype | None = None
        self.combined = ""
        self.held: dict[str, torch.Tensor] = {}
        self.payloads: tuple[int, list[torch.Tensor]] | None = None  # (version, tensors in send order), rank 0

    def prepare(
        self, model: nn.Module, *, version: int, served: str, skip: set[str], checkpoint_dtype: torch.dtype
    ) -> DeltaBroadcastPlan:
        """Collective (every rank drains the gather). See the module docstring."""
        t0 = time.perf_counter()
        dtype = served_dtype(served)
        rank = dist.get_rank() if dist.is_initialized() else 0
        delta = self.version is not None and version == self.version + 1 and dtype == self.dtype
        builder = IdentityBuilder(dtype, version)
        held: dict[str, torch.Tensor] = {}
        spec = WeightSpec(names=[], dtypes=[], shapes=[])
        payloads: list[torch.Tensor] = []
        changed = total = 0
        for name, tensor in iter_full_tensors(model, skip=skip, dtype=checkpoint_dtype, to_cpu=True):
            if rank != 0 or tensor is None:
                continue
            bits = tensor.to(dtype, copy=True)  # [same shape] served values; a copy (it may share the parameter)
            builder.add(name, bits)
            held[name] = bits
            total += bits.numel()
            if delta:
                diff = diff_tensor(self.held[name], bits)
                if diff is not None:
                    packed, n = diff
                    changed += n
                    payloads.append(packed)
                    spec.names.append(name)
                    spec.dtypes.append("uint8")
                    spec.shapes.append([packed.numel()])
        base = self.combined
        identity = builder.finish()
        self.version, self.dtype, self.combined, self.held = version, dtype, identity.combined, held
        self.payloads = (version, payloads) if delta and rank == 0 else None
        return DeltaBroadcastPlan(
            kind="delta" if delta else "full",
            version=version,
            spec=spec,
            base_combined=base if delta else "",
            identity=identity,
            num_bytes=sum(p.numel() for p in payloads),
            full_bytes=total * dtype.itemsize,
            changed=changed,
            total=total,
            seconds=time.perf_counter() - t0,
        )

    def take(self, version: int) -> list[torch.Tensor]:
        """Rank 0: the payloads prepared for `version` (once); [] on other ranks. Raises when none were."""
        if not (dist.is_initialized() and dist.get_rank() != 0):
            if self.payloads is None or self.payloads[0] != version:
                raise RuntimeError(f"no delta of version {version} was prepared")
            payloads, self.payloads = self.payloads[1], None
            return payloads
        return []
