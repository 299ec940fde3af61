r"""Code rewards: run a model-written Python program against a dataset's tests, where it cannot game the grading.

The reference answer carries the tests (formats in code_tests.py: stdin/stdout cases, fn_name call cases, MBPP
asserts, a HumanEval `check` with `meta["entry_point"]`). The program is the last fenced code block of the
completion (```python ... ```), or the whole completion when it has none. The verdict is the fraction of tests
passed, or all-or-nothing (`all_or_nothing=True`); a crash, timeout or any limit hit fails the tests it affects,
with the reason kept in `CodeVerdict`.

Why the grading is shaped the way it is (grading.py): RL policies find reward hacks, and a grader that runs beside
the solution in one interpreter can be told anything (a no-op `exec`, an always-equal return value, a rebound
comparison helper, a nonce read from a caller's frame). Here the solution runs alone in its sandbox and only ever
answers with plain data; stdout and returned values are compared on the host (exact for integers and strings, a
tolerance only for floats); test code runs in a separate judge sandbox whose calls into the solution are relayed.

Time: each test has `wall_s`; the whole sample has `budget_s` (default 30 s), and when the reward runs in a
RewardRunner worker, the runner's own deadline minus a margin for cleanup, so the sandbox always gives up first and
cleans up before the runner would kill the worker.

Isolation: the first evaluation in a process probes what the sandbox achieves on this machine. A weak result
(no private root, pid or network namespace, no memory bound, or root without a dropped uid) is logged as a warning,
or refused with SandboxIsolationError when `require_isolation=True` (or AREAL_SANDBOX_REQUIRE_ISOLATION=1 in the
environment), before any untrusted code runs. In the weakest mode (no namespaces and no uid of its own, so the
program shares ours) this process also makes itself non-dumpable, so the program cannot write its memory.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import msgspec

from areal_async.rewards.code_tests import CodeTests, parse_tests
from areal_async.rewards.grading import ServerSession, outputs_match, run_calls, run_judged, run_stdio
from areal_async.rewards.registry import time_left
from areal_async.rewards.sandbox import Sandbox, SandboxLimits, probe_isolation

__all__ = [
    "CodeTests",
    "CodeVerdict",
    "SandboxIsolationError",
    "code_reward",
    "evaluate_code",
    "extract_code",
    "outputs_match",
    "parse_tests",
]

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 30.0
CLEANUP_MARGIN_S = 1.5  # kept free of the runner's deadline for killing and cleaning up
MAX_COMPLETION_CHARS = 1 << 20
_PY_TAGS = ("python", "py", "python3")
_LANG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_+-")


class SandboxIsolationError(RuntimeError):
    """The sandbox cannot isolate untrusted code well enough on this machine, and isolation was required."""


class CodeVerdict(msgspec.Struct, kw_only=True):
    reward: float
    passed: int
    total: int
    reason: str | None  # the first failure's reason, None when everything passed
    failures: list[str] = []  # one reason per failed test, in test order
    isolation: list[str] = []  # what the solution's sandbox achieved


def extract_code(completion: str) -> str:
    """The last fenced block, preferring ones tagged python/py; the whole text when there is no fence.

    A linear scan (str.find), not a regex: a completion of 128k backticks must not cost seconds on the host."""
    text = (completion or "")[:MAX_COMPLETION_CHARS]
    blocks: list[tuple[str, str]] = []
    pos = 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            break
        eol = text.find("\n", start + 3)
        if eol < 0:
            break
        info = text[start + 3 : eol].lstrip(" \t")
        n = 0
        while n < len(info) and info[n] in _LANG_CHARS:
            n += 1
        end = text.find("```", eol + 1)
        if end < 0:
            break
        blocks.append((info[:n], text[eol + 1 : end]))
        pos = end + 3
    if not blocks:
        return text
    python = [body for lang, body in blocks if lang.lower() in _PY_TAGS]
    return (python or [body for _, body in blocks])[-1]


_warned: set[tuple] = set()


def check_isolation(require: bool, *, disable: Iterable[str] = (), allow_network: bool = False) -> list[str]:
    """Probe (once per process) what the sandbox achieves; warn or raise when it is weak. Returns what it achieves."""
    disable = frozenset(disable)
    report = probe_isolation(disable=disable, allow_network=allow_network)
    if report.weak:
        if require:
            raise SandboxIsolationError(f"refusing to run untrusted code: the sandbox is weak here, {report.summary()}")
        key = (disable, allow_network)
        if key not in _warned:
            _warned.add(key)
            log.warning(
                "code reward: the sandbox is weak on this machine (%s); set require_isolation=True to refuse",
                report.summary(),
            )
        if not {"uid", "userns"} & set(report.achieved):
            _not_dumpable()
    return report.achieved


def _not_dumpable() -> None:
    """The program runs under our own uid in no namespace: without this it could write our memory through
    /proc/<pid>/mem (ptrace itself is refused by seccomp) and forge the verdict. Costs debuggers and core dumps."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(
            ctypes.c_int(4), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)
        )  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        log.warning("code reward: could not make this process non-dumpable")


