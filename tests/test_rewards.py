"""Math rewards, the reward registry, and RewardRunner's promise: every call returns, a hang or a crash scores 0
with a reason, and the runner keeps working afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import textwrap

import pytest

from areal_async.rewards import RewardRunner, call_reward, names, register, resolve
from areal_async.rewards.math import math_reward

# ---- math-verify -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, answer, want",
    [
        ("So the answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("we get $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{x(x+2)}", "x^2+2x", 1.0),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("The answer is 3.", "3", 1.0),
        # GSM8K: only what follows the last #### counts, for the reference and the completion
        ("She sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "Natalia sold 48/2 = 24 clips...\n#### 72", 1.0),
        ("First 72, then 10 more.\n#### 82", "#### 72", 0.0),
        ("#### 1200", "#### 1,200", 1.0),
        ("#### 1,200", "1200", 1.0),
        ("#### 7 apples", "7", 1.0),
    ],
)
def test_math_reward_cases(completion, answer, want):
    assert math_reward(completion, answer) == want


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("", "42"),
        ("garbage ### ) (", "42"),
        ("\\boxed{{{{", "1"),
        ("\\boxed{42}", ""),
        (None, "1"),
        ("\\boxed{1}", None),
        ("x" * 5000, "42"),
    ],
)
def test_math_reward_never_raises_on_garbage(completion, answer):
    assert math_reward(completion, answer) == 0.0


def test_math_reward_off_the_main_thread():
    """math-verify's SIGALRM timeouts only work on the main thread; the reward must still work elsewhere."""
    import threading

    got: list[float] = []
    t = threading.Thread(target=lambda: got.append(math_reward("\\boxed{7}", "7")))
    t.start()
    t.join()
    assert got == [1.0]


# ---- registry ---------------------------------------------------------------------------------------------------


def test_registry_names_and_paths():
    assert {"arith", "math", "code"} <= set(names())
    assert resolve("math").target == "areal_async.rewards.math:math_reward"
    assert resolve("arith").inline
    assert resolve("pkg.mod:fn").target == "pkg.mod:fn" and not resolve("pkg.mod:fn").inline
    with pytest.raises(KeyError, match="known: .*math"):
        resolve("no_such_reward")
    for bad in ("mod:", ":fn", "a b:c", "mod:fn()"):
        with pytest.raises(ValueError):
            resolve(bad)
    with pytest.raises(ValueError):
        register("x:y", "mod:fn")


def test_call_reward_passes_only_accepted_keywords():
    def two(completion, answer):
        return completion == answer

    def with_prompt(completion, answer, *, prompt=""):
        return float(prompt == "p")

    def with_meta(completion, answer, **meta):
        return float(meta.get("k", 0))

    assert call_reward(two, "a", "a", "p", {"k": 1}) == 1.0
    assert call_reward(with_prompt, "a", "b", "p", {"k": 1}) == 1.0
    assert call_reward(with_meta, "a", "b", "p", {"k": 3}) == 3.0
    with pytest.raises(TypeError):
        call_reward(lambda c, a: "1.0", "a", "b")
    with pytest.raises(ValueError):
        call_reward(lambda c, a: float("nan"), "a", "b")


# ---- RewardRunner --------------------------------------------------------------------------------------------------


@pytest.fixture
def reward_module(tmp_path):
    """A throwaway importable module of misbehaving reward functions; workers import it by path."""
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent("""
        import os, sys, time

        def exact(completion, answer, *, prompt="", **meta):
            return 1.0 if completion.strip() == answer.strip() else 0.0

        def with_meta(completion, answer, *, prompt="", **meta):
            return float(meta["weight"]) * (prompt == "the prompt")

        def hang(completion, answer, **meta):
            time.sleep(600)

        def slow_import_ok(completion, answer, **meta):
            return 0.25

        def boom(completion, answer, **meta):
            raise RuntimeError("reward exploded")

        def crash(completion, answer, **meta):
            os._exit(3)

        def chatty(completion, answer, **meta):
            print("noise on stdout " * 100)
            sys.stdout.write("\\x00\\x00\\x00\\x05hello")
            return 0.5

        def not_a_number(completion, answer, **meta):
            return "high"

        def pid(completion, answer, **meta):
            return float(os.getpid())

        def deadline(completion, answer, **meta):
            from areal_async.rewards.registry import time_left
            left = time_left()
            return -1.0 if left is None else left

        def sandbox_ignoring_deadline(completion, answer, **meta):
            # runs a program far past the runner's timeout: only the runner's SIGTERM ends it
            from areal_async.rewards.sandbox import Sandbox, SandboxLimits
            with Sandbox(SandboxLimits(wall_s=120, cpu_s=60)) as sb:
                sb.write("main.py", "import time\\ntime.sleep(120)\\n")
                sb.run([sb.python(), "-I", "main.py", answer])
            return 1.0
    """)
    )
    return str(tmp_path)


