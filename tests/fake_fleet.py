"""Helpers shared by the tests that drive stand-in SGLang servers (areal_async.testing.fake_sglang)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(cond: Callable[[], bool], timeout: float = 10.0, poll_s: float = 0.01) -> None:
    """Wait for `cond()` to hold, polling every `poll_s`; an AssertionError after `timeout` seconds of polls."""
    for _ in range(int(timeout / poll_s)):
        if cond():
            return
        await asyncio.sleep(poll_s)
    raise AssertionError("condition never held")
