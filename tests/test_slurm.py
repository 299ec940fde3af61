"""launcher=slurm on a real Slurm: a short default-task run submitted from outside an allocation, Ctrl-C and SIGTERM
of a run inside one (salloc) and of the command following a batch job, server steps killed and hung mid-run (each
replaced by a new step holding the current weights), and the bad inputs (a partition that does not exist, a drained
node, a step that cannot be created); each must end with nothing left: no job, no step, no process. Plus the
placement and batch-script rules, which need no Slurm.

The cluster is the single-node Slurm of .ci/start_slurm.sh (slurmctld + slurmd, this host the only node). When it
is not running and we are root, the fixture starts it; a machine where that is impossible skips, loudly, and fails
instead under AREAL_REQUIRE_SLURM=1 (what .ci/run sets: CI must run these).

A slower node must not fail these: a test waits for the state it needs (a node `drained`, not still `draining`; a
reservation that Slurm confirms) instead of assuming it, and the time limits are hang guards, not speed bars. Every
job a test submits is named with this pytest session's token (AREAL_TEST_SESSION, set in conftest.py), so a test's
finalizer and the `slurm` fixture cancel exactly this session's jobs (another session, such as a CI run beside this
one on the same cluster, is never touched), and a test that failed leaves nothing for the next one to trip on.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest

from areal_async.config import ConfigError, load_config
from areal_async.launch.sbatch import classify_reason, render_sbatch
from areal_async.launch.slurm import Allocation, check_allocation, expand_counts, job_nodes, place
from areal_async.net.rank_registry import route_address
from areal_async.testing.faults import RunProcess, assert_exact_accounting, pid_alive, wait_gone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the job-name token of this pytest session (conftest.py exports it before any test runs)
SESSION = os.environ.get("AREAL_TEST_SESSION", "nosession")
JOB_PREFIX = f"areal-t{SESSION}-"
HANG_S = 600  # how long a wait may take before the test calls it a hang: far above what any machine needs
START_SLURM = os.path.join(REPO, ".ci", "start_slurm.sh")

# pytest-timeout's limit for these tests: a hang guard over the whole test (a run through Slurm on a slow, busy node
# takes minutes), never a speed bar
pytestmark = pytest.mark.timeout(2400)

SMALL = [
    "schedule.batch_size=4",
    "rollout.group_size=4",
    "eval.num_prompts=8",
    "eval.max_new_tokens=16",
    "data.num_train=200",
    "data.num_eval=8",
    "schedule.eval_every=0",
    "server.max_total_tokens=16384",
    "train.micro_batch_tokens=1024",
    "server.device=cpu",
    "train.device=cpu",
]


# ---- the cluster ----------------------------------------------------------------------------------------------


def _sinfo_idle() -> bool:
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0 and any(s.strip() in ("idle", "mixed", "allocated") for s in p.stdout.splitlines())


def _why_no_slurm() -> str | None:
    if _sinfo_idle():
        return None
    if os.geteuid() != 0:
        return "Slurm is not running and starting it (.ci/start_slurm.sh) needs root"
    if not os.path.exists(START_SLURM):
        return f"Slurm is not running and {START_SLURM} is missing"
    p = subprocess.run(["bash", START_SLURM], capture_output=True, text=True, timeout=600)
    if p.returncode != 0 or not _sinfo_idle():
        return f".ci/start_slurm.sh could not start Slurm (exit {p.returncode}): {(p.stderr or p.stdout)[-1500:]}"
    return None


def _node_states() -> list[str]:
    try:
        p = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return p.stdout.split() if p.returncode == 0 else []


def _wait_for_responding_node(timeout: float = HANG_S) -> None:
    """A node marked not responding ('idle*', after a missed ping on a loaded machine, or after a drain and resume)
    makes Slurm refuse jobs outright: wait for its slurmd to answer again (restarting slurmd if it is gone) so that
    each test starts from an idle, responding cluster, as it would on a real one."""
    deadline = time.monotonic() + timeout
    restarted = False
    while time.monotonic() < deadline:
        states = _node_states()
        if states and not any(s.endswith("*") for s in states):
            return
        if not restarted and os.geteuid() == 0 and subprocess.run(["pgrep", "-x", "slurmd"]).returncode != 0:
            subprocess.run(["slurmd"], check=False)
            restarted = True
        time.sleep(1)
    pytest.fail(f"the Slurm node does not respond: sinfo states {_node_states()}")


@pytest.fixture(scope="module")
def _slurm_cluster() -> None:
    reason = _why_no_slurm()
    if reason is None:
        return
    message = f"NO SLURM ON THIS MACHINE, the Slurm launcher is untested: {reason}"
    if os.environ.get("AREAL_REQUIRE_SLURM") == "1":
        pytest.fail(message)
    warnings.warn(message, stacklevel=2)
    pytest.skip(message)


def session_jobs() -> list[str]:
    """The ids of this session's jobs still listed (any state)."""
    return [
        line.split()[0]
        for line in squeue("--format", "%i %j").splitlines()
        if len(line.split()) == 2 and line.split()[1].startswith(JOB_PREFIX)
    ]