def evaluate_code(
    code: str,
    tests: CodeTests,
    *,
    all_or_nothing: bool = False,
    limits: SandboxLimits | None = None,
    budget_s: float = DEFAULT_BUDGET_S,
    require_isolation: bool = False,
    disable: Iterable[str] = (),
) -> CodeVerdict:
    """Run `code` against `tests` and return the verdict; the whole evaluation ends within `budget_s`.

    `disable` switches sandbox mechanisms off (see sandbox.MECHANISMS): for tests of the weaker modes."""
    lim = limits or SandboxLimits()
    disable = frozenset(disable)
    iso = check_isolation(require_isolation, disable=disable, allow_network=lim.allow_network)
    deadline = time.monotonic() + max(0.0, budget_s)
    results: list[str | None] = []
    with Sandbox(lim, disable=disable) as sb:
        sb.write("solution.py", code)
        if tests.stdio:
            got, run_iso = run_stdio(sb, tests.stdio, lim, deadline, all_or_nothing)
            results += got
            iso = run_iso or iso
        if (tests.calls or tests.snippets) and not (all_or_nothing and any(results)):
            server = ServerSession(sb, tests.setup, lim, deadline)
            try:
                if tests.calls and tests.fn_name:
                    results += run_calls(server, tests.fn_name, tests.calls, lim, deadline, all_or_nothing)
                if tests.snippets and not (all_or_nothing and any(results)):
                    with Sandbox(lim, disable=disable) as judge_sb:
                        got, _ = run_judged(
                            server,
                            judge_sb,
                            tests.snippets,
                            tests.setup,
                            tests.proxies,
                            tests.modules,
                            lim,
                            deadline,
                            all_or_nothing,
                        )
                        results += got
            finally:
                server.close()
            iso = server.isolation or iso
    total = tests.total
    passed = sum(1 for r in results if r is None)
    failures = [r for r in results if r is not None]
    ok_all = passed == total and total > 0
    reward = (1.0 if ok_all else 0.0) if all_or_nothing else (passed / total if total else 0.0)
    return CodeVerdict(
        reward=reward,
        passed=passed,
        total=total,
        reason=failures[0] if failures else None,
        failures=failures,
        isolation=list(iso),
    )


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def code_reward(completion: str, answer: str, *, prompt: str = "", all_or_nothing: bool = False, **meta: Any) -> float:
    """Reward-function entry point ("code" in the registry). Bad tests or any failure of the solution score 0.0;
    the only exception it raises is SandboxIsolationError, when isolation is required and weak.

    Per-sample options in `meta`: wall_s (per test), cpu_s, memory_mb, budget_s (the whole sample),
    require_isolation, and the dataset's entry_point for HumanEval-style checks."""
    del prompt
    try:
        tests = parse_tests(answer, meta)
        kw: dict[str, Any] = {}
        if "wall_s" in meta:
            kw["wall_s"] = float(meta["wall_s"])
        if "cpu_s" in meta:
            kw["cpu_s"] = int(meta["cpu_s"])
        if "memory_mb" in meta:
            kw["memory_bytes"] = int(meta["memory_mb"]) << 20
        budget = float(meta.get("budget_s", DEFAULT_BUDGET_S))
        left = time_left()
        if left is not None:
            budget = min(budget, left - CLEANUP_MARGIN_S)
        require = _flag(meta.get("require_isolation", os.environ.get("AREAL_SANDBOX_REQUIRE_ISOLATION", "")))
        limits = SandboxLimits(**kw) if kw else None
    except (ValueError, TypeError, OverflowError):
        return 0.0
    try:
        verdict = evaluate_code(
            extract_code(completion),
            tests,
            all_or_nothing=bool(all_or_nothing),
            limits=limits,
            budget_s=budget,
            require_isolation=require,
        )
    except SandboxIsolationError:
        raise
    except Exception:
        log.exception("code reward failed")
        return 0.0
    return verdict.reward
