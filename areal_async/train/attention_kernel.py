"""Training attention (forward and backward) for short sequences on CPU: a small C kernel, built on first use.

Why: the trainer's rows are short (one sample or one shared prompt per row, 30-300 tokens), and torch's CPU flash
attention runs them far below the matmuls beside it: on SmolLM2-135M in bf16 on an AMD EPYC Zen 5, forward and
backward together were ~19% of a train step at ~20 GFLOP/s, a twentieth of the bf16 GEMM rate
(benchmarks/README.md). Its per-tile overhead dominates at these lengths, it upcasts every tile of keys again
for each query tile, and with a mask (the shared-prefix layout's second pass) it copies the keys and values once per
query head (transformers' repeat_kv). This kernel works one (row, kv head) at a time: that head's keys and values
are converted to fp32 once (kept transposed for the score products) and serve all the query heads that share them,
four query rows at a time against all their visible keys (scores, softmax, values in one go: a row of 300 keys fits
in L1). Key blocks past the last visible key of the four rows are skipped (the causal upper triangle, a mask's
trailing padding). Arithmetic is fp32 FMA on fp32 copies of the bf16 inputs, as torch's kernel does; outputs are
rounded once to the input dtype.

Backward recomputes the scores from the saved log-sum-exp (no [L, Lk] tensor is kept between passes) and
accumulates dK, dV for a kv head over its query heads in fp32, so GQA needs no copies and no atomics.

Plain C with GCC vector extensions (16 floats with AVX-512, 8 on the portable AVX2 baseline), loaded with ctypes
(areal_async/server/kernels/build.py). `AREAL_TRAIN_ATTENTION=0` turns it off; where it cannot be built `load()`
returns None and the trainer keeps torch's SDPA (train/attention.py decides per call).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from areal_async.server.kernels.build import BF16_C, EXP_POLY_C, bind, load_library

__all__ = ["Kernel", "load", "MAX_KEYS"]

MAX_KEYS = 2048  # scratch per (row, kv head) is ~6 x keys x head_dim floats; longer rows keep torch's flash kernel

_SOURCE = (
    EXP_POLY_C
    + BF16_C
    + r"""
#include <stdlib.h>
#include <math.h>

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
/* Register blocking: RB query rows x NV vectors of accumulators (16 of AVX-512's 32 registers, 8 of AVX2's 16) */
#if VL == 16
#define RB 8
#else
#define RB 4
#endif
#define NV 2
#define DC (NV * VL)  /* head-dim floats per register block: head_dim must be a multiple */
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
#define LD(p) (*(const vfu*)(p))
#define ST(p, v) (*(vfu*)(p) = (v))

/* params: B, H, Hkv, L, Lk, D, q strides (b, h, l), k strides, v strides, mask strides (b, l), causal, bf16,
   threads. Strides in elements; the head dim is contiguous everywhere. */
enum { P_B, P_H, P_HKV, P_L, P_LK, P_D, P_QB, P_QH, P_QL, P_KB, P_KH, P_KL, P_VB, P_VH, P_VL, P_MB, P_ML,
       P_CAUSAL, P_BF16, P_THREADS, P_N };


