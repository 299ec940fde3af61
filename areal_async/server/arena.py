"""The CPU engine's big tensors (its weights, its KV cache) in buffers backed by huge pages.

Why: a decode step of few rows is bound by streaming the weights from DRAM once per step, and with the default
4 KiB pages that stream pays a TLB miss every 4 KiB; attention reads KV pages scattered over gigabytes. One
zero-filled buffer, 2 MiB-aligned and advised for transparent huge pages before it is first touched, is faulted in
2 MiB at a time (host/memory.py), and weight updates copy into the same memory, so the pages stay huge for the
server's life. A batch-1 decode step of SmolLM2-135M took 14.7 instead of 20.6 ms in bf16 and 21.4 instead of
29.2 ms in fp32 with its weights there (1 thread, CPU time, AMD EPYC with AVX512-BF16). Every tensor starts on a
64-byte boundary (a cache line, what the kernels' vector loads like). On other devices each tensor is allocated
alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from areal_async.host.memory import HUGE_PAGE, advise_huge_pages

_ALIGN = 64  # bytes


def zeros(shapes: Sequence[tuple[int, ...]], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Zero-filled tensors of `shapes` in `dtype` on `device`; on CPU views into one huge-page buffer (so they share
    its storage: resize or `set_` them never), elsewhere separate allocations."""
    if device.type != "cpu":
        return [torch.zeros(s, device=device, dtype=dtype) for s in shapes]
    item = torch.empty((), dtype=dtype).element_size()
    offsets, total = [], 0
    for s in shapes:
        offsets.append(total)
        total += -(-math.prod(s) * item // _ALIGN) * _ALIGN
    raw = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)  # not yet touched: malloc'd, not written
    skip = -raw.data_ptr() % HUGE_PAGE
    flat = raw[skip : skip + total]  # [total] bytes, 2 MiB-aligned
    advise_huge_pages(flat.data_ptr(), total, collapse=True)  # collapse: pages a reused heap block already had
    flat.zero_()
    return [flat[o : o + math.prod(s) * item].view(dtype).view(s) for o, s in zip(offsets, shapes, strict=True)]
