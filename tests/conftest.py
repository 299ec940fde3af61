"""Shared fixtures: tiny checkpoints made once per session (no downloads). And the suite's leak check: every
process a test starts inherits AREAL_TEST_SESSION (set here, before any test runs), and every Slurm job a test
submits carries the same token in its name (`session_job_name`); when the session ends, any such process or job still
alive is killed or cancelled and the suite fails, naming each one and the test after which it was first seen. The
same goes for network-namespace hosts (areal_async/testing/hosts.py) a test did not remove.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from areal_async.testing.tiny import make_tiny_checkpoint

SESSION_ENV = "AREAL_TEST_SESSION"
# Under pytest-xdist (`-n`), each worker is a session of its own (its own token, its own check), and the token of
# the controlling process, which the workers inherit, names the file where they report what they found left behind.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_CONTROLLER_SESSION = os.environ.get(SESSION_ENV) if _WORKER else None
# one token per pytest session, inherited by every child: processes (and Slurm jobs) of another session on the same
# machine, such as a CI run beside this one, carry another token and are never touched
SESSION = uuid.uuid4().hex[:10]
os.environ[SESSION_ENV] = SESSION
# long-lived system processes a test may (re)start, which then inherit the token: not the tests' to kill
_SYSTEM_COMMANDS = frozenset({"slurmctld", "slurmd", "slurmstepd", "slurmdbd", "munged", "sshd"})


def session_job_name(label: str) -> str:
    """The name for a Slurm job a test submits: it carries this session's token, so the session-end check (and a
    test's own fixture, as in test_slurm.py, which builds the same prefix from the environment) cancels exactly
    the jobs of this session and never another session's on the same cluster."""
    return f"areal-t{SESSION}-{label}"


@pytest.fixture
async def fakes():
    """Factory of started stand-in SGLang servers (`await fakes(n, **FakeSGLang options)`); at the end each is
    released from any hang or pause first, so that its kill does not wait on a request it holds, then killed."""
    from areal_async.testing.fake_sglang import FakeSGLang

    made: list[FakeSGLang] = []

    async def make(n: int = 1, **kw) -> list[FakeSGLang]:
        out = [await FakeSGLang(**kw).start() for _ in range(n)]
        made.extend(out)
        return out

    yield make
    for f in made:
        f.hung = False
        f.paused = False
        f._resumed.set()
        await f.kill()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    """A tiny random Qwen2 checkpoint with the char tokenizer."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "qwen2"), "qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_b(tmp_path_factory) -> str:
    """Same architecture, different weights: for weight-update tests."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "qwen2_b"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_ckpts_all_archs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("archs")
    return {a: make_tiny_checkpoint(str(root / a), a, seed=0) for a in ("qwen2", "qwen3", "llama")}


_prebuild: subprocess.Popen | None = None


def pytest_sessionstart(session):
    """On a machine without the recipe's build of the default base model (a fresh clone in CI), start building it
    now, in the background, on the core the first tests leave idle: the test that checks the recipe against the
    shipped model waits on the cache's lock instead of building it from scratch. Only for a whole-suite run; a run
    that selects tests (files, -k, -m, node ids) builds it when, and if, a test needs it."""
    global _prebuild
    if _WORKER:  # the controlling process of a parallel run builds it, once
        return
    root = str(session.config.rootpath)
    whole = {os.path.realpath(root), os.path.realpath(os.path.join(root, "tests"))}
    if (
        session.config.getoption("keyword")
        or session.config.getoption("markexpr")
        or any(os.path.realpath(a) not in whole for a in session.config.args)
    ):
        return
    from areal_async.tasks.base_model import cached_path, is_built

    if is_built(cached_path()):
        return
    log = open(os.path.join(session.config.rootpath, ".pytest_base_model.log"), "w")
    _prebuild = subprocess.Popen(
        [sys.executable, "-m", "areal_async.tasks.base_model", "--from-recipe"], stdout=log, stderr=subprocess.STDOUT
    )


def pytest_sessionfinish(session, exitstatus):
    if _prebuild is not None and _prebuild.poll() is None:  # no test needed it after all: stop it (SIGINT, so
        _prebuild.send_signal(signal.SIGINT)  # that it removes its temporary directory)
        try:
            _prebuild.wait(30)
        except subprocess.TimeoutExpired:
            _prebuild.kill()
    if _distributing(session.config):  # the workers ran the tests and checked what they left; collect their word
        _report_leftovers(session, _read_worker_leftovers())
    else:
        _fail_on_leftovers(session)


