"""`x @ W.T` with bf16 weights for a few fp32 rows on CPU: the decode kernel of bf16 serving.

Why: with bf16 weights the CPU engine keeps its activations in fp32 and rounds each matmul's input to bf16 (what a
bf16 trainer's matmuls take), so a product reads half the bytes of an fp32 one. A decode step of few rows is bound
by reading the weights, and torch's bf16 product (oneDNN) is slow there: a SmolLM2-135M step at one row spent
6.7 ms in its 49k-row LM head against 4 ms for a bf16 kernel (1 thread, AMD EPYC Zen 4, CPU time). This kernel
reads the weights in their natural [N, K] layout (no packed copy, so an in-place weight update needs no repack),
streams each block of eight weight rows once and multiplies it with up to two input rows held in registers.

Arithmetic: the input rows are rounded to bf16 once per call (round to nearest even, as `.to(torch.bfloat16)`),
every product of two bf16 values is exact in fp32, and sums are fp32. Where the target has AVX512-BF16 the inner
step is `vdpbf16ps` (32 pairs per instruction); elsewhere (the AVX2 baseline, AVX-512 without BF16) the weights are
widened to fp32 by a 16-bit shift and multiplied with FMA: the same products, summed in another order. The result
(fp32) is not rounded to bf16.

Built on first use (build.py). The engine uses it where the packed-weight kernels (kernels/gemm_packed.py, faster
at every row count) are off or cannot be built; `AREAL_CPU_GEMM_BF16=0` turns it off too, and the model uses
torch's bf16 product.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from areal_async.server.kernels.build import bind, load_library

# Rows where this kernel beats torch's bf16 product (oneDNN), 30 layers' matmuls + the LM head of SmolLM2-135M,
# CPU time at 1 thread on an AMD EPYC Zen 4 with AVX512-BF16: see benchmarks/README.md. Above it oneDNN's blocked
# GEMM runs at ~200 GFLOP/s a thread and the kernel's dot-product form (one horizontal sum per output) cannot.
MAX_ROWS = 16
# the AVX2 build (no bf16 instruction: widened weights and FMA); oneDNN is emulating bf16 there, far slower
MAX_ROWS_NO_BF16 = 256

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 8  /* weight rows per block: streamed once, multiplied with MB input rows at a time */

static inline uint16_t f2bf(float f) {  /* round to nearest even, as torch's .to(bfloat16); NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)((((u & 0x7fffffffu) > 0x7f800000u) ? (u | 0x400000u) : r) >> 16);
}

static inline float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAS_DP 1
typedef uint16_t xin_t;  /* the rounded input rows, as bf16 */

/* MBV input rows against NB weight rows: acc[r][m] (16 lanes) over the whole K, 32 pairs per step, the tail
   through masked loads (zeros past K). */
#define BLOCK(MBV)                                                                                             \
    {                                                                                                          \
        __m512 acc[NB][MBV];                                                                                   \
        for (int r = 0; r < NB; r++)                                                                           \
            for (int m = 0; m < (MBV); m++) acc[r][m] = _mm512_setzero_ps();                                   \
        for (int64_t k = 0; k < K; k += 32) {                                                                  \
            const __mmask32 mk = K - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);                \
            __m512i xv[MBV];                                                                                   \
            for (int m = 0; m < (MBV); m++) xv[m] = _mm512_maskz_loadu_epi16(mk, xr[m] + k);                   \
            for (int r = 0; r < NB; r++) {                                                                     \
                const __m512i wv = _mm512_maskz_loadu_epi16(mk, wr[r] + k);                                    \
                for (int m = 0; m < (MBV); m++)                                                                \
                    acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)xv[m], (__m512bh)wv);                    \
            }                                                                                                  \
        }                                                                                                      \
        for (int m = 0; m < (MBV); m++)                                                                        \
            for (int r = 0; r < NB && n0 + r < N; r++) sums[r][m] = _mm512_reduce_add_ps(acc[r][m]);           \
    }
#else
#define HAS_DP 0
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float xin_t;  /* the rounded input rows, widened back to fp32 (exactly) */
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

static inline vf widen(const uint16_t* p) {  /* VL bf16 -> fp32: the bits shifted into the top half */
    const vu u = __builtin_convertvector(*(const vh*)p, vu) << 16;
    return (vf)u;
}

#define BLOCK(MBV)                                                                                             \
    {                                                                                                          \
        vf acc[NB][MBV];                                                                                       \
        for (int r = 0; r < NB; r++)                                                                           \
            for (int m = 0; m < (MBV); m++) acc[r][m] = (vf){0};                                               \
        const int64_t kv = K - K % VL;                                                                         \
        for (int64_t k = 0; k < kv; k += VL) {                                                                 \
            vf xv[MBV];                                                                                        \
            for (int m = 0; m < (MBV); m++) xv[m] = *(const vfu*)(xr[m] + k);                                  \
            for (int r = 0; r < NB; r++) {                                                                     \
                const vf wv = widen(wr[r] + k);                                                                \
                for (int m = 0; m < (MBV); m++) acc[r][m] += wv * xv[m];                                       \
            }                                                                                                  \
        }                                                                                                      \
        for (int m = 0; m < (MBV); m++)                                                                        \
            for (int r = 0; r < NB && n0 + r < N; r++) {                                                       \
                float s = 0.f;                                                                                 \
                for (int i = 0; i < VL; i++) s += acc[r][m][i];                                                \
                for (int64_t k = kv; k < K; k++) s += xr[m][k] * bf2f(wr[r][k]);                               \
                sums[r][m] = s;                                                                                \
            }                                                                                                  \
    }
#endif

/* y[m, n] = (c ? c[m, n] : 0) + (bias ? bias[n] : 0) + sum_k bf16(x[m, k]) w[n, k] for m < M, n < N. x [M, K]
   fp32 and w [N, K] bf16 contiguous, bias fp32; y and c fp32 with row stride ldy, and c may be y itself (each
   element of c is read just before the same element of y is written). Returns 0, or -1 when out of memory. */
int skinny_linear_bf16(const float* x, const uint16_t* w, const float* bias, const float* c, float* y, int64_t M,
                       int64_t N, int64_t K, int64_t ldy, int64_t threads) {
    xin_t* xs = (xin_t*)malloc(sizeof(xin_t) * (size_t)(M * K > 0 ? M * K : 1));
    if (!xs) return -1;
    for (int64_t i = 0; i < M * K; i++) {
#if HAS_DP
        xs[i] = f2bf(x[i]);
#else
        xs[i] = bf2f(f2bf(x[i]));
#endif
    }
    const int64_t nblocks = (N + NB - 1) / NB;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const int64_t n0 = nb * NB;
        const uint16_t* wr[NB];
        for (int r = 0; r < NB; r++) wr[r] = w + (n0 + r < N ? n0 + r : N - 1) * K;  /* past N: a repeat, unused */
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            const int two = m0 + 1 < M;
            const xin_t* xr[2] = {xs + m0 * K, xs + (two ? m0 + 1 : m0) * K};
            float sums[NB][2];
            if (two) BLOCK(2) else BLOCK(1)
            for (int m = 0; m < 1 + two; m++)
                for (int r = 0; r < NB && n0 + r < N; r++) {
                    const int64_t n = n0 + r, at = (m0 + m) * ldy + n;
                    float s = sums[r][m];
                    if (bias) s += bias[n];
                    if (c) s += c[at];
                    y[at] = s;
                }
        }
    }
    free(xs);
    return 0;
}

int64_t skinny_bf16_has_dp(void) { return HAS_DP; }
"""


