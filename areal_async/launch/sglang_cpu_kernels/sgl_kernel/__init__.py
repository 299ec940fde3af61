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


def _missing(qualname: str) -> Any:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{qualname}: not in areal_async's CPU stand-in of sgl_kernel (only assign_req_to_token_pool_cpu is); "
            "this SGLang code path needs the real CPU build of sgl-kernel"
        )

    missing.__name__ = qualname.rsplit(".", 1)[-1]
    return missing


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(f"sgl_kernel.{name}")
