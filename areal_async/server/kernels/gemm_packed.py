"""`x @ W.T` on CPU from weights packed once into 32-column panels: the engine's decode matmuls, fp32 and bf16.

Why: a decode step multiplies every weight matrix by one row per running request, and with few rows it is bound
by reading the weights. Read in their natural [N, K] layout, a kernel has to stream several weight rows side by
side (eight streams a thread) and end every output with a horizontal sum, and it reached ~18 GB/s in SmolLM2-135M's
decode step on a 2-core AMD EPYC Zen 5, where one stream reads at ~33. Packed, a thread reads one contiguous
stream: panel p holds columns 32p..32p+31 k after k (fp32: [K][32] floats; bf16: [K/2][32] pairs of bf16, as the
AVX512-BF16 dot-product instruction reads them, the same layout as server/kernels/head.py's), so one vector load
gives 16 outputs' weights for one k, and 16 outputs accumulate in one register with no horizontal sum at the end.
Rows come in register blocks of MR (AVX-512: 6 rows x 32 columns of accumulators; AVX2: 2 x 32), later blocks
reading the panel from L1/L2, so the same code serves every batch of a decode step. With two threads and no more
rows than one block (a product that only reads weights), the threads take panels from both ends until they meet
instead of half each, since the two cores of a VM do not read equally fast (`take`).

Costs: a packed copy of every weight matrix the kernel takes (server/cpu_matmul.py packs on first use and again
after any in-place write; `Tensor._version` tells it), so weights take twice their memory;
`AREAL_CPU_GEMM_PACKED=0` turns packing off and the engine uses kernels/gemm.py and kernels/gemm_bf16.py on the
natural layout instead.

Arithmetic: fp32: exact fp32 FMAs, summed over k in order (the one-row path in two interleaved halves). bf16: the
input rows are rounded to bf16 once per call (round to nearest even, as `.to(torch.bfloat16)`), every product of two
bf16 values is exact in fp32 and sums are fp32; `vdpbf16ps` where the target has AVX512-BF16, else the weights are
widened by a 16-bit shift and multiplied with FMA (the same products, summed in another order). Results are fp32.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from areal_async.server.kernels.build import BF16_C, bind, load_library

__all__ = ["Kernel", "load", "PANEL"]

PANEL = 32  # output columns per packed panel

_SOURCE = (
    BF16_C
    + r"""
#include <omp.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#define VL 16
#define MR 6   /* rows per register block: 6 x 2 accumulators of 16 lanes */
#else
#define VL 8
#define MR 2   /* AVX2's 16 registers: 2 x 4 accumulators, the row broadcasts and one weight vector */
#endif
#define PANEL 32
#define NV (PANEL / VL)  /* vectors per k of a panel */
typedef float vf __attribute__((vector_size(VL * 4)));        /* packed panels: 64-byte aligned */
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

/* y[m, n0 + j] = acc[m][j] (+ bias) (+ c) for the rows and the columns of one panel below N */
static inline void store(vf acc[MR][NV], int rows, const float* bias, const float* c, float* y, int64_t m0,
                         int64_t n0, int64_t N, int64_t ldy) {
    if (n0 + PANEL <= N) {
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < NV; j++) {
                const int64_t at = (m0 + m) * ldy + n0 + j * VL;
                vf s = acc[m][j];
                if (bias) s += *(const vfu*)(bias + n0 + j * VL);
                if (c) s += *(const vfu*)(c + at);
                *(vfu*)(y + at) = s;
            }
        return;
    }
    for (int m = 0; m < rows; m++)
        for (int64_t i = 0; i < N - n0; i++) {
            const int64_t at = (m0 + m) * ldy + n0 + i;
            float s = acc[m][i / VL][i % VL];
            if (bias) s += bias[n0 + i];
            if (c) s += c[at];
            y[at] = s;
        }
}

/* The next chunk [*a, *b) of the panels a team of two shares through `st` (the panels not yet taken, [lo, hi), as
   lo << 32 | hi): thread 0 takes from the front, thread 1 from the back, a third of what is left each time (at
   least one panel), until they meet. Returns 0 when none is left. Why not a static half each: at one row the
   product is a race to read the weights, and the two cores of a VM do not read equally fast (perf, 2-core AMD EPYC
   Zen 5: the engine thread's half took ~8% longer than the other's, which then waited); from both ends each thread
   still reads long runs of adjacent panels, and a product costs a handful of claims. */
