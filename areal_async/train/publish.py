"""Publishing the trained policy as a Hugging Face checkpoint directory that servers load (`update_weights_from_disk`).

The directory is what `save_pretrained` would have written for the base model: the base model's own config,
generation config and tokenizer files (copied byte for byte, so chat templates and special tokens cannot drift),
plus the current weights as safetensors in the checkpoint's own dtype, sharded with an index past
`max_shard_bytes`. Tied aliases (a tied lm_head) are written once, as transformers does.

Weights leave FSDP one parameter at a time (`full_tensor()` is an all-gather every rank joins), and rank 0 writes
them out shard by shard, so neither GPU nor host ever holds more than one shard beyond the sharded model.

Readers never see a partial directory: everything is written into `root/.tmp-v<k>`, fsynced, and renamed to
`root/v<k>` in one step; then all but the newest `keep` versions are removed. Files get the modes the umask
allows (safetensors alone would write them 0600).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from areal_async.cache import follow_umask
from areal_async.train.dist import any_rank
from areal_async.train.errors import PeerPublishError, PublishError
from areal_async.types import PublishResult

__all__ = ["publish_hf", "iter_full_tensors", "version_dir", "list_versions", "DEFAULT_MAX_SHARD_BYTES"]

DEFAULT_MAX_SHARD_BYTES = 5 << 30  # transformers' default shard size
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_VERSION_RE = re.compile(r"^v(\d+)$")


def version_dir(root: str, version: int) -> str:
    return os.path.join(root, f"v{version}")


def list_versions(root: str) -> list[int]:
    """Published versions under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    found = (_VERSION_RE.match(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def iter_full_tensors(
    model: nn.Module, *, skip: set[str], dtype: torch.dtype, to_cpu: bool
) -> Iterator[tuple[str, Tensor | None]]:
    """(name, full tensor) for each state-dict entry of an FSDP2 model, in state-dict order, floating-point ones
    cast to `dtype` (integer buffers keep theirs).

    Collective: every rank must drain the iterator (each sharded entry is an all-gather). Only rank 0 receives
    tensors; the other ranks get (name, None)."""
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, value in model.state_dict().items():
        if name in skip:
            continue
        if isinstance(value, DTensor):
            # cast the local shard first: the all-gather then moves `dtype` (bf16: half the bytes of fp32 masters)
            if value.is_floating_point() and value.dtype != dtype:
                value = value.to(dtype)
            full = value.full_tensor()
        else:
            full = value
        if rank != 0:
            del full
            yield name, None
            continue
        full = full.detach()
        if full.is_floating_point():
            full = full.to(dtype)
        yield name, (full.cpu() if to_cpu else full).contiguous()


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems refuse directory fsync; the rename is still atomic
        pass


class _ShardWriter:
    """Rank 0's side: collects tensors into safetensors files of at most `max_shard_bytes`."""

    def __init__(self, directory: str, max_shard_bytes: int) -> None:
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self.num_bytes = 0

    def add(self, name: str, tensor: Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.num_bytes += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        fname = f"part-{len(self.files):05d}.safetensors"
        path = os.path.join(self.directory, fname)
        save_file(self.pending, path, metadata={"format": "pt"})
        follow_umask(path)  # safetensors writes 0600; readers on a shared filesystem get what the umask allows
        _fsync_file(path)
        self.files.append((fname, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Give the shards their transformers names and write the index when there is more than one."""
        import json

        self.flush()
        if len(self.files) == 1:
            os.rename(os.path.join(self.directory, self.files[0][0]), os.path.join(self.directory, "model.safetensors"))
            return
        n = len(self.files)
        weight_map = {}
        for i, (tmp_name, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(self.directory, tmp_name), os.path.join(self.directory, final))
            weight_map.update({name: final for name in names})
        index = os.path.join(self.directory, "model.safetensors.index.json")
        with open(index, "w") as f:
            json.dump({"metadata": {"total_size": self.num_bytes}, "weight_map": weight_map}, f, indent=2)
        _fsync_file(index)


def _copy_model_files(source_dir: str, dest: str) -> None:
    """Everything of the base model's directory except its weights: config, generation config, tokenizer, chat
    template, custom code."""
    for name in sorted(os.listdir(source_dir)):
        src = os.path.join(source_dir, name)
        if os.path.isdir(src) and name == "additional_chat_templates":  # named templates (transformers 5 layout)
            shutil.copytree(src, os.path.join(dest, name), dirs_exist_ok=True)
            continue
        if not os.path.isfile(src) or name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            continue
        shutil.copyfile(src, os.path.join(dest, name))
        _fsync_file(os.path.join(dest, name))


def _prune(root: str, keep: int, newest: int) -> None:
    for v in list_versions(root)[: -max(keep, 1)]:
        if v != newest:
            shutil.rmtree(version_dir(root, v), ignore_errors=True)
    for name in os.listdir(root):  # leftovers of a publish that died half way
        if name.startswith((".tmp-v", ".old-v")) and name != f".tmp-v{newest}":
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def settle_publish(error: BaseException | None, rank: int, tmp: str, what: str) -> None:
    """Every rank learns whether rank 0's write of `what` failed (a collective, so also the barrier after its
    rename): rank 0 removes its temporary directory `tmp` and raises its error, the others `PeerPublishError`.
    Full, delta and adapter publishing all end this way."""
    failed = any_rank(error is not None)
    if rank == 0 and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PublishError(f"publishing {what} failed: {type(error).__name__}: {error}") from error
    if failed:
        raise PeerPublishError(f"publishing {what} failed on trainer rank 0 (see its error)")


def publish_hf(
    model: nn.Module,
    *,
    source_dir: str,
    root: str,
    version: int,
    keep: int = 2,
    dtype: torch.dtype = torch.float32,
    skip: set[str] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    observe: Callable[[str, Tensor], None] | None = None,
    tensors: Iterator[tuple[str, Tensor | None]] | None = None,
) -> PublishResult:
    """Write `root/v<version>` atomically (collective; rank 0 writes) and keep only the newest `keep` versions.

    An error on rank 0 (disk full, permissions) is raised on every rank (`PublishError` there, `PeerPublishError`
    on the others), after every rank has finished its part of the gathers, so no rank is left waiting in a
    collective.

    `observe(name, tensor)` sees every tensor rank 0 writes, as it is written (the delta publisher keeps the served
    bits of a full snapshot this way, without a second gather); an error it raises fails the publish.

    `tensors`: the stream to write instead of `iter_full_tensors(model)` (train.lora: the base weights with the
    adapters merged in, train/lora.py's `merged_tensors`); every rank must pass one."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    t0 = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = version_dir(root, version)
    tmp = os.path.join(root, f".tmp-v{version}")
    error: BaseException | None = None
    writer = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            writer = _ShardWriter(tmp, max_shard_bytes)
        except OSError as e:
            error = e
    if tensors is None:
        tensors = iter_full_tensors(model, skip=skip or set(), dtype=dtype, to_cpu=True)
    for name, tensor in tensors:
        if writer is not None and error is None and tensor is not None:
            try:
                writer.add(name, tensor)
                if observe is not None:
                    observe(name, tensor)
            except Exception as e:  # keep gathering with the others; report at the end
                error = e
    if rank == 0 and error is None:
        try:
            writer.finish()
            _copy_model_files(source_dir, tmp)
            _fsync_dir(tmp)
            if os.path.exists(final):  # a version published again (after a resume): replace it
                old = os.path.join(root, f".old-v{version}")
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(tmp, final)
            _fsync_dir(root)
            _prune(root, keep, version)
        except Exception as e:
            error = e
    num_bytes = writer.num_bytes if writer is not None else 0
    settle_publish(error, rank, tmp, f"version {version} to {root}")
    return PublishResult(path=os.path.abspath(final), seconds=time.perf_counter() - t0, num_bytes=num_bytes)
