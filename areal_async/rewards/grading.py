"""Grading a solution without letting it near the grader: the host side of the solution server and the judge.

    host (this module)                   decides every verdict, holds the expected values, enforces the budget
      |-- solution sandbox (uid A)       solution_server.py + the solution; answers calls with plain data
      `-- judge sandbox (uid B)          judge.py + the dataset's test code; calls into the solution via the host

Three kinds of tests:
- stdin/stdout: one fresh run of the solution per case; the host compares the output (`outputs_match`).
- call cases (fn_name): the host asks the server to call the function and compares the returned plain data with
  the expected value itself (`values_match`): exact for ints and strings, a tolerance only for floats.
- test code (asserts, HumanEval check): the judge runs it; calls into the solution are relayed by the host. The
  solution's process never sees a test or an expected value, and the judge's process is out of its reach.

Every call and every test has the per-test wall clock `limits.wall_s`, and everything together the sample's
budget (a deadline); a solution that hits a limit during a call loses that test, and its server is restarted for
the next one. Results are per test: None for a pass, else the reason.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Any

import msgspec

from areal_async.rewards import plaindata as pd
from areal_async.rewards.sandbox import LiveRun, Sandbox, SandboxLimits, SandboxResult, session_limits

_HERE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=4)
def _source(name: str) -> str:
    with open(os.path.join(_HERE, name), encoding="utf-8") as f:
        return f.read()


def _program(module: str, call: str) -> str:
    """A `python -c` program: plaindata and one sandbox-side module loaded from source, then `call`."""
    return (
        "import sys, types\n"
        "def _load(name, src):\n"
        "    m = types.ModuleType(name)\n"
        "    exec(compile(src, name + '.py', 'exec'), m.__dict__)\n"
        "    return m\n"
        f"_pd = _load('areal_plaindata', {_source('plaindata.py')!r})\n"
        f"_mod = _load('areal_{module}', {_source(module + '.py')!r})\n"
        f"{call}\n"
    )


def outputs_match(got: str, want: str, rel_tol: float = 1e-6) -> bool:
    """Whitespace-insensitive token comparison. A token the reference writes as an integer must be that integer
    (1000000000001 is not 1000000000000); only where the reference writes a float is there a tolerance."""
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        if _is_int(y):
            if not (_is_int(x) and _int_key(x) == _int_key(y)):
                return False
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isfinite(fy) or not math.isclose(fx, fy, rel_tol=rel_tol, abs_tol=rel_tol):  # inf: exact only
            return False
    return True


def _is_int(tok: str) -> bool:
    body = tok[1:] if tok[:1] in "+-" else tok
    return body.isdigit() and body.isascii()


def _int_key(tok: str) -> tuple[bool, str]:
    """An integer token's value as (negative, digits): exact at any length, no int() conversion limit."""
    neg, body = tok[:1] == "-", tok.lstrip("+-").lstrip("0")
    return (neg and bool(body), body)


# ---- the solution server -------------------------------------------------------------------------------------