def cancel_session_jobs() -> list[str]:
    """scancel every job of this session and wait until Slurm no longer lists them; the ids cancelled."""
    jobs = session_jobs()
    for job in jobs:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    if jobs:
        wait_until(lambda: not session_jobs(), HANG_S, f"cancelled jobs {jobs} gone")
    return jobs


@pytest.fixture
def slurm(_slurm_cluster: None):
    """An idle, responding cluster with no job of this session on it, before and after the test: a test that
    failed half-way (its job still running, holding the node's CPUs) does not make the next ones fail too."""
    left = cancel_session_jobs()
    if left:
        warnings.warn(f"jobs {left} of an earlier test were still there; cancelled", stacklevel=2)
    _wait_for_responding_node()
    yield
    cancel_session_jobs()


def clean_env() -> dict[str, str]:
    """This environment without any Slurm job of its own (the suite may itself run inside an allocation)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def cli(args: list[str], timeout: float = HANG_S, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "areal_async.run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or clean_env(),
        cwd=REPO,
    )


def squeue(*args: str) -> str:
    return subprocess.run(["squeue", "--noheader", *args], capture_output=True, text=True, timeout=30).stdout


def jobs_named(name: str) -> str:
    return squeue("--name", name, "--format", "%i %T")


def steps_of(job: str) -> str:
    return squeue("--steps", "--jobs", job, "--format", "%i %j") if job else ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(cond, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"{what} not within {timeout:.0f}s")


def reported_pids(run_dir: str) -> list[int]:
    """Every process the run's registry heard from (server steps, trainer ranks) and every srun it started."""
    with open(os.path.join(run_dir, "run.log")) as f:
        text = f.read()
    return [int(p) for p in re.findall(r"pid (\d+)", text)]


def assert_nothing_left(run_dir: str, job: str, name: str) -> None:
    wait_until(lambda: not steps_of(job).strip(), HANG_S, f"steps of job {job} gone")
    wait_until(lambda: not jobs_named(name).strip(), HANG_S, f"job {name} gone")
    pids = reported_pids(run_dir)
    assert pids, "the run logged no process ids"
    wait_until(lambda: not [p for p in pids if alive(p)], HANG_S, f"processes {pids} gone")


def host_address() -> str:
    """A non-loopback address of this host if it has one: steps then report routable addresses, as on a cluster."""
    addr = socket.gethostbyname(socket.gethostname())
    if addr.startswith("127."):
        addr = route_address("192.0.2.1")
    return addr


def run_dir_and_name(tmp_path, label: str) -> tuple[str, str]:
    """A run directory and the name of the job that runs it: the launcher names a job `areal-<run_dir's name>`,
    so the directory's name carries the session's token."""
    base = f"{JOB_PREFIX[len('areal-') :]}{label}-{secrets.token_hex(3)}"
    return str(tmp_path / base), f"areal-{base}"


def wait_node_state(node: str, want: str) -> None:
    """Slurm moves a node through states (drain: `draining` while a job still runs there, then `drained`):
    wait for the one a test relies on."""

    def state() -> str:
        p = subprocess.run(["sinfo", "-h", "-n", node, "-N", "-o", "%T"], capture_output=True, text=True, timeout=30)
        return p.stdout.strip()

    wait_until(lambda: state() == want, HANG_S, f"node {node} {want} (sinfo says {state()!r})")