static inline float ld(const void* p, int64_t i, int bf16) {
    return bf16 ? bf2f(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

/* dst[i] = src[i] * mul (n values, bf16 or fp32) as fp32, and back: the branch outside the loops, so they vectorise */
static inline void load_vec(const void* src, int64_t off, int64_t n, int bf16, float mul, float* dst) {
    if (bf16) {
        const uint16_t* s = (const uint16_t*)src + off;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = mul * bf2f(s[i]);
    } else {
        const float* s = (const float*)src + off;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = mul * s[i];
    }
}

static inline void store_vec(void* dst, int64_t off, int64_t n, int bf16, float mul, const float* src) {
    if (bf16) {
        uint16_t* d = (uint16_t*)dst + off;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = f2bf(mul * src[i]);
    } else {
        float* d = (float*)dst + off;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = mul * src[i];
    }
}


/* Keys visible to the block's rows i0..i0+nr-1 lie below the returned bound (the last visible key + 1). */
static int64_t key_end(const uint8_t* mrow0, int64_t sml, int64_t i0, int64_t nr, int64_t Lk, int causal) {
    int64_t end = causal ? (i0 + nr < Lk ? i0 + nr : Lk) : Lk;
    if (!mrow0) return end;
    int64_t best = 0;
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t* m = mrow0 + (i0 + r) * sml;
        int64_t j = end;
        while (j > best && !m[j - 1]) j--;
        if (j > best) best = j;
    }
    return best;
}

/* Scores of keys row i does not see become -inf: past i when causal, where the mask row is 0. */
static inline void mask_row(float* sr, const uint8_t* mrow, int64_t i, int64_t jend, int causal) {
    if (causal)
        for (int64_t j = i + 1; j < jend; j++) sr[j] = -INFINITY;
    if (mrow) {
        #pragma omp simd
        for (int64_t j = 0; j < jend; j++) sr[j] = mrow[j] ? sr[j] : -INFINITY;
    }
}

/* S[r, j] = sum_d A[r, d] Bt[d, j] for r < RB, j < jend rounded up to 2 VL (Bt has row stride ldb, zero padded). */
static void block_scores(const float* A, const float* Bt, int64_t ldb, int64_t D, int64_t jend, float* S,
                         int64_t lds) {
    for (int64_t j0 = 0; j0 < jend; j0 += 2 * VL) {
        vf acc[RB][2];
        for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = (vf){0};
        for (int64_t d = 0; d < D; d++) {
            const vf b0 = LD(Bt + d * ldb + j0), b1 = LD(Bt + d * ldb + j0 + VL);
            for (int r = 0; r < RB; r++) {
                const float a = A[r * D + d];
                acc[r][0] += a * b0;
                acc[r][1] += a * b1;
            }
        }
        for (int r = 0; r < RB; r++) {
            ST(S + r * lds + j0, acc[r][0]);
            ST(S + r * lds + j0 + VL, acc[r][1]);
        }
    }
}

/* Out[r, :] = sum_{j < jend} W[r, j] Rows[j, :] for r < RB, head dim D (a multiple of DC). */
static void block_combine(const float* W, int64_t ldw, const float* Rows, int64_t D, int64_t jend, float* Out) {
    for (int64_t dc = 0; dc < D; dc += DC) {
        vf acc[RB][NV];
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < NV; c++) acc[r][c] = (vf){0};
        for (int64_t j = 0; j < jend; j++) {
            vf x[NV];
            for (int c = 0; c < NV; c++) x[c] = LD(Rows + j * D + dc + c * VL);
            for (int r = 0; r < RB; r++) {
                const float w = W[r * ldw + j];
                for (int c = 0; c < NV; c++) acc[r][c] += w * x[c];
            }
        }
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < NV; c++) ST(Out + r * D + dc + c * VL, acc[r][c]);
    }
}

/* Acc[j, :] += sum_r W[r, j] X[r, :] for j < jend: the transposed product, into fp32 rows. */
static void block_accumulate(const float* W, int64_t ldw, const float* X, int64_t D, int64_t jend, float* Acc) {
    for (int64_t dc = 0; dc < D; dc += DC) {
        vf x[RB][NV];
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < NV; c++) x[r][c] = LD(X + r * D + dc + c * VL);
        for (int64_t j = 0; j < jend; j++) {
            float* a = Acc + j * D + dc;
            vf acc[NV];
            for (int c = 0; c < NV; c++) acc[c] = LD(a + c * VL);
            for (int r = 0; r < RB; r++) {
                const float w = W[r * ldw + j];
                for (int c = 0; c < NV; c++) acc[c] += w * x[r][c];
            }
            for (int c = 0; c < NV; c++) ST(a + c * VL, acc[c]);
        }
    }
}

