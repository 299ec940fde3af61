"""Decode attention straight from the paged KV cache on CPU: a small C kernel, built on first use.

Why: with one new token per request, attention is bound by reading the cache. The portable path (gather every
request's pages into a padded batch, then SDPA with an additive mask) reads the keys and values three times
(gather, write, attend), pads every row to the longest and, with grouped-query attention, works per query head.
In a SmolLM2-135M decode step at batch 64 and ~150 tokens of context that was 40% of the step (profiled, 2 threads:
gather 34 ms + SDPA 35 ms of 173 ms). This kernel reads each key and value once, straight from its page, for all
query heads that share it, with no padding: one pass per request over its pages, parallel over requests with
OpenMP. Within a page (16 keys, 24 KB for SmolLM2: it stays in L1) it works one kv head at a time: the scores of
its query heads, one online-softmax update per head and page with a vectorised exp, then the values; meanwhile the
next page (pages are scattered, so the hardware prefetcher cannot guess it) is prefetched. Against the first
version (one online-softmax update per key with scalar expf), 30 layers of SmolLM2 at batch 64 and mean context
168 with the cache cold: 46 -> 36 ms at 2 threads, 88 -> 72 ms at 1 (scratch A/B of the two builds).

The cache may hold fp32 or bf16 (bf16 serving): one copy of the kernel per element type, the bf16 one widening
each key and value to fp32 as it reads it (a 16-bit shift, exact), so a bf16 cache halves the bytes read and the
arithmetic stays fp32.

It is plain C, built on first use and loaded with ctypes (build.py). Where no compiler is found or the build
fails, `load()` returns None and the engine uses the portable path (logged once). `AREAL_CPU_ATTENTION=0` turns the
kernel off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from areal_async.server.kernels.build import EXP_POLY_C, bind, load_library

_HEADER = r"""#include <float.h>

#define MAX_HEADS 128
#define MAX_HEAD_DIM 256
#define MAX_PAGE 64

/* the cache's element types: fp32, and bf16 widened to fp32 by a 16-bit shift (exact) */
#define KV_T_f32 float
#define LDKV_f32(v) (v)
#define KV_T_bf16 uint16_t
static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
#define LDKV_bf16(v) bf16_to_f32(v)

"""

# One copy of the kernel per cache element type (the suffix names it: f32, bf16); q, the scores, the softmax and
# the accumulators are fp32 in both.
_TEMPLATE = r"""
/* One page of one row for one kv head: the G query heads that share it. Scores for the page's m keys, one online
   softmax update per head and page, then the values weighted into the accumulators. DD is the head dim (a
   compile-time constant in the specialised copies, so the accumulators live in registers). */
#define PAGE_BODY_@S@(DD)                                                                                          \
    for (int64_t j = 0; j < m; j++) {                                                                          \
        const KV_T_@S@* kh = base + j * row + g * (DD);                                                           \
        for (int64_t h = 0; h < G; h++) {                                                                      \
            const float* qh = qg + h * (DD);                                                                   \
            float a = 0.f;                                                                                     \
            _Pragma("omp simd reduction(+:a)")                                                                 \
            for (int64_t d = 0; d < (DD); d++) a += qh[d] * LDKV_@S@(kh[d]);                                             \
            s[h * MAX_PAGE + j] = a;                                                                           \
        }                                                                                                      \
    }                                                                                                          \
    for (int64_t h = 0; h < G; h++) {                                                                          \
        float* sh = s + h * MAX_PAGE;                                                                          \
        float bm = mx[g * G + h];                                                                              \
        for (int64_t j = 0; j < m; j++) bm = sh[j] > bm ? sh[j] : bm;                                          \
        const float c = exp_poly(mx[g * G + h] - bm);                                                           \
        float ps = 0.f;                                                                                        \
        _Pragma("omp simd reduction(+:ps)")                                                                    \
        for (int64_t j = 0; j < m; j++) { const float e = exp_poly(sh[j] - bm); sh[j] = e; ps += e; }           \
        sum[g * G + h] = sum[g * G + h] * c + ps;                                                              \
        mx[g * G + h] = bm;                                                                                    \
        float* ah = acc + (g * G + h) * (DD);                                                                  \
        if (c != 1.f) {                                                                                        \
            _Pragma("omp simd")                                                                                \
            for (int64_t d = 0; d < (DD); d++) ah[d] *= c;                                                     \
        }                                                                                                      \
    }                                                                                                          \
    for (int64_t h = 0; h < G; h++) {                                                                          \
        float* ah = acc + (g * G + h) * (DD);                                                                  \
        const float* sh = s + h * MAX_PAGE;                                                                    \
        for (int64_t j = 0; j < m; j++) {                                                                      \
            const KV_T_@S@* vh = base + j * row + (Hkv + g) * (DD);                                               \
            const float p = sh[j];                                                                             \
            _Pragma("omp simd")                                                                                \
            for (int64_t d = 0; d < (DD); d++) ah[d] += p * LDKV_@S@(vh[d]);                                             \
        }                                                                                                      \
    }

