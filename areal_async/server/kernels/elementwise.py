"""RMSNorm, SiLU-gating and greedy argmax + logsumexp for the CPU decode path: small C kernels, one or two passes
over the data each.

Why: on CPU torch runs `F.rms_norm` as five passes (square, mean, add, rsqrt, multiply, with their temporaries) and
`silu(gate) * up` as two, which at decode sizes is per-op overhead more than arithmetic: in a SmolLM2-135M decode
step at batch 64 (2 threads) `F.rms_norm` on [64, 576] took 20.5 us a call against 7.2 us here (61 calls a step),
silu-gating 31 us against 24 us (30 a step), and greedy sampling's `logsumexp` over [64, 49152] was ~4% of the
engine thread (py-spy). Each kernel here reads its input once or twice and writes only its output. The numerics
follow transformers: the mean of squares in fp32, x * rsqrt(mean + eps), then the weight; SiLU as x / (1 + exp(-x))
with a vectorised exp (relative error < 2e-7).

Built on first use (build.py); `AREAL_CPU_ELEMENTWISE=0` turns them off, and where they cannot be built the
model uses torch's ops.
"""

from __future__ import annotations

import ctypes

import torch

from areal_async.server.kernels.build import EXP_POLY_C, bind, load_library

_SOURCE = (
    EXP_POLY_C
    + r"""
#include <math.h>

/* y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w, rows of n contiguous floats (x row stride ldx). */
void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, int64_t ldx, float eps,
              int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads(rows >= 8 ? threads : 1)
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * ldx;
        float* yr = y + r * n;
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}

/* Greedy decoding's two numbers per row of logits [rows, n]: the argmax (first of equal maxima, as torch.argmax)
   and logsumexp, so the chosen token's logprob is x[argmax] - lse. Two passes over each row, no temporaries. */
void argmax_logsumexp(const float* x, int64_t* idx, float* lse, int64_t rows, int64_t n, int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads(rows >= 2 ? threads : 1)
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * n;
        float mx = xr[0];
        int64_t at = 0;
        for (int64_t i = 1; i < n; i++)
            if (xr[i] > mx) { mx = xr[i]; at = i; }
        double s = 0.0;  /* a float sum of 49k terms could err by 49k roundings (3e-3); a double's is nothing */
        #pragma omp simd reduction(+:s)
        for (int64_t i = 0; i < n; i++) s += (double)exp_poly(xr[i] - mx);
        idx[r] = at;
        lse[r] = (float)((double)mx + log(s));
    }
}

/* y[r, i] = silu(g[r, i]) * u[r, i] with g = gu[r, :n] and u = gu[r, n:2n] (the fused gate|up projection). */
void silu_mul(const float* gu, float* y, int64_t rows, int64_t n, int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads(rows >= 8 ? threads : 1)
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gu + r * 2 * n;
        const float* u = g + n;
        float* yr = y + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) yr[i] = g[i] / (1.f + exp_poly(-g[i])) * u[i];
    }
}
"""
)


class Kernels:
    """The two ctypes functions, with the tensor-level calls."""

    def __init__(self, lib: ctypes.CDLL):
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._norm = bind(lib, "rms_norm", [ptr] * 3 + [i64] * 3 + [ctypes.c_float, i64])
        self._silu = bind(lib, "silu_mul", [ptr] * 2 + [i64] * 3)
        self._greedy = bind(lib, "argmax_logsumexp", [ptr] * 3 + [i64] * 3)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [R, n] fp32 (rows may be strided, the last dim contiguous), weight [n] -> [R, n]."""
        rows, n = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(rows, n, dtype=x.dtype)
        self._norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, n, x.stride(0), eps, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [R, 2n] contiguous fp32 -> silu(gate) * up [R, n]."""
        rows, n2 = gate_up.shape
        out = torch.empty(rows, n2 // 2, dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), out.data_ptr(), rows, n2 // 2, torch.get_num_threads())
        return out

    def argmax_logsumexp(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] contiguous fp32 -> (argmax [B] long, logsumexp [B] fp32)."""
        rows, n = logits.shape
        idx = torch.empty(rows, dtype=torch.long)
        lse = torch.empty(rows, dtype=torch.float32)
        self._greedy(logits.data_ptr(), idx.data_ptr(), lse.data_ptr(), rows, n, torch.get_num_threads())
        return idx, lse


def load(march: str | None = None) -> Kernels | None:
    """The kernels built for `march` (default: cpu_build.default_march()), or None where they cannot be built
    (build.py)."""
    lib = load_library("elementwise", _SOURCE, "AREAL_CPU_ELEMENTWISE", "torch's rms_norm and silu", march)
    return Kernels(lib) if lib is not None else None
