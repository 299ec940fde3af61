"""The code reward's grading: correct solutions score in every test format, and reward hacks score 0.

The hacks are real programs of the kinds a policy finds (issue 17): a no-op `exec`, an object whose __eq__ is always
true (plain, int and str subclasses), rebinding the comparison helpers, reading the harness's state from the caller's
frames and the garbage collector, forging protocol messages, overwriting the grader's files, printing PASS, exiting
early, killing everything in sight, flooding the channel. Each runs against MBPP asserts, fn_name call cases and a
HumanEval `check`, partial credit and all-or-nothing, and every case checks that the host is left clean.
"""

from __future__ import annotations

import json
import logging
import sys
import textwrap
import time

import pytest
from sandbox_host import watched_host

from areal_async.rewards import code as code_module
from areal_async.rewards import plaindata as pd
from areal_async.rewards.code import (
    CodeTests,
    SandboxIsolationError,
    code_reward,
    evaluate_code,
    extract_code,
    outputs_match,
    parse_tests,
)
from areal_async.rewards.sandbox import SandboxLimits, probe_isolation

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

LIM = SandboxLimits(wall_s=4.0, cpu_s=2)
STDIO = json.dumps({"inputs": ["1 2\n", "10 -4\n", "0 0\n"], "outputs": ["3\n", "6\n", "0\n"]})
# expected values no hack can guess (no small constants that also live in the grader's processes)
FN = json.dumps({"fn_name": "add", "inputs": [[1234, 4321], [98765, 1], [-777, 333]], "outputs": [5555, 98766, -444]})
MBPP = (
    "assert add(1234, 4321) == 5555\nassert add(98765, 1) == 98766\nassert abs(add(0.5, 0.25) - 0.75) < 1e-9\n"
    "assert math.isclose(add(0.1, 0.2), 0.3)\nassert isinstance(add(811, 1), int) and add(811, 1) == 812"
)
HUMANEVAL = textwrap.dedent("""
    def check(candidate):
        assert candidate(1234, 4321) == 5555
        assert candidate(98765, 1) == 98766
        for i in range(20):
            assert candidate(i, 1000) == i + 1000
""")
FORMATS = {"fn_name": (FN, {}), "mbpp": (MBPP, {}), "humaneval": (HUMANEVAL, {"entry_point": "add"})}
GOOD = "import math\ndef add(a, b):\n    return a + b\n"


@pytest.fixture
def host():
    with watched_host() as uids:
        yield uids


def _eval(code: str, fmt: str, **kw):
    answer, meta = FORMATS[fmt]
    return evaluate_code(code, parse_tests(answer, meta), limits=kw.pop("limits", LIM), **kw)


# ---- correct solutions score -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_correct_solution_scores_one_in_every_format(host, fmt):
    v = _eval(GOOD, fmt)
    assert (v.reward, v.failures) == (1.0, []), v
    answer, meta = FORMATS[fmt]
    assert code_reward(f"Here:\n```python\n{GOOD}```\n", answer, wall_s=4, **meta) == 1.0


def test_stdio_scores_fraction_and_all_or_nothing(host):
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"
    assert code_reward(good, STDIO) == 1.0
    assert code_reward(half, STDIO) == pytest.approx(2 / 3)
    assert code_reward(half, STDIO, all_or_nothing=True) == 0.0


def test_partial_credit_and_failure_reasons(host):
    code = "def f(x):\n    if x == 3:\n        raise ValueError('no')\n    return x + 1 if x < 5 else 0\n"
    tests = parse_tests(json.dumps(["assert f(1) == 2", "assert f(3) == 4", "assert f(9) == 10", "assert f(0) == 1"]))
    v = evaluate_code(code, tests, limits=LIM)
    assert (v.passed, v.total, v.reward) == (2, 4, 0.5)
    assert v.failures == ["test_failed: ValueError", "test_failed: AssertionError"]
    calls = parse_tests(json.dumps({"fn_name": "f", "inputs": [[1], [3], [9]], "outputs": [2, 4, 10]}))
    v = evaluate_code(code, calls, limits=LIM)
    assert (v.passed, v.failures) == (1, ["test_failed: ValueError", "wrong_answer"])
    v = evaluate_code(code, calls, limits=LIM, all_or_nothing=True)
    assert (v.reward, v.failures) == (0.0, ["test_failed: ValueError"])


