"""The LM head's forward product `h W^T` from bf16 operands into fp32 logits on CPUs with AVX512-BF16: a small C
kernel, built on first use.

Why: train/lm_head.py computes the head's logits in fp32 (bf16 logits would put ~1e-2 of rounding into the loss's
importance ratios), and in a bf16 trainer both operands are bf16 values (the hidden states and the gathered
weight), so it upcasts them and runs an fp32 GEMM. On an AMD EPYC Zen 5 torch's fp32 GEMM runs at ~100 GFLOP/s
against ~400 for bf16, and for SmolLM2-135M (a 49k-row head, a fifth of the matmul parameters) that fp32 forward was
~9% of a bf16 train step. The AVX512-BF16 dot-product instruction multiplies bf16 pairs exactly and accumulates in
fp32, so the kernel computes the same fp32 logits (up to summation order, like any two fp32 GEMMs) at the bf16
instruction rate, with no bf16 rounding of the result.

Used by the trainer's head (train/lm_head.py) and by the CPU engine's head when it serves bf16 weights
(server/cpu_matmul.py), so it lives with the server's kernels: the trainer may import those, the server never
imports the trainer.

Layout: `pack` reorders W [N, K] once per call into panels of 32 columns, each k-pair of the 32 columns one 64-byte
vector (pairs of bf16, as the instruction reads them); the product then runs 12 rows x 32 columns of fp32
accumulators per block over the whole K, rows in blocks of MC that stay in L2.

Built only where the compiler targets AVX512-BF16 (`-march=native` on such a CPU); elsewhere `load()` returns None
and the head keeps torch's fp32 product. `AREAL_TRAIN_HEAD_KERNEL=0` turns it off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from areal_async.server.kernels.build import EXP_POLY_C, bind, load_library

__all__ = ["Kernel", "load", "PANEL"]

PANEL = 32  # columns per packed panel (two 16-lane vectors)

_SOURCE = (
    EXP_POLY_C
    + r"""
#include <math.h>

static inline uint16_t f2bf(float f) {  /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)((((u & 0x7fffffffu) > 0x7f800000u) ? (u | 0x400000u) : r) >> 16);  /* NaN stays NaN */
}

/* Per row of logits z [C, V] (fp32, scaled in place by inv_t): lse = log sum exp z, lp = z[target] - lse, and the
   entropy H = lse - sum p z = log s - sum e (z - max) / s. Two passes over a row (it stays in L2 between them);
   the sums in double, as a float sum of 49k terms could err by 3e-3 where a double's is nothing. */
void head_softmax_fwd(float* z, const int64_t* tgt, float* lp, float* lse, float* ent, int64_t C, int64_t V,
                      float inv_t, int64_t want_ent, int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads(C >= 2 ? threads : 1)
    for (int64_t r = 0; r < C; r++) {
        float* zr = z + r * V;
        float mx = -INFINITY;
        if (inv_t != 1.f) {
            #pragma omp simd reduction(max:mx)
            for (int64_t i = 0; i < V; i++) { const float x = zr[i] * inv_t; zr[i] = x; mx = x > mx ? x : mx; }
        } else {
            #pragma omp simd reduction(max:mx)
            for (int64_t i = 0; i < V; i++) mx = zr[i] > mx ? zr[i] : mx;
        }
        double s = 0.0, t = 0.0;
        if (want_ent) {
            #pragma omp simd reduction(+:s, t)
            for (int64_t i = 0; i < V; i++) {
                const float d = zr[i] - mx, e = exp_poly(d);
                s += (double)e;
                t += (double)(e * d);
            }
        } else {
            #pragma omp simd reduction(+:s)
            for (int64_t i = 0; i < V; i++) s += (double)exp_poly(zr[i] - mx);
        }
        const double ls = log(s);
        lse[r] = (float)((double)mx + ls);
        lp[r] = (float)((double)zr[tgt[r]] - (double)mx - ls);
        if (want_ent) ent[r] = (float)(ls - t / s);
    }
}

