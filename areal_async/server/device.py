"""Where the embedded server runs: the torch device a `--device` string names, and the dtype `--dtype` names on it.

The server's rule, not the trainer's: "auto" is the process's current CUDA device (a server launched with one GPU
in CUDA_VISIBLE_DEVICES sees it as its current one) and a CUDA device this process cannot see is refused up front.
A trainer rank picks its device by LOCAL_RANK instead (train/dist.py's `rank_device`).
"""

from __future__ import annotations

import os

import torch

from areal_async.server.weights import DTYPES

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


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]