static inline int take(uint64_t* st, int front, int64_t* a, int64_t* b) {
    uint64_t cur = __atomic_load_n(st, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t lo = (int64_t)(cur >> 32), hi = (int64_t)(cur & 0xffffffffu);
        if (lo >= hi) return 0;
        const int64_t n = (hi - lo) / 3 > 0 ? (hi - lo) / 3 : 1;
        const uint64_t nxt = front ? ((uint64_t)(lo + n) << 32) | (uint64_t)hi
                                   : ((uint64_t)lo << 32) | (uint64_t)(hi - n);
        if (__atomic_compare_exchange_n(st, &cur, nxt, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *a = front ? lo : hi - n;
            *b = front ? lo + n : hi;
            return 1;
        }
    }
}

/* Runs BODY(p) for every panel p < P: from both ends with two threads and at most one register block of rows
   (take: there the product only reads weights), else a static split. */
#define FOR_PANELS(P, M, threads, BODY)                                                                      \
    if ((threads) == 2 && (M) <= MR && (P) > 1 && (P) < ((int64_t)1 << 31)) {                                \
        uint64_t st_ = (uint64_t)(P);                                                                        \
        _Pragma("omp parallel num_threads(2)")                                                               \
        {                                                                                                    \
            const int front_ = omp_get_thread_num() == 0;                                                    \
            int64_t a_, b_;                                                                                  \
            while (take(&st_, front_, &a_, &b_))                                                             \
                for (int64_t p = a_; p < b_; p++) BODY(p);                                                   \
        }                                                                                                    \
    } else {                                                                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                   \
        for (int64_t p = 0; p < (P); p++) BODY(p);                                                           \
    }

/* ---- fp32: panel p = wp[p][K][32] -------------------------------------------------------------------------- */

void packed_pack_f32(const float* w, float* wp, int64_t N, int64_t K, int64_t ldw, int64_t threads) {
    const int64_t P = (N + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < P; p++)
        for (int c = 0; c < PANEL; c++) {
            const int64_t n = p * PANEL + c;
            float* dst = wp + p * K * PANEL + c;
            for (int64_t k = 0; k < K; k++) dst[k * PANEL] = n < N ? w[n * ldw + k] : 0.f;
        }
}

/* R rows (a compile-time constant) against one panel over the whole K */
#define F32_BLOCK(R)                                                                                         \
    {                                                                                                        \
        for (int64_t k = 0; k < K; k++) {                                                                    \
            const vf* wk = pw + k * NV;                                                                      \
            for (int j = 0; j < NV; j++) {                                                                   \
                const vf wv = wk[j];                                                                         \
                for (int m = 0; m < (R); m++) acc[m][j] += wv * xr[m * K + k];                               \
            }                                                                                                \
        }                                                                                                    \
    }

/* Every row block of x against panel p. */
static inline void f32_panel(const float* x, const float* wp, const float* bias, const float* c, float* y, int64_t M,
                             int64_t N, int64_t K, int64_t ldy, int64_t p) {
    const vf* pw = (const vf*)(wp + p * K * PANEL);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int rows = M - m0 < MR ? (int)(M - m0) : MR;
        const float* xr = x + m0 * K;
        vf acc[MR][NV];
        for (int m = 0; m < MR; m++)
            for (int j = 0; j < NV; j++) acc[m][j] = (vf){0};
        if (rows == 1) {  /* two independent chains per vector: even and odd k */
            vf odd[NV];
            for (int j = 0; j < NV; j++) odd[j] = (vf){0};
            int64_t k = 0;
            for (; k + 1 < K; k += 2) {
                const vf* wk = pw + k * NV;
                for (int j = 0; j < NV; j++) {
                    acc[0][j] += wk[j] * xr[k];
                    odd[j] += wk[NV + j] * xr[k + 1];
                }
            }
            for (; k < K; k++)
                for (int j = 0; j < NV; j++) acc[0][j] += pw[k * NV + j] * xr[k];
            for (int j = 0; j < NV; j++) acc[0][j] += odd[j];
        }
#if MR > 2
        else if (rows == 2) F32_BLOCK(2)
        else if (rows == 3) F32_BLOCK(3)
        else if (rows == 4) F32_BLOCK(4)
        else if (rows == 5) F32_BLOCK(5)
#endif
        else F32_BLOCK(MR)
        store(acc, rows, bias, c, y, m0, p * PANEL, N, ldy);
    }
}