# ---- running in parallel ---------------------------------------------------------------------------------------
# `make test` runs the suite on two pytest-xdist workers (the Makefile says why): most tests wait on processes
# they started (a server loading, a trainer's rendezvous), so more tests than cores at a time keep both cores busy.
# A module's tests stay on one worker, in order (they share module fixtures); the groups below never run beside each
# other: the SmolLM2 modules (a trainer and a server of the real model hold 6-9 GB each), and the modules that share
# the one-node Slurm cluster.
_GROUPS = {"test_real_model.py": "smollm2", "test_model_store.py": "smollm2", "test_slurm.py": "slurm"}
# the longest groups go out first, so that the workers finish together; the rest keep their (random) order
_LONG_FIRST = (
    "smollm2",
    "test_faults.py",
    "test_e2e.py",
    "test_ray_launcher.py",
    "slurm",
    "test_benchmark_e2e.py",
    "test_learning.py",
    "test_fleet.py",
    "test_netns_slurm.py",
    "test_netns_slurm_faults.py",
    "test_netns_faults.py",
    "test_multinode.py",
    "test_netns_multinode.py",
    "test_clean_runs.py",
)


def _distributing(config) -> bool:
    """This process is the controller of a pytest-xdist run (it runs no tests itself)."""
    return config.pluginmanager.has_plugin("dsession")


def _leftovers_file(controller_session: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"areal-test-leftovers-{controller_session}.txt")


def _read_worker_leftovers() -> list[str]:
    path = _leftovers_file(SESSION)
    try:
        with open(path) as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except OSError:
        return []
    os.remove(path)
    return lines


def _group_of(nodeid: str) -> str:
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return _GROUPS.get(name, name)


class _LongFirst:
    """A plugin object, so that its hook can run last: after pytest-random-order has shuffled the items."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items) -> None:
        rank = {g: i for i, g in enumerate(_LONG_FIRST)}
        items.sort(key=lambda it: rank.get(_group_of(it.nodeid), len(rank)))  # stable: shuffled within a rank


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole groups to a worker, in the order the workers collected them (long ones first). xdist's own
    `--dist loadgroup` marks node ids in a way pytest 9 no longer sees, so the groups are named here."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid)

    return ByGroup(config, log)


def pytest_configure(config):
    # A shell without job control starts `cmd &` with SIGINT ignored, and a child inherits an ignored signal
    # through exec: every run a test started would then shrug off its Ctrl-C and the signal tests would hang to
    # their timeouts. A handler of our own is reset to the default on exec, so the runs get Python's usual one.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _WORKER:  # a worker of `pytest -n N`: it collects, the controller schedules by group
        config.pluginmanager.register(_LongFirst(), "areal-long-first")


# ---- nothing left behind ------------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int, str] | None:
    """(state, parent pid, start time in ticks) of a process, None when it is gone. The start time tells a pid
    from a later process that reused it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), fields[19]


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return "?"


_carries: dict[tuple[int, str], bool] = {}  # (pid, start time) -> whether it carries this session's token


def _carries_session(pid: int, start: str) -> bool:
    key = (pid, start)
    if key not in _carries:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                _carries[key] = f"{SESSION_ENV}={SESSION}".encode() in f.read().split(b"\0")
        except OSError:
            return False
    return _carries[key]


def _ancestors() -> set[int]:
    """pytest and the processes above it: never leftovers."""
    out, pid = {os.getpid()}, os.getpid()
    while pid > 1:
        st = _proc_stat(pid)
        if st is None:
            break
        pid = st[1]
        out.add(pid)
    return out


_seen: dict[tuple[int, str], str] = {}  # (pid, start time) -> the test after which it was first seen