/* dz [C, V] (bf16 or fp32) of lp (and H) with respect to the unscaled logits, from the scaled z and lse:
   p = exp(z - lse); dz = (onehot g - p (g + g_ent (z - lse + H))) inv_t, rounded once to the output dtype. */
void head_softmax_bwd(const float* z, const float* lse, const float* ent, const float* glp, const float* gent,
                      const int64_t* tgt, void* dz, int64_t C, int64_t V, float inv_t, int64_t use_ent,
                      int64_t out_bf16, int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads(C >= 2 ? threads : 1)
    for (int64_t r = 0; r < C; r++) {
        const float* zr = z + r * V;
        const float l = lse[r], g = glp[r], ge = use_ent ? gent[r] : 0.f, h = use_ent ? ent[r] : 0.f;
        uint16_t* ob = (uint16_t*)dz + r * V;
        float* of = (float*)dz + r * V;
        if (out_bf16) {
            #pragma omp simd
            for (int64_t i = 0; i < V; i++) {
                const float lp = zr[i] - l;
                ob[i] = f2bf(-exp_poly(lp) * (g + ge * (lp + h)) * inv_t);
            }
        } else {
            #pragma omp simd
            for (int64_t i = 0; i < V; i++) {
                const float lp = zr[i] - l;
                of[i] = -exp_poly(lp) * (g + ge * (lp + h)) * inv_t;
            }
        }
        const int64_t j = tgt[r];
        const float lp = zr[j] - l, d = (g - exp_poly(lp) * (g + ge * (lp + h))) * inv_t;
        if (out_bf16) ob[j] = f2bf(d);
        else of[j] = d;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define MR 12      /* rows per register block: 12 x 2 accumulators + 2 weight vectors + 1 broadcast */
#define MC 240     /* rows per L2 block (a multiple of MR) */

/* bp [ceil(N / 32)][Kp][32] uint32 pairs (W[n, 2kp], W[n, 2kp + 1]); zeros past N and past K. */
void head_pack(const uint16_t* w, uint32_t* bp, int64_t N, int64_t K, int64_t ldw, int64_t threads) {
    const int64_t Kp = (K + 1) / 2, panels = (N + 31) / 32;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t nb = 0; nb < panels; nb++) {
        uint32_t* dst = bp + nb * Kp * 32;
        if (nb * 32 + 32 <= N && K % 2 == 0 && ldw % 2 == 0 && ((uintptr_t)w & 3) == 0) {
            /* whole panel: 32 rows of K / 2 pairs each, written k-pair by k-pair (64 contiguous bytes each) */
            const uint32_t* src[32];
            for (int c = 0; c < 32; c++) src[c] = (const uint32_t*)(w + (nb * 32 + c) * ldw);
            for (int64_t kp = 0; kp < Kp; kp++)
                for (int c = 0; c < 32; c++) dst[kp * 32 + c] = src[c][kp];
            continue;
        }
        for (int64_t c = 0; c < 32; c++) {
            const int64_t n = nb * 32 + c;
            for (int64_t kp = 0; kp < Kp; kp++) {
                uint32_t lo = 0, hi = 0;
                if (n < N) {
                    lo = w[n * ldw + 2 * kp];
                    hi = 2 * kp + 1 < K ? w[n * ldw + 2 * kp + 1] : 0;
                }
                dst[kp * 32 + c] = lo | (hi << 16);
            }
        }
    }
}

/* C[m, n] = sum_k A[m, k] W[n, k] (+ bias[n]) in fp32 for MR rows of A (row stride lda, K even or zero padded). */
static inline void block(const uint16_t* a, int64_t lda, const uint32_t* panel, int64_t Kp, const float* bias,
                        float* c, int64_t ldc, int64_t rows, int64_t n0, int64_t N) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < Kp; kp++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + kp * 32);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + kp * 32 + 16);
        for (int r = 0; r < MR; r++) {
            int32_t pair;
            memcpy(&pair, a + r * lda + 2 * kp, 4);
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
        }
    }
    const int64_t left = N - n0;
    const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? 0xffff : (left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1));
    __m512 bb0 = _mm512_setzero_ps(), bb1 = _mm512_setzero_ps();
    if (bias) {
        bb0 = _mm512_maskz_loadu_ps(m0, bias + n0);
        bb1 = _mm512_maskz_loadu_ps(m1, bias + n0 + 16);
    }
    for (int r = 0; r < rows; r++) {
        _mm512_mask_storeu_ps(c + r * ldc + n0, m0, _mm512_add_ps(acc[r][0], bb0));
        _mm512_mask_storeu_ps(c + r * ldc + n0 + 16, m1, _mm512_add_ps(acc[r][1], bb1));
    }
}

