r"""Code rewards: run a model-written Python program against tests inside the sandbox.

The reference answer carries the tests, in one of the formats public code datasets use:

- stdin/stdout cases (APPS, CodeContests, LiveCodeBench "stdin"):
      {"inputs": ["1 2\n", ...], "outputs": ["3\n", ...]}
- call-based cases (APPS / LiveCodeBench "functional"):
      {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}
- assert statements (MBPP, HumanEval-style), setup optional:
      {"tests": ["assert add(1, 2) == 3", ...], "setup": "import math"}
- a JSON list of such statements, or a plain string of assert lines (MBPP's test_list joined by newlines), or, when
  it is not assert lines, one block of test code run after the solution (a HumanEval `check` function plus
  `meta["entry_point"]` is called for you).

The program is the last fenced code block of the completion (```python ... ```), or the whole completion when it has
none. The verdict is the fraction of tests passed, or all-or-nothing (`all_or_nothing=True`); a crash, timeout or
any limit hit fails the tests it affects, with the reason kept in `CodeVerdict`.

Stdin cases run one process each. Function and assert tests run in one process (a small harness imports the
solution, then runs each test and reports it); a test that hangs therefore also fails the tests after it. The
harness reports through a per-run random nonce read from stdin before the solution runs, so a program that exits
early or prints "PASS" does not pass; it is not proof against a program that deliberately inspects the harness's
stack frames, which is why the sandbox, not the harness, is the security boundary.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Any

import msgspec

from areal_async.rewards.sandbox import Sandbox, SandboxLimits, SandboxResult

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


class CodeTests(msgspec.Struct, kw_only=True):
    """Parsed tests: either stdin/stdout cases or Python test snippets run after the solution."""

    stdio: list[tuple[str, str]] = []  # (stdin, expected stdout)
    snippets: list[str] = []  # each one test: runs in the solution's namespace, passes if it raises nothing
    setup: str = ""  # runs before the snippets (imports)


class CodeVerdict(msgspec.Struct, kw_only=True):
    reward: float
    passed: int
    total: int
    reason: str | None  # the first failure's reason, None when everything passed
    failures: list[str] = []  # one reason per failed test, in test order


def extract_code(completion: str) -> str:
    """The last fenced block, preferring ones tagged python/py; the whole text when there is no fence."""
    blocks = _FENCE_RE.findall(completion or "")
    if not blocks:
        return completion or ""
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1]


def parse_tests(answer: str | dict, meta: dict[str, Any] | None = None, max_tests: int = 64) -> CodeTests:
    """Turn a dataset's reference answer into `CodeTests`; raises ValueError on anything unrecognisable."""
    meta = meta or {}
    spec: Any = answer
    if isinstance(answer, str):
        text = answer.strip()
        if text.startswith(("{", "[")):
            try:
                spec = json.loads(text)
            except ValueError as e:
                raise ValueError(f"code tests look like JSON but do not parse: {e}") from None
            if isinstance(spec, list):  # MBPP's test_list as JSON
                spec = {"tests": spec}
        else:
            lines = [ln for ln in text.splitlines() if ln.strip()]
            if lines and all(ln.lstrip().startswith("assert") for ln in lines):
                return CodeTests(snippets=[ln.strip() for ln in lines][:max_tests])
            if not text:
                raise ValueError("empty code tests")
            snippet = text
            if "def check(" in text and meta.get("entry_point"):
                snippet += f"\ncheck({meta['entry_point']})\n"
            return CodeTests(snippets=[snippet])
    if not isinstance(spec, dict):
        raise ValueError(f"code tests must be a JSON object or assert lines, got {type(spec).__name__}")
    if "tests" in spec:
        tests = spec["tests"]
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests) or not tests:
            raise ValueError("'tests' must be a non-empty list of strings")
        return CodeTests(snippets=tests[:max_tests], setup=str(spec.get("setup", "")))
    inputs, outputs = spec.get("inputs"), spec.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError("'inputs' and 'outputs' must be non-empty lists of equal length")
    fn = spec.get("fn_name")
    if fn:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", fn):
            raise ValueError(f"bad fn_name {fn!r}")
        snippets = []
        for args, want in zip(inputs[:max_tests], outputs[:max_tests]):
            args = args if isinstance(args, list) else [args]
            snippets.append(f"assert _areal_eq({fn}(*{args!r}), {want!r})")
        return CodeTests(snippets=snippets)
    return CodeTests(stdio=[(str(i), str(o)) for i, o in zip(inputs[:max_tests], outputs[:max_tests])])


