"""Decode attention straight from the paged KV cache on CPU: a small C kernel, built on first use.

Why: with one new token per request, attention reads each cached key and value once and does two multiply-adds
per element read for every query head that shares it. The portable path (gather every request's pages into a padded
batch, then SDPA with an additive mask) reads the cache three times (gather, write, attend), pads every row to the
longest and, with grouped-query attention, works per query head. This kernel reads each key and value once,
straight from its page, for all query heads that share it, with no padding: one pass per request over its pages,
parallel over requests with OpenMP.

At batch 64 the cache does not fit any cache level (SmolLM2-135M, context ~170: 0.5 GB of fp32 KV a step over 30
layers), so reading it is half the cost. Pages are scattered, so the hardware prefetcher cannot guess the next one:
the page PF_AHEAD on is prefetched into L2 (prefetcht1), a kv head's share between each kv head's work, running on
into the next row's first pages. Prefetching a whole page into L1 at once (the first version) stalled the core on
its miss buffers and overlapped nothing: with the arithmetic below, 30 layers at batch 64, 1 thread, that took
67 -> 48 ms with an fp32 cache and 68 -> 35 ms with bf16, near what a plain C loop needs to read the same
scattered pages on this machine (~40 and ~29 ms; AMD EPYC family 25 model 17, shared, scratch A/B).

How the arithmetic is laid out, and why: a score is a dot product over the head dim, which in SIMD ends in a
horizontal sum. Done per key (the first version: one `omp simd` reduction per key and query head) the horizontal
sums and the accumulators' trips through memory bound the kernel: ~9 GFLOP/s in a SmolLM2-135M step (78 ms of a
348 ms fp32 step at batch 64, and no faster with a bf16 cache that halves the bytes); with the cache hot, 26
GFLOP/s against 33 here, where this machine's FMA peak measured ~45 a thread under the same load. Here, per page and
kv head:
- scores: for each query head of the group, a block of VL keys (VL = 16 floats with AVX-512, 8 with AVX2) gets VL
  vector accumulators filled by vertical FMAs over the head dim; one shuffle-and-add tree (VL - 1 two-input
  shuffle pairs, `hsum_keys`) then turns the VL accumulators into one vector whose lane j is key j's score, so a
  block costs one tree instead of VL horizontal sums;
- one online-softmax update per query head and page (vectorised exp), the earlier accumulators' rescale folded
  into the next step;
- values: for each query head, its accumulator stays in registers (up to 4 vectors at a time) while the page's
  values are added with the weight broadcast, so no accumulator goes through memory per key.

The cache may hold fp32 or bf16 (bf16 serving). A bf16 page is widened once per kv head into an fp32 scratch (a
16-bit shift, exact) and attended from there, so the arithmetic is fp32 in both and the bf16 cache halves the bytes
read; an fp32 page is read in place. A head dim that is not a multiple of VL is padded with zeros in the scratch.
(`vdpbf16ps` would take bf16 queries too: their rounding would change the scores, so it is not used.)

It is plain C (GCC/Clang vector extensions, so one source serves the AVX-512 and the AVX2 builds), built on first
use and loaded with ctypes (build.py). Where no compiler is found or the build fails, `load()` returns None and the
engine uses the portable path (logged once). `AREAL_CPU_ATTENTION=0` turns the kernel off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from areal_async.server.kernels.build import EXP_POLY_C, bind, load_library


def _hsum_keys(vl: int) -> str:
    """The body of `hsum_keys` for vectors of `vl` floats: P[0..vl) -> one vector whose lane j is the sum of P[j]'s
    lanes. Each stage pairs neighbours with two shuffles and one add. After stage s, a vector holds 2^(s+1) keys,
    key(lane) = lane mod 2^(s+1), each spread over vl / 2^(s+1) lanes. Stage 0 (every input lane is one key) is the
    in-128-bit unpack; stage s >= 1 takes, per block of 2^(s+1) lanes, the first halves of both inputs' blocks (one
    shuffle) and the second halves (the other), which x86 does in one instruction each (shufps, vperm2f128,
    vshuff32x4)."""
    lines, cur, s = [], [f"P[{j}]" for j in range(vl)], 0
    while len(cur) > 1:
        if s == 0:
            a = [x for b in range(0, vl, 4) for x in (b, vl + b, b + 1, vl + b + 1)]
            c = [x for b in range(0, vl, 4) for x in (b + 2, vl + b + 2, b + 3, vl + b + 3)]
        else:
            bs, half = 2 ** (s + 1), 2**s
            a = [(lane - lane % bs) + (lane % bs if lane % bs < half else vl + lane % bs - half) for lane in range(vl)]
            c = [(lane - lane % bs) + (half + lane % bs if lane % bs < half else vl + lane % bs) for lane in range(vl)]
        ma, mc = ", ".join(map(str, a)), ", ".join(map(str, c))
        nxt = []
        for i in range(0, len(cur), 2):
            name = f"t{s}_{i // 2}"
            x, y = cur[i], cur[i + 1]
            lines.append(
                f"    const vf {name} = __builtin_shufflevector({x}, {y}, {ma})"
                f" + __builtin_shufflevector({x}, {y}, {mc});"
            )
            nxt.append(name)
        cur, s = nxt, s + 1
    return "\n".join([*lines, f"    return {cur[0]};"])


def _fold(vl: int, combine: str) -> str:
    """The body of a horizontal reduction of one vector `v` of `vl` floats: fold it in halves, `combine` (a C
    expression of `v` and `w`) joining each half with the other, then return lane 0."""
    lines, width = [], vl
    while width > 1:
        width //= 2
        idx = ", ".join(str((lane + width) % (2 * width) + lane // (2 * width) * 2 * width) for lane in range(vl))
        lines.append(f"    {{ const vf w = __builtin_shufflevector(v, v, {idx}); v = {combine}; }}")
    return "\n".join([*lines, "    return v[0];"])


_COMMON = r"""#include <float.h>