class ServerSession:
    """The solution loaded in a server process; restarted (within the budget) after it dies or times out."""

    def __init__(self, sb: Sandbox, setup: str, limits: SandboxLimits, deadline: float) -> None:
        self.sb, self.setup, self.limits, self.deadline = sb, setup, limits, deadline
        self.live: LiveRun | None = None
        self.load_error: str | None = None
        self.starts = 0
        self.isolation: list[str] = []

    def _ensure(self) -> str | None:
        if self.load_error:
            return self.load_error
        if self.live is not None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0.05:
            return "budget_exhausted"
        self.starts += 1
        live = self.sb.start(
            [self.sb.python(), "-I", "-c", _program("solution_server", "_mod.serve(_pd)")],
            limits=session_limits(self.limits, left),
        )
        if isinstance(live, SandboxResult):
            self.load_error = live.reason or "sandbox_error"
            return self.load_error
        wait = min(self.limits.wall_s, left)
        sent = live.send(json.dumps({"setup": self.setup}).encode(), wait)
        line = live.recv(wait) if sent else None
        msg = _json(line)
        if not isinstance(msg, dict) or msg.get("ready") is not True:
            r = self.sb.finish(live, grace_s=0.0, reason_if_killed="timeout")
            self.isolation = r.isolation
            if isinstance(msg, dict) and "exc" in msg:
                self.load_error = f"solution_error: {str(msg['exc'])[:80]}"
            else:
                self.load_error = r.reason or "solution_error: no answer"
            return self.load_error
        self.live = live
        return None

    def request(self, req: dict, timeout_s: float) -> tuple[bytes | None, dict | None, str | None]:
        """(raw reply line, parsed reply, None) or (None, None, why the call got no answer)."""
        why = self._ensure()
        if why:
            return None, None, why
        assert self.live is not None
        timeout_s = max(0.0, min(timeout_s, self.deadline - time.monotonic()))
        if not self.live.send(json.dumps(req, separators=(",", ":")).encode(), timeout_s):
            return None, None, self._lost("timeout")
        line = self.live.recv(timeout_s)
        if line is None:
            return None, None, self._lost("timeout")
        reply = _json(line)
        if not isinstance(reply, dict) or reply.get("id") != req.get("id"):
            return None, None, self._lost("protocol_error")
        return line, reply, None

    def _lost(self, cut: str) -> str:
        """End the server after a call got no answer; the reason is ours (`cut`) if it was still running, else
        its own (memory_limit, killed, exit_code N, ...)."""
        assert self.live is not None
        live, self.live = self.live, None
        was_running = not live.done
        r = self.sb.finish(live, grace_s=0.0, reason_if_killed=cut)
        self.isolation = r.isolation
        if was_running:
            return cut
        return r.reason or "solution_exited"

    def close(self) -> None:
        if self.live is not None:
            live, self.live = self.live, None
            r = self.sb.finish(live, grace_s=0.5)
            self.isolation = r.isolation


def _json(line: bytes | None) -> Any:
    if line is None:
        return None
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


# ---- the three kinds of tests --------------------------------------------------------------------------------


def run_stdio(
    sb: Sandbox, cases: list[tuple[str, str]], limits: SandboxLimits, deadline: float, stop_on_failure: bool
) -> tuple[list[str | None], list[str]]:
    """Each case in a fresh run of solution.py; returns (per-case result, isolation achieved)."""
    results: list[str | None] = []
    iso: list[str] = []
    for stdin, want in cases:
        left = deadline - time.monotonic()
        if left <= 0.05:
            results.append("budget_exhausted")
        else:
            lim = msgspec.structs.replace(limits, wall_s=min(limits.wall_s, left))
            r = sb.run([sb.python(), "-I", "solution.py"], stdin=stdin, limits=lim)
            iso = iso or r.isolation
            results.append(None if r.ok and outputs_match(r.stdout, want) else (r.reason or "wrong_answer"))
        if stop_on_failure and results[-1] is not None:
            break
    return results, iso


def run_calls(
    server: ServerSession,
    fn_name: str,
    calls: list[tuple[list, Any]],
    limits: SandboxLimits,
    deadline: float,
    stop_on_failure: bool,
) -> list[str | None]:
    """Call `fn_name(*args)` in the solution for each case and compare on the host."""
    results: list[str | None] = []
    for i, (args, want) in enumerate(calls):
        req = {"id": i + 1, "op": "call", "ref": {"name": fn_name}, "args": [pd.encode(a) for a in args], "kwargs": []}
        _raw, reply, lost = server.request(req, min(limits.wall_s, deadline - time.monotonic()))
        if lost:
            results.append(lost)
        elif "exc" in reply:
            results.append(f"test_failed: {str(reply['exc'])[:80]}")
        else:
            try:
                got = pd.decode(reply.get("ok"))
                results.append(None if pd.values_match(got, want) else "wrong_answer")
            except (pd.PlainDataError, RecursionError):
                results.append("wrong_answer: not plain data")
        if stop_on_failure and results[-1] is not None:
            break
    return results


