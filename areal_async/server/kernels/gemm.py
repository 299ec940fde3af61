"""`x @ W.T` for a few rows on CPU: a small C kernel for the decode steps where the batch has few requests left.

Why: a decode step multiplies every weight matrix by one row per running request. With few rows that is bound by
reading the weights (540 MB per step for SmolLM2-135M in fp32), but the BLAS torch ships (MKL) handles 4-15 rows
far from that bound: the step's matmuls took 36 ms at 4 rows, 47 ms at 8 and 57 ms at 12 against 20 ms at one row
(2 threads). In a long-tailed batch most steps run with that few requests left. This kernel streams each block of
eight weight rows once and multiplies it with two input rows at a time held in registers, so the weights are read
once whatever the row count: 26, 31 and 36 ms at those sizes (the model's own shapes, 2 threads; MKL is kept below
3 rows, where its matrix-vector path is at the bandwidth, and above 24, where it is faster).

It is plain C with GCC vector extensions, blocked per target (AVX-512: 16-float vectors, 8 weight rows x 2 input
rows; the AVX2 baseline: 8-float vectors, 6 x 2, which fits its 16 registers), built on first use (build.py).
The rows it takes depend on the build (ROWS). The engine uses it where the packed-weight kernels
(kernels/gemm_packed.py, faster at every row count) are off or cannot be built; `AREAL_CPU_GEMM=0` turns it off
too, and the engine uses torch's matmul.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from areal_async.server.kernels.build import bind, load_library

MIN_ROWS, MAX_ROWS = 3, 24  # where the AVX-512 build beats torch's matmul (measured, see above)
# Row range per build (floats per vector): where the kernel beat torch's matmul, the 30 layers' four matmuls of
# SmolLM2-135M, CPU time at 1 thread (AMD EPYC Zen 5). AVX2 (x86-64-v3 build, torch held to AVX2): at 1 / 2 / 3 /
# 8 / 16 / 32 / 64 rows torch 31 / 49 / 74 / 62 / 99 / 141 / 221 ms, the kernel 20 / 21 / 36 / 47 / 79 / 109 /
# 203 ms (the AVX-512 blocking built for AVX2, as before: 42 / 39 / 109 / 192 / 385 / 575 / 1,131 ms, slower than
# torch from 3 rows on). At 40-64 rows the two are even, so AVX2 keeps the kernel for 1-32 rows. AVX-512: on the
# AMX machine MKL was ahead at 1-2 rows and above 24 (2 threads), so 3-24 there; on Zen 5 (no AMX) a whole decode
# step at 1 row took 38 ms with MKL's matrix-vector path against 28 ms with the kernel (decode_step.py, CPU time),
# so without AMX the AVX-512 build takes 1-24 rows.
ROWS = {16: (MIN_ROWS, MAX_ROWS), 8: (1, 32)}
ROWS_AVX512_NO_AMX = (1, MAX_ROWS)


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(ln.startswith("flags") and "amx_tile" in ln.split() for ln in f)
    except OSError:
        return False


def row_range(vector_width: int) -> tuple[int, int]:
    """The rows a build of this vector width takes on this CPU (see ROWS)."""
    if vector_width == 16 and not _has_amx():
        return ROWS_AVX512_NO_AMX
    return ROWS.get(vector_width, (MIN_ROWS, MAX_ROWS))


_SOURCE = r"""
#include <stdint.h>

/* Register blocking by target: NB weight rows streamed once per block, MB input rows per pass over it (later
   passes read the block from L1/L2). The inner loop holds MB input vectors and NB x MB accumulators, loading one
   weight vector at a time: 2 + 16 + 1 of AVX-512's 32 registers; on AVX2 (16 registers of 8 floats) 2 + 12 + 1,
   where the AVX-512 blocking would spill 20 of them on every step of the loop. */
