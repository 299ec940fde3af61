"""Where the embedded server runs: the torch device a `--device` string names, and the dtype `--dtype` names on it.

The server's rule, not the trainer's: "auto" is the process's current CUDA device (a server launched with one GPU
in CUDA_VISIBLE_DEVICES sees it as its current one) and a CUDA device this process cannot see is refused up front.
A trainer rank picks its device by LOCAL_RANK instead (train/dist.py's `rank_device`).

`--dtype auto` follows the machine with the trainer's own rule (host/cpu_features.py's `resolve_mixed_precision`,
the one `train.mixed_precision=auto` uses): bf16 on CUDA; on a CPU, bf16 weights and KV cache where it has a bf16
dot product (AVX512-BF16 or AMX, not held below it by ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY) and the model is
big enough for its matmuls to matter (hidden size >= 512), else fp32. One rule on both sides, so a run's server and
trainer agree on bf16 wherever the trainer's auto picks it. The server reports what it serves in /get_server_info
(`dtype`), which is what the trainer's weight identity is computed in (rollout/weight_sync.py asks it).
"""

from __future__ import annotations

import logging
import os

import torch

from areal_async.host.cpu_features import describe, model_hidden_size, resolve_mixed_precision
from areal_async.server.weights import DTYPES

log = logging.getLogger(__name__)

__all__ = ["resolve_visible_device", "resolve_dtype"]


def resolve_visible_device(device: str) -> torch.device:
    """ "auto" is the current CUDA device with its index (a process group and `set_device` need one), else CPU.
    A CUDA device that is not there is a ValueError naming it, not a CUDA error at the first allocation."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {device!r}: no CUDA device is visible to this process")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= count:
            raise ValueError(
                f"device {device!r}: this process sees {count} CUDA device(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
            )
    return dev


def resolve_dtype(dtype: str, device: torch.device, model_dir: str | None = None) -> torch.dtype:
    """The served dtype that `dtype` names on `device`; "auto" decides by the machine and the model in `model_dir`
    (its config.json's hidden size; None: unknown) and logs what it chose and why."""
    if dtype == "auto":
        hidden = model_hidden_size(model_dir) if model_dir else None
        choice, why = resolve_mixed_precision("auto", device.type, hidden)
        picked = torch.bfloat16 if choice == "bf16" else torch.float32
        where = describe() if device.type == "cpu" else str(device)
        log.info("--dtype auto on %s: %s (%s)", where, str(picked).removeprefix("torch."), why)
        return picked
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]