def run_judged(
    server: ServerSession,
    judge_sb: Sandbox,
    snippets: list[str],
    setup: str,
    proxies: list[str],
    modules: list[str],
    limits: SandboxLimits,
    deadline: float,
    stop_on_failure: bool,
) -> tuple[list[str | None], list[str]]:
    """Run test code in the judge, relaying its calls into the solution; returns (per-test result, judge isolation)."""
    n = len(snippets)
    results: list[str | None] = ["not_run"] * n
    first, iso = 0, []
    program = _program("judge", "_mod.judge(_pd)")
    while first < n:
        left = deadline - time.monotonic()
        if left <= 0.05:
            for i in range(first, n):
                results[i] = "budget_exhausted"
            break
        judge = judge_sb.start([judge_sb.python(), "-I", "-c", program], limits=session_limits(limits, left))
        if isinstance(judge, SandboxResult):
            for i in range(first, n):
                results[i] = f"judge_error: {judge.reason}"
            break
        cfg = {"tests": snippets, "setup": setup, "proxies": proxies, "modules": modules, "first": first}
        first, stop = _relay(server, judge, cfg, results, limits, deadline, stop_on_failure)
        r = judge_sb.finish(judge, grace_s=0.5, reason_if_killed="timeout")
        iso = iso or r.isolation
        if stop:
            break
    return results, iso


def _relay(
    server: ServerSession,
    judge: LiveRun,
    cfg: dict,
    results: list[str | None],
    limits: SandboxLimits,
    deadline: float,
    stop_on_failure: bool,
) -> tuple[int, bool]:
    """Drive one judge process; returns (the test to restart from, stop). Fills `results`."""
    n = len(results)
    if not judge.send(json.dumps(cfg, separators=(",", ":")).encode(), limits.wall_s):
        return _abort(results, cfg["first"], "judge_error: did not start"), True
    cur: int | None = None
    lost: dict[int, str] = {}
    test_deadline = min(deadline, time.monotonic() + limits.wall_s)  # for the judge's setup
    while True:
        wait = test_deadline - time.monotonic()
        if wait <= 0:
            if cur is None:  # the test setup itself hung
                return _abort(results, cfg["first"], "test_setup_error: timeout"), True
            results[cur] = lost.get(cur, "timeout")
            return cur + 1, stop_on_failure
        msg = _json(judge.recv(wait))
        if msg is None:
            if not judge.done and judge.cut is None and time.monotonic() < test_deadline:
                continue
            reason = "judge_error: " + (judge.cut or "the judge ended")
            if cur is None:
                return _abort(results, cfg["first"], reason), True
            results[cur] = lost.get(cur, reason)
            return cur + 1, stop_on_failure
        if not isinstance(msg, dict):
            continue
        if "start" in msg:
            i = msg["start"]
            if type(i) is not int or i != (cfg["first"] if cur is None else cur + 1) or i >= n:
                return _abort(results, cfg["first"] if cur is None else cur, "judge_error: protocol"), True
            cur = i
            test_deadline = min(deadline, time.monotonic() + limits.wall_s)
        elif "rpc" in msg and cur is not None:
            req = msg["rpc"]
            raw, _reply, why = server.request(req if isinstance(req, dict) else {}, test_deadline - time.monotonic())
            if why:
                lost.setdefault(cur, why)
                raw = json.dumps({"id": req.get("id") if isinstance(req, dict) else None, "lost": why}).encode()
            if not judge.send(raw, max(0.1, test_deadline - time.monotonic())):
                results[cur] = lost.get(cur, "judge_error: stalled")
                return cur + 1, stop_on_failure
        elif "result" in msg and msg.get("result") == cur:
            failed = lost.get(cur) or (None if msg.get("ok") is True else f"test_failed: {str(msg.get('exc'))[:80]}")
            results[cur] = failed
            if failed and stop_on_failure:
                return n, True
        elif "setup_error" in msg:
            return _abort(results, cfg["first"], f"test_setup_error: {str(msg['setup_error'])[:80]}"), True
        elif msg.get("done") is True:
            return n, True


def _abort(results: list[str | None], start: int, reason: str) -> int:
    for i in range(start, len(results)):
        results[i] = reason
    return len(results)