@dataclass(frozen=True)
class Kernel:
    """The built kernel of one target and the row counts it takes."""

    fn: Callable[..., int]
    has_dp: bool  # the target has AVX512-BF16's dot product (else widened weights and FMA)
    max_rows: int

    def applies(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether `linear` takes this product: fp32 rows x [1..max_rows, K] and bf16 weights w [N, K], both
        contiguous on CPU."""
        return (
            1 <= x.shape[0] <= self.max_rows
            and x.dtype == torch.float32
            and w.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and x.is_contiguous()
            and w.is_contiguous()
        )


def load(march: str | None = None) -> Kernel | None:
    """The kernel built for `march` (default: build.default_march()), or None where it cannot be built."""
    lib = load_library(
        "skinny_linear_bf16", _SOURCE, "AREAL_CPU_GEMM_BF16", "torch's bf16 matmul for every batch size", march
    )
    if lib is None:
        return None
    fn = bind(lib, "skinny_linear_bf16", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5)
    fn.restype = ctypes.c_int
    has = lib.skinny_bf16_has_dp
    has.restype, has.argtypes = ctypes.c_int64, []
    dp = bool(has())
    return Kernel(fn, dp, MAX_ROWS if dp else MAX_ROWS_NO_BF16)


def linear(
    kernel: Kernel,
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] fp32 @ w [N, K].T bf16 (+ bias [N]) -> [M, N] fp32; with `add_to` [M, N] (fp32, contiguous) the
    product is added into it in place and it is returned. The caller checks `kernel.applies` first."""
    m, k = x.shape
    n = w.shape[0]
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    out = add_to if add_to is not None else torch.empty(m, n, dtype=torch.float32)
    rc = kernel.fn(
        x.data_ptr(),
        w.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr() if add_to is not None else None,
        out.data_ptr(),
        m,
        n,
        k,
        n,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError(f"skinny_linear_bf16: no memory for a {m}x{k} input copy")
    return out
