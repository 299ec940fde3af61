"""Math rewards through Hugging Face's math-verify: \\boxed{} answers, GSM8K `#### N` answers, numbers, fractions
and symbolic expressions compared by value.

Why math-verify: string matching scores `\\frac{1}{2}`, `0.5` and `1/2` differently; math-verify parses LaTeX and
plain expressions into sympy and compares them, which is what the published reasoning-RL recipes grade with.

GSM8K convention: when a text contains `####`, only what follows the last marker (up to the end of that line) is the
answer, for the reference and the completion alike, so a worked solution's intermediate numbers never count.

math-verify bounds its own parsing time with SIGALRM, which only works on a process's main thread; off the main
thread (an in-thread fast path) we switch its timeouts off and rely on the caller's (RewardRunner's) timeout.
"""

from __future__ import annotations

import re
import threading
from typing import Any

_GSM8K_RE = re.compile(r"####[ \t]*([^\n]*)")
_NUMBER_WITH_COMMAS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$")


def _after_marker(text: str) -> str | None:
    """The answer after the last `####`, commas in numbers removed; None when there is no marker."""
    found = _GSM8K_RE.findall(text)
    if not found:
        return None
    ans = found[-1].strip().rstrip(".")
    if _NUMBER_WITH_COMMAS.match(ans):
        ans = ans.replace(",", "")
    return ans


def _timeouts() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def parse_reference(answer: str) -> list[Any]:
    """Parse a dataset's gold answer: a GSM8K solution, a bare value, LaTeX with or without $ or \\boxed{}."""
    from math_verify import parse

    text = answer.strip()
    marked = _after_marker(text)
    if marked is not None:
        text = marked
    t = _timeouts()
    if "\\boxed" in text or "$" in text:
        got = parse(text, parsing_timeout=t)
        if got:
            return got
    return parse("$" + text + "$", parsing_timeout=t) or parse(text, parsing_timeout=t)


def parse_completion(completion: str) -> list[Any]:
    """Parse a model's answer: after the last `####` if there is one, else the last \\boxed{} or the final value."""
    from math_verify import parse

    marked = _after_marker(completion)
    t = _timeouts()
    if marked is not None:
        return parse("$" + marked + "$", parsing_timeout=t) or parse(marked, parsing_timeout=t)
    return parse(completion, parsing_timeout=t)


def math_reward(completion: str, answer: str, *, prompt: str = "", **meta: Any) -> float:
    """1.0 when the completion's final answer equals the reference mathematically, else 0.0. Never raises."""
    del prompt, meta
    try:
        if not isinstance(completion, str) or not isinstance(answer, str) or not completion.strip():
            return 0.0
        gold = parse_reference(answer)
        if not gold:
            return 0.0
        pred = parse_completion(completion)
        if not pred:
            return 0.0
        from math_verify import verify

        return 1.0 if verify(gold, pred, timeout_seconds=_timeouts()) else 0.0
    except BaseException as e:  # math-verify raises its own TimeoutException; sympy can raise anything
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return 0.0
