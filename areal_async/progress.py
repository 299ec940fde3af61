"""Progress bars (tqdm) for the long waits: building the base model, converting a GGUF file, a held-out eval.

A bar is drawn only where someone watches it: when stderr is a terminal, so run logs, pipes and CI output stay
free of them. `TQDM_DISABLE` (any non-empty value, as tqdm itself reads it) turns every bar off. Without tqdm
installed there are no bars. Never torch; tqdm is imported when a bar is drawn.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["NoBar", "bar", "enabled", "shown"]


def enabled(stream: TextIO | None = None) -> bool:
    """Whether bars are drawn on `stream` (default stderr): when it is a terminal and TQDM_DISABLE is not set."""
    if os.environ.get("TQDM_DISABLE"):
        return False
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class NoBar:
    """What `bar` returns when no bar is drawn: takes the same calls and does nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bar(total: int | None, desc: str, unit: str = "it", leave: bool = True, stream: TextIO | None = None) -> Any:
    """A tqdm bar on `stream` (default stderr) when `enabled`, else an object taking the same calls (update,
    set_postfix_str, close, use as a context manager) that draws nothing."""
    if not enabled(stream):
        return NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return NoBar()
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        leave=leave,
        file=stream if stream is not None else sys.stderr,
        dynamic_ncols=True,
        disable=False,
    )


@contextlib.contextmanager
def shown(total: int | None, desc: str, unit: str = "it", leave: bool = True) -> Iterator[Any]:
    """`bar` on stderr as a context, with the console's log lines printed above the bar while it is drawn (tqdm's
    logging_redirect_tqdm), not through it: for a wait beside a run that keeps logging (an eval during training)."""
    drawn = bar(total, desc, unit=unit, leave=leave)
    if isinstance(drawn, NoBar):
        yield drawn
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), drawn:
        yield drawn