int packed_linear_f32(const float* x, const float* wp, const float* bias, const float* c, float* y, int64_t M,
                      int64_t N, int64_t K, int64_t ldy, int64_t threads) {
    const int64_t P = (N + PANEL - 1) / PANEL;
#define F32_PANEL(p) f32_panel(x, wp, bias, c, y, M, N, K, ldy, p)
    FOR_PANELS(P, M, threads, F32_PANEL)
#undef F32_PANEL
    return 0;
}

/* ---- bf16: panel p = wp[p][ceil(K / 2)][32] uint32, the pair (W[n, 2kp], W[n, 2kp + 1]) ------------------- */

void packed_pack_bf16(const uint16_t* w, uint32_t* wp, int64_t N, int64_t K, int64_t ldw, int64_t threads) {
    const int64_t Kp = (K + 1) / 2, P = (N + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < P; p++)
        for (int c = 0; c < PANEL; c++) {
            const int64_t n = p * PANEL + c;
            uint32_t* dst = wp + p * Kp * PANEL + c;
            for (int64_t kp = 0; kp < Kp; kp++) {
                uint32_t lo = 0, hi = 0;
                if (n < N) {
                    lo = w[n * ldw + 2 * kp];
                    hi = 2 * kp + 1 < K ? w[n * ldw + 2 * kp + 1] : 0;
                }
                dst[kp * PANEL] = lo | (hi << 16);
            }
        }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAS_DP 1
typedef uint32_t xin_t;  /* an input row as bf16 pairs [Kp] */
#define XIN_LEN(Kp) (Kp)

static inline void round_rows(const float* x, xin_t* xs, int64_t M, int64_t K, int64_t Kp) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t kp = 0; kp < Kp; kp++) {
            const uint32_t lo = f2bf(x[m * K + 2 * kp]);
            const uint32_t hi = 2 * kp + 1 < K ? f2bf(x[m * K + 2 * kp + 1]) : 0;
            xs[m * Kp + kp] = lo | (hi << 16);
        }
}

#define DP(a, xpair, w) a = (vf)_mm512_dpbf16_ps((__m512)a, (__m512bh)_mm512_set1_epi32((int)(xpair)), (__m512bh)(w))

#define BF16_BLOCK(R)                                                                                        \
    {                                                                                                        \
        for (int64_t kp = 0; kp < Kp; kp++) {                                                                \
            const __m512i w0 = _mm512_load_si512(pw + kp * PANEL);                                           \
            const __m512i w1 = _mm512_load_si512(pw + kp * PANEL + 16);                                      \
            for (int m = 0; m < (R); m++) {                                                                  \
                DP(acc[m][0], xr[m * Kp + kp], w0);                                                          \
                DP(acc[m][1], xr[m * Kp + kp], w1);                                                          \
            }                                                                                                \
        }                                                                                                    \
    }

static inline void one_row(const uint32_t* pw, const xin_t* xr, int64_t Kp, vf acc[MR][NV]) {
    vf odd0 = (vf){0}, odd1 = (vf){0};
    int64_t kp = 0;
    for (; kp + 1 < Kp; kp += 2) {
        DP(acc[0][0], xr[kp], _mm512_load_si512(pw + kp * PANEL));
        DP(acc[0][1], xr[kp], _mm512_load_si512(pw + kp * PANEL + 16));
        DP(odd0, xr[kp + 1], _mm512_load_si512(pw + kp * PANEL + 32));
        DP(odd1, xr[kp + 1], _mm512_load_si512(pw + kp * PANEL + 48));
    }
    for (; kp < Kp; kp++) {
        DP(acc[0][0], xr[kp], _mm512_load_si512(pw + kp * PANEL));
        DP(acc[0][1], xr[kp], _mm512_load_si512(pw + kp * PANEL + 16));
    }
    acc[0][0] += odd0;
    acc[0][1] += odd1;
}
#else
#define HAS_DP 0
typedef float xin_t;  /* an input row rounded to bf16 and widened back (exactly) [2 Kp], zero padded */
#define XIN_LEN(Kp) (2 * (Kp))

static inline void round_rows(const float* x, xin_t* xs, int64_t M, int64_t K, int64_t Kp) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < 2 * Kp; k++) xs[m * 2 * Kp + k] = k < K ? bf2f(f2bf(x[m * K + k])) : 0.f;
}

