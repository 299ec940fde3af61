r"""The tests of a code task, parsed from a dataset's reference answer, in one of the formats public datasets use:

- stdin/stdout cases (APPS, CodeContests, LiveCodeBench "stdin"):
      {"inputs": ["1 2\n", ...], "outputs": ["3\n", ...]}
- call-based cases (APPS / LiveCodeBench "functional"):
      {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}
- assert statements (MBPP, HumanEval-style), setup optional:
      {"tests": ["assert add(1, 2) == 3", ...], "setup": "import math"}
- a JSON list of such statements, or a plain string of assert lines (MBPP's test_list joined by newlines), or, when
  it is not assert lines, one block of test code (a HumanEval `check` function plus `meta["entry_point"]` is called
  for you).

Test code is analysed here, on the host, without running it: the free names it expects from the solution (`add`, the
entry point) become remote proxies in the judge, and standard-library modules it uses without importing them
(`math.isclose` in an MBPP assert, which relied on the solution's `import math`) are imported by the judge itself,
so a solution cannot substitute its own `math`.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
import sys
from typing import Any

import msgspec

from areal_async.host import safe_ast

_FN_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_BUILTINS = frozenset(dir(builtins))


class CodeTests(msgspec.Struct, kw_only=True):
    """Parsed tests: stdin/stdout cases, call cases compared on the host, or test code run by the judge."""

    stdio: list[tuple[str, str]] = []  # (stdin, expected stdout)
    fn_name: str | None = None  # call cases: the solution's function
    calls: list[tuple[list, Any]] = []  # (arguments, expected return value)
    snippets: list[str] = []  # each one test, run by the judge; passes if it raises nothing
    setup: str = ""  # runs before the snippets (imports), in the judge and before the solution
    proxies: list[str] = []  # names the snippets take from the solution
    modules: list[str] = []  # standard modules the snippets use without importing them

    @property
    def total(self) -> int:
        return len(self.stdio) + len(self.calls) + len(self.snippets)


def solution_names(snippets: list[str], setup: str = "") -> tuple[list[str], list[str]]:
    """(names the test code expects from the solution, stdlib modules it uses without importing them)."""
    loaded: set[str] = set()
    bound: set[str] = set()
    direct: set[str] = set()  # names used other than as `name.attr`
    for src, is_setup in [(s, False) for s in snippets] + [(setup, True)]:
        try:
            tree = safe_ast.parse(src)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue  # the judge reports a test that does not compile as failed
        attr_bases = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                if isinstance(node.ctx, ast.Load):
                    if not is_setup:
                        loaded.add(node.id)
                        if id(node) not in attr_bases:
                            direct.add(node.id)
                else:
                    bound.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
            elif isinstance(node, ast.ExceptHandler) and node.name:
                bound.add(node.name)
            elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
                bound.add(node.name)
            elif isinstance(node, ast.MatchMapping) and node.rest:
                bound.add(node.rest)
    free = loaded - bound - _BUILTINS
    modules = sorted(n for n in free if n in sys.stdlib_module_names and n not in direct)
    return sorted(free - set(modules)), modules


def _snippet_tests(snippets: list[str], setup: str = "") -> CodeTests:
    proxies, modules = solution_names(snippets, setup)
    return CodeTests(snippets=snippets, setup=setup, proxies=proxies, modules=modules)


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
                return _snippet_tests([ln.strip() for ln in lines][:max_tests])
            if not text:
                raise ValueError("empty code tests")
            snippet = text
            entry = meta.get("entry_point")
            if "def check(" in text and entry:
                if not isinstance(entry, str) or not _FN_NAME_RE.fullmatch(entry):
                    raise ValueError(f"bad entry_point {entry!r}")
                snippet += f"\ncheck({entry})\n"
            return _snippet_tests([snippet])
    if not isinstance(spec, dict):
        raise ValueError(f"code tests must be a JSON object or assert lines, got {type(spec).__name__}")
    if "tests" in spec:
        tests = spec["tests"]
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests) or not tests:
            raise ValueError("'tests' must be a non-empty list of strings")
        return _snippet_tests(tests[:max_tests], str(spec.get("setup", "") or ""))
    inputs, outputs = spec.get("inputs"), spec.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError("'inputs' and 'outputs' must be non-empty lists of equal length")
    fn = spec.get("fn_name")
    if fn:
        if not isinstance(fn, str) or not _FN_NAME_RE.fullmatch(fn):
            raise ValueError(f"bad fn_name {fn!r}")
        calls = [
            (args if isinstance(args, list) else [args], want)
            for args, want in zip(inputs[:max_tests], outputs[:max_tests])
        ]
        return CodeTests(fn_name=fn, calls=calls)
    return CodeTests(stdio=[(str(i), str(o)) for i, o in zip(inputs[:max_tests], outputs[:max_tests])])
