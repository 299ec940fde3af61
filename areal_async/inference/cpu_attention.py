"""Decode attention straight from the paged KV cache on CPU: a small C kernel, built on first use.

Why: with one new token per request, attention is bound by reading the cache. The portable path (gather every
request's pages into a padded batch, then SDPA with an additive mask) reads the keys and values three times
(gather, write, attend), pads every row to the longest and, with grouped-query attention, works per query head.
In a SmolLM2-135M decode step at batch 64 and ~150 tokens of context that was 40% of the step (profiled, 2 threads:
gather 34 ms + SDPA 35 ms of 173 ms). This kernel reads each key and value once, straight from its page, for all
query heads that share it, with no padding: one streaming pass per request with an online softmax, parallel over
requests with OpenMP.

It is plain C with no torch headers, so it compiles in about a second with the system's C compiler (`$CC`, else
`cc`) and is loaded with ctypes; the built library is cached under `~/.cache/areal_async/kernels/` keyed by the
source, the flags, the compiler and the CPU's feature flags (the build uses -march=native, and a cluster's nodes
often share one home directory). OpenMP resolves to the runtime torch has already loaded (the same libgomp soname),
so the kernel shares torch's threads instead of starting a second pool. Where no compiler is found or the build
fails, `load()` returns None and the engine uses the portable path (logged once). `AREAL_CPU_ATTENTION=0` turns the
kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <float.h>

#define MAX_HEADS 128
#define MAX_HEAD_DIM 256

/* One query token per row. q [B, H, D] (already scaled); kv [slots, 2 * Hkv, D], slot = page * page_size + offset,
   k heads then v heads; table [B, P] pages of each row; lens [B] keys visible to each row; out [B, H, D].
   One task per row streams its pages once, keys and values together, all heads per key (query head hq uses kv
   head hq / (H / Hkv)), with an online softmax: per head a running max, a running sum and an accumulator that is
   rescaled when the max grows. */
void paged_decode_attention(const float* q, const float* kv, const int64_t* table, const int64_t* lens, float* out,
                            int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t P, int64_t page_size,
                            int64_t threads) {
    const int64_t G = H / Hkv, row = 2 * Hkv * D, page_stride = page_size * row;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = lens[b];
        const float* qb = q + b * H * D;
        float* ob = out + b * H * D;
        float acc[MAX_HEADS * MAX_HEAD_DIM];
        float mx[MAX_HEADS], sum[MAX_HEADS], sc[MAX_HEADS];
        for (int64_t i = 0; i < H * D; i++) acc[i] = 0.f;
        for (int64_t i = 0; i < H; i++) { mx[i] = -FLT_MAX; sum[i] = 0.f; }
        const int64_t* pages = table + b * P;
        for (int64_t s0 = 0; s0 < n; s0 += page_size) {
            const float* base = kv + pages[s0 / page_size] * page_stride;
            const int64_t m = n - s0 < page_size ? n - s0 : page_size;
            for (int64_t j = 0; j < m; j++) {
                const float* k = base + j * row;
                const float* v = k + Hkv * D;
                for (int64_t hq = 0; hq < H; hq++) {
                    const float* kh = k + (hq / G) * D;
                    const float* qh = qb + hq * D;
                    float a = 0.f;
                    #pragma omp simd reduction(+:a)
                    for (int64_t d = 0; d < D; d++) a += qh[d] * kh[d];
                    sc[hq] = a;
                }
                for (int64_t hq = 0; hq < H; hq++) {
                    const float s = sc[hq];
                    float* ah = acc + hq * D;
                    const float* vh = v + (hq / G) * D;
                    if (s > mx[hq]) {  /* new max: rescale what was accumulated so far */
                        const float c = expf(mx[hq] - s);
                        sum[hq] = sum[hq] * c + 1.f;
                        mx[hq] = s;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; d++) ah[d] = ah[d] * c + vh[d];
                    } else {
                        const float p = expf(s - mx[hq]);
                        sum[hq] += p;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; d++) ah[d] += p * vh[d];
                    }
                }
            }
        }
        for (int64_t hq = 0; hq < H; hq++) {
            const float inv = sum[hq] > 0.f ? 1.f / sum[hq] : 0.f;
            for (int64_t d = 0; d < D; d++) ob[hq * D + d] = acc[hq * D + d] * inv;
        }
    }
}
"""
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
MAX_HEADS, MAX_HEAD_DIM = 128, 256

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def _cache_dir() -> str:
    root = os.environ.get("AREAL_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "areal_async",
                                                                "kernels")
    return root


def _cpu_signature() -> str:
    """What -march=native depends on: a library built on one CPU kind can crash with SIGILL on another, and a home
    directory (so the cache) is often shared across a cluster's nodes."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name", "vendor_id"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.machine() + platform.processor()


def _build(compiler: str) -> str:
    key = "\0".join([_SOURCE, " ".join(_FLAGS), compiler, _cpu_signature()])
    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
    out_dir = os.path.join(_cache_dir(), tag)
    lib = os.path.join(out_dir, "paged_attention.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # build aside, then rename: concurrent builders are safe
        src = os.path.join(tmp, "paged_attention.c")
        with open(src, "w") as f:
            f.write(_SOURCE)
        tmp_lib = os.path.join(tmp, "paged_attention.so")
        proc = subprocess.run([compiler, *_FLAGS, src, "-o", tmp_lib, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp_lib, lib)
    return lib


def load():
    """The kernel as a ctypes function, or None where it cannot be built (the reason is logged once)."""
    with _lock:
        if "fn" in _loaded:
            return _loaded["fn"]
        fn = None
        if os.environ.get("AREAL_CPU_ATTENTION", "1") == "0":
            log.info("CPU paged attention kernel disabled by AREAL_CPU_ATTENTION=0")
        else:
            compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            try:
                if compiler is None:
                    raise RuntimeError("no C compiler found (set CC)")
                torch.get_num_threads()  # make sure torch's OpenMP runtime is loaded first: the kernel links to it
                lib = ctypes.CDLL(_build(compiler))
                fn = lib.paged_decode_attention
                fn.restype = None
                fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7
            except Exception as e:  # any failure means the portable path, never a dead engine
                log.warning("CPU paged attention kernel unavailable (%s); using gather + SDPA", e)
                fn = None
        _loaded["fn"] = fn
        return fn


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    return (dtype == torch.float32 and num_heads <= MAX_HEADS and head_dim <= MAX_HEAD_DIM
            and num_heads % num_kv_heads == 0)


def paged_decode_attention(fn, q: torch.Tensor, kv_pages: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                           num_kv_heads: int) -> torch.Tensor:
    """q [B, H, D] fp32 (scaled), kv_pages [num_pages, page_size, 2 * Hkv, D], table [B, P] long, lens [B] long
    (all on CPU) -> [B, H, D]. Row b attends to its first lens[b] keys, read through its pages."""
    b, h, d = q.shape
    q = q.contiguous()
    table = table.contiguous()
    lens = lens.contiguous()
    out = torch.empty_like(q)
    fn(q.data_ptr(), kv_pages.data_ptr(), table.data_ptr(), lens.data_ptr(), out.data_ptr(), b, h, num_kv_heads, d,
       table.shape[1], kv_pages.shape[1], torch.get_num_threads())
    return out