/* a vector of pairs -> the low (even k) and high (odd k) halves as fp32 */
#define LO(u) ((vf)((u) << 16))
#define HI(u) ((vf)((u) & 0xffff0000u))

#define BF16_BLOCK(R)                                                                                        \
    {                                                                                                        \
        for (int64_t kp = 0; kp < Kp; kp++) {                                                                \
            const vu* wk = (const vu*)(pw + kp * PANEL);                                                     \
            for (int j = 0; j < NV; j++) {                                                                   \
                const vu u = wk[j];                                                                          \
                const vf lo = LO(u), hi = HI(u);                                                             \
                for (int m = 0; m < (R); m++)                                                                \
                    acc[m][j] += lo * xr[m * 2 * Kp + 2 * kp] + hi * xr[m * 2 * Kp + 2 * kp + 1];            \
            }                                                                                                \
        }                                                                                                    \
    }

static inline void one_row(const uint32_t* pw, const xin_t* xr, int64_t Kp, vf acc[MR][NV]) {
    vf odd[NV];
    for (int j = 0; j < NV; j++) odd[j] = (vf){0};
    for (int64_t kp = 0; kp < Kp; kp++) {
        const vu* wk = (const vu*)(pw + kp * PANEL);
        for (int j = 0; j < NV; j++) {
            acc[0][j] += LO(wk[j]) * xr[2 * kp];
            odd[j] += HI(wk[j]) * xr[2 * kp + 1];
        }
    }
    for (int j = 0; j < NV; j++) acc[0][j] += odd[j];
}
#endif

/* Every row block of the rounded rows xs against panel p. */
static inline void bf16_panel(const xin_t* xs, const uint32_t* wp, const float* bias, const float* c, float* y,
                              int64_t M, int64_t N, int64_t Kp, int64_t ldy, int64_t p) {
    const uint32_t* pw = wp + p * Kp * PANEL;
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int rows = M - m0 < MR ? (int)(M - m0) : MR;
        const xin_t* xr = xs + m0 * XIN_LEN(Kp);
        vf acc[MR][NV];
        for (int m = 0; m < MR; m++)
            for (int j = 0; j < NV; j++) acc[m][j] = (vf){0};
        if (rows == 1) one_row(pw, xr, Kp, acc);
#if MR > 2
        else if (rows == 2) BF16_BLOCK(2)
        else if (rows == 3) BF16_BLOCK(3)
        else if (rows == 4) BF16_BLOCK(4)
        else if (rows == 5) BF16_BLOCK(5)
#endif
        else BF16_BLOCK(MR)
        store(acc, rows, bias, c, y, m0, p * PANEL, N, ldy);
    }
}

/* Returns 0, or -1 when out of memory for the rounded copy of x. */
int packed_linear_bf16(const float* x, const uint32_t* wp, const float* bias, const float* c, float* y, int64_t M,
                       int64_t N, int64_t K, int64_t ldy, int64_t threads) {
    const int64_t Kp = (K + 1) / 2, P = (N + PANEL - 1) / PANEL;
    xin_t* xs = (xin_t*)malloc(sizeof(xin_t) * (size_t)(M * XIN_LEN(Kp) > 0 ? M * XIN_LEN(Kp) : 1));
    if (!xs) return -1;
    round_rows(x, xs, M, K, Kp);
#define BF16_PANEL(p) bf16_panel(xs, wp, bias, c, y, M, N, Kp, ldy, p)
    FOR_PANELS(P, M, threads, BF16_PANEL)
#undef BF16_PANEL
    free(xs);
    return 0;
}

