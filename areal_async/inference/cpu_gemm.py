"""`x @ W.T` for a few rows on CPU: a small C kernel for the decode steps where the batch has 3-24 requests left.

Why: a decode step multiplies every weight matrix by one row per running request. With few rows that is bound by
reading the weights (540 MB per step for SmolLM2-135M in fp32), but the BLAS torch ships (MKL) handles 4-15 rows
far from that bound: the step's matmuls took 36 ms at 4 rows, 47 ms at 8 and 57 ms at 12 against 20 ms at one row
(2 threads). In a long-tailed batch most steps run with that few requests left. This kernel streams each block of
eight weight rows once and multiplies it with two input rows at a time held in registers, so the weights are read
once whatever the row count: 26, 31 and 36 ms at those sizes (the model's own shapes, 2 threads; MKL is kept below
3 rows, where its matrix-vector path is at the bandwidth, and above 24, where it is faster).

It is plain C with GCC vector extensions (512-bit vectors; a compiler splits them on narrower machines), built on
first use (cpu_build.py). `AREAL_CPU_GEMM=0` turns it off; where it cannot be built the engine uses torch's matmul.
"""

from __future__ import annotations

import ctypes

import torch

from areal_async.inference.cpu_build import bind, load_library

MIN_ROWS, MAX_ROWS = 3, 24  # where the kernel beats torch's matmul (measured, see above)

_SOURCE = r"""
#include <stdint.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
#define LD(p) (*(const v16u*)(p))
#define NB 8  /* weight rows per block: streamed once, 8 + 2 x 8 + 1 registers in the inner loop */
#define MB 2  /* input rows per pass over the block (later passes read the block from L1/L2) */

static inline float hsum(v16 v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* y[m, n] = (c ? c[m, n] : 0) + (bias ? bias[n] : 0) + sum_k x[m, k] w[n, k] for m < M, n < N. x [M, K] and
   w [N, K] contiguous; y and c have row stride ldy, and c may be y itself (each element of c is read just before
   the same element of y is written). */
void skinny_linear(const float* x, const float* w, const float* bias, const float* c, float* y, int64_t M,
                   int64_t N, int64_t K, int64_t ldy, int64_t threads) {
    const int64_t K16 = K & ~(int64_t)15, nblocks = (N + NB - 1) / NB;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const int64_t n0 = nb * NB;
        const float* wr[NB];
        for (int r = 0; r < NB; r++) wr[r] = w + (n0 + r < N ? n0 + r : N - 1) * K;  /* past N: a repeat, unused */
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const float* xr[MB];
            for (int m = 0; m < MB; m++) xr[m] = x + (m0 + m < M ? m0 + m : M - 1) * K;
            v16 acc[NB][MB];
            for (int r = 0; r < NB; r++)
                for (int m = 0; m < MB; m++) acc[r][m] = (v16){0};
            for (int64_t k = 0; k < K16; k += 16) {
                v16 wv[NB];
                for (int r = 0; r < NB; r++) wv[r] = LD(wr[r] + k);
                for (int m = 0; m < MB; m++) {
                    const v16 xv = LD(xr[m] + k);
                    for (int r = 0; r < NB; r++) acc[r][m] += wv[r] * xv;
                }
            }
            for (int m = 0; m < MB && m0 + m < M; m++) {
                for (int r = 0; r < NB && n0 + r < N; r++) {
                    float s = hsum(acc[r][m]);
                    for (int64_t k = K16; k < K; k++) s += xr[m][k] * wr[r][k];
                    const int64_t n = n0 + r, at = (m0 + m) * ldy + n;
                    if (bias) s += bias[n];
                    if (c) s += c[at];
                    y[at] = s;
                }
            }
        }
    }
}
"""


def load(march: str | None = None):
    """The kernel built for `march` (default: cpu_build.default_march()) as a ctypes function, or None where it
    cannot be built (cpu_build.py)."""
    lib = load_library("skinny_linear", _SOURCE, "AREAL_CPU_GEMM", "torch's matmul for every batch size", march)
    if lib is None:
        return None
    return bind(lib, "skinny_linear", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5)


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear` should take this product: fp32 on CPU, contiguous, MIN_ROWS..MAX_ROWS rows."""
    return (MIN_ROWS <= x.shape[0] <= MAX_ROWS and x.dtype == w.dtype == torch.float32 and x.device.type == "cpu"
            and x.is_contiguous() and w.is_contiguous())


def linear(fn, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           add_to: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> [M, N]; with `add_to` [M, N] (contiguous) the product is added into
    it in place and it is returned. The caller checks `applies` first."""
    m, k = x.shape
    n = w.shape[0]
    if bias is not None:
        bias = bias.contiguous()
    out = add_to if add_to is not None else torch.empty(m, n, dtype=x.dtype)
    fn(x.data_ptr(), w.data_ptr(), bias.data_ptr() if bias is not None else None,
       out.data_ptr() if add_to is not None else None, out.data_ptr(), m, n, k, n, torch.get_num_threads())
    return out
