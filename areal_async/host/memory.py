"""Keep freed host memory in the process instead of returning it to the OS (glibc's malloc), for the processes that
allocate and free the same large tensors over and over: an inference server's decode steps, a trainer's steps.

Why: with glibc's defaults, blocks above the mmap threshold (at most 32 MB) are mapped fresh on every allocation and
unmapped on free, so each one is page-faulted in and zeroed by the kernel again, and heap tops are trimmed back.
A decode step's gathered KV pages and logits measured 3-5x slower than the step itself that way. Threads other than
the main one allocate from their own arenas, whose heaps hold at most 64 MB, so a larger block there (a trainer's
[1024, vocab] fp32 logits chunk is 200 MB) is always mapped afresh whatever the threshold; `single_arena` puts every
thread on the main arena, where the thresholds apply. No-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def keep_freed_memory(single_arena: bool = False) -> bool:
    """Raise glibc's mmap threshold to 1 GiB and its trim threshold to 2 GiB (and, with `single_arena`, use one
    arena for every thread; call it before the threads that allocate start). Returns False where not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))
    if single_arena:
        ok = bool(mallopt(_M_ARENA_MAX, 1)) and ok
    return ok
