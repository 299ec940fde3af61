"""RMSNorm for a bf16 trainer on CPU: one C pass forward and one backward, with the same roundings as
transformers' module.

Why: in bf16 torch runs a Llama RMSNorm as eight element-wise ops forward (upcast, square, mean, add, rsqrt,
multiply, downcast, weight) and about a dozen in its autograd backward, each a full pass over [tokens, hidden] with
a fresh temporary. In a SmolLM2-135M bf16 train step on an AMD EPYC Zen 5 the element-wise work inside the decoder
layers was ~18% of their time (torch.profiler over a 4-layer model, 12 x 170 tokens), the norms the largest part;
forward and backward of one norm on [2040, 576] took 3.8 ms in torch and 0.9 ms here (CPU time, 1 thread). (The
MLP's silu(gate) * up fused the same way was slower than torch's ops, 8.3 against 4.4 ms; written with AVX-512
intrinsics and the AVX512-BF16 conversions it was bit-identical to torch but no faster in the whole step, 19.11
against 18.71 s: its exp and division are compute-bound here, so the MLP keeps torch's ops.)

Numerics follow transformers' LlamaRMSNorm (the mean of squares in fp32, x * rsqrt(mean + eps) rounded to the input
dtype, then the weight, rounded again), and the backward rounds where autograd over those ops does (the gradient of
the normalised input is g * w rounded to bf16); the weight's gradient sums the bf16 products g * bf16(x_hat) in
fp32 and rounds once.

`install(model)` replaces the forward of the norm modules whose classes are known to compute exactly this (Llama,
Qwen2, Qwen3, Mistral), when the model trains in bf16 on CPU and the kernel builds; anything else keeps
transformers' forward. `AREAL_TRAIN_RMS_NORM=0` turns it off.
"""

from __future__ import annotations

import ctypes
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from areal_async.server.kernels.build import BF16_C, bind, load_library

__all__ = ["Kernels", "load", "rms_norm", "install"]

_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"}
MAX_THREADS = 256

_SOURCE = (
    BF16_C
    + r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif


static inline float rbf(float f) { return bf2f(f2bf(f)); }  /* f rounded to bf16, as a float */

/* y = bf16(w * bf16(x * rstd)), rstd [rows] = 1 / sqrt(mean(x^2) + eps); x, y [rows, n] bf16 (x row stride ldx). */
void rms_fwd(const uint16_t* x, const uint16_t* w, uint16_t* y, float* rstd, int64_t rows, int64_t n, int64_t ldx,
             float eps, int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads(rows >= 8 ? threads : 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * ldx;
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < n; i++) { const float v = bf2f(xr[i]); ss += v * v; }
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
        rstd[r] = inv;
        uint16_t* yr = y + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) yr[i] = f2bf(bf2f(w[i]) * rbf(bf2f(xr[i]) * inv));
    }
}

/* dx = bf16(rstd (gn - x_hat mean(gn x_hat))) with gn = bf16(g w), x_hat = x rstd (fp32); dw = sum over rows of
   bf16(g bf16(x_hat)), in fp32 (per-thread partial rows, then added). */
void rms_bwd(const uint16_t* x, const uint16_t* w, const float* rstd, const uint16_t* g, uint16_t* dx, float* dw,
             int64_t rows, int64_t n, int64_t ldx, int64_t threads) {
    if (threads < 1) threads = 1;
    float* part = calloc((size_t)threads * n, sizeof(float));
    #pragma omp parallel num_threads(rows >= 8 ? threads : 1)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float* acc = part + (int64_t)tid * n;
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t* xr = x + r * ldx;
            const uint16_t* gr = g + r * n;
            const float inv = rstd[r];
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t i = 0; i < n; i++) {
                const float xh = bf2f(xr[i]) * inv, gn = rbf(bf2f(gr[i]) * bf2f(w[i]));
                dot += gn * xh;
                acc[i] += rbf(bf2f(gr[i]) * rbf(xh));
            }
            const float m = dot / (float)n;
            uint16_t* dr = dx + r * n;
            #pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                const float xh = bf2f(xr[i]) * inv, gn = rbf(bf2f(gr[i]) * bf2f(w[i]));
                dr[i] = f2bf(inv * (gn - xh * m));
            }
        }
    }
    for (int64_t i = 0; i < n; i++) {
        float s = 0.f;
        for (int64_t t = 0; t < threads; t++) s += part[t * n + i];
        dw[i] = s;
    }
    free(part);
}