async def test_runner_scores_by_name_and_by_path(reward_module):
    async with RewardRunner(max_workers=2, env={"PYTHONPATH": reward_module}) as rr:
        assert await rr.score("math", "\\boxed{12}", "12") == (1.0, None)
        assert await rr.score("math", "\\boxed{13}", "12") == (0.0, None)
        assert await rr.score("arith", "1+2=3\n#### 3", "3") == (1.0, None)  # inline fast path
        assert await rr.score("my_rewards:exact", " 7 ", "7") == (1.0, None)
        got = await rr.score("my_rewards:with_meta", "x", "y", prompt="the prompt", weight=2.5)
        assert got == (2.5, None)
        assert rr.stats.inline_calls == 1


async def test_runner_code_reward_in_worker():
    tests = json.dumps({"inputs": ["2 3\n"], "outputs": ["5\n"]})
    async with RewardRunner(max_workers=1) as rr:
        assert await rr.score("code", "```python\nprint(sum(map(int, input().split())))\n```", tests) == (1.0, None)
        assert await rr.score("code", "```python\nprint(6)\n```", tests) == (0.0, None)


async def test_runner_timeout_kills_and_replaces_the_worker(reward_module):
    async with RewardRunner(max_workers=1, env={"PYTHONPATH": reward_module}) as rr:
        pid_before, _ = await rr.score("my_rewards:pid", "", "")
        assert await rr.score("my_rewards:hang", "", "", timeout_s=0.5) == (0.0, "timeout")
        pid_after, why = await rr.score("my_rewards:pid", "", "")
        assert why is None and pid_after != pid_before  # a fresh worker took over
        assert rr.stats.timeouts == 1 and rr.stats.workers_killed == 1
        with pytest.raises(ProcessLookupError):
            import os

            os.kill(int(pid_before), 0)


async def test_runner_exceptions_and_crashes_score_zero(reward_module):
    async with RewardRunner(max_workers=1, env={"PYTHONPATH": reward_module}) as rr:
        assert await rr.score("my_rewards:boom", "", "") == (0.0, "RuntimeError: reward exploded")
        reward, why = await rr.score("my_rewards:crash", "", "")
        assert reward == 0.0 and why.startswith("worker died (exit code 3)")
        reward, why = await rr.score("my_rewards:not_a_number", "", "")
        assert reward == 0.0 and "expected a float" in why
        reward, why = await rr.score("my_rewards:missing", "", "")
        assert reward == 0.0 and why.startswith("cannot import my_rewards:missing")
        reward, why = await rr.score("no_such_module_xyz:fn", "", "")
        assert reward == 0.0 and "No module named" in why
        reward, why = await rr.score("not registered", "", "")
        assert reward == 0.0 and "unknown reward" in why
        # printing to stdout (even bytes that look like a frame header) does not corrupt the protocol
        assert await rr.score("my_rewards:chatty", "", "") == (0.5, None)
        assert await rr.score("my_rewards:exact", "1", "1") == (1.0, None)


async def test_runner_unserialisable_meta_is_an_error_not_a_crash(reward_module):
    async with RewardRunner(max_workers=1, env={"PYTHONPATH": reward_module}) as rr:
        reward, why = await rr.score("my_rewards:exact", "1", "1", obj=object())
        assert reward == 0.0 and why.startswith("bad arguments")


async def test_runner_runs_calls_concurrently_up_to_max_workers(reward_module):
    async with RewardRunner(max_workers=2, env={"PYTHONPATH": reward_module}) as rr:
        results = await asyncio.gather(*(rr.score("my_rewards:exact", str(i), "3") for i in range(8)))
        assert [r for r, _ in results] == [1.0 if i == 3 else 0.0 for i in range(8)]
        assert rr.stats.workers_started <= 2


async def test_cancelled_call_does_not_poison_the_pool(reward_module):
    async with RewardRunner(max_workers=1, env={"PYTHONPATH": reward_module}) as rr:
        task = asyncio.create_task(rr.score("my_rewards:hang", "", "", timeout_s=60))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await rr.score("my_rewards:exact", "1", "1") == (1.0, None)


async def test_close_answers_pending_calls(reward_module):
    rr = RewardRunner(max_workers=1, env={"PYTHONPATH": reward_module})
    task = asyncio.create_task(rr.score("my_rewards:hang", "", "", timeout_s=60))
    await asyncio.sleep(0.5)
    await rr.close()
    assert await asyncio.wait_for(task, 10) == (0.0, "runner closed")
    assert await rr.score("my_rewards:exact", "1", "1") == (0.0, "runner closed")


def _procs_with(marker: str) -> list[int]:
    import os

    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


