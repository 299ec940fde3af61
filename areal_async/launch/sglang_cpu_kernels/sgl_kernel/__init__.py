"""A pure-torch stand-in for the CPU build of sgl-kernel, for serving real SGLang on a CPU without AMX.

SGLang's CPU path (`SGLANG_USE_CPU_ENGINE=1 ... --device cpu`) imports a handful of ops from the CPU build of
sgl-kernel, which no package index carries (the CUDA wheel on PyPI fails to import without libcuda). On a CPU
without AMX, SGLang's dense-model path calls exactly one of them on every prefill:
`assign_req_to_token_pool_cpu`, which writes the KV slots of each request's new tokens into its row of the
request-to-token table. That one is implemented here with torch indexing; every other name imports (SGLang imports
some at module load) and raises NotImplementedError if called, naming itself.

The launcher (launch/processes.py) puts the folder above this package first on SGLang's PYTHONPATH when it starts
SGLang on the CPU. It runs inside SGLang's own interpreter only: nothing in areal_async imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,  # [B] the requests' rows of req_to_token
    req_to_token: torch.Tensor,  # [rows, max_context] KV slot of each request's token positions
    start_offset: torch.Tensor,  # [B] first position written for each request
    end_offset: torch.Tensor,  # [B] one past the last position written
    out_cache_loc: torch.Tensor,  # [sum(end - start)] the new slots, request after request
    row_len: int,  # req_to_token.shape[1]
) -> None:
    """req_to_token[row_b, start_b:end_b] = the b-th run of out_cache_loc, for every request b."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n <= 0:
            continue
        if end > row_len:
            raise ValueError(f"positions {start}..{end} exceed the table's {row_len} columns")
        req_to_token[row, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


class _Missing:
    """A name the stand-in does not implement. Some releases touch such names at import (0.5.10 reads
    `scalar_types.uint4b8` from a quantization table at module load): attribute access gives further stand-ins,
    and only a call raises, naming the op."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, name: str) -> _Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{self._qualname}: not in areal_async's CPU stand-in of sgl_kernel (only assign_req_to_token_pool_cpu "
            "is); this SGLang code path needs the real CPU build of sgl-kernel"
        )


def _stand_in(module: str, name: str) -> _Missing:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"{module}.{name}")


def __getattr__(name: str) -> Any:
    return _stand_in(__name__, name)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Releases before 0.5.11 import submodules (sgl_kernel.kvcacheio, .flash_attn, ...) at module load whatever the
    device: each is found here as a module whose every name is a `_Missing`."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # type: ignore[attr-defined]
        module.__getattr__ = lambda name: _stand_in(spec.name, name)  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.append(_Submodules())