def _session_processes() -> dict[tuple[int, str], str]:
    """Live processes (not zombies) started in this session (they carry its token), keyed by (pid, start time),
    without pytest's own: its ancestors and the helpers that live as long as it does (multiprocessing's resource
    tracker or forkserver)."""
    found: dict[tuple[int, str], str] = {}
    own = _ancestors()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in own:
            continue
        pid = int(entry)
        st = _proc_stat(pid)
        if st is None or st[0] in ("Z", "X") or not _carries_session(pid, st[2]):
            continue
        cmd = _cmdline(pid)
        if _comm(pid) in _SYSTEM_COMMANDS or (st[1] == os.getpid() and "multiprocessing." in cmd):
            continue
        found[(pid, st[2])] = cmd
    return found


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Note which test each new process of this session first showed up after, so that a leftover names its test
    (a process a module's fixture still holds shows up here too; only the session-end check judges)."""
    if os.environ.get(SESSION_ENV) != SESSION:
        return
    for key in _session_processes():
        _seen.setdefault(key, item.nodeid)


def _session_jobs() -> list[tuple[str, str]]:
    """(job id, name) of every Slurm job of this session (its name carries the token), when Slurm is here."""
    try:
        p = subprocess.run(["squeue", "--noheader", "--format", "%i %j"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [line.split(None, 1) for line in p.stdout.splitlines() if line.strip()] if p.returncode == 0 else []
    return [(r[0], r[1]) for r in rows if len(r) == 2 and f"t{SESSION}-" in r[1]]


def _netns_leftovers() -> list[str]:
    """Remove, and name, the network-namespace hosts (areal_async/testing/hosts.py) this session's process made
    and did not remove. Hosts of other processes are left alone: a concurrent session's (or xdist worker's), and a
    killed creator's, which the next `Hosts` removes."""
    if os.geteuid() != 0 or not os.path.isdir("/run/netns"):
        return []
    from areal_async.testing import hosts

    return [f"network-namespace host or link {n}, removed" for n in hosts.remove_of(os.getpid())]


def _fail_on_leftovers(session: pytest.Session) -> None:
    """Cancel the session's Slurm jobs and kill its processes that outlived the tests, and fail the suite loudly,
    naming them: a test that leaves something running is a bug even when it passes."""
    lines = _netns_leftovers()
    jobs = _session_jobs()
    for job, name in jobs:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
        lines.append(f"Slurm job {job} ({name}), cancelled")
    deadline = time.monotonic() + 30  # cancelled jobs take their steps' processes with them: give them a moment
    while jobs and time.monotonic() < deadline and any(j for j, _ in _session_jobs()):
        time.sleep(0.5)
    # a process the last tests ended may still be on its way out (a trainer rank finishing its call after its
    # controller was killed, which its own watchdog bounds at about a minute): only what outlives that is left behind
    deadline = time.monotonic() + 90
    procs = _session_processes()
    while procs and time.monotonic() < deadline:
        time.sleep(0.5)
        procs = _session_processes()
    for (pid, start), cmd in procs.items():
        with_test = _seen.get((pid, start))
        lines.append(f"pid {pid} [{_comm(pid)}] {cmd!r}" + (f", first seen after {with_test}" if with_test else ""))
    for pid, _ in procs:
        for kill in (
            lambda: os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else None,
            lambda: os.kill(pid, signal.SIGKILL),
        ):
            try:
                kill()
            except OSError:
                pass
    if _WORKER and lines and _CONTROLLER_SESSION:  # the controller reports them and fails the run
        with open(_leftovers_file(_CONTROLLER_SESSION), "a") as f:
            f.write("".join(f"[{_WORKER}] {line}\n" for line in lines))
    _report_leftovers(session, lines)


def _report_leftovers(session: pytest.Session, lines: list[str]) -> None:
    if not lines:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = "LEFT RUNNING BY THE TESTS (now killed; each is a test bug):\n  " + "\n  ".join(lines)
    if reporter is not None:
        reporter.write("\n")
        reporter.write_sep("!", "processes or Slurm jobs left behind", red=True, bold=True)
        reporter.write_line(message, red=True)
    else:
        print(message, file=sys.stderr)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            # the marker itself: `"gpu" in item.keywords` also matches a folder named gpu above the tests
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_finish(session):
    """Everything the test modules imported (torch, transformers, the package, hypothesis) is frozen out of the
    cyclic collector's scans: a worker process holds a few million such objects, and every full collection a test
    set off (a planner run, a controller in this process, a property test's thousands of examples) scanned them
    all, finding nothing: whole seconds per test in some modules. Cycles the tests make are still collected."""
    import gc

    gc.collect()
    gc.freeze()
