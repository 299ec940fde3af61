"""The cyclic garbage collector during a process's start-up: off while it imports and builds, then the start-up's
objects frozen out of every later collection.

Why: importing torch and transformers and building a model creates a few million long-lived objects in seconds.
CPython 3.11 starts a full collection each time its old generation has grown by a quarter, so a trainer rank ran
six of them while it started, each a scan of everything imported so far that frees next to nothing (module
dictionaries, functions, types): about a fifth of a short run's trainer CPU time, and a tenth of the server's.
With the collector off until the process is ready, one full collection then frees whatever start-up cycles there
are, and `gc.freeze()` moves the survivors to the permanent generation, which later collections skip: the steps
that follow scan only what they allocate.

For processes this package owns (a trainer rank, an embedded server), from their `main`: a program that embeds
the controller keeps its own collector settings. Standard library only.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Automatic collection off inside the block; on leaving it (also by an exception), one full collection, the
    survivors frozen, and automatic collection back as it was."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        if was_enabled:
            gc.enable()