async def test_runner_timeout_takes_down_a_sandboxed_program():
    """A code reward whose program (and its children) outlive the reward timeout: killing the worker must kill
    the whole sandboxed process tree too (parent-death signals + the sandbox's pid namespace)."""
    import sys
    import time
    import uuid

    if not sys.platform.startswith("linux"):
        pytest.skip("the sandbox is Linux-only")
    marker = f"areal-marker-{uuid.uuid4().hex}"
    program = textwrap.dedent(f"""
        import os, sys, time
        for _ in range(2):
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", "{marker}"])
        time.sleep(120)
    """)
    tests = json.dumps({"inputs": [""], "outputs": ["x"]})
    async with RewardRunner(max_workers=1) as rr:
        task = asyncio.create_task(rr.score("code", f"```python\n{program}\n```", tests, timeout_s=60, wall_s=100))
        deadline = time.monotonic() + 30
        while len(_procs_with(marker)) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(_procs_with(marker)) == 2
        task.cancel()  # the caller gives up: the worker is killed, and with it the sandbox
        with pytest.raises(asyncio.CancelledError):
            await task
    deadline = time.monotonic() + 10
    while _procs_with(marker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _procs_with(marker) == []


# ---- the code reward under the runner (issue 17) ----------------------------------------------------------------


async def test_reward_sees_the_runners_deadline(reward_module):
    import time

    async with RewardRunner(max_workers=1, env={"PYTHONPATH": reward_module}) as rr:
        t0 = time.monotonic()
        left, why = await rr.score("my_rewards:deadline", "", "", timeout_s=7.0)
        took = time.monotonic() - t0
        # the reward ran inside this call, so its deadline had at most `took` of the 7 s behind it: a bound that
        # holds on any machine, however slow
        assert why is None and 7.0 - took <= left <= 7.0, (left, took)


def _leftovers_of(pid: int) -> list[str]:
    from areal_async.rewards.sandbox import host_leftovers

    return [p for p in host_leftovers() if f"-{pid}-" in os.path.basename(p)]


async def test_code_reward_gives_up_before_the_runner_and_cleans_up(reward_module):
    """Hole 2: a sleeping solution used to outlive the sandbox's wall clock = the runner's timeout, so the worker was
    killed before Sandbox.close() and every timeout leaked a scratch directory. Now the reward's budget ends first."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("the sandbox is Linux-only")
    sleeper = "```python\nimport time\ntime.sleep(60)\n```"
    tests = json.dumps({"inputs": ["1\n", "2\n"], "outputs": ["1\n", "2\n"]})
    async with RewardRunner(max_workers=1, env={"PYTHONPATH": reward_module}) as rr:
        pid, _ = await rr.score("my_rewards:pid", "", "")
        got = await rr.score("code", sleeper, tests, timeout_s=4.0, wall_s=10)
        # the sandbox's verdict, not the runner's timeout: the runner counts no timeout and killed no worker
        assert got == (0.0, None)
        assert rr.stats.timeouts == 0 and rr.stats.workers_killed == 0
        assert _leftovers_of(int(pid)) == []
        pid_after, _ = await rr.score("my_rewards:pid", "", "")
        assert pid_after == pid  # the same worker goes on


async def test_runner_timeout_lets_the_sandbox_clean_up(reward_module):
    """A reward that ignores its deadline: SIGTERM first, so its sandbox closes (no scratch, cgroup or process)."""
    import sys
    import uuid

    if not sys.platform.startswith("linux"):
        pytest.skip("the sandbox is Linux-only")
    marker = f"areal-marker-{uuid.uuid4().hex}"
    async with RewardRunner(max_workers=1, env={"PYTHONPATH": reward_module}) as rr:
        pid, _ = await rr.score("my_rewards:pid", "", "")
        got = await rr.score("my_rewards:sandbox_ignoring_deadline", "", marker, timeout_s=2.0)
        assert got == (0.0, "timeout")
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)
    assert _procs_with(marker) == []
    assert _leftovers_of(int(pid)) == []  # cleaned by the worker itself, not by a later sweep


@pytest.mark.parametrize(
    "hack",
    [
        "import builtins\nbuiltins.exec = lambda *a, **k: None\ndef add(a, b):\n    return 0\n",
        "class E:\n    def __eq__(self, o): return True\ndef add(a, b):\n    return E()\n",
    ],
)
async def test_reward_hacks_score_zero_through_the_runner(hack):
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("the sandbox is Linux-only")
    mbpp = "assert add(1234, 4321) == 5555\nassert add(98765, 1) == 98766"
    fn = json.dumps({"fn_name": "add", "inputs": [[1234, 4321]], "outputs": [5555]})
    async with RewardRunner(max_workers=2) as rr:
        for answer in (mbpp, fn):
            assert await rr.score("code", f"```python\n{hack}```", answer) == (0.0, None)
            assert await rr.score("code", f"```python\n{hack}```", answer, all_or_nothing=True) == (0.0, None)
        assert await rr.score("code", "```python\ndef add(a, b):\n    return a + b\n```", mbpp) == (1.0, None)