#define MAX_HEADS 128
#define MAX_HEAD_DIM 256
#define MAX_PAGE 64
#define PF_AHEAD 2  /* pages ahead of the one worked on */
#define PF_HINT 1  /* prefetcht1: into L2 (a whole page into L1 would stall on its miss buffers) */
#define NCB 4  /* accumulator vectors of one query head held in registers while a page's values are added */

#if defined(__AVX512F__)
#define VL 16
#define IOTA {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#else
#define VL 8
#define IOTA {0, 1, 2, 3, 4, 5, 6, 7}
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE vf ldv(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
ALWAYS_INLINE void stv(float* p, vf v) { memcpy(p, &v, sizeof v); }
ALWAYS_INLINE vf splat(float x) { return (vf){0} + x; }  /* x in every lane */
/* VL bf16 -> fp32: the 16 bits become the top half of the float (exact) */
ALWAYS_INLINE vf ld_bf16(const uint16_t* p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}
static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* lane j of the result: the sum of P[j]'s lanes (the tree is generated: attention.py _hsum_keys) */
ALWAYS_INLINE vf hsum_keys(const vf* P) {
#if VL == 16
@HSUM16@
#else
@HSUM8@
#endif
}

/* The scores of one query head q [Dp] against nj <= VL keys k + j * ldk (lanes past nj are 0): a vector
   accumulator per key filled by vertical FMAs, then one reduction tree for the block. */
ALWAYS_INLINE vf dot_block(const float* q, const float* k, int64_t ldk, int64_t nj, const int64_t Dp) {
    vf P[VL];
    _Pragma("GCC unroll 16")
    for (int j = 0; j < VL; j++) {
        vf a = {0};
        if (j < nj) {
            const float* kj = k + j * ldk;
            for (int64_t c = 0; c < Dp; c += VL) a += ldv(q + c) * ldv(kj + c);
        }
        P[j] = a;
    }
    return hsum_keys(P);
}

/* acc [Dp] = acc * scale + sum_j p[j] * v_j over m keys (v_j = v + j * vstride): up to NCB accumulator vectors
   stay in registers across the keys, in two sets (even and odd keys) so that each FMA chain is half as long. */
ALWAYS_INLINE void add_values(float* acc, float scale, const float* p, const float* v, int64_t vstride, int64_t m,
                              const int64_t Dp) {
    for (int64_t c0 = 0; c0 < Dp; c0 += NCB * VL) {
        const int64_t nc = (Dp - c0) / VL < NCB ? (Dp - c0) / VL : NCB;
        vf a[NCB], o[NCB];
        _Pragma("GCC unroll 4")
        for (int i = 0; i < NCB; i++) {
            a[i] = i < nc ? ldv(acc + c0 + i * VL) * scale : (vf){0};
            o[i] = (vf){0};
        }
        int64_t j = 0;
        for (; j + 1 < m; j += 2) {
            const vf p0 = splat(p[j]), p1 = splat(p[j + 1]);
            const float* v0 = v + j * vstride + c0;
            const float* v1 = v0 + vstride;
            _Pragma("GCC unroll 4")
            for (int i = 0; i < NCB; i++)
                if (i < nc) {
                    a[i] += p0 * ldv(v0 + i * VL);
                    o[i] += p1 * ldv(v1 + i * VL);
                }
        }
        if (j < m) {
            const vf p0 = splat(p[j]);
            _Pragma("GCC unroll 4")
            for (int i = 0; i < NCB; i++)
                if (i < nc) a[i] += p0 * ldv(v + j * vstride + c0 + i * VL);
        }
        _Pragma("GCC unroll 4")
        for (int i = 0; i < NCB; i++)
            if (i < nc) stv(acc + c0 + i * VL, a[i] + o[i]);
    }
}

/* lanes where mask (a comparison's result) is set from a, the others from b */
ALWAYS_INLINE vf select(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
ALWAYS_INLINE vf vmax(vf a, vf b) { return select(a > b, a, b); }

/* exp_poly (build.py) on a vector: the same steps lane by lane */
ALWAYS_INLINE vf exp_vec(vf x) {
    x = vmax(x, splat(-87.0f));
    x = select(x > 88.0f, splat(88.0f), x);
    const vf kf = EXP_KF(x);
    const vf r = EXP_R(x, kf);
    const vf p = EXP_HORNER(splat(1.3888949e-3f), r);
    return (vf)((vi)p + (__builtin_convertvector(kf, vi) << 23));
}

/* the max and the sum of a vector's lanes (folded in halves: attention.py _fold) */
ALWAYS_INLINE float hmax(vf v) {
#if VL == 16
@HMAX16@
#else
@HMAX8@
#endif
}

ALWAYS_INLINE float hsum(vf v) {
#if VL == 16
@HSUM_LANES16@
#else
@HSUM_LANES8@
#endif
}

/* One page (m keys) for one kv head and its G query heads qg [G, Dp]; k, v: the page's keys and values of this kv
   head, key j at k + j * ld (fp32, head dim padded to Dp). s: scratch scores [G, MAX_PAGE]; mx, sum, acc [G, Dp]:
   the heads' running softmax max, denominator and weighted values. Per head: the scores block by block (lanes
   past m masked), one online-softmax update for the page on those vectors, then the values. */
ALWAYS_INLINE void page_group(const float* qg, const float* k, const float* v, int64_t ld, int64_t m, int64_t G,
                              float* s, float* mx, float* sum, float* acc, const int64_t Dp) {
    const vi iota = IOTA;
    for (int64_t h = 0; h < G; h++) {
        float* sh = s + h * MAX_PAGE;
        vf top = splat(-FLT_MAX);
        for (int64_t j0 = 0; j0 < m; j0 += VL) {
            const int64_t nj = m - j0 < VL ? m - j0 : VL;
            const vf sc = select(iota < (vi){0} + (int32_t)nj, dot_block(qg + h * Dp, k + j0 * ld, ld, nj, Dp),
                                 splat(-FLT_MAX));
            stv(sh + j0, sc);
            top = vmax(top, sc);
        }
        const float bm = hmax(top) > mx[h] ? hmax(top) : mx[h];
        const float c = exp_poly(mx[h] - bm);
        vf ps = {0};
        for (int64_t j0 = 0; j0 < m; j0 += VL) {
            const vi live = iota < (vi){0} + (int32_t)(m - j0);
            const vf e = (vf)((vi)exp_vec(ldv(sh + j0) - bm) & live);
            stv(sh + j0, e);
            ps += e;
        }
        sum[h] = sum[h] * c + hsum(ps);
        mx[h] = bm;
        add_values(acc + h * Dp, c, sh, v, ld, m, Dp);
    }
}

/* a page's rows of one kv head into fp32 scratch [m, Dp], zero-padded past D */
static void widen_f32(const float* src, int64_t ld, int64_t m, int64_t D, int64_t Dp, float* dst) {
    for (int64_t j = 0; j < m; j++) {
        memcpy(dst + j * Dp, src + j * ld, (size_t)D * sizeof(float));
        for (int64_t d = D; d < Dp; d++) dst[j * Dp + d] = 0.f;
    }
}

static void widen_bf16(const uint16_t* src, int64_t ld, int64_t m, int64_t D, int64_t Dp, float* dst) {
    for (int64_t j = 0; j < m; j++) {
        const uint16_t* sj = src + j * ld;
        float* dj = dst + j * Dp;
        if (D == Dp) {
            for (int64_t d = 0; d < D; d += VL) stv(dj + d, ld_bf16(sj + d));
        } else {
            for (int64_t d = 0; d < D; d++) dj[d] = bf16_to_f32(sj[d]);
            for (int64_t d = D; d < Dp; d++) dj[d] = 0.f;
        }
    }
}
"""

# One copy of the row loop per cache element type (the suffix names it: f32, bf16); q, the scores, the softmax and
# the accumulators are fp32 in both. An fp32 page whose head dim is a multiple of VL is read in place.
_TEMPLATE = r"""
void paged_decode_attention_@S@(const float* q, const @T@* kv, const int64_t* table, const int64_t* lens, float* out,
                                int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t P, int64_t page_size,
                                int64_t threads) {
    const int64_t G = H / Hkv, row = 2 * Hkv * D, page_stride = page_size * row;
    const int64_t Dp = (D + VL - 1) / VL * VL, pbytes = page_stride * (int64_t)sizeof(@T@);
    const int in_place = @IN_PLACE@ && Dp == D;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = lens[b];
        float acc[MAX_HEADS * MAX_HEAD_DIM], qp[MAX_HEADS * MAX_HEAD_DIM];
        float kbuf[MAX_PAGE * MAX_HEAD_DIM], vbuf[MAX_PAGE * MAX_HEAD_DIM];
        float mx[MAX_HEADS], sum[MAX_HEADS];
        float s[MAX_HEADS * MAX_PAGE];
        const float* qb = q + b * H * D;
        if (Dp != D) {  /* queries padded like the keys */
            for (int64_t i = 0; i < H * Dp; i++) qp[i] = i % Dp < D ? qb[i / Dp * D + i % Dp] : 0.f;
            qb = qp;
        }
        for (int64_t i = 0; i < H * Dp; i++) acc[i] = 0.f;
        for (int64_t i = 0; i < H; i++) { mx[i] = -FLT_MAX; sum[i] = 0.f; }
        const int64_t* pages = table + b * P;
        for (int64_t s0 = 0; s0 < n; s0 += page_size) {
            const @T@* base = kv + pages[s0 / page_size] * page_stride;
            /* the page PF_AHEAD on, into L2 while this one is worked on (pages are scattered: the hardware
               prefetcher cannot guess them); past this row's end, the next row's first pages */
            const int64_t pa = s0 / page_size + PF_AHEAD, np = (n + page_size - 1) / page_size;
            const int64_t next_np = b + 1 < B ? (lens[b + 1] + page_size - 1) / page_size : 0;
            const char* ahead = pa < np ? (const char*)(kv + pages[pa] * page_stride)
                              : pa - np < next_np ? (const char*)(kv + table[(b + 1) * P + pa - np] * page_stride)
                              : NULL;
            const int64_t m = n - s0 < page_size ? n - s0 : page_size;
            for (int64_t g = 0; g < Hkv; g++) {
                if (ahead)  /* a page further on, a kv head's share at a time, between the work */
                    for (int64_t o = pbytes * g / Hkv / 64 * 64; o < pbytes * (g + 1) / Hkv; o += 64)
                        __builtin_prefetch(ahead + o, 0, PF_HINT);
                const float *k = kbuf, *v = vbuf;
                int64_t ld = Dp;
                if (in_place) {
                    k = (const float*)(const void*)(base + g * D);
                    v = (const float*)(const void*)(base + (Hkv + g) * D);
                    ld = row;
                } else {
                    @WIDEN@(base + g * D, row, m, D, Dp, kbuf);
                    @WIDEN@(base + (Hkv + g) * D, row, m, D, Dp, vbuf);
                }
                const int64_t h0 = g * G;
                float* sc = s;
                if (Dp == 64) page_group(qb + h0 * Dp, k, v, ld, m, G, sc, mx + h0, sum + h0, acc + h0 * Dp, 64);
                else if (Dp == 128) page_group(qb + h0 * Dp, k, v, ld, m, G, sc, mx + h0, sum + h0, acc + h0 * Dp, 128);
                else page_group(qb + h0 * Dp, k, v, ld, m, G, sc, mx + h0, sum + h0, acc + h0 * Dp, Dp);
            }
        }
        float* ob = out + b * H * D;
        for (int64_t hq = 0; hq < H; hq++) {
            const float inv = sum[hq] > 0.f ? 1.f / sum[hq] : 0.f;
            for (int64_t d = 0; d < D; d++) ob[hq * D + d] = acc[hq * Dp + d] * inv;
        }
    }
}
"""


def _instance(suffix: str, ctype: str, in_place: bool, widen: str) -> str:
    return (
        _TEMPLATE.replace("@S@", suffix)
        .replace("@T@", ctype)
        .replace("@IN_PLACE@", "1" if in_place else "0")
        .replace("@WIDEN@", widen)
    )


_SOURCE = (
    EXP_POLY_C
    + _COMMON.replace("@HSUM16@", _hsum_keys(16))
    .replace("@HSUM8@", _hsum_keys(8))
    .replace("@HMAX16@", _fold(16, "vmax(v, w)"))
    .replace("@HMAX8@", _fold(8, "vmax(v, w)"))
    .replace("@HSUM_LANES16@", _fold(16, "v + w"))
    .replace("@HSUM_LANES8@", _fold(8, "v + w"))
    + _instance("f32", "float", True, "widen_f32")
    + _instance("bf16", "uint16_t", False, "widen_bf16")
)
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