def test_richer_solutions_and_tests(host):
    """Classes, generators, tuples, exceptions the tests expect, helpers inside check, a LeetCode Solution class."""
    code = textwrap.dedent("""
        from typing import List
        class Stack:
            def __init__(self): self.items = []
            def push(self, x): self.items.append(x); return self
            def top(self): return self.items[-1]
        def evens(n):
            return (i for i in range(n) if i % 2 == 0)
        def divmod2(a, b):
            if b == 0:
                raise ZeroDivisionError("b")
            return a // b, a % b
        class Solution:
            def twoSum(self, nums: List[int], target: int) -> List[int]:
                seen = {}
                for i, x in enumerate(nums):
                    if target - x in seen:
                        return [seen[target - x], i]
                    seen[x] = i
    """)
    tests = parse_tests(
        json.dumps(
            [
                "assert Stack().push(1).push(2).top() == 2",
                "assert list(evens(7)) == [0, 2, 4, 6]",
                "assert divmod2(7, 2) == (3, 1)",
                "try:\n    divmod2(1, 0)\n    assert False\nexcept ZeroDivisionError:\n    pass",
                "def ref(a, b):\n    return (a // b, a % b)\n"
                "for a in range(30):\n    assert divmod2(a, 7) == ref(a, 7)",
            ]
        )
    )
    v = evaluate_code(code, tests, limits=LIM)
    assert (v.reward, v.failures) == (1.0, []), v
    lc = parse_tests(
        json.dumps({"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]], "outputs": [[0, 1], [1, 2]]})
    )
    assert evaluate_code(code, lc, limits=LIM).reward == 1.0


def test_setup_code_runs_for_both_sides(host):
    tests = parse_tests(json.dumps({"tests": ["assert area(2) == pytest_pi * 4"], "setup": "pytest_pi = 3"}))
    assert evaluate_code("def area(r):\n    return pytest_pi * r * r\n", tests, limits=LIM).reward == 1.0
    broken = parse_tests(json.dumps({"tests": ["assert True"], "setup": "raise RuntimeError"}))
    v = evaluate_code("x = 1", broken, limits=LIM)
    assert v.reward == 0.0 and v.reason.startswith("solution_error") or v.reason.startswith("test_setup_error")


# ---- comparisons ------------------------------------------------------------------------------------------------


def test_outputs_match_is_exact_for_integers():
    assert outputs_match("3\n", "3") and outputs_match("1 2\n3  \n\n", "1 2 3")
    assert outputs_match("0.3333333", "0.33333333")  # a float in the reference: tolerance
    assert not outputs_match("1000000000001", "1000000000000")  # hole 7: an int is an int
    assert not outputs_match("3.0000001", "3") and not outputs_match("3", "4") and not outputs_match("1 2", "1 2 3")
    assert not outputs_match("YES", "yes") and outputs_match("+7", "7") and outputs_match("-0", "0")
    big = "9" * 5000  # beyond float range and int()'s digit limit: still exact
    assert outputs_match(big, big) and outputs_match("0" + big, big) and not outputs_match(big + "1", "1" + big)
    assert not outputs_match("8" + big[1:], big) and not outputs_match("-" + big, big)


@pytest.mark.parametrize(
    "got, want, same",
    [
        (3, 3, True),
        (3.0, 3, True),
        (1000000000001, 1000000000000, False),
        (3.0000001, 3, False),
        (0.30000000000000004, 0.3, True),
        (0.31, 0.3, False),
        (True, 1, False),
        (1, True, False),
        ((1, 2), [1, 2], True),
        ([1, [2, 3.0000000001]], [1, [2, 3.0]], True),
        ({"a": 1}, {"a": 1}, True),
        ({"a": 1}, {"b": 1}, False),
        ("abc", "abc", True),
        ("abc", "abd", False),
        (None, None, True),
        (None, 0, False),
        ({1, 2}, {2, 1}, True),
        (float("nan"), float("nan"), True),
        (pd.Opaque(1, "E"), 3, False),
    ],
)
def test_values_match(got, want, same):
    assert pd.values_match(got, want) is same


def test_plain_data_never_carries_behaviour():
    class Evil(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    class EvilList(list):
        def __eq__(self, other):
            return True

    handles: dict = {}
    value = pd.loads(pd.dumps([Evil(0), EvilList([1]), (1, "x"), {1: {2}}, object(), 10**30], handles))
    assert type(value[0]) is int and value[0] == 0 and value[0] != 5
    assert type(value[1]) is list and value[1] != [2]
    assert value[2] == (1, "x") and value[3] == {1: {2}} and value[5] == 10**30
    assert isinstance(value[4], pd.Opaque) and value[4] != value[4] or value[4] == value[4]  # identity only
    assert not (value[4] == 3)
    for bad in ('{"$": "nope"}', '{"a": 1}', "[" * 100000 + "]" * 100000, '{"$": "int", "v": "zz"}'):
        with pytest.raises(pd.PlainDataError):
            pd.loads(bad)


# ---- parsing ------------------------------------------------------------------------------------------------------


def test_parse_tests_formats():
    assert parse_tests(STDIO).stdio[1] == ("10 -4\n", "6\n")
    call = parse_tests(json.dumps({"fn_name": "f", "inputs": [[1, 2], 5], "outputs": [3, 6]}))
    assert (call.fn_name, call.calls) == ("f", [([1, 2], 3), ([5], 6)])
    lines = parse_tests("assert f(1) == 2\nassert math.isclose(g(2), 3.0)\n")
    assert lines.snippets == ["assert f(1) == 2", "assert math.isclose(g(2), 3.0)"]
    assert (lines.proxies, lines.modules) == (["f", "g"], ["math"])
    he = parse_tests(HUMANEVAL, {"entry_point": "add"})
    assert he.snippets[0].endswith("check(add)\n") and he.proxies == ["add"]
    shadow = parse_tests("import math\nmath = None\nassert f(math) == 1")  # a name the test binds is its own
    assert shadow.proxies == ["f"] and shadow.modules == []
    for bad in (
        "",
        "{not json",
        json.dumps({"inputs": [1], "outputs": []}),
        json.dumps([1, 2]),
        "[]",
        json.dumps({"fn_name": "os.system('x')", "inputs": [[1]], "outputs": [1]}),
    ):
        with pytest.raises(ValueError):
            parse_tests(bad)
    with pytest.raises(ValueError):
        parse_tests(HUMANEVAL, {"entry_point": "add); import os; os.system('x'"})
    assert code_reward("print(1)", "{not json") == 0.0  # bad tests: reward 0, never an exception


@pytest.mark.timeout(60)
def test_extract_code_is_linear_on_adversarial_input():
    """Hole 5: the old regex took 11.4 s on 128k backticks (quadratic); this input is 8x that."""
    assert extract_code("`" * (1 << 20)) == "`" * (1 << 20)
    assert extract_code("```\n" * (1 << 18)) == ""
    text = "```\nnot this\n```\nthen\n```python\nprint(1)\n```\nand\n```text\nlog\n```"
    assert extract_code(text) == "print(1)\n" and extract_code("print(2)") == "print(2)"
    assert extract_code("```py  \nx = 1\n```") == "x = 1\n"


# ---- reward hacks (hole 1): each scores 0 ---------------------------------------------------------------------

HACKS = {
    "noop_exec": "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.eval = lambda *a, **k: True\n"
    "def add(a, b):\n    return 0\n",
    "always_equal": textwrap.dedent("""
        class Anything:
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            def __lt__(self, other): return True
            def __gt__(self, other): return True
            def __hash__(self): return 0
            def __sub__(self, other): return 0
            def __abs__(self): return 0
            def __bool__(self): return True
        def add(a, b):
            return Anything()
    """),
    "int_subclass": textwrap.dedent("""
        class Int(int):
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            __hash__ = int.__hash__
        def add(a, b):
            return Int(0)
    """),
    "rebind_helpers": textwrap.dedent("""
        import builtins, math, operator
        _areal_eq = lambda a, b: True
        builtins.abs = lambda x: 0
        builtins.isinstance = lambda *a: True
        math.isclose = lambda *a, **k: True
        operator.eq = lambda a, b: True
        def add(a, b):
            return 0
    """),
    "frames_and_gc": textwrap.dedent("""
        import gc, os, re, sys
        def add(a, b):
            # the grader's secrets, wherever it keeps them: a nonce and a report channel in a caller's frame ...
            f = sys._getframe(1)
            while f is not None:
                names = f.f_locals
                nonce = next((v for v in names.values() if isinstance(v, str) and re.fullmatch("[0-9a-f]{32}", v)),
                             None)
                if nonce:
                    fds = [v for v in names.values() if type(v) is int and 0 < v < 64] + [1]
                    for fd in fds:
                        for i in range(64):
                            try:
                                os.write(fd, ("%s %d PASS\\n" % (nonce, i)).encode())
                            except OSError:
                                pass
                    os._exit(0)
                f = f.f_back
            # ... or the expected value among the live objects
            pattern = re.compile(r"add\\(%d, %d\\) == (-?\\d+)" % (a, b))
            for o in gc.get_objects():
                if isinstance(o, str):
                    m = pattern.search(o)
                    if m:
                        return int(m.group(1))
            return None
    """),
    "forge_channel": textwrap.dedent("""
        import os, sys, json
        os.write(4, b'{"ready": true}\\n' + b"".join(b'{"id": %d, "ok": 42}\\n' % i for i in range(1, 64)))
        os.write(4, b'{"result": 0, "ok": true}\\n{"done": true}\\n')
        json.dumps = lambda *a, **k: '{"id": 1, "ok": 42}'
        print("0 PASS")
        def add(a, b):
            return 42
    """),
    "print_pass_and_exit": "print('PASS')\nimport sys\nsys.stdout.flush()\nsys.exit(0)\n",
    "hard_exit": "import os\nos.write(1, b'0 PASS\\n1 PASS\\n')\nos._exit(0)\n",
    "kill_everything": textwrap.dedent("""
        import os, signal
        for pid in [-1] + list(range(1, 300)):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        def add(a, b):
            return 0
    """),
    "overwrite_grader_files": textwrap.dedent("""
        import glob, os, sys
        for path in ["judge.py", "harness.py", "plaindata.py", "solution_server.py", "/tmp/judge.py",
                     *glob.glob("/tmp/**/*.py", recursive=True), *sys.path]:
            try:
                with open(path, "w") as f:
                    f.write("print('PASS')")
            except OSError:
                pass
        def add(a, b):
            return 0
    """),
    "flood_the_channel": "def add(a, b):\n    return 'x' * (8 << 20)\n",  # twice the channel's message cap
    "spam_the_channel": "import os\ndef add(a, b):\n    while True:\n        os.write(4, b'{}\\n' * 4096)\n",
}


@pytest.mark.parametrize("hack", sorted(HACKS))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_reward_hack_scores_zero(host, hack, fmt):
    v = _eval(HACKS[hack], fmt)
    assert v.reward == 0.0 and v.passed == 0, (hack, fmt, v)
    assert len(v.failures) == v.total and all(v.failures)


@pytest.mark.parametrize("hack", ["noop_exec", "always_equal", "rebind_helpers", "forge_channel"])
def test_reward_hack_scores_zero_all_or_nothing_and_through_code_reward(host, hack):
    for fmt, (answer, meta) in FORMATS.items():
        completion = f"```python\n{HACKS[hack]}```"
        assert code_reward(completion, answer, all_or_nothing=True, **meta) == 0.0, (hack, fmt)
        assert code_reward(completion, answer, **meta) == 0.0, (hack, fmt)


@pytest.mark.parametrize("hack", ["print_pass_and_exit", "hard_exit", "kill_everything"])
def test_stdio_hacks_score_zero(host, hack):
    assert code_reward(f"```python\n{HACKS[hack]}```", STDIO) == 0.0


def test_a_hanging_call_fails_only_its_test(host):
    code = "import time\ndef f(x):\n    if x == 2:\n        time.sleep(60)\n    return x * 2\n"
    tests = parse_tests(json.dumps({"fn_name": "f", "inputs": [[1], [2], [3]], "outputs": [2, 4, 6]}))
    v = evaluate_code(code, tests, limits=SandboxLimits(wall_s=1.0, cpu_s=2))
    assert (v.passed, v.failures) == (2, ["timeout"])  # the server was restarted for the third case
    asserts = parse_tests(json.dumps(["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 6"]))
    v = evaluate_code(code, asserts, limits=SandboxLimits(wall_s=1.0, cpu_s=2))
    assert (v.passed, v.failures) == (2, ["timeout"])


def test_total_time_is_bounded_by_the_budget(host):
    """Hole 7: 64 sleeping cases used to cost 64 x wall_s; the sample's budget bounds them together."""
    tests = CodeTests(stdio=[("", "x")] * 64)
    t0 = time.monotonic()
    v = evaluate_code("import time\ntime.sleep(60)\n", tests, limits=SandboxLimits(wall_s=10.0), budget_s=3.0)
    assert time.monotonic() - t0 < 3.0 + 5.0  # the budget, plus process start and cleanup
    assert v.reward == 0.0 and v.failures[0] == "timeout" and v.failures[-1] == "budget_exhausted"


# ---- weak isolation (hole 6) ------------------------------------------------------------------------------------


def test_weak_isolation_warns_and_can_refuse(host, caplog, monkeypatch):
    # the warning is said once per process; another weak-mode test may have run first (random order)
    monkeypatch.setattr(code_module, "_warned", set())
    tests = parse_tests("assert add(1, 2) == 3")
    with caplog.at_level(logging.WARNING, logger="areal_async.rewards.code"):
        v = evaluate_code(GOOD, tests, limits=LIM, disable=("namespaces",))
    assert v.reward == 1.0  # still grades
    assert any("sandbox is weak" in r.getMessage() for r in caplog.records)
    with pytest.raises(SandboxIsolationError, match="missing .*pidns"):
        evaluate_code(GOOD, tests, limits=LIM, disable=("namespaces",), require_isolation=True)
    # the switch reaches code_reward; the full mode (as root, or with user namespaces) is not refused
    monkeypatch.setenv("AREAL_SANDBOX_REQUIRE_ISOLATION", "1")
    if probe_isolation().weak:
        with pytest.raises(SandboxIsolationError):
            code_reward(GOOD, "assert add(1, 2) == 3")
    else:
        assert code_reward(GOOD, "assert add(1, 2) == 3") == 1.0
        assert code_reward(GOOD, "assert add(1, 2) == 3", require_isolation=False) == 1.0


@pytest.mark.parametrize("hack", ["noop_exec", "always_equal", "frames_and_gc"])
def test_hacks_score_zero_in_the_weak_mode_too(host, hack):
    v = _eval(HACKS[hack], "mbpp", disable=("namespaces",))
    assert v.reward == 0.0, v