/* Row j of one (row b, kv head g) of K or V as fp32: rows [Lk, D] and/or transposed [D, ldt] (zero padded). */
static void load_kv(const void* src, int64_t base, int64_t sl, int64_t Lk, int64_t D, int bf16, float* rows,
                    float* trans, int64_t ldt) {
    if (trans) memset(trans, 0, sizeof(float) * D * ldt);
    for (int64_t j = 0; j < Lk; j++)
        for (int64_t d = 0; d < D; d++) {
            const float x = ld(src, base + j * sl + d, bf16);
            if (rows) rows[j * D + d] = x;
            if (trans) trans[d * ldt + j] = x;
        }
}

/* One block's query rows as fp32 times `mul` [RB, D]; rows past nr repeat the last (computed, never used). */
static void load_rows(const void* src, int64_t base, int64_t sl, int64_t nr, int64_t D, int bf16, float mul,
                      float* out) {
    for (int r = 0; r < RB; r++) load_vec(src, base + (r < nr ? r : nr - 1) * sl, D, bf16, mul, out + r * D);
}

/* out [B, L, H, D] = softmax(scale q k^T + mask) v per (b, h) with kv head h / (H / Hkv); lse [B, H, L] fp32 (the
   log-sum-exp of each row's scaled scores, -inf for a row that sees no key, whose output is 0). */
void attn_fwd(const void* q, const void* k, const void* v, const uint8_t* mask, void* out, float* lse,
              const int64_t* p, float scale) {
    const int64_t B = p[P_B], H = p[P_H], Hkv = p[P_HKV], L = p[P_L], Lk = p[P_LK], D = p[P_D];
    const int64_t G = H / Hkv, ldt = (Lk + 2 * VL - 1) / (2 * VL) * (2 * VL);
    const int causal = (int)p[P_CAUSAL], bf16 = (int)p[P_BF16];
    #pragma omp parallel for schedule(dynamic, 1) num_threads(p[P_THREADS])
    for (int64_t t = 0; t < B * Hkv; t++) {
        const int64_t b = t / Hkv, g = t % Hkv;
        float* kt = malloc(sizeof(float) * (D * ldt + ldt * D + RB * ldt + 2 * RB * D));
        float* vr = kt + D * ldt;
        float* s = vr + ldt * D;
        float* qb = s + RB * ldt;
        float* ob = qb + RB * D;
        load_kv(k, b * p[P_KB] + g * p[P_KH], p[P_KL], Lk, D, bf16, NULL, kt, ldt);
        load_kv(v, b * p[P_VB] + g * p[P_VH], p[P_VL], Lk, D, bf16, vr, NULL, 0);
        const uint8_t* mb = mask ? mask + b * p[P_MB] : NULL;
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
            for (int64_t i0 = 0; i0 < L; i0 += RB) {
                const int64_t nr = L - i0 < RB ? L - i0 : RB;
                const int64_t jend = key_end(mb, p[P_ML], i0, nr, Lk, causal);
                load_rows(q, b * p[P_QB] + h * p[P_QH] + i0 * p[P_QL], p[P_QL], nr, D, bf16, scale, qb);
                block_scores(qb, kt, ldt, D, jend, s, ldt);
                for (int64_t r = 0; r < RB; r++) {
                    float* sr = s + r * ldt;
                    if (r >= nr) {
                        for (int64_t j = 0; j < jend; j++) sr[j] = 0.f;
                        continue;
                    }
                    const int64_t i = i0 + r;
                    mask_row(sr, mb ? mb + i * p[P_ML] : NULL, i, jend, causal);
                    float mx = -INFINITY;
                    #pragma omp simd reduction(max:mx)
                    for (int64_t j = 0; j < jend; j++) mx = sr[j] > mx ? sr[j] : mx;
                    float sum = 0.f;
                    if (mx == -INFINITY) {
                        for (int64_t j = 0; j < jend; j++) sr[j] = 0.f;
                    } else {
                        #pragma omp simd reduction(+:sum)
                        for (int64_t j = 0; j < jend; j++) {
                            const float e = sr[j] == -INFINITY ? 0.f : exp_poly(sr[j] - mx);
                            sr[j] = e;
                            sum += e;
                        }
                        const float inv = 1.f / sum;
                        #pragma omp simd
                        for (int64_t j = 0; j < jend; j++) sr[j] *= inv;
                    }
                    lse[(b * H + h) * L + i] = mx == -INFINITY ? -INFINITY : mx + logf(sum);
                }
                block_combine(s, ldt, vr, D, jend, ob);
                for (int64_t r = 0; r < nr; r++)
                    store_vec(out, ((b * L + i0 + r) * H + h) * D, D, bf16, 1.f, ob + r * D);
            }
        }
        free(kt);
    }
}

