"""Compile a small C kernel with the system's C compiler on first use, cache the library, and load it with ctypes.

Why C and not a torch extension: plain C with no torch headers compiles in about a second with whatever `cc` the
machine has, so the CPU engine's kernels need no build step at install time and no C++ toolchain matching torch's.
The library is cached under `~/.cache/areal_async/kernels/` (`AREAL_KERNEL_CACHE` elsewhere) keyed by the source,
the flags, the compiler and (for -march=native) the CPU's feature flags: a cluster's nodes often share one home
directory. The target is `AREAL_KERNEL_MARCH` (default `native`); `x86-64-v3` (AVX2 + FMA) is the portable
baseline, and since it runs on every AVX-512 machine too, the tests build and check both targets in one process
(`load_library(..., march=...)` loads each target's library separately). OpenMP resolves to the runtime torch has
already loaded (the same libgomp soname), so a kernel shares torch's threads instead of starting a second pool.
Callers treat None (no compiler, a failed build) as "use the portable path"; the reason is logged once per kernel.
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
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# plus -march=<target>. -fno-trapping-math changes no result (no FP exception is ever unmasked here); without it
# gcc will not if-convert the exp polynomial's clamp for AVX2, so the exp loops stayed scalar on x86-64-v3
FLAGS = ["-O3", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared"]
MARCH_ENV = "AREAL_KERNEL_MARCH"
PORTABLE_MARCH = "x86-64-v3"  # AVX2, FMA, BMI2, F16C: every x86 server CPU since ~2015
_V3_FLAGS = {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}  # what -march=x86-64-v3 lets gcc emit (and more)

# exp(x) for the kernels' softmaxes and SiLU: libm's expf does not vectorise without -ffast-math, this does. x is
# clamped to [-87, 88], x = k ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (relative error < 2e-7),
# 2^k through the exponent bits. Sources that use it include this text first.
EXP_POLY_C = r"""
#include <stdint.h>
#include <string.h>

/* The reduction and the polynomial as expressions, for a float or a GCC float vector alike (kernels with vector
   code reuse them, so every exp in the project has the same constants and order of operations). */
#define EXP_KF(x) (((x) * 1.44269504088896341f + 12582912.0f) - 12582912.0f)  /* round to nearest */
#define EXP_R(x, kf) ((x) - (kf) * 0.693145751953125f - (kf) * 1.428606765330187e-06f)
#define EXP_HORNER(p, r) \
    ((((((((p) * (r) + 8.3333958e-3f) * (r) + 4.1666641e-2f) * (r) + 1.6666666e-1f) * (r) + 0.5f) * (r) + 1.0f) \
      * (r)) + 1.0f)

static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float kf = EXP_KF(x);
    const float r = EXP_R(x, kf);
    float p = EXP_HORNER(1.3888949e-3f, r);
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += (int32_t)kf << 23;
    memcpy(&p, &bits, 4);
    return p;
}
"""

# bf16 <-> fp32 for the trainer's kernels, bit-exact with torch: a bf16 is the top half of an fp32, and the
# conversion down rounds to nearest even as `.to(torch.bfloat16)` does (a NaN stays a NaN instead of rounding into
# an infinity). Sources that use it include this text first.
BF16_C = r"""
#include <stdint.h>
#include <string.h>

static inline float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)((((u & 0x7fffffffu) > 0x7f800000u) ? (u | 0x400000u) : r) >> 16);
}
"""

_lock = threading.Lock()
_loaded: dict[tuple[str, str], ctypes.CDLL | None] = {}


def default_march() -> str:
    """The kernels' target: `AREAL_KERNEL_MARCH`, else `native` (this CPU's every extension)."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not all(c.isalnum() or c in "-_." for c in march):
        raise ValueError(f"{MARCH_ENV}={march!r} is not a -march value")
    return march


def runnable_marches() -> list[str]:
    """The targets whose code this CPU can run, native first: the ones tests build and check here. The portable
    baseline is included wherever the CPU has its extensions (any AVX2 + FMA x86 CPU)."""
    out = ["native"]
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError:
        flags = set()
    if _V3_FLAGS <= flags:
        out.append(PORTABLE_MARCH)
    return out


def _cache_dir() -> str:
    return os.environ.get("AREAL_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "areal_async", "kernels"
    )


def _cpu_signature() -> str:
    """What -march=native depends on: a library built on one CPU kind can crash with SIGILL on another."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name", "vendor_id"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.machine() + platform.processor()


def _build(name: str, source: str, compiler: str, march: str) -> str:
    flags = [*FLAGS, f"-march={march}"]
    key = "\0".join([source, " ".join(flags), compiler, _cpu_signature() if march == "native" else march])
    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
    out_dir = os.path.join(_cache_dir(), tag)
    lib = os.path.join(out_dir, f"{name}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # build aside, then rename: concurrent builders are safe
        src = os.path.join(tmp, f"{name}.c")
        with open(src, "w") as f:
            f.write(source)
        tmp_lib = os.path.join(tmp, f"{name}.so")
        proc = subprocess.run(
            [compiler, *flags, src, "-o", tmp_lib, "-lm"], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp_lib, lib)
    return lib


def bind(lib: ctypes.CDLL, symbol: str, argtypes: list) -> Callable[..., None]:
    """The C function `symbol` of `lib`, returning void and taking `argtypes` (pointers as c_void_p)."""
    fn = getattr(lib, symbol)
    fn.restype = None
    fn.argtypes = argtypes
    return fn


def load_library(name: str, source: str, disable_env: str, what: str, march: str | None = None) -> ctypes.CDLL | None:
    """The built library for `source` and target `march` (default: `default_march()`; built once per process and
    target, cached on disk), or None where it cannot be built or `disable_env`=0 turns it off. `what` names the
    fallback in the log line. Two targets of one kernel are two separate libraries, both loadable at once."""
    try:
        march = march or default_march()
    except ValueError as e:  # a mistyped target means the portable path, never a dead engine
        log.warning("CPU kernel %s unavailable (%s); using %s", name, e, what)
        return None
    with _lock:
        if (name, march) in _loaded:
            return _loaded[(name, march)]
        lib = None
        if os.environ.get(disable_env, "1") == "0":
            log.info("CPU kernel %s disabled by %s=0", name, disable_env)
        else:
            compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            try:
                if compiler is None:
                    raise RuntimeError("no C compiler found (set CC)")
                torch.get_num_threads()  # make sure torch's OpenMP runtime is loaded first: the kernel links to it
                # a separate file per target: dlopen returns the already loaded library for the same path
                lib = ctypes.CDLL(_build(name, source, compiler, march))
            except Exception as e:  # any failure means the portable path, never a dead engine
                log.warning("CPU kernel %s (-march=%s) unavailable (%s); using %s", name, march, e, what)
                lib = None
        _loaded[(name, march)] = lib
        return lib