void paged_decode_attention_@S@(const float* q, const KV_T_@S@* kv, const int64_t* table, const int64_t* lens, float* out,
                            int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t P, int64_t page_size,
                            int64_t threads) {
    const int64_t G = H / Hkv, row = 2 * Hkv * D, page_stride = page_size * row;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = lens[b];
        const float* qb = q + b * H * D;
        float* ob = out + b * H * D;
        float acc[MAX_HEADS * MAX_HEAD_DIM];
        float mx[MAX_HEADS], sum[MAX_HEADS];
        float s[MAX_HEADS * MAX_PAGE];
        for (int64_t i = 0; i < H * D; i++) acc[i] = 0.f;
        for (int64_t i = 0; i < H; i++) { mx[i] = -FLT_MAX; sum[i] = 0.f; }
        const int64_t* pages = table + b * P;
        for (int64_t s0 = 0; s0 < n; s0 += page_size) {
            const KV_T_@S@* base = kv + pages[s0 / page_size] * page_stride;
            if (s0 + page_size < n) {  /* the next page, while this one is worked on */
                const char* nxt = (const char*)(kv + pages[s0 / page_size + 1] * page_stride);
                for (int64_t o = 0; o < page_stride * (int64_t)sizeof(KV_T_@S@); o += 64) __builtin_prefetch(nxt + o, 0, 3);
            }
            const int64_t m = n - s0 < page_size ? n - s0 : page_size;
            for (int64_t g = 0; g < Hkv; g++) {
                const float* qg = qb + g * G * D;
                if (D == 64) { PAGE_BODY_@S@(64) }
                else if (D == 128) { PAGE_BODY_@S@(128) }
                else { PAGE_BODY_@S@(D) }
            }
        }
        for (int64_t hq = 0; hq < H; hq++) {
            const float inv = sum[hq] > 0.f ? 1.f / sum[hq] : 0.f;
            for (int64_t d = 0; d < D; d++) ob[hq * D + d] = acc[hq * D + d] * inv;
        }
    }
}
"""
_SOURCE = EXP_POLY_C + _HEADER + _TEMPLATE.replace("@S@", "f32") + _TEMPLATE.replace("@S@", "bf16")
MAX_HEADS, MAX_HEAD_DIM, MAX_PAGE = 128, 256, 64


@dataclass(frozen=True)
class Kernel:
    """The built kernel of one target: one C function per cache element type."""

    f32: Callable[..., None]
    bf16: Callable[..., None]


def load(march: str | None = None) -> Kernel | None:
    """The kernel built for `march` (default: cpu_build.default_march()), or None where it cannot be built
    (build.py; `AREAL_CPU_ATTENTION=0` turns it off)."""
    lib = load_library("paged_attention", _SOURCE, "AREAL_CPU_ATTENTION", "gather + SDPA", march)
    if lib is None:
        return None
    args = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7
    return Kernel(bind(lib, "paged_decode_attention_f32", args), bind(lib, "paged_decode_attention_bf16", args))


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel serves this model with a cache of `dtype` (fp32 or bf16; queries are fp32)."""
    return (
        dtype in (torch.float32, torch.bfloat16)
        and num_heads <= MAX_HEADS
        and head_dim <= MAX_HEAD_DIM
        and num_heads % num_kv_heads == 0
    )


def paged_decode_attention(
    kernel: Kernel, q: torch.Tensor, kv_pages: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, num_kv_heads: int
) -> torch.Tensor:
    """q [B, H, D] fp32 (scaled), kv_pages [num_pages, page_size, 2 * Hkv, D] fp32 or bf16, table [B, P] long,
    lens [B] long (all on CPU) -> [B, H, D] fp32. Row b attends to its first lens[b] keys, read through its pages."""
    b, h, d = q.shape
    if kv_pages.shape[1] > MAX_PAGE:
        raise ValueError(f"page size {kv_pages.shape[1]} is above the kernel's {MAX_PAGE}")
    if q.dtype != torch.float32 or kv_pages.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"queries {q.dtype} and cache {kv_pages.dtype}: the kernel takes fp32 queries, fp32/bf16 cache")
    fn = kernel.bf16 if kv_pages.dtype == torch.bfloat16 else kernel.f32
    q = q.contiguous()
    table = table.contiguous()
    lens = lens.contiguous()
    out = torch.empty_like(q)
    fn(
        q.data_ptr(),
        kv_pages.data_ptr(),
        table.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        b,
        h,
        num_kv_heads,
        d,
        table.shape[1],
        kv_pages.shape[1],
        min(torch.get_num_threads(), b),
    )  # one task per row: no idle team
    return out