/* Gradients of attn_fwd: dout [B, L, H, D] (contiguous) -> dq [B, L, H, D], dk [B, Hkv, Lk, D], dv likewise,
   from the forward's out and lse. */
void attn_bwd(const void* q, const void* k, const void* v, const uint8_t* mask, const void* out, const float* lse,
              const void* dout, void* dq, void* dk, void* dv, const int64_t* p, float scale) {
    const int64_t B = p[P_B], H = p[P_H], Hkv = p[P_HKV], L = p[P_L], Lk = p[P_LK], D = p[P_D];
    const int64_t G = H / Hkv, ldt = (Lk + 2 * VL - 1) / (2 * VL) * (2 * VL);
    const int causal = (int)p[P_CAUSAL], bf16 = (int)p[P_BF16];
    #pragma omp parallel for schedule(dynamic, 1) num_threads(p[P_THREADS])
    for (int64_t t = 0; t < B * Hkv; t++) {
        const int64_t b = t / Hkv, g = t % Hkv;
        const size_t kvsz = (size_t)D * ldt;
        float* kt = malloc(sizeof(float) * (6 * kvsz + 2 * RB * ldt + 4 * RB * D));
        float* vt = kt + kvsz;     /* [D, ldt] */
        float* kr = vt + kvsz;     /* [ldt, D] */
        float* dka = kr + kvsz;    /* [ldt, D] fp32 accumulators */
        float* dva = dka + kvsz;
        float* s = dva + kvsz;     /* [RB, ldt]: scores, then P */
        float* dp = s + RB * ldt;  /* [RB, ldt]: dP, then dS */
        float* qb = dp + RB * ldt; /* [RB, D] scale * q */
        float* gb = qb + RB * D;   /* [RB, D] dout */
        float* ob = gb + RB * D;   /* [RB, D] dq block */
        float* unused = ob + RB * D;
        (void)unused;
        load_kv(k, b * p[P_KB] + g * p[P_KH], p[P_KL], Lk, D, bf16, kr, kt, ldt);
        load_kv(v, b * p[P_VB] + g * p[P_VH], p[P_VL], Lk, D, bf16, NULL, vt, ldt);
        memset(dka, 0, sizeof(float) * 2 * kvsz);
        const uint8_t* mb = mask ? mask + b * p[P_MB] : NULL;
        const int64_t ol = H * D;  /* row stride of out, dout, dq */
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
            for (int64_t i0 = 0; i0 < L; i0 += RB) {
                const int64_t nr = L - i0 < RB ? L - i0 : RB;
                const int64_t jend = key_end(mb, p[P_ML], i0, nr, Lk, causal);
                load_rows(q, b * p[P_QB] + h * p[P_QH] + i0 * p[P_QL], p[P_QL], nr, D, bf16, scale, qb);
                load_rows(dout, ((b * L + i0) * H + h) * D, ol, nr, D, bf16, 1.f, gb);
                block_scores(qb, kt, ldt, D, jend, s, ldt);
                block_scores(gb, vt, ldt, D, jend, dp, ldt);
                for (int64_t r = 0; r < RB; r++) {
                    float* sr = s + r * ldt;
                    float* dr = dp + r * ldt;
                    const int64_t i = i0 + r;
                    const float l = r < nr ? lse[(b * H + h) * L + i] : -INFINITY;
                    if (l == -INFINITY) {
                        for (int64_t j = 0; j < jend; j++) sr[j] = dr[j] = 0.f;
                        continue;
                    }
                    float di = 0.f;  /* sum_d dout * out: the softmax backward's row term */
                    load_vec(out, ((b * L + i) * H + h) * D, D, bf16, 1.f, ob);
                    #pragma omp simd reduction(+:di)
                    for (int64_t d = 0; d < D; d++) di += gb[r * D + d] * ob[d];
                    mask_row(sr, mb ? mb + i * p[P_ML] : NULL, i, jend, causal);
                    #pragma omp simd
                    for (int64_t j = 0; j < jend; j++) {
                        const float pj = sr[j] == -INFINITY ? 0.f : exp_poly(sr[j] - l);
                        sr[j] = pj;
                        dr[j] = pj * (dr[j] - di);
                    }
                }
                block_combine(dp, ldt, kr, D, jend, ob);  /* dq = scale dS K */
                for (int64_t r = 0; r < nr; r++)
                    store_vec(dq, ((b * L + i0 + r) * H + h) * D, D, bf16, scale, ob + r * D);
                block_accumulate(dp, ldt, qb, D, jend, dka);  /* dk += dS^T (scale q) */
                block_accumulate(s, ldt, gb, D, jend, dva);   /* dv += P^T dout */
            }
        }
        store_vec(dk, (b * Hkv + g) * Lk * D, Lk * D, bf16, 1.f, dka);
        store_vec(dv, (b * Hkv + g) * Lk * D, Lk * D, bf16, 1.f, dva);
        free(kt);
    }
}

