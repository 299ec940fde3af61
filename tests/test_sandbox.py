"""The code sandbox's containment table: each hostile program ends with reward 0 and leaves the machine as it was.

Every case checks the aftermath, not just the verdict: no process of the sandbox's uid is left, files outside the
scratch directory were not created, and the scratch directory itself is gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from areal_async.rewards.code import CodeTests, code_reward, evaluate_code, extract_code, outputs_match, parse_tests
from areal_async.rewards.sandbox import Sandbox, SandboxLimits, _pids_of_uid, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

FAST = SandboxLimits(wall_s=3.0, cpu_s=1, max_processes=8)
ADD_TESTS = json.dumps({"inputs": ["1 2\n", "10 -4\n", "0 0\n"], "outputs": ["3\n", "6\n", "0\n"]})


def _run_contained(source: str, limits: SandboxLimits = FAST, stdin: str = ""):
    """Run `source`; return (result, uid, dir) after the sandbox is closed."""
    sb = Sandbox(limits)
    try:
        sb.write("main.py", source)
        res = sb.run([sb.python(), "-I", "main.py"], stdin=stdin)
    finally:
        sb.close()
    return res, sb.uid, sb.dir


def _assert_clean(uid: int | None, scratch: str) -> None:
    assert not os.path.exists(scratch), "scratch directory must be deleted"
    if uid is not None:
        assert _pids_of_uid(uid) == [], "no process of the sandbox uid may survive"


def test_correct_program_scores_one():
    completion = "Sure:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
    assert code_reward(completion, ADD_TESTS) == 1.0


def test_wrong_program_scores_fraction_or_zero():
    completion = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"
    assert code_reward(completion, ADD_TESTS) == pytest.approx(2 / 3)
    assert code_reward(completion, ADD_TESTS, all_or_nothing=True) == 0.0


def test_infinite_loop_is_stopped():
    res, uid, scratch = _run_contained("while True:\n    pass\n")
    assert not res.ok and res.reason in ("cpu_limit", "timeout", "killed")
    _assert_clean(uid, scratch)
    assert code_reward("```python\nwhile True: pass\n```", ADD_TESTS, wall_s=2, cpu_s=1, all_or_nothing=True) == 0.0


def test_sleeping_program_hits_the_wall_clock():
    res, uid, scratch = _run_contained("import time\ntime.sleep(60)\n", SandboxLimits(wall_s=1.0, cpu_s=5))
    assert res.reason == "timeout"
    _assert_clean(uid, scratch)


def test_fork_bomb_is_bounded_and_reaped():
    # children detach into their own sessions and sleep: only the pid namespace / uid sweep can catch them
    src = textwrap.dedent("""
        import os, time
        made = 0
        for _ in range(200):
            try:
                if os.fork() == 0:
                    os.setsid()
                    time.sleep(120)
                    os._exit(0)
                made += 1
            except OSError:
                pass
        print(made, flush=True)
        while True:
            time.sleep(1)
    """)
    res, uid, scratch = _run_contained(src, SandboxLimits(wall_s=2.0, cpu_s=2, max_processes=8))
    assert not res.ok and res.reason == "timeout"
    if "uid" in res.isolation:
        assert int(res.stdout.strip()) < 8  # RLIMIT_NPROC bound: the program itself counts
    _assert_clean(uid, scratch)


def test_memory_hog_is_refused():
    res, uid, scratch = _run_contained("x = bytearray(4 * 1024 ** 3)\nprint(len(x))\n",
                                       SandboxLimits(wall_s=5.0, memory_bytes=256 << 20))
    assert not res.ok and res.reason == "memory_limit"
    _assert_clean(uid, scratch)
    hog = "```python\nblocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024 * 1024))\n```"
    assert code_reward(hog, ADD_TESTS, memory_mb=256, wall_s=5) == 0.0


def test_output_flood_is_cut():
    limits = SandboxLimits(wall_s=5.0, output_bytes=10_000)
    res, uid, scratch = _run_contained("while True:\n    print('x' * 1000)\n", limits)
    assert not res.ok and res.reason == "output_limit"
    assert len(res.stdout) <= 10_000
    _assert_clean(uid, scratch)


def test_writes_outside_the_sandbox_do_not_land(tmp_path):
    private = tmp_path / f"escape_{uuid.uuid4().hex}.txt"  # a root-owned 0700 pytest directory
    shared_tmp = f"/tmp/areal_escape_{uuid.uuid4().hex}.txt"  # world-writable on the host
    src = textwrap.dedent(f"""
        import os
        for path in ({str(private)!r}, {shared_tmp!r}, "inside.txt"):
            try:
                with open(path, "w") as f:
                    f.write("pwned")
                print("wrote", path)
            except OSError as e:
                print("refused", path, type(e).__name__)
    """)
    res, uid, scratch = _run_contained(src)
    assert "wrote inside.txt" in res.stdout  # the scratch directory itself is writable
    assert not private.exists()
    if "private_tmp" in res.isolation:
        assert not os.path.exists(shared_tmp)
    else:  # no mount namespace: the program can use /tmp like any unprivileged user; note it and clean up
        if os.path.exists(shared_tmp):
            os.unlink(shared_tmp)
    _assert_clean(uid, scratch)


def test_no_network_when_isolated():
    src = textwrap.dedent("""
        import socket
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=1)
            print("connected")
        except OSError as e:
            print("blocked", e.errno)
    """)
    res, uid, scratch = _run_contained(src)
    if "netns" not in res.isolation:
        pytest.skip("this machine does not allow a private network namespace")
    assert res.ok and res.stdout.startswith("blocked")
    _assert_clean(uid, scratch)


def test_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("AREAL_SECRET_TOKEN", "hunter2")
    res = run_python("import os, json\nprint(json.dumps(dict(os.environ)))\n", limits=FAST)
    env = json.loads(res.stdout)
    assert "AREAL_SECRET_TOKEN" not in env
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED",
                        "PYTHONIOENCODING", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}


def test_killing_the_parent_takes_the_sandbox_down(tmp_path):
    """SIGKILL the process that runs the sandbox mid-run (a reward worker being replaced): nothing survives."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent("""
        import sys
        from areal_async.rewards.sandbox import Sandbox, SandboxLimits
        sb = Sandbox(SandboxLimits(wall_s=60, cpu_s=60))
        print(sb.uid, flush=True)
        sb.write("main.py", "import os, time\\nfor _ in range(3):\\n    os.fork()\\ntime.sleep(60)\\n")
        sb.run([sb.python(), "-I", "main.py"])
    """))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        uid = int(line) if line.isdigit() else None
        if uid is None:
            pytest.skip("not root: the sandbox runs under the caller's uid, which we cannot sweep for")
        deadline = time.monotonic() + 30
        while len(_pids_of_uid(uid)) < 8 and time.monotonic() < deadline:  # 2**3 processes up
            time.sleep(0.05)
        assert len(_pids_of_uid(uid)) == 8
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while _pids_of_uid(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pids_of_uid(uid) == []


# ---- test formats ---------------------------------------------------------------------------------------------


def test_extract_code_prefers_last_python_block():
    text = "```\nnot this\n```\nthen\n```python\nprint(1)\n```\nand\n```text\nlog\n```"
    assert extract_code(text) == "print(1)\n"
    assert extract_code("print(2)") == "print(2)"


def test_parse_tests_formats():
    assert parse_tests(ADD_TESTS).stdio[1] == ("10 -4\n", "6\n")
    call = parse_tests(json.dumps({"fn_name": "f", "inputs": [[1, 2]], "outputs": [3]}))
    assert call.snippets == ["assert _areal_eq(f(*[1, 2]), 3)"]
    assert parse_tests("assert f(1) == 2\nassert f(2) == 3\n").snippets == ["assert f(1) == 2", "assert f(2) == 3"]
    assert parse_tests(json.dumps(["assert f(1) == 2"])).snippets == ["assert f(1) == 2"]
    he = parse_tests("def check(candidate):\n    assert candidate(1) == 2\n", {"entry_point": "inc"})
    assert he.snippets[0].endswith("check(inc)\n")
    for bad in ("", "{not json", json.dumps({"inputs": [1], "outputs": []}), json.dumps([1, 2]), "[]",
                json.dumps({"fn_name": "os.system('x')", "inputs": [[1]], "outputs": [1]})):
        with pytest.raises(ValueError):
            parse_tests(bad)
    assert code_reward("print(1)", "{not json") == 0.0  # bad tests: reward 0, never an exception


def test_outputs_match():
    assert outputs_match("3\n", "3")
    assert outputs_match("1 2\n3  \n\n", "1 2 3")
    assert outputs_match("0.3333333", "0.33333333")
    assert not outputs_match("3", "4")
    assert not outputs_match("1 2", "1 2 3")


def test_harness_results_cannot_be_faked():
    """Exiting early, or printing what looks like a pass, does not pass tests."""
    tests = parse_tests("assert f(1) == 2")
    for cheat in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "print('0 PASS')\ndef f(x): return 0"):
        verdict = evaluate_code(cheat, tests, limits=FAST)
        assert verdict.reward == 0.0 and verdict.passed == 0, cheat


def test_function_tests_fraction_and_failure_reasons():
    code = "def f(x):\n    if x == 3:\n        raise ValueError\n    return x + 1 if x < 5 else 0\n"
    tests = CodeTests(snippets=["assert f(1) == 2", "assert f(3) == 4", "assert f(9) == 10", "assert f(0) == 1"])
    v = evaluate_code(code, tests, limits=FAST)
    assert (v.passed, v.total, v.reward) == (2, 4, 0.5)
    assert v.failures == ["test_failed: ValueError", "test_failed: AssertionError"]