/* C [M, N] fp32 (row stride ldc) = A [M, K] bf16 (row stride lda) @ W^T (+ bias), W packed by head_pack. */
void head_forward(const uint16_t* a, const uint32_t* bp, const float* bias, float* c, int64_t M, int64_t N,
                  int64_t K, int64_t lda, int64_t ldc, int64_t threads) {
    const int64_t Kp = (K + 1) / 2, panels = (N + 31) / 32;
    const int64_t ldp = 2 * Kp;  /* padded row stride of the tail copy */
    uint16_t tail[MR * 2 * 4096];
    for (int64_t mc = 0; mc < M; mc += MC) {
        const int64_t mend = mc + MC < M ? mc + MC : M;
        #pragma omp parallel for schedule(static) num_threads(threads) private(tail)
        for (int64_t nb = 0; nb < panels; nb++) {
            const uint32_t* panel = bp + nb * Kp * 32;
            for (int64_t m0 = mc; m0 < mend; m0 += MR) {
                const int64_t rows = mend - m0 < MR ? mend - m0 : MR;
                if (rows == MR && K % 2 == 0) {
                    block(a + m0 * lda, lda, panel, Kp, bias, c + m0 * ldc, ldc, MR, nb * 32, N);
                } else {  /* the last rows (or an odd K): a zero-padded copy of MR rows */
                    memset(tail, 0, sizeof(uint16_t) * MR * ldp);
                    for (int64_t r = 0; r < rows; r++) memcpy(tail + r * ldp, a + (m0 + r) * lda, 2 * K);
                    block(tail, ldp, panel, Kp, bias, c + m0 * ldc, ldc, rows, nb * 32, N);
                }
            }
        }
    }
}