int64_t packed_has_dp(void) { return HAS_DP; }
int64_t packed_vector_width(void) { return VL; }
"""
)

# Rows up to which the packed kernels beat torch's product (MKL for fp32, oneDNN for bf16; above, the engine uses
# torch's), measured by benchmarks/gemm_packed.py on SmolLM2-135M's shapes at 2 threads, AMD EPYC Zen 5 (see
# benchmarks/README.md). fp32, AVX-512: 2.4x MKL at 1 row, 1.67x at 64, still 1.30x at 512 (the largest measured);
# AVX2 (x86-64-v3, torch held to AVX2): 1.53x at 64, 1.08x at 256. bf16 with AVX512-BF16: 2.2x oneDNN at 1 row,
# 1.30x at 64, 1.06x at 128, 0.88x at 256; without it (widened weights) 1.35-4.3x oneDNN's emulated bf16 from 1 to
# 256 rows.
MAX_ROWS_F32 = {16: 512, 8: 256}  # by floats per vector
MAX_ROWS_BF16 = {True: 128, False: 256}  # by has_dp


@dataclass(frozen=True)
class Kernel:
    """The packed kernels built for one target and the rows each dtype takes."""

    pack_f32_fn: Callable[..., None]
    pack_bf16_fn: Callable[..., None]
    f32_fn: Callable[..., int]
    bf16_fn: Callable[..., int]
    has_dp: bool  # the target has AVX512-BF16's dot product (else widened weights and FMA)
    vector_width: int  # floats per vector: 16 with AVX-512, 8 on the AVX2 baseline
    max_rows_f32: int
    max_rows_bf16: int

    def applies(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether `linear` takes x [M, K] fp32 (contiguous, CPU) against weights w [N, K] of fp32 or bf16: M from 1
        to this dtype's row limit."""
        m = x.shape[0]
        limit = self.max_rows_f32 if w.dtype == torch.float32 else self.max_rows_bf16
        return (
            1 <= m <= limit
            and x.dtype == torch.float32
            and w.dtype in (torch.float32, torch.bfloat16)
            and x.device.type == "cpu"
            and w.device.type == "cpu"
            and x.dim() == 2
            and w.dim() == 2
            and x.is_contiguous()
        )

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """w [N, K] (fp32 or bf16, row stride any, unit column stride) -> its panels: fp32 [ceil(N/32), K, 32],
        bf16 [ceil(N/32), ceil(K/2), 32] int32 (pairs). Zeros past N and past K."""
        if w.stride(-1) != 1:
            w = w.contiguous()
        n, k = w.shape
        panels = -(-n // PANEL)
        if w.dtype == torch.float32:
            out = torch.empty(panels, k, PANEL, dtype=torch.float32)
            fn = self.pack_f32_fn
        else:
            out = torch.empty(panels, (k + 1) // 2, PANEL, dtype=torch.int32)
            fn = self.pack_bf16_fn
        if out.data_ptr() % 64:  # the kernels' aligned loads; torch's CPU allocator aligns to 64 bytes
            raise RuntimeError("packed weights are not 64-byte aligned")
        fn(w.data_ptr(), out.data_ptr(), n, k, w.stride(0), torch.get_num_threads())
        return out

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None = None,
        add_to: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K] fp32 @ w [N, K].T (+ bias [N]) -> [M, N] fp32, w given by `packed` (= pack(w); w itself only
        for its shape and dtype); with `add_to` [M, N] (fp32, contiguous) the product is added into it in place
        and it is returned. The caller checks `applies` first."""
        m, k = x.shape
        n = w.shape[0]
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        out = add_to if add_to is not None else torch.empty(m, n, dtype=torch.float32)
        fn = self.f32_fn if w.dtype == torch.float32 else self.bf16_fn
        rc = fn(
            x.data_ptr(),
            packed.data_ptr(),
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
            raise MemoryError(f"packed_linear_bf16: no memory for a {m}x{k} input copy")
        return out


def load(march: str | None = None) -> Kernel | None:
    """The kernels built for `march` (default: build.default_march()), or None where they cannot be built or
    `AREAL_CPU_GEMM_PACKED=0` turns them off."""
    lib = load_library(
        "gemm_packed", _SOURCE, "AREAL_CPU_GEMM_PACKED", "the few-rows kernels on unpacked weights", march
    )
    if lib is None:
        return None
    pack_args = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4
    lin_args = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5
    f32_fn = bind(lib, "packed_linear_f32", lin_args)
    bf16_fn = bind(lib, "packed_linear_bf16", lin_args)
    f32_fn.restype = bf16_fn.restype = ctypes.c_int
    info = {}
    for sym in ("packed_has_dp", "packed_vector_width"):
        f = getattr(lib, sym)
        f.restype, f.argtypes = ctypes.c_int64, []
        info[sym] = int(f())
    dp, vl = bool(info["packed_has_dp"]), info["packed_vector_width"]
    return Kernel(
        bind(lib, "packed_pack_f32", pack_args),
        bind(lib, "packed_pack_bf16", pack_args),
        f32_fn,
        bf16_fn,
        dp,
        vl,
        MAX_ROWS_F32.get(vl, 256),
        MAX_ROWS_BF16[dp],
    )