"""
)


@dataclass(frozen=True)
class Kernels:
    """The built kernels of one target."""

    rms_fwd: Callable[..., None]
    rms_bwd: Callable[..., None]


def load(march: str | None = None) -> Kernels | None:
    """The kernels built for `march` (default: build.default_march()), or None where they cannot be built
    (`AREAL_TRAIN_RMS_NORM=0` turns them off)."""
    lib = load_library("train_rms_norm", _SOURCE, "AREAL_TRAIN_RMS_NORM", "torch's element-wise ops", march)
    if lib is None:
        return None
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    return Kernels(
        rms_fwd=bind(lib, "rms_fwd", [p] * 4 + [i64] * 3 + [f32, i64]),
        rms_bwd=bind(lib, "rms_bwd", [p] * 6 + [i64] * 4),
    )


_lock = threading.Lock()
_state: dict[str, object] = {}


def _kernels() -> Kernels | None:
    with _lock:
        if "kernels" not in _state:
            _state["kernels"] = load()
        return _state["kernels"]  # type: ignore[return-value]


def _threads() -> int:
    return min(torch.get_num_threads(), MAX_THREADS)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, kernels: Kernels) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [R, N], a view where it can be
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        w = weight.contiguous()
        rows, n = x2.shape
        y = torch.empty(rows, n, dtype=x.dtype)  # [R, N]
        rstd = torch.empty(rows, dtype=torch.float32)  # [R]
        kernels.rms_fwd(
            x2.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows, n, x2.stride(0), eps, _threads()
        )
        ctx.save_for_backward(x2, w, rstd)
        ctx.kernels, ctx.shape = kernels, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, g: Tensor):
        x2, w, rstd = ctx.saved_tensors
        rows, n = x2.shape
        g2 = g.reshape(rows, n).contiguous()  # [R, N]
        dx = torch.empty(rows, n, dtype=x2.dtype)
        dw = torch.empty(n, dtype=torch.float32)
        threads = _threads()
        ctx.kernels.rms_bwd(
            x2.data_ptr(), w.data_ptr(), rstd.data_ptr(), g2.data_ptr(), dx.data_ptr(), dw.data_ptr(), rows, n,
            x2.stride(0), threads,
        )  # fmt: skip
        return dx.view(ctx.shape), dw.to(w.dtype), None, None


def _applies(*ts: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in ts)


def rms_norm(x: Tensor, weight: Tensor, eps: float, kernels: Kernels | None = None) -> Tensor:
    """transformers' Llama RMSNorm of x [..., N] with weight [N] (bf16 on CPU through the kernel, else torch)."""
    kernels = kernels if kernels is not None else _kernels()
    if kernels is not None and _applies(x, weight) and x.dim() >= 1 and x.numel():
        return _RMSNorm.apply(x, weight, float(eps), kernels)
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _norm_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def install(model: nn.Module, device: torch.device, compute_dtype: torch.dtype) -> int:
    """Route the known norm modules of `model` through the kernel when it computes in bf16 on CPU and
    they build; returns how many modules were changed (0: the model keeps transformers' forwards)."""
    if device.type != "cpu" or compute_dtype != torch.bfloat16 or _kernels() is None:
        return 0
    changed = 0
    for module in model.modules():
        name = type(module).__name__
        if name in _NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_norm_forward, module)  # type: ignore[method-assign]
            changed += 1
    return changed