# ---- a run through launcher=slurm ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def submitted_run(_slurm_cluster, tmp_path_factory):
    cancel_session_jobs()
    _wait_for_responding_node()
    run_dir, name = run_dir_and_name(tmp_path_factory.mktemp("slurm"), "e2e")
    try:
        # --mem-per-cpu: the job exports SLURM_MEM_PER_CPU, which the steps' srun must not inherit next to --mem=0
        p = cli(
            [
                "launcher=slurm",
                f"run_dir={run_dir}",
                "total_steps=3",
                *SMALL,
                "server.host=0.0.0.0",
                "server.api_key=test-key",
                f"slurm.controller_address={host_address()}",
                "slurm.sbatch_args=[--mem-per-cpu=200M]",
            ]
        )
    except subprocess.TimeoutExpired:  # the submitting command is killed, its job is not: cancel it
        cancel_session_jobs()
        raise
    yield run_dir, name, p
    cancel_session_jobs()


@pytest.mark.slow
def test_submitted_run_trains_in_srun_steps_and_leaves_nothing(submitted_run):
    run_dir, name, p = submitted_run
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    job = re.search(r"submitted batch job (\d+)", out).group(1)
    assert f"job {job} ended: COMPLETED, exit code 0" in out
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 3 and summary["trained_samples"] == 3 * 4 * 4
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, f) if r["kind"] == "train"]
    assert [r["version"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["train/loss"]) and r["train/response_tokens"] > 0 for r in train)
    # the controller ran in the batch job (its log is the job's output) and started its parts as steps of that job
    with open(os.path.join(run_dir, "logs", f"slurm-{job}.out")) as f:
        batch_log = f.read()
    assert "servers ['http://" in batch_log and "trained samples" in batch_log
    with open(os.path.join(run_dir, "run.log")) as f:
        run_log = f.read()
    steps = dict(re.findall(r"(\w+) runs as Slurm step (\S+)", run_log))
    assert set(steps) == {"trainer", "server0"} and all(s.startswith(f"{job}.") for s in steps.values()), steps
    assert f"scancel --signal=TERM {job}." in run_log
    with open(os.path.join(run_dir, "logs", "server0.log")) as f:
        server_log = f.read()
    assert f"Slurm step {steps['server0']}, serving at tcp://{host_address()}:" in server_log
    assert "signal received; shutting down" in server_log and "Killed" not in server_log  # scancel --signal=TERM
    with open(os.path.join(run_dir, "logs", "trainer.log")) as f:
        assert "rank 0/1 serving" in f.read()
    assert re.search(
        rf"registered rank0 at tcp://{re.escape(host_address())}:\d+ .*Slurm step {steps['trainer']}", run_log
    )
    assert_nothing_left(run_dir, job, name)
    assert not os.path.exists(os.path.join(run_dir, "trainer", "rank0.json"))


# ---- interruptions ------------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[-1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _trained(run_dir: str) -> bool:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return any(json.loads(line)["kind"] == "train" for line in f)
    except OSError:
        return False


def _ready(run_dir: str) -> bool:
    try:
        with open(os.path.join(run_dir, "run.log")) as f:
            return "trainer rank(s) ready" in f.read()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_interrupted_run_in_an_allocation_leaves_nothing(slurm, tmp_path, sig):
    """salloc ... python -m areal_async.run launcher=slurm: the controller is signalled mid-training."""
    run_dir, name = run_dir_and_name(tmp_path, sig.name.lower())
    proc = subprocess.Popen(
        [
            "salloc",
            f"--job-name={name}",
            "--ntasks=1",
            "--cpus-per-task=6",
            sys.executable,
            "-m",
            "areal_async.run",
            "launcher=slurm",
            f"run_dir={run_dir}",
            "total_steps=10000",
            *SMALL,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(),
        cwd=REPO,
    )
    try:
        wait_until(lambda: _trained(run_dir) or proc.poll() is not None, HANG_S, "a train step")
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        job = jobs_named(name).split()[0]
        assert len(steps_of(job).splitlines()) == 2  # trainer and server0
        controller = [c for c in _children(proc.pid) if "areal_async.run" in open(f"/proc/{c}/cmdline").read()]
        assert len(controller) == 1
        os.kill(controller[0], sig)
        out, _ = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()  # salloc's job itself is cancelled by the fixture
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted" in out and "Traceback" not in out, out[-3000:]
    assert_nothing_left(run_dir, job, name)


@pytest.mark.slow
def test_ctrl_c_of_the_following_command_cancels_the_job(slurm, tmp_path):
    run_dir, name = run_dir_and_name(tmp_path, "follow")
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_async.run", "launcher=slurm", f"run_dir={run_dir}", "total_steps=10000", *SMALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(),
        cwd=REPO,
    )
    try:  # interrupted once servers and trainers are up (the runs above are interrupted mid-training)
        wait_until(lambda: _ready(run_dir) or proc.poll() is not None, HANG_S, "the run's servers and trainers")
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        job = jobs_named(name).split()[0]
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()  # the job it follows is not killed with it: the fixture cancels it
    assert proc.returncode == 130, out[-3000:]
    assert f"cancelling job {job}: interrupted" in out
    assert_nothing_left(run_dir, job, name)


