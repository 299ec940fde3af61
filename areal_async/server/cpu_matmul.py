"""Which code takes each matmul of the engine's model: C kernels on CPU where they win, torch elsewhere.

On CPU the model keeps its activations in fp32 whatever its weights' dtype (bf16 serving stores weights and KV in
bf16, computes in fp32 between the matmuls), so every product here takes fp32 rows and returns fp32:
- packed weights (kernels/gemm_packed.py), fp32 or bf16, for every row count up to the kernel's limit (decode steps
  and short prefills): each weight matrix is packed into 32-column panels once per weight version
  (`Tensor._version` moves on every in-place write, and every weight update copies into the model's tensors, so
  the next product repacks what changed; `load_tensors` packs eagerly). Above the limit: torch's product (MKL for
  fp32; oneDNN for bf16, the rows rounded to bf16 on the way in, as a bf16 trainer's matmuls take them);
- with packing off (`AREAL_CPU_GEMM_PACKED=0`, which halves the weights' memory): kernels/gemm.py and
  kernels/gemm_bf16.py on the natural layout for few rows, torch above;
- the LM head with bf16 weights and more rows than the packed kernel takes: fp32 logits from bf16 operands (the
  trainer's head kernel, server/kernels/head.py, on AVX512-BF16 CPUs; it reads the same panels), since oneDNN's
  result would be bf16: ~0.06 of rounding on logits of magnitude 10-20, all of it in the logprobs.
On CUDA the weights and activations share one dtype and every product is torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areal_async.server.kernels import gemm as cpu_gemm
from areal_async.server.kernels import gemm_bf16 as cpu_gemm_bf16
from areal_async.server.kernels import gemm_packed as cpu_gemm_packed

__all__ = ["Matmuls"]


def _head_kernel():
    """server/kernels/head.py's product (the same arithmetic as the trainer's head), or None where not built."""
    from areal_async.server.kernels import head as head_kernel

    k = head_kernel.load()
    return k if k is not None and k.forward_fn is not None else None


class Matmuls:
    """The products of one model on one device, each routed to the code that is fastest for its rows and dtype."""

    def __init__(self, device: torch.device, weight_dtype: torch.dtype):
        cpu = device.type == "cpu" and weight_dtype in (torch.float32, torch.bfloat16)
        self.packed = cpu_gemm_packed.load() if cpu else None
        unpacked = cpu and self.packed is None
        self.gemm = cpu_gemm.load() if unpacked and weight_dtype == torch.float32 else None
        self.gemm_bf16 = cpu_gemm_bf16.load() if unpacked and weight_dtype == torch.bfloat16 else None
        self.head_kernel = _head_kernel() if cpu and weight_dtype == torch.bfloat16 else None
        self._packs: dict[int, tuple[int, torch.Size, torch.Tensor]] = {}  # data_ptr -> (_version, shape, panels)

    def _panels(self, w: torch.Tensor) -> torch.Tensor:
        """w's packed panels, packed again when w was written since (its `_version` moved) or is another tensor."""
        ptr, version = w.data_ptr(), w._version
        hit = self._packs.get(ptr)
        if hit is None or hit[0] != version or hit[1] != w.shape:
            packer = self.packed.pack if self.packed is not None else self.head_kernel.pack  # one layout
            hit = (version, w.shape, packer(w))
            self._packs[ptr] = hit
        return hit[2]

    def prepack(self, weights: list[torch.Tensor]) -> int:
        """Pack these weight matrices now (a load's end) rather than in the next step; returns the packed bytes
        held in all. Nothing happens where the packed kernels are off."""
        if self.packed is not None:
            for w in weights:
                if w.dtype in (torch.float32, torch.bfloat16) and w.device.type == "cpu":
                    self._panels(w)
        return sum(p.numel() * p.element_size() for _, _, p in self._packs.values())

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ w [N, K].T (+ b) -> [M, N] in x's dtype."""
        if self.packed is not None and self.packed.applies(x, w):
            return self.packed.linear(x, self._panels(w), w, b)
        if self.gemm is not None and self.gemm.applies(x, w):
            return cpu_gemm.linear(self.gemm, x, w, b)
        if w.dtype == x.dtype:
            return F.linear(x, w, b)
        if self.gemm_bf16 is not None and self.gemm_bf16.applies(x, w):
            return cpu_gemm_bf16.linear(self.gemm_bf16, x, w, b)
        return F.linear(x.to(w.dtype), w, b).to(x.dtype)

    def linear_add(self, x: torch.Tensor, inp: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x + inp @ w.T (+ b) for the residual connections, x [M, N] and inp [M, K]; a kernel adds into x in place
        (the caller's own residual stream)."""
        if self.packed is not None and self.packed.applies(inp, w) and x.is_contiguous() and x.dtype == torch.float32:
            return self.packed.linear(inp, self._panels(w), w, b, add_to=x)
        if self.gemm is not None and self.gemm.applies(inp, w) and x.is_contiguous():
            return cpu_gemm.linear(self.gemm, inp, w, b, add_to=x)
        if w.dtype == x.dtype == inp.dtype:
            out = torch.addmm(x, inp, w.t())
            return out if b is None else out.add_(b)
        if self.gemm_bf16 is not None and self.gemm_bf16.applies(inp, w) and x.is_contiguous():
            return cpu_gemm_bf16.linear(self.gemm_bf16, inp, w, b, add_to=x)
        return torch.add(x, F.linear(inp.to(w.dtype), w, b))  # promoted to x's dtype

    def head(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The LM head: x [M, hidden] @ w [V, hidden].T -> fp32 logits [M, V]."""
        if self.head_kernel is not None and x.dtype == torch.float32 and w.dtype == torch.bfloat16:
            few = (self.packed is not None and self.packed.applies(x, w)) or (
                self.gemm_bf16 is not None and self.gemm_bf16.applies(x, w)
            )
            if not few:  # many rows: the head kernel, on the panels the packed kernel reads too
                xb = x.to(torch.bfloat16)  # [M, hidden]
                if self.head_kernel.applies(xb, w):
                    return self.head_kernel.forward(xb, self._panels(w), w.shape[0], None)  # [V / 32, hidden / 2, 32]
        return self.linear(x, w).float()
