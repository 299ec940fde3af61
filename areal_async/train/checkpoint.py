"""Resumable trainer checkpoints: torch.distributed.checkpoint (DCP) for the sharded model and optimizer, JSON for
the rest.

Layout of a checkpoint directory:

    .metadata, __*_*.distcp     DCP: model and AdamW state, each rank writing its own shards (resharding on load
                                to another world size is DCP's job)
    trainer_state.json          version, LR-scheduler state, world size, base model path (rank 0)
    rng_rank<r>.json            each rank's torch RNG state (a resumed run draws the same numbers)

The directory appears atomically: DCP writes into `<path>.tmp`, and rank 0 renames it once every rank is done, so
a crash mid-save leaves the previous checkpoint intact. Its files get the modes the umask allows, whatever the
writer's own (cache.follow_umask). On a multi-node job `path` must be on a filesystem every
rank sees. Our own state is JSON rather than pickle; DCP itself keeps its metadata in its own (pickled) format, so
load only checkpoints you wrote.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from areal_async.cache import follow_umask
from areal_async.train.dist import agree
from areal_async.train.errors import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "read_trainer_state", "CheckpointError", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_STATE_FILE = "trainer_state.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    trainer_state: dict[str, Any],
    rng_state: dict[str, bytes],
) -> None:
    """Collective. `trainer_state` must be JSON-serialisable; `rng_state` is this rank's {name: raw bytes}."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = os.path.abspath(path)
    tmp = path + ".tmp"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    _write_json(
        os.path.join(tmp, f"rng_rank{rank}.json"),
        {k: base64.b64encode(v).decode("ascii") for k, v in rng_state.items()},
    )
    if rank == 0:
        _write_json(os.path.join(tmp, _STATE_FILE), {"format": FORMAT_VERSION, **trainer_state})
    _barrier()
    if rank == 0:
        follow_umask(tmp)  # every rank's files, whatever wrote them: readable as the umask allows
        old = path + ".old"
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def read_trainer_state(path: str) -> dict[str, Any]:
    """The JSON part of a checkpoint; raises CheckpointError when `path` is not one of ours."""
    state_file = os.path.join(path, _STATE_FILE)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory not found: {path}")
    if not os.path.exists(state_file) or not os.path.exists(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path} is not a trainer checkpoint (no {_STATE_FILE} or DCP .metadata)")
    try:
        with open(state_file) as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {state_file}: {e}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{state_file}: unsupported checkpoint format {state.get('format')!r}")
    for key in ("version", "scheduler"):
        if key not in state:
            raise CheckpointError(f"{state_file}: missing {key!r}")
    return state


def load_checkpoint(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, bytes] | None]:
    """Collective. Restores model and optimizer in place; returns (trainer_state, this rank's RNG state or None
    when the checkpoint was written by a smaller world)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = os.path.abspath(path)
    error = None
    state: dict[str, Any] = {}
    try:
        state = read_trainer_state(path)
    except CheckpointError as e:
        error = e
    agree(error, CheckpointError, f"{path} could not be read")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    target = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(target, checkpoint_id=path)
    except Exception as e:  # DCP names missing keys / shape mismatches; say which checkpoint
        raise CheckpointError(f"{path} does not match this model/optimizer: {type(e).__name__}: {e}") from e
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
    rng = None
    rng_file = os.path.join(path, f"rng_rank{_rank()}.json")
    if os.path.exists(rng_file):
        with open(rng_file) as f:
            rng = {k: base64.b64decode(v) for k, v in json.load(f).items()}
    return state, rng