int64_t head_product_ok(void) { return 1; }
#else
int64_t head_product_ok(void) { return 0; }
#endif
"""
)

MAX_K = 4096  # the tail copy's row width (hidden sizes up to 4096)


@dataclass(frozen=True)
class Kernel:
    """The built kernels of one target: the log-softmax passes everywhere, the product where AVX512-BF16 is."""

    softmax_fwd_fn: Callable[..., None]
    softmax_bwd_fn: Callable[..., None]
    pack_fn: Callable[..., None] | None  # None: this target has no AVX512-BF16
    forward_fn: Callable[..., None] | None

    def applies(self, hidden: Tensor, weight: Tensor) -> bool:
        """Whether `pack` / `forward` take this product: an AVX512-BF16 build, bf16 hidden [M, K] and weight
        [V, K] on CPU, K up to MAX_K."""
        return (
            self.forward_fn is not None
            and hidden.device.type == "cpu"
            and hidden.dtype == weight.dtype == torch.bfloat16
            and hidden.dim() == 2
            and weight.dim() == 2
            and hidden.shape[1] == weight.shape[1] <= MAX_K
        )

    def pack(self, weight: Tensor) -> Tensor:
        """W [N, K] bf16 -> the panels `forward` reads: [ceil(N / 32), ceil(K / 2), 32] int32."""
        assert self.pack_fn is not None
        w = weight if weight.stride(-1) == 1 else weight.contiguous()
        n, k = w.shape
        packed = torch.empty(-(-n // PANEL), (k + 1) // 2, PANEL, dtype=torch.int32)
        self.pack_fn(w.data_ptr(), packed.data_ptr(), n, k, w.stride(0), torch.get_num_threads())
        return packed

    def forward(self, hidden: Tensor, packed: Tensor, n: int, bias: Tensor | None, out: Tensor | None = None) -> Tensor:
        """hidden [M, K] bf16 @ W^T (+ bias [N] fp32) -> [M, N] fp32 (into `out`, contiguous, when given), W as
        packed by `pack` with N rows."""
        assert self.forward_fn is not None
        h = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
        m, k = h.shape
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
        assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
        b = None if bias is None else bias.float().contiguous()
        self.forward_fn(
            h.data_ptr(),
            packed.data_ptr(),
            None if b is None else b.data_ptr(),
            out.data_ptr(),
            m,
            n,
            k,
            h.stride(0),
            n,
            torch.get_num_threads(),
        )
        return out

    def softmax_forward(
        self, z: Tensor, targets: Tensor, temperature: float, want_entropy: bool
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """z [C, V] fp32 contiguous logits, divided by `temperature` in place -> lp [C], lse [C], entropy [C] | None
        of softmax(z / T)."""
        c, v = z.shape
        tg = targets.to(torch.int64).contiguous()
        lp = torch.empty(c, dtype=torch.float32)
        lse = torch.empty(c, dtype=torch.float32)
        ent = torch.empty(c, dtype=torch.float32) if want_entropy else None
        self.softmax_fwd_fn(
            z.data_ptr(),
            tg.data_ptr(),
            lp.data_ptr(),
            lse.data_ptr(),
            None if ent is None else ent.data_ptr(),
            c,
            v,
            1.0 / temperature,
            int(want_entropy),
            torch.get_num_threads(),
        )
        return lp, lse, ent

    def softmax_backward(
        self,
        z: Tensor,
        lse: Tensor,
        targets: Tensor,
        g_lp: Tensor,
        temperature: float,
        out_dtype: torch.dtype,
        ent: Tensor | None = None,
        g_ent: Tensor | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """d(sum g_lp lp + sum g_ent H) / d logits [C, V] in `out_dtype` (bf16 or fp32), from `softmax_forward`'s
        scaled z [C, V] and lse [C]; the entropy term where `ent` and `g_ent` [C] are given; into `out` [C, V]
        (contiguous) when given."""
        c, v = z.shape
        use_ent = ent is not None and g_ent is not None
        dz = torch.empty(c, v, dtype=out_dtype) if out is None else out
        assert dz.shape == (c, v) and dz.dtype == out_dtype and dz.is_contiguous()
        vecs = [t.float().contiguous() for t in (lse, g_lp)]
        extra = [t.float().contiguous() for t in (ent, g_ent)] if use_ent else [None, None]
        tg = targets.to(torch.int64).contiguous()
        self.softmax_bwd_fn(
            z.data_ptr(),
            vecs[0].data_ptr(),
            None if extra[0] is None else extra[0].data_ptr(),
            vecs[1].data_ptr(),
            None if extra[1] is None else extra[1].data_ptr(),
            tg.data_ptr(),
            dz.data_ptr(),
            c,
            v,
            1.0 / temperature,
            int(use_ent),
            int(out_dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        return dz


def load(march: str | None = None) -> Kernel | None:
    """The kernels built for `march` (default: build.default_march()), or None where they cannot be built
    (`AREAL_TRAIN_HEAD_KERNEL=0` turns them off); the product only where the target has AVX512-BF16."""
    lib = load_library("train_head", _SOURCE, "AREAL_TRAIN_HEAD_KERNEL", "torch's ops for the head", march)
    if lib is None:
        return None
    fwd = bind(
        lib, "head_softmax_fwd", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float] + [ctypes.c_int64] * 2
    )
    bwd = bind(
        lib, "head_softmax_bwd", [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 2 + [ctypes.c_float] + [ctypes.c_int64] * 3
    )
    ok = lib.head_product_ok
    ok.restype, ok.argtypes = ctypes.c_int64, []
    if not ok():
        return Kernel(fwd, bwd, None, None)
    pack_fn = bind(lib, "head_pack", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4)
    forward_fn = bind(lib, "head_forward", [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6)
    return Kernel(fwd, bwd, pack_fn, forward_fn)
