"""Publishing a version as a full snapshot or as a delta of its served-dtype bits, with its identity either way.

Trainer rank 0 keeps the bits of the last version it published, in the dtype the servers serve (one copy of the
model in that dtype, in host memory). The next version, if it follows that one directly, is published as a delta
(areal_async/weights/delta.py): only the elements whose served bits changed. A full snapshot (the ordinary HF
checkpoint of publish.py) is written instead

- every `full_every` versions (so a chain never grows past it),
- for the first publish of a process, after a checkpoint load (a resume or a rollback: the held bits are of
  another lineage), after an ordinary `publish` (it may have pruned the chain's snapshot), and for a version that
  does not follow the last one,
- when asked (`force_full`: a delta was refused somewhere, and the run falls back to a full load),
- always, without `train.delta_sync`.

Each version's directory is `root/v<k>` either way, so a server that is further behind than one delta still loads
that one path: it resolves the chain (snapshot, then each delta) itself, and it checks every step against the
identities in the manifests. All but the current chain (and the newest `keep` versions) are pruned.

Every publish also returns the identity of what it published as served (protocol/weight_identity.py): the
controller checks each server against it after the load.
"""

from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist
from torch import nn

from areal_async.train.errors import PublishError
from areal_async.train.messages import DeltaPublishResult
from areal_async.train.publish import (
    _fsync_dir,
    iter_full_tensors,
    list_versions,
    publish_hf,
    settle_publish,
    version_dir,
)
from areal_async.weights.delta import FORMAT, Manifest, diff_tensor, write_delta
from areal_async.weights.digest import IdentityBuilder, served_dtype

__all__ = ["DeltaPublisher"]