#if defined(__AVX512F__)
#define VL 16
#define NB 8
#define MB 2
#else
#define VL 8
#define NB 6
#define MB 2
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
#define LD(p) (*(const vfu*)(p))

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* y[m, n] = (c ? c[m, n] : 0) + (bias ? bias[n] : 0) + sum_k x[m, k] w[n, k] for m < M, n < N. x [M, K] and
   w [N, K] contiguous; y and c have row stride ldy, and c may be y itself (each element of c is read just before
   the same element of y is written). */
void skinny_linear(const float* x, const float* w, const float* bias, const float* c, float* y, int64_t M,
                   int64_t N, int64_t K, int64_t ldy, int64_t threads) {
    const int64_t KV = K - K % VL, nblocks = (N + NB - 1) / NB;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const int64_t n0 = nb * NB;
        const float* wr[NB];
        for (int r = 0; r < NB; r++) wr[r] = w + (n0 + r < N ? n0 + r : N - 1) * K;  /* past N: a repeat, unused */
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const float* xr[MB];
            for (int m = 0; m < MB; m++) xr[m] = x + (m0 + m < M ? m0 + m : M - 1) * K;
            vf acc[NB][MB];
            for (int r = 0; r < NB; r++)
                for (int m = 0; m < MB; m++) acc[r][m] = (vf){0};
            for (int64_t k = 0; k < KV; k += VL) {
                vf xv[MB];
                for (int m = 0; m < MB; m++) xv[m] = LD(xr[m] + k);
                for (int r = 0; r < NB; r++) {
                    const vf wv = LD(wr[r] + k);
                    for (int m = 0; m < MB; m++) acc[r][m] += wv * xv[m];
                }
            }
            for (int m = 0; m < MB && m0 + m < M; m++) {
                for (int r = 0; r < NB && n0 + r < N; r++) {
                    float s = hsum(acc[r][m]);
                    for (int64_t k = KV; k < K; k++) s += xr[m][k] * wr[r][k];
                    const int64_t n = n0 + r, at = (m0 + m) * ldy + n;
                    if (bias) s += bias[n];
                    if (c) s += c[at];
                    y[at] = s;
                }
            }
        }
    }
}

int64_t skinny_vector_width(void) { return VL; }
"""


@dataclass(frozen=True)
class Kernel:
    """The built kernel for one target and the row counts where it beats torch's matmul there."""

    fn: Callable[..., None]
    vector_width: int  # floats per vector in this build: 16 with AVX-512, 8 on the AVX2 baseline
    min_rows: int
    max_rows: int

    def applies(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether `linear` should take this product: fp32 on CPU, contiguous, min_rows..max_rows rows."""
        return (
            self.min_rows <= x.shape[0] <= self.max_rows
            and x.dtype == w.dtype == torch.float32
            and x.device.type == "cpu"
            and x.is_contiguous()
            and w.is_contiguous()
        )


def load(march: str | None = None) -> Kernel | None:
    """The kernel built for `march` (default: cpu_build.default_march()), or None where it cannot be built
    (build.py). Its row range follows the build's vector width (ROWS)."""
    lib = load_library("skinny_linear", _SOURCE, "AREAL_CPU_GEMM", "torch's matmul for every batch size", march)
    if lib is None:
        return None
    fn = bind(lib, "skinny_linear", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5)
    width = lib.skinny_vector_width
    width.restype, width.argtypes = ctypes.c_int64, []
    vl = int(width())
    lo, hi = row_range(vl)
    return Kernel(fn, vl, lo, hi)


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a product fits the AVX-512 build's row range (MIN_ROWS..MAX_ROWS), fp32, CPU and contiguous; the
    engine asks its loaded Kernel instead, whose range follows its target."""
    return (
        MIN_ROWS <= x.shape[0] <= MAX_ROWS
        and x.dtype == w.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and w.is_contiguous()
    )


def linear(
    kernel: Kernel,
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> [M, N]; with `add_to` [M, N] (contiguous) the product is added into
    it in place and it is returned. The caller checks `kernel.applies` first."""
    m, k = x.shape
    n = w.shape[0]
    if bias is not None:
        bias = bias.contiguous()
    out = add_to if add_to is not None else torch.empty(m, n, dtype=x.dtype)
    kernel.fn(
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
    return out