# ---- a server step replaced mid-run -------------------------------------------------------------------------------


class FollowedRun(RunProcess):
    """`python -m areal_async.run launcher=slurm ...` from outside any allocation: it submits the batch job and
    follows it (the run's files appear in its run directory, as the controller in the job writes them)."""

    def start(self) -> FollowedRun:
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "areal_async.run", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=clean_env(),
                cwd=REPO,
            )
        self.started = time.monotonic()
        return self

    def registered_pid(self, name: str) -> int:
        """The newest process that reported as `name` (a server step reports, then becomes the server: same pid)."""
        with open(os.path.join(self.run_dir, "run.log")) as f:
            pids = re.findall(rf"registered {re.escape(name)} at \S+ \(node \S+, pid (\d+)", f.read())
        assert pids, f"{name} never registered"
        return int(pids[-1])


@pytest.mark.slow
def test_dead_and_hung_server_steps_are_replaced_with_the_current_weights(slurm, tmp_path):
    """Two server steps. server1's process is SIGKILLed mid-run: its step ends, the run goes on with server0, and
    the controller starts a new server1 step on the node (launch/slurm.py `restart_server`) that serves only once it
    holds the current weights. Then server0's process is SIGSTOPped: the watchdog kills its step (scancel
    --signal=KILL) after recovery.unhealthy_restart_s and replaces it the same way. Every step is trained exactly
    once and no sample is lost; nothing is left. (While a recovery is awaited the trainer rank is frozen, so the run
    cannot finish first on a fast day.)"""
    steps, b, n = 6, 4, 4
    run_dir, name = run_dir_and_name(tmp_path, "srvrestart")
    run = FollowedRun(
        [
            "launcher=slurm",
            f"run_dir={run_dir}",
            f"total_steps={steps}",
            *SMALL,
            "eval.num_prompts=0",
            "server.num_servers=2",
            "server.torch_threads=1",
            "rollout.max_new_tokens=48",
            "recovery.restart_backoff_s=0.2",
            "recovery.health_interval_s=0.5",
            "recovery.health_timeout_s=1",
            "recovery.unhealthy_restart_s=3",
        ],
        run_dir,
    ).start()
    try:
        run.wait_version(2, timeout=HANG_S)
        killed = run.registered_pid("server1")
        os.kill(killed, signal.SIGKILL)
        with run.training_frozen():
            back = run.wait_recovery("server_recovered", timeout=HANG_S)[0]
        assert back["name"] == "server1" and back["server_version"] == back["current_version"] > 0, back
        assert back["where"].startswith(f"on node {socket.gethostname().split('.')[0]} (Slurm step "), back
        assert run.registered_pid("server1") != killed and not pid_alive(killed)
        stopped = run.registered_pid("server0")
        os.kill(stopped, signal.SIGSTOP)
        with run.training_frozen():
            hung = run.wait_recovery("server_unhealthy", timeout=HANG_S)[0]
            assert hung["name"] == "server0" and "silent on /health" in hung["what"], hung
            back = [r for r in run.wait_recovery("server_recovered", 2, timeout=HANG_S) if r["name"] == "server0"][0]
        assert back["server_version"] == back["current_version"] > 0, back
        assert run.wait(HANG_S) == 0, run.output()[-4000:]
    finally:
        run.kill()
    assert wait_gone([stopped], 30) == []  # killed through Slurm (SIGKILL reaches a stopped process)
    s = assert_exact_accounting(run_dir, steps, b, n)
    rec = s["recovery"]
    assert rec["by_event"] == {"server_exited": 1, "server_unhealthy": 1} and rec["recovered"] == 2, rec
    with open(os.path.join(run_dir, "run.log")) as f:
        run_log = f.read()
    for server in ("server0", "server1"):  # each ran as two steps of the job, one after the other
        ids = re.findall(rf"{server} runs as Slurm step (\S+)", run_log)
        assert len(ids) == 2 and ids[0] != ids[1], (server, ids)
    job = re.search(r"submitted batch job (\d+)", run.output()).group(1)
    assert_nothing_left(run_dir, job, name)