class DeltaPublisher:
    """One trainer rank's delta state. Every rank keeps the version counters (so all ranks take the same path
    through the collectives); only rank 0 holds bits."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the lineage: the next publish is a full snapshot."""
        self.version: int | None = None  # the last version published
        self.snapshot: int | None = None  # the full snapshot its chain starts from
        self.chain: list[int] = []  # delta versions after the snapshot
        self.combined = ""  # identity of the last version
        self.dtype: torch.dtype | None = None
        self.held: dict[str, torch.Tensor] = {}  # rank 0: name -> served bits of `version` (CPU)

    def _full_due(self, version: int, dtype: torch.dtype, delta: bool, full_every: int, force_full: bool) -> bool:
        return (
            not delta
            or force_full
            or self.version is None
            or self.snapshot is None
            or version != self.version + 1
            or dtype != self.dtype
            or version - self.snapshot >= full_every
        )

    def publish(
        self,
        model: nn.Module,
        *,
        source_dir: str,
        root: str,
        version: int,
        keep: int,
        checkpoint_dtype: torch.dtype,
        served: str,
        skip: set[str],
        delta: bool,
        full_every: int,
        force_full: bool = False,
    ) -> DeltaPublishResult:
        """Collective: publish `root/v<version>` (see the module docstring) and return what it holds."""
        dtype = served_dtype(served)
        t0 = time.perf_counter()
        if self._full_due(version, dtype, delta, full_every, force_full):
            return self._full(model, source_dir, root, version, keep, checkpoint_dtype, dtype, skip, t0)
        return self._delta(model, root, version, keep, checkpoint_dtype, dtype, skip, t0)

    def _full(
        self,
        model: nn.Module,
        source_dir: str,
        root: str,
        version: int,
        keep: int,
        checkpoint_dtype: torch.dtype,
        dtype: torch.dtype,
        skip: set[str],
        t0: float,
    ) -> DeltaPublishResult:
        rank = dist.get_rank() if dist.is_initialized() else 0
        builder = IdentityBuilder(dtype, version)
        held: dict[str, torch.Tensor] = {}
        spent = [0.0]

        def observe(name: str, tensor: torch.Tensor) -> None:
            t1 = time.perf_counter()
            bits = tensor.to(dtype, copy=True)  # a copy: the gathered tensor may be the parameter itself
            builder.add(name, bits)
            held[name] = bits
            spent[0] += time.perf_counter() - t1

        self.reset()  # a failure part-way leaves no lineage to extend
        pub = publish_hf(
            model,
            source_dir=source_dir,
            root=root,
            version=version,
            keep=keep,
            dtype=checkpoint_dtype,
            skip=skip,
            observe=observe if rank == 0 else None,
        )
        identity = builder.finish()
        total = sum(t.numel() for t in held.values())
        self.version, self.snapshot, self.chain, self.dtype = version, version, [], dtype
        self.combined, self.held = identity.combined, held
        return DeltaPublishResult(
            path=pub.path,
            seconds=time.perf_counter() - t0,
            num_bytes=pub.num_bytes,
            kind="full",
            identity=identity,
            total=total,
            full_bytes=total * dtype.itemsize,
            identity_s=spent[0],
        )

    def _delta(
        self,
        model: nn.Module,
        root: str,
        version: int,
        keep: int,
        checkpoint_dtype: torch.dtype,
        dtype: torch.dtype,
        skip: set[str],
        t0: float,
    ) -> DeltaPublishResult:
        assert self.version is not None and self.snapshot is not None
        rank = dist.get_rank() if dist.is_initialized() else 0
        builder = IdentityBuilder(dtype, version)
        new_held: dict[str, torch.Tensor] = {}
        parts: dict[str, torch.Tensor] = {}
        changed = total = 0
        spent = 0.0
        error: BaseException | None = None
        for name, tensor in iter_full_tensors(model, skip=skip, dtype=checkpoint_dtype, to_cpu=True):
            if rank != 0 or tensor is None or error is not None:
                continue  # still in every gather after a failure
            try:
                # [same shape] the served values; a copy, since with one rank (or fp32 serving) the gathered tensor
                # may share the parameter's memory, which the next train step changes in place
                bits = tensor.to(dtype, copy=True)
                t1 = time.perf_counter()
                builder.add(name, bits)
                spent += time.perf_counter() - t1
                old = self.held.get(name)
                if old is None:
                    raise PublishError(f"{name} was not in the previous version's weights")
                diff = diff_tensor(old, bits)
                if diff is not None:
                    parts[name], n = diff
                    changed += n
                total += bits.numel()
                new_held[name] = bits
            except Exception as e:  # keep gathering with the others; report at the end
                error = e
        path = version_dir(root, version)
        identity = builder.finish()
        num_bytes = 0
        if rank == 0 and error is None:
            try:
                num_bytes = self._write(root, version, parts, identity.combined, dtype, changed, total)
                self._prune(root, keep, version)
            except Exception as e:
                error = e
        settle_publish(error, rank, os.path.join(root, f".tmp-v{version}"), f"the delta of version {version} to {root}")
        base = self.version
        self.chain = [*self.chain, version]
        self.version, self.combined = version, identity.combined
        if rank == 0:
            self.held = new_held
        return DeltaPublishResult(
            path=os.path.abspath(path),
            seconds=time.perf_counter() - t0,
            num_bytes=num_bytes,
            kind="delta",
            identity=identity,
            changed=changed,
            total=total,
            full_bytes=total * dtype.itemsize,
            base_version=base,
            identity_s=spent,
        )

    def _write(
        self,
        root: str,
        version: int,
        parts: dict[str, torch.Tensor],
        combined: str,
        dtype: torch.dtype,
        changed: int,
        total: int,
    ) -> int:
        """Rank 0: the delta directory, written aside and renamed into place (readers never see half of one)."""
        assert self.version is not None and self.snapshot is not None
        tmp = os.path.join(root, f".tmp-v{version}")
        final = version_dir(root, version)
        shutil.rmtree(tmp, ignore_errors=True)
        manifest = Manifest(
            format=FORMAT,
            version=version,
            base_version=self.version,
            dtype=str(dtype).removeprefix("torch."),
            base_combined=self.combined,
            combined=combined,
            snapshot=self.snapshot,
            chain=[*self.chain, version],
            sha256="",
            num_bytes=0,
            changed=changed,
            total=total,
        )
        num_bytes = write_delta(tmp, parts, manifest)
        for name in os.listdir(tmp):
            fd = os.open(os.path.join(tmp, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if os.path.exists(final):  # a version published again: replace it
            old = os.path.join(root, f".old-v{version}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_dir(root)
        return num_bytes

    def _prune(self, root: str, keep: int, newest: int) -> None:
        """Keep the current chain (its snapshot and every delta after it) and the newest `keep` versions."""
        assert self.snapshot is not None
        versions = list_versions(root)
        recent = set(versions[-max(keep, 1) :])
        for v in versions:
            if v < self.snapshot and v not in recent and v != newest:
                shutil.rmtree(version_dir(root, v), ignore_errors=True)