def outputs_match(got: str, want: str, rel_tol: float = 1e-6) -> bool:
    """Whitespace-insensitive token comparison; numeric tokens compare with a small tolerance."""
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isclose(fx, fy, rel_tol=rel_tol, abs_tol=rel_tol):
            return False
    return True


_HARNESS = r'''
import json, os, sys
def _main():
    out = os.dup(1)
    nonce = sys.stdin.readline().strip()
    tests = json.loads(sys.stdin.readline())
    setup = json.loads(sys.stdin.readline())
    def report(msg):
        os.write(out, (nonce + " " + msg + "\n").encode())
    def eq(a, b):
        if isinstance(a, tuple): a = list(a)
        if isinstance(b, tuple): b = list(b)
        if isinstance(a, float) or isinstance(b, float):
            try: return abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
            except (TypeError, ValueError): return False
        return a == b
    g = {"__name__": "solution", "__builtins__": __builtins__, "_areal_eq": eq}
    try:
        with open("solution.py") as f:
            code = compile(f.read(), "solution.py", "exec")
        if setup:
            exec(compile(setup, "setup", "exec"), g)
        exec(code, g)
    except BaseException as e:
        report("SETUP " + type(e).__name__)
        return
    for i, t in enumerate(tests):
        try:
            exec(compile(t, "test_%d" % i, "exec"), g)
            report("%d PASS" % i)
        except BaseException as e:
            report("%d FAIL %s" % (i, type(e).__name__))
_main()
'''


def evaluate_code(code: str, tests: CodeTests, *, all_or_nothing: bool = False,
                  limits: SandboxLimits | None = None) -> CodeVerdict:
    """Run `code` against `tests` in one fresh sandbox and return the verdict."""
    failures: list[str] = []
    passed = 0
    total = len(tests.stdio) + len(tests.snippets)
    with Sandbox(limits) as sb:
        sb.write("solution.py", code)
        py = sb.python()
        for stdin, want in tests.stdio:
            r = sb.run([py, "-I", "solution.py"], stdin=stdin)
            if r.ok and outputs_match(r.stdout, want):
                passed += 1
            else:
                failures.append(r.reason or "wrong_answer")
                if all_or_nothing:
                    break
        if tests.snippets and not (all_or_nothing and failures):
            sb.write("harness.py", _HARNESS)
            nonce = secrets.token_hex(16)
            payload = f"{nonce}\n{json.dumps(tests.snippets)}\n{json.dumps(tests.setup)}\n"
            r = sb.run([py, "-I", "harness.py"], stdin=payload)
            p, f = _read_harness(r, nonce, len(tests.snippets))
            passed += p
            failures += f
    ok_all = passed == total and total > 0
    reward = (1.0 if ok_all else 0.0) if all_or_nothing else (passed / total if total else 0.0)
    return CodeVerdict(reward=reward, passed=passed, total=total, reason=failures[0] if failures else None,
                       failures=failures)


def _read_harness(r: SandboxResult, nonce: str, n: int) -> tuple[int, list[str]]:
    status: dict[int, str] = {}
    setup_fail = None
    for line in r.stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue
        parts = line[len(nonce) + 1:].split()
        if parts and parts[0] == "SETUP":
            setup_fail = "solution_error: " + (parts[1] if len(parts) > 1 else "?")
        elif len(parts) >= 2 and parts[0].isdigit() and int(parts[0]) < n:
            status.setdefault(int(parts[0]), "PASS" if parts[1] == "PASS" else "test_failed: " + " ".join(parts[2:]))
    missing = setup_fail or (r.reason if r.reason else "no_result")
    passed = sum(1 for v in status.values() if v == "PASS")
    failures = [status.get(i, missing) for i in range(n) if status.get(i) != "PASS"]
    return passed, failures


def code_reward(completion: str, answer: str, *, prompt: str = "", all_or_nothing: bool = False,
                **meta: Any) -> float:
    """Reward-function entry point ("code" in the registry). Never raises: bad tests or a crash score 0.0.

    Per-sample limits may be given in `meta`: wall_s, cpu_s, memory_mb.
    """
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
        verdict = evaluate_code(extract_code(completion), tests, all_or_nothing=bool(all_or_nothing),
                                limits=SandboxLimits(**kw) if kw else None)
        return verdict.reward
    except Exception:
        return 0.0