# ---- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_unknown_partition_is_refused_before_submission(slurm, tmp_path):
    run_dir, name = run_dir_and_name(tmp_path, "partition")
    p = cli(["launcher=slurm", f"run_dir={run_dir}", "slurm.partition=no_such_partition"])
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith("config error: slurm.partition: Slurm refuses the job"), p.stderr
    assert "invalid partition" in p.stderr.lower()
    assert not jobs_named(name).strip()


@pytest.mark.slow
def test_drained_node_is_refused_before_submission(slurm, tmp_path):
    run_dir, name = run_dir_and_name(tmp_path, "drained")
    node = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout.split()[0]
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=drain", "reason=areal_async test"], check=True)
    try:
        wait_node_state(node, "drained")  # `draining` until the jobs still running there (anyone's) end
        p = cli(["launcher=slurm", f"run_dir={run_dir}"])
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=True)
    _wait_for_responding_node()
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith("config error: slurm.nodes: Slurm refuses the job"), p.stderr
    assert re.search(r"nodes of partition \S+: .*\bdrained\b", p.stderr), p.stderr
    assert not jobs_named(name).strip()


@pytest.mark.slow
def test_job_whose_nodes_never_come_up_fails_within_the_node_timeout(slurm, tmp_path):
    """Every node reserved for maintenance: the job is accepted, then waits on unavailable nodes."""
    run_dir, name = run_dir_and_name(tmp_path, "unavailable")
    resv = f"areal_test_{secrets.token_hex(3)}"
    # ignore_jobs: without it Slurm refuses a reservation of nodes a job is running on ("Requested nodes are
    # busy"), which on a shared or slower cluster (a job of another test still ending) is common
    made = subprocess.run(
        [
            "scontrol",
            "create",
            "reservation",
            f"ReservationName={resv}",
            "StartTime=now",
            "Duration=30",
            "Nodes=ALL",
            "Users=nobody",
            "Flags=maint,ignore_jobs",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        assert made.returncode == 0, f"scontrol create reservation failed: {made.stderr or made.stdout}"
        shown = subprocess.run(["scontrol", "show", "reservation", resv], capture_output=True, text=True, timeout=30)
        assert "State=ACTIVE" in shown.stdout, shown.stdout + shown.stderr
        p = cli(["launcher=slurm", f"run_dir={run_dir}", "slurm.node_timeout_s=3"])
    finally:
        subprocess.run(["scontrol", "delete", f"ReservationName={resv}"], capture_output=True, timeout=60)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "its nodes did not come up within 3s (slurm.node_timeout_s): ReqNodeNotAvail" in p.stderr, p.stderr
    wait_until(lambda: not jobs_named(name).strip(), HANG_S, "the job cancelled")


@pytest.mark.slow
def test_step_that_cannot_be_created_fails_within_the_node_timeout(slurm, tmp_path):
    """An allocation of 4 CPUs, 2 of them held by another step: one of the run's steps (2 CPUs each) waits."""
    run_dir, name = run_dir_and_name(tmp_path, "busy")
    alloc = subprocess.run(
        ["salloc", "--no-shell", f"--job-name={name}", "--ntasks=1", "--cpus-per-task=4"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    job = re.search(r"Granted job allocation (\d+)", alloc.stderr).group(1)
    # the blocker outlives any wait of the test (it is killed, and the allocation cancelled, at the end)
    blocker = subprocess.Popen(
        ["srun", f"--jobid={job}", "--exact", "--ntasks=1", "--cpus-per-task=2", "--job-name=blocker", "sleep", "3600"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=clean_env(),
    )
    try:
        wait_until(lambda: "blocker" in steps_of(job), HANG_S, "the blocking step")
        p = cli(
            ["launcher=slurm", f"run_dir={run_dir}", "slurm.node_timeout_s=8"], env={**clean_env(), "SLURM_JOB_ID": job}
        )
        assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
        assert re.search(
            r"(trainer|server0): Slurm did not create its step within 8s \(slurm.node_timeout_s\)", p.stdout
        ), p.stdout[-3000:]
        assert re.search(rf"job {job} holds 4 CPUs on \S+; its running steps: {job}\.\d+ blocker \(2 CPUs", p.stdout), (
            p.stdout[-3000:]
        )
        # ours are gone; the blocker (not ours) is still there
        wait_until(lambda: "areal." not in steps_of(job), HANG_S, "the run's steps gone")
        assert "blocker" in steps_of(job)
        pids = reported_pids(run_dir)
        wait_until(lambda: not [q for q in pids if alive(q)], HANG_S, "the run's processes gone")
    finally:
        blocker.kill()
        blocker.wait(60)
        subprocess.run(["scancel", job], timeout=30)
    wait_until(lambda: not jobs_named(name).strip(), HANG_S, "the allocation released")


@pytest.mark.slow
def test_checks_before_launch_run_before_submission(slurm, tmp_path):
    """A typo in model.path (or a reward that does not exist) is a config error on the submitting host: nothing
    is submitted, and no run directory is made."""
    run_dir, name = run_dir_and_name(tmp_path, "precheck")
    p = cli(["launcher=slurm", f"run_dir={run_dir}", f"model.path={tmp_path / 'no_such_model'}"])
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith("config error: model.path: "), p.stderr
    assert "submitted batch job" not in p.stdout and not jobs_named(name).strip()
    p = cli(["launcher=slurm", f"run_dir={run_dir}", "data.reward=no_such_reward", "--print-sbatch"])
    assert p.returncode == 2 and p.stderr.startswith("config error: data.reward: "), p.stdout + p.stderr
    assert not os.path.exists(run_dir)


# ---- placement and the batch script (no Slurm needed) -------------------------------------------------------------


def cfg(*overrides: str):
    return load_config(None, ["launcher=slurm", *overrides])


def test_paper_split_two_nodes_of_eight_gpus():
    c = cfg(
        "server.backend=sglang",
        "server.num_servers=12",
        "server.host=0.0.0.0",
        "server.api_key=k",
        "slurm.gpus_per_node=8",
        "train.nnodes=2",
        "train.nproc=2",
        "slurm.nodes=2",
    )
    p = place(c, ["g1", "g2"], controller_node="g1")
    assert p.server_nodes == ["g1"] * 6 + ["g2"] * 6 and p.trainer_nodes == ["g1", "g2"]
    assert p.needs("g1") == p.needs("g2") == (6 * 2 + 2 * 2, 8)
    with pytest.raises(ConfigError, match=r"^slurm.gpus_per_node: the steps on g1 need 9 GPUs"):
        place(
            cfg(
                "server.backend=sglang",
                "server.num_servers=14",
                "server.host=0.0.0.0",
                "server.api_key=k",
                "slurm.gpus_per_node=8",
                "train.nnodes=2",
                "train.nproc=2",
            ),
            ["g1", "g2"],
            controller_node="g1",
        )


def test_servers_apart_keeps_servers_off_the_trainer_nodes():
    common = ("server.backend=sglang", "server.host=0.0.0.0", "server.api_key=k", "slurm.gpus_per_node=8")
    c = cfg(*common, "server.num_servers=16", "train.nnodes=2", "train.nproc=8", "slurm.servers_apart=true")
    assert job_nodes(c) == 3  # the trainers' two, and one for the servers (servers_per_node null)
    p = place(c, ["g1", "g2", "g3", "g4"], controller_node="g1")
    assert p.trainer_nodes == ["g1", "g2"] and p.server_nodes == ["g3"] * 8 + ["g4"] * 8
    assert p.needs("g1") == (8 * 2, 8) and p.needs("g3") == (8 * 2, 8)  # trainer nodes: no server CPUs or GPUs
    per = cfg(*common, "server.num_servers=16", "slurm.servers_per_node=8", "slurm.servers_apart=true")
    assert job_nodes(per) == 3
    with pytest.raises(ConfigError, match=r"^slurm.servers_apart: the trainers take all 2 nodes"):
        place(cfg(*common, "train.nnodes=2", "slurm.servers_apart=true"), ["g1", "g2"], controller_node="g1")
    with pytest.raises(ConfigError, match=r"^slurm.servers_per_node: 3 servers at 1 per node need 3 nodes, .* has 2 "):
        place(
            cfg(*common, "server.num_servers=3", "slurm.servers_per_node=1", "slurm.servers_apart=true"),
            ["g1", "g2", "g3"],
            controller_node="g1",
        )


def test_a_server_whose_node_went_away_moves_to_a_node_with_room():
    from areal_async.launch.node_assignment import node_for_server

    common = ("server.host=0.0.0.0", "server.api_key=k", "server.torch_threads=2", "train.torch_threads=2")
    # two nodes, one server each, the trainers on the first: 3 CPUs a server, 3 the trainer rank
    c = cfg(*common, "server.num_servers=2", "slurm.servers_per_node=1")
    p = place(c, ["a", "b"], controller_node="a")
    assert p.server_nodes == ["a", "b"] and p.cpus_per_server == 3 and p.cpus_per_trainer_node == 3

    def room(cpus: dict[str, int], index: int, nodes: list[str], lost: set[str], **kw) -> str | None:
        kw = {"gpus_per_node": 0, "servers_apart": False, **kw}
        return node_for_server(p, Allocation("7", ["a", "b"], cpus, "a"), index, nodes, lost, **kw)

    assert room({"a": 9, "b": 3}, 1, ["a", "b"], {"b"}) == "a"  # 3 + 3 used on a, 3 left
    assert room({"a": 8, "b": 3}, 1, ["a", "b"], {"b"}) is None  # 2 left on a
    assert room({"a": 9, "b": 9}, 0, ["a", "b"], {"a"}) == "b"
    assert room({"a": 9, "b": 9}, 0, ["a", "b"], {"a", "b"}) is None  # nowhere left
    assert room({"a": 16, "b": 16}, 1, ["a", "b"], {"b"}, gpus_per_node=0) == "a"
    # servers apart: never onto a trainer node, even with room there
    apart = cfg(*common, "server.num_servers=2", "slurm.servers_per_node=1", "slurm.servers_apart=true")
    p = place(apart, ["a", "b", "c"], controller_node="a")
    assert p.server_nodes == ["b", "c"]
    cpus = {"a": 16, "b": 16, "c": 16}
    assert (
        node_for_server(
            p, Allocation("7", ["a", "b", "c"], cpus, "a"), 0, ["b", "c"], {"b"}, gpus_per_node=0, servers_apart=True
        )
        == "c"
    )
    assert (
        node_for_server(
            p,
            Allocation("7", ["a", "b", "c"], cpus, "a"),
            0,
            ["b", "c"],
            {"b", "c"},
            gpus_per_node=0,
            servers_apart=True,
        )
        is None
    )


@pytest.mark.parametrize(
    "overrides,nodes,key",
    [
        (["train.nnodes=2"], ["a"], "train.nnodes"),
        (["server.num_servers=2"], ["a", "b"], "server.host"),  # server1 on b, bound to loopback
        (
            ["server.num_servers=3", "slurm.servers_per_node=1", "server.host=0.0.0.0", "server.api_key=k"],
            ["a", "b"],
            "slurm.servers_per_node",
        ),
        (["server.num_servers=2", "server.host=0.0.0.0"], ["a", "b"], "server.api_key"),
        (["server.backend=sglang"], ["a"], "slurm.gpus_per_node"),
        (["train.cuda_visible_devices='1'"], ["a"], "train.cuda_visible_devices"),
        (["train.torchrun_args=[--standalone]"], ["a"], "train.torchrun_args"),
        (["slurm.nodes=3"], ["a", "b"], "slurm.nodes"),
    ],
)
def test_impossible_layouts_name_the_key(overrides, nodes, key):
    with pytest.raises(ConfigError) as e:
        place(cfg(*overrides), nodes, controller_node="a")
    assert str(e.value).startswith(key + ":"), str(e.value)


def test_allocation_too_small_names_the_cpus():
    p = place(cfg("server.num_servers=2", "server.torch_threads=2"), ["a"], controller_node="a")
    with pytest.raises(ConfigError, match=r"^slurm.cpus_per_server: the steps on a need 8 CPUs .* holds 4"):
        check_allocation(p, Allocation("7", ["a"], {"a": 4}, "a"))
    check_allocation(p, Allocation("7", ["a"], {"a": 8}, "a"))


def test_batch_script_asks_for_what_the_steps_need(tmp_path):
    c = cfg(
        f"run_dir={tmp_path / 'r'}",
        "slurm.partition=gpu",
        "slurm.gpus_per_node=8",
        "slurm.time_limit=2:00:00",
        "server.num_servers=4",
        "server.host=0.0.0.0",
        "server.api_key=k",
        "train.nnodes=2",
        "slurm.sbatch_args=[--exclusive]",
        "slurm.setup=[module load cuda]",
    )
    script = render_sbatch(
        c,
        config_path="configs/default.yaml",
        overrides=["launcher=slurm", "slurm.detach=true"],
        cwd=str(tmp_path),
        python="/venv/bin/python",
    )
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for want in (
        "--nodes=2",
        "--gres=gpu:8",
        "--partition=gpu",
        "--time=0-02:00:00",
        "--exclusive",
        "--cpus-per-task=8",
        f"--output={tmp_path / 'r'}/logs/slurm-%j.out",
    ):  # 2 servers x 2 + 2 + 2
        assert f"#SBATCH {want}" in lines, (want, script)
    assert "module load cuda" in lines and f"cd {tmp_path}" in lines
    assert (
        lines[-1] == f"exec /venv/bin/python -m areal_async.run --config {tmp_path}/configs/default.yaml launcher=slurm"
    )
    assert "slurm.detach" not in script  # the job itself never detaches


def test_print_sbatch_prints_a_script_and_submits_nothing(tmp_path):
    p = cli(["launcher=slurm", f"run_dir={tmp_path / 'p'}", "--print-sbatch"], timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=areal-p\n")
    assert "exec " in p.stdout and "launcher=slurm" in p.stdout.splitlines()[-1]
    p = cli([f"run_dir={tmp_path / 'p'}", "--print-sbatch"], timeout=60)
    assert p.returncode == 2 and "needs launcher=slurm" in p.stderr


def test_model_dtype_reaches_the_servers_in_slurm_steps():
    from types import SimpleNamespace

    from areal_async.launch.slurm import SlurmLauncher

    class Recorder:
        def __init__(self):
            self.cmds = []

        def spawn(self, name, cmd, env=None, **kw):
            self.cmds.append(cmd)

    for backend, extra in (("embedded", []), ("sglang", ["slurm.gpus_per_node=2"])):
        c = cfg(f"server.backend={backend}", "model.dtype=bfloat16", *extra)
        procs = Recorder()
        cluster = SimpleNamespace(
            processes=procs,
            alloc=SimpleNamespace(job_id="7"),
            step_name=lambda n: n,
            registry=SimpleNamespace(env=lambda: {}),
        )
        SlurmLauncher._start_servers(cluster, c, place(c, ["a"], controller_node="a"), "/m", b"s")
        (cmd,) = procs.cmds
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16", (backend, cmd)


def test_slurm_helpers():
    assert expand_counts("16") == [16] and expand_counts("8(x2),4") == [8, 8, 4]
    assert classify_reason("PartitionNodeLimit") == "cannot_start"
    assert (
        classify_reason("Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority partitions")
        == "nodes_unavailable"
    )
    assert classify_reason("ReqNodeNotAvail, UnavailableNodes:n1") == "nodes_unavailable"
    assert classify_reason("Resources") == classify_reason("Priority") == "wait"
    with pytest.raises(ConfigError, match="^launcher: slurm runs inside an allocation"):
        Allocation.current({})


def test_launch_modules_import_no_torch():
    mods = [
        "areal_async.launch.slurm",
        "areal_async.launch.slurm_steps",
        "areal_async.launch.sbatch",
        "areal_async.net.rank_registry",
        "areal_async.launch.step",
    ]
    code = (
        "import json, sys\nfor m in sys.argv[1:]: __import__(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))))"
    )
    p = subprocess.run([sys.executable, "-c", code, *mods], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == []


def test_lost_nodes_names_a_silent_or_restarted_slurmd():
    from areal_async.launch.slurm_allocation import NodeHealth, lost_nodes

    before = {"a": NodeHealth("MIXED", "t0"), "b": NodeHealth("MIXED", "t0"), "c": NodeHealth("IDLE", "t0")}
    now = {"a": NodeHealth("MIXED", "t0"), "b": NodeHealth("MIXED+NOT_RESPONDING", "t0"), "c": NodeHealth("IDLE", "t1")}
    lost = lost_nodes(before, now)
    assert set(lost) == {"b", "c"}
    assert "does not answer" in lost["b"] and "restarted at t1" in lost["c"]
    assert not NodeHealth("IDLE*", "t0").responding and not NodeHealth("DOWN", "t0").responding
    assert lost_nodes(before, {}) == {}  # slurmctld silent: no verdict
