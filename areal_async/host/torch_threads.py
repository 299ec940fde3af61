"""One thread of a serving or training process computes with several torch threads: the engine thread of a server,
the RPC worker thread of a trainer rank. Everything else that touches torch there runs with one.

Why: torch's CPU build parallelises with OpenMP, and with libgomp every thread that ever runs a parallel region
keeps its own team of worker threads for the rest of its life (`import torch` with OMP_NUM_THREADS=2 already gives
the main thread one). Once the process holds more such threads than it has CPUs, libgomp stops letting idle workers
spin between regions and puts them to sleep after each one, so every op afterwards pays a futex wake-up. Measured
on a SmolLM2-135M decode step at batch 64 with 2 threads on 2 cores: 155 ms when only one thread had ever run
parallel regions, 204 ms once a second thread had (element-wise ops alone 2.3 -> 27.9 ms per step;
OMP_WAIT_POLICY=active instead makes the idle team spin forever and doubles the matmuls). So such a process starts
torch with one thread (`one_thread_until_set`, before torch loads), and the compute thread sets its own count.

No torch import at module level: `one_thread_until_set` must run before torch is loaded.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


def one_thread_until_set() -> bool:
    """Make torch (OpenMP and MKL) start with one thread in every thread of this process, so that only the thread
    that calls `torch.set_num_threads(n)` ever holds a team. Only possible before torch is loaded: returns False
    (and changes nothing) when it already is. The environment is inherited by child processes."""
    if "torch" in sys.modules:
        return False
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    return True


@contextmanager
def single_torch_thread() -> Iterator[None]:
    """Run the body with this thread's torch ops on one thread (no OpenMP team is made for it); the thread's
    setting is restored afterwards."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _call_single(fn: Callable[..., T], *args: Any) -> T:
    with single_torch_thread():
        return fn(*args)


async def to_side_thread(fn: Callable[..., T], *args: Any) -> T:
    """`asyncio.to_thread` for torch work that is not the compute thread's: one torch thread in the helper."""
    return await asyncio.to_thread(_call_single, fn, *args)


def thread_env(n: int) -> dict[str, str]:
    """Environment that pins a child's intra-op thread pools to n threads (children share the host's cores)."""
    n = max(1, n)
    return {
        "OMP_NUM_THREADS": str(n),
        "MKL_NUM_THREADS": str(n),
        "AREAL_TORCH_THREADS": str(n),
        "TOKENIZERS_PARALLELISM": "false",
    }
