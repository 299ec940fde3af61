"""Which code takes each matmul of the engine's model: C kernels on CPU where they win, torch elsewhere.

On CPU the model keeps its activations in fp32 whatever its weights' dtype (bf16 serving stores weights and KV in
bf16, computes in fp32 between the matmuls), so every product here takes fp32 rows and returns fp32:
- fp32 weights: kernels/gemm.py for few rows (torch's MKL is far from the bandwidth bound there), torch above;
- bf16 weights: kernels/gemm_bf16.py for few rows (weights read once, in bf16), torch's bf16 matmul above (oneDNN:
  ~200 GFLOP/s a thread with AVX512-BF16, measured on the model's shapes at 64 rows) with the rows rounded to bf16
  on the way in, which is what the bf16 kernel and a bf16 trainer's matmuls take too;
- the LM head with bf16 weights: fp32 logits from bf16 operands (the trainer's head kernel, server/kernels/head.py,
  on AVX512-BF16 CPUs: its packed product was 20 ms against oneDNN's 23 ms for 64 rows of SmolLM2's 49k-row head,
  and oneDNN's result would be bf16: ~0.06 of rounding on logits of magnitude 10-20, all of it in the logprobs).
  The head is packed once per weight version: `Tensor._version` moves on every in-place write, so a weight update
  (all of them copy into the model's tensors) repacks it on the next step that needs it.
On CUDA the weights and activations share one dtype and every product is torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areal_async.server.kernels import gemm as cpu_gemm
from areal_async.server.kernels import gemm_bf16 as cpu_gemm_bf16

__all__ = ["Matmuls"]


def _head_kernel():
    """server/kernels/head.py's product (the same arithmetic as the trainer's head), or None where not built."""
    from areal_async.server.kernels import head as head_kernel

    k = head_kernel.load()
    return k if k is not None and k.forward_fn is not None else None


class Matmuls:
    """The products of one model on one device, each routed to the code that is fastest for its rows and dtype."""

    def __init__(self, device: torch.device, weight_dtype: torch.dtype):
        cpu = device.type == "cpu"
        self.gemm = cpu_gemm.load() if cpu and weight_dtype == torch.float32 else None
        self.gemm_bf16 = cpu_gemm_bf16.load() if cpu and weight_dtype == torch.bfloat16 else None
        self.head_kernel = _head_kernel() if cpu and weight_dtype == torch.bfloat16 else None
        self._packed: tuple[int, int, torch.Tensor] | None = None  # (data_ptr, _version, packed head)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ w [N, K].T (+ b) -> [M, N] in x's dtype."""
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
            if not (self.gemm_bf16 is not None and self.gemm_bf16.applies(x, w)):  # few rows: the bf16 kernel's
                xb = x.to(torch.bfloat16)  # [M, hidden]
                if self.head_kernel.applies(xb, w):
                    key = (w.data_ptr(), w._version)
                    if self._packed is None or self._packed[:2] != key:
                        self._packed = (*key, self.head_kernel.pack(w))  # [V / 32, hidden / 2, 32] int32
                    return self.head_kernel.forward(xb, self._packed[2], w.shape[0], None)
        return self.linear(x, w).float()
