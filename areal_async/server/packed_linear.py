"""Products of many rows on CPU through oneDNN, with each weight reordered once into oneDNN's blocked layout.

Why: torch's `F.linear` on CPU hands fp32 to MKL's sgemm, which packs the weight again on every call; at the
engine's decode sizes (25-128 rows) that runs at 53-78 GFLOP/s a thread on SmolLM2-135M's shapes, where oneDNN's
linear on a weight reordered once runs at 83-106 (1.4-1.6x; 1.1x at 512 rows), AMD EPYC Zen 4 with AVX-512, one
thread, CPU time. The same holds for bf16 weights, where oneDNN is torch's own path but reorders per call. The
reordered copy is an opaque oneDNN tensor the size of the weight, so packing stops at a memory budget (the
remaining weights keep torch's path), and it is redone when the weight changes: `Tensor._version` moves on every
in-place write, which is how weight loads, updates, deltas and LoRA merges reach the model.

Results differ from torch's product only in the order of the sums (fp32), or not at all in what is rounded (bf16:
the same bf16 operands, fp32 accumulation, a bf16 result). `AREAL_CPU_PACKED_LINEAR=0` turns it off.
"""

from __future__ import annotations

import os

import torch

PACK_ROWS = 64  # the batch size oneDNN is told to expect when reordering: a decode step of many requests
MIN_ROWS = 4  # below this the few-row kernels (or MKL's matrix-vector path) are the better code
_DEFAULT_BUDGET = 2 << 30  # bytes of packed copies at most, and at most a tenth of the machine's memory


def _memory_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def available() -> bool:
    """Whether this torch build has oneDNN's linear ops and they are not turned off."""
    if os.environ.get("AREAL_CPU_PACKED_LINEAR", "1") == "0":
        return False
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available()) and ops is not None and hasattr(ops, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


class PackedLinear:
    """Reordered copies of one model's weights, made on first use and remade after the weight changes."""

    def __init__(self, budget_bytes: int | None = None):
        total = _memory_total()
        self.budget = budget_bytes if budget_bytes is not None else min(_DEFAULT_BUDGET, total // 10 or _DEFAULT_BUDGET)
        self.used = 0  # bytes of weights packed
        self.refused: set[torch.dtype] = set()  # dtypes this CPU's oneDNN cannot reorder
        self._packs: dict[tuple[int, tuple[int, ...], torch.dtype], tuple[int, torch.Tensor]] = {}

    def packed(self, w: torch.Tensor) -> torch.Tensor | None:
        """w [N, K]'s reordered copy, current with w's contents, or None where the budget is spent."""
        key = (w.data_ptr(), tuple(w.shape), w.dtype)
        hit = self._packs.get(key)
        if hit is not None and hit[0] == w._version:
            return hit[1]
        if w.dtype in self.refused:
            return None
        nbytes = w.numel() * w.element_size()
        if hit is None and self.used + nbytes > self.budget:
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)
        except RuntimeError:  # oneDNN's bf16 linear needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: torch's path then
            self.refused.add(w.dtype)
            return None
        if hit is None:
            self.used += nbytes
        self._packs[key] = (w._version, packed)
        return packed

    def applies(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Rows enough to pay, a contiguous 2-D weight on CPU in fp32 or bf16."""
        return (
            x.shape[0] >= MIN_ROWS
            and x.dim() == 2
            and w.dim() == 2
            and w.device.type == "cpu"
            and w.dtype in (torch.float32, torch.bfloat16)
            and w.is_contiguous()
        )


def linear(p: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T (+ b) -> [M, N] in x's dtype, W reordered into `p`; x in W's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), p, b, "none", [], "")


def linear_add(p: torch.Tensor, other: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """other [M, N] + x [M, K] @ W.T (+ b): a new tensor, the add fused into the product."""
    return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), other, p, b, "add")
