"""Reward functions by name: a registry of import paths, never of function objects.

Why import paths: rewards run in worker processes (see runner.py) that are spawned fresh and replaced when a reward
hangs; a worker receives the string "module:function" and imports the function itself, so nothing is pickled and a
function defined anywhere importable works. A reward function has the signature

    fn(completion: str, answer: str, *, prompt: str = "", **meta) -> float

Functions that take fewer keywords (e.g. `fn(completion, answer)`) are called with only what they accept.
A reward that may take long (the code sandbox) reads `time_left()` to finish, and clean up, before the caller's
timeout would kill it.
`inline=True` marks functions cheap and safe enough to call directly on the caller's thread (a string comparison),
skipping the process round trip; they still cannot crash the caller (exceptions score 0.0).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import numbers
import time
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any, NamedTuple

RewardFn = Callable[..., float]


class RewardEntry(NamedTuple):
    target: str  # "package.module:function"
    inline: bool = False


_REGISTRY: dict[str, RewardEntry] = {
    # helper modules are referenced by path, so registering costs no import
    "arith": RewardEntry("areal_async.tasks.arith:reward", inline=True),
    "math": RewardEntry("areal_async.rewards.math:math_reward"),
    "gsm8k": RewardEntry("areal_async.rewards.math:math_reward"),
    "code": RewardEntry("areal_async.rewards.code:code_reward"),
}


def register(name: str, target: str, *, inline: bool = False) -> None:
    """Add or replace a named reward. `target` is "module:function"; it is imported only when first used."""
    _check_target(target)
    if ":" in name:
        raise ValueError(f"reward names must not contain ':' (that marks an import path): {name!r}")
    _REGISTRY[name] = RewardEntry(target, inline)


def names() -> list[str]:
    return sorted(_REGISTRY)


def resolve(spec: str) -> RewardEntry:
    """A registry name or a "module:function" path -> its entry. Raises KeyError naming the known rewards."""
    if ":" in spec:
        _check_target(spec)
        return RewardEntry(spec, False)
    try:
        return _REGISTRY[spec]
    except KeyError:
        raise KeyError(f"unknown reward {spec!r}; known: {', '.join(names())}, or give 'module:function'") from None


def _check_target(target: str) -> None:
    mod, sep, fn = target.partition(":")
    if not sep or not mod or not fn or not all(p.isidentifier() for p in mod.split(".") + fn.split(".")):
        raise ValueError(f"reward import path must look like 'package.module:function', got {target!r}")


@lru_cache(maxsize=256)
def load(target: str) -> RewardFn:
    """Import "module:function" (attribute paths like "module:Class.method" work too)."""
    _check_target(target)
    mod_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{target} is not callable")
    return obj


@lru_cache(maxsize=256)
def _accepted(fn: RewardFn) -> tuple[bool, bool]:
    """(takes prompt=, takes **meta)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True, True
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return var_kw or any(p.name == "prompt" for p in params), var_kw


def call_reward(
    fn: RewardFn, completion: str, answer: str, prompt: str = "", meta: dict[str, Any] | None = None
) -> float:
    """Call `fn` with the keywords it accepts and check the result is a finite number (raises otherwise)."""
    takes_prompt, takes_meta = _accepted(fn)
    kw: dict[str, Any] = dict(meta or {}) if takes_meta else {}
    if takes_prompt:
        kw["prompt"] = prompt
    value = fn(completion, answer, **kw)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward function returned {type(value).__name__}, expected a float")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward function returned {value}")
    return value


_deadline: float | None = None  # time.monotonic() at which the current call's caller gives up


def time_left() -> float | None:
    """Seconds until whoever called the current reward gives up on it (RewardRunner's timeout); None when no
    deadline is set (a direct call)."""
    return None if _deadline is None else _deadline - time.monotonic()


@contextlib.contextmanager
def reward_deadline(timeout_s: float | None) -> Iterator[None]:
    """Set the deadline `time_left()` reports for the duration of one reward call."""
    global _deadline
    previous = _deadline
    _deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        yield
    finally:
        _deadline = previous