int64_t attn_vector_width(void) { return VL; }
"""
)


@dataclass(frozen=True)
class Kernel:
    """The built forward and backward for one target."""

    fwd: Callable[..., None]
    bwd: Callable[..., None]
    vector_width: int  # floats per vector: 16 with AVX-512, 8 on the AVX2 baseline

    def supports(self, head_dim: int, keys: int, dtype: torch.dtype) -> bool:
        """Shapes and dtypes this build computes: head dims in whole register blocks (2 vectors), rows up to
        MAX_KEYS keys, bf16 or fp32."""
        return head_dim % (2 * self.vector_width) == 0 and 0 < keys <= MAX_KEYS and dtype in _DTYPES


_DTYPES = (torch.bfloat16, torch.float32)


def load(march: str | None = None) -> Kernel | None:
    """The kernel built for `march` (default: build.default_march()), or None where it cannot be built
    (`AREAL_TRAIN_ATTENTION=0` turns it off)."""
    lib = load_library("train_attention", _SOURCE, "AREAL_TRAIN_ATTENTION", "torch's SDPA in the trainer", march)
    if lib is None:
        return None
    fwd = bind(lib, "attn_fwd", [ctypes.c_void_p] * 7 + [ctypes.c_float])
    bwd = bind(lib, "attn_bwd", [ctypes.c_void_p] * 11 + [ctypes.c_float])
    width = lib.attn_vector_width
    width.restype, width.argtypes = ctypes.c_int64, []
    return Kernel(fwd, bwd, int(width()))


def params(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, threads: int) -> Tensor:
    """The kernel's int64 parameter block for q [B, H, L, D], k/v [B, Hkv, Lk, D] and a mask [B|1, 1, L, Lk] (uint8,
    last dim contiguous) or None."""
    b, h, length, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    mb, ml = (0, 0) if mask is None else ((mask.stride(0) if mask.shape[0] > 1 else 0), mask.stride(2))
    vals = [b, h, hkv, length, lk, d, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], mb, ml]
    vals += [int(causal), int(q.dtype == torch.bfloat16), threads]
    return torch.tensor(vals, dtype=torch.int64)
