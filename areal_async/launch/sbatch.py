"""`launcher=slurm` from outside an allocation: the run is submitted as a batch job, and `--print-sbatch` writes that
job's script for users who submit by hand.

    python -m areal_async.run launcher=slurm slurm.partition=gpu ...                  # submit, follow the log
    python -m areal_async.run launcher=slurm ... --print-sbatch > run.sbatch; sbatch run.sbatch

Why a batch job and not an allocation held from here (salloc-style): the controller is the run's state (the buffer,
the schedule, the sample ledger) and talks to every server and trainer rank all the time. In a batch job it runs on
the job's first node, next to its servers and trainers, and its life is the job's: it survives a closed laptop or
a dropped ssh session, rollout workflows and reward code run on a compute node rather than a shared login node, and
a login node that cannot reach compute nodes' ports does not matter. There is one launch path (launch/slurm.py,
inside an allocation) for this, for `sbatch` by hand and for `salloc ... python -m areal_async.run`. When the job
ends, for any reason, Slurm releases the allocation: nothing this command made can outlive it.

Following (the default; `slurm.detach=true` only submits): the job's log, `run_dir/logs/slurm-<job>.out`, is
streamed here while it runs (when this host sees run_dir), and the command exits with the job's exit code. Ctrl-C or
SIGTERM here cancels the job. While it waits in the queue: a job Slurm says cannot start as asked fails at once, one
held by down or drained nodes fails after `slurm.node_timeout_s`, any other wait ends after `slurm.queue_timeout_s`
(null: the queue takes as long as it takes); the job is cancelled in every case. Before anything is submitted the
config is validated, laid out on the nodes (slurm.place) and shown to Slurm with `sbatch --test-only`, so a bad
partition or an impossible request is an error that names the key, with Slurm's own words; before that, the
checks a run makes before launch (model, tokenizer and chat template, dataset, reward, workflow) run here too, so a
typo in model.path never waits in the queue. No torch here.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from areal_async.config import ConfigError
from areal_async.launch.slurm import SlurmError, in_allocation, job_nodes, place, slurm_cmd

if TYPE_CHECKING:
    from areal_async.config import RunConfig

log = logging.getLogger(__name__)

# squeue reasons for a job that will not start as asked: fail at once
CANNOT_START = (
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "PartitionConfig",
    "BadConstraints",
    "DependencyNeverSatisfied",
    "InvalidAccount",
    "InvalidQOS",
    "AccountNotAllowed",
    "QOSNotAllowed",
    "MaxCpuPerAccount",
    "AssocMaxNodesPerJobLimit",
    "AssocMaxCpuPerJobLimit",
    "QOSMaxNodePerJobLimit",
    "QOSMaxCpuPerJobLimit",
    "QOSMaxGRESPerJob",
)
# ... held by nodes that are down, drained or not answering: fail after slurm.node_timeout_s
NODES_UNAVAILABLE = (
    "ReqNodeNotAvail",
    "NodeDown",
    "PartitionDown",
    "PartitionInactive",
    "DOWN, DRAINED",
    "DOWN,_DRAINED",
    "Nodes required for job are DOWN",
)
_POLL_S = 1.0


def classify_reason(reason: str) -> str:
    """'cannot_start', 'nodes_unavailable' or 'wait' for a pending job's squeue reason."""
    if any(r in reason for r in CANNOT_START):
        return "cannot_start"
    if any(r in reason for r in NODES_UNAVAILABLE):
        return "nodes_unavailable"
    return "wait"


def job_cpus_per_node(cfg: RunConfig) -> int:
    """CPUs per node the submitted job asks for: the busiest node's steps, plus the controller on the first."""
    nodes = [f"node{i}" for i in range(job_nodes(cfg))]
    p = place(cfg, nodes, controller_node=nodes[0])
    return max(p.needs(n)[0] + (cfg.slurm.controller_cpus if i == 0 else 0) for i, n in enumerate(nodes))


def log_path(cfg: RunConfig) -> str:
    return os.path.join(os.path.abspath(cfg.run_dir), "logs", "slurm-%j.out")


def render_sbatch(
    cfg: RunConfig,
    *,
    config_path: str | None,
    overrides: list[str],
    cwd: str | None = None,
    python: str = sys.executable,
) -> str:
    """The batch script: #SBATCH lines from the slurm section, then this very command in the job (where it finds
    itself inside an allocation and launches the steps). Raises ConfigError when the run cannot be laid out."""
    s = cfg.slurm
    cwd = os.path.abspath(cwd or os.getcwd())
    name = "areal-" + (os.path.basename(os.path.normpath(os.path.abspath(cfg.run_dir))) or "run")
    opts = [
        f"--job-name={name}",
        f"--nodes={job_nodes(cfg)}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={job_cpus_per_node(cfg)}",
        f"--output={log_path(cfg)}",
        "--open-mode=append",
    ]
    if s.gpus_per_node:
        opts.append(f"--gres=gpu:{s.gpus_per_node}")
    limit = s.time_limit
    if isinstance(limit, int):  # seconds
        limit = f"{limit // 86400}-{limit % 86400 // 3600:02d}:{limit % 3600 // 60:02d}:{limit % 60:02d}"
    for flag, value in (("partition", s.partition), ("account", s.account), ("time", limit)):
        if value:
            opts.append(f"--{flag}={value}")
    opts += s.sbatch_args  # last: they win over ours
    args = [python, "-m", "areal_async.run"]
    if config_path:
        args += ["--config", os.path.join(cwd, config_path)]  # absolute stays absolute
    args += [o for o in overrides if not o.startswith("slurm.detach=")]
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {o}" for o in opts),
        "# Written by `python -m areal_async.run ... --print-sbatch`. Submit with `sbatch FILE`: the controller",
        "# runs on the job's first node and starts the servers and trainers as srun steps (docs/cluster.md).",
        f"# The log directory {os.path.dirname(log_path(cfg))} must exist before the job starts.",
        "set -eo pipefail",
        f"cd {shlex.quote(cwd)}",
        *s.setup,
        "exec " + shlex.join(args),
        "",
    ]
    return "\n".join(lines)


def check_submission(cfg: RunConfig, script: str) -> str:
    """`sbatch --test-only`: Slurm's verdict without submitting. Its refusal becomes a ConfigError naming the key."""
    try:
        return _sbatch(["--test-only"], script)
    except SlurmError as e:
        text, low = str(e), str(e).lower()
        key = (
            "slurm.partition"
            if "partition" in low
            else "slurm.gpus_per_node"
            if "gres" in low
            else "slurm.account"
            if "account" in low
            else "slurm.nodes"
            if "node configuration" in low
            else "slurm"
        )
        if "node configuration" in low:  # too much asked, or the nodes that could serve it are down or drained
            text += f" ({node_states(cfg.slurm.partition)})"
        raise ConfigError(f"{key}: Slurm refuses the job: {text}") from None


def node_states(partition: str | None) -> str:
    """'nodes of partition debug: 1 drained, 3 idle'"""
    try:
        out = slurm_cmd(
            ["sinfo", "--noheader", *(["--partition", partition] if partition else []), "--format", "%P|%T|%D"]
        )
    except SlurmError as e:
        return f"sinfo failed: {e}"
    counts: dict[str, int] = {}
    parts = set()
    for line in out.splitlines():
        part, state, n = (line.strip().split("|") + ["", "", "0"])[:3]
        parts.add(part.rstrip("*"))
        counts[state] = counts.get(state, 0) + int(n or 0)
    where = f"partition {partition}" if partition else f"partition {', '.join(sorted(parts)) or '?'}"
    return f"nodes of {where}: " + (", ".join(f"{n} {st}" for st, n in sorted(counts.items())) or "none")


def _sbatch(flags: list[str], script: str) -> str:
    try:
        p = subprocess.run(["sbatch", *flags], input=script, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SlurmError("sbatch not found: launcher=slurm needs the Slurm client commands on PATH") from None
    except subprocess.TimeoutExpired:
        raise SlurmError("sbatch did not answer within 60s (is slurmctld up?)") from None
    if p.returncode != 0:
        raise SlurmError(" ".join(line.strip() for line in (p.stderr or p.stdout).strip().splitlines()))
    return (p.stdout + p.stderr).strip()


def submit(
    cfg: RunConfig, *, config_path: str | None, overrides: list[str], print_only: bool = False, out: TextIO = sys.stdout
) -> int:
    """`--print-sbatch` (print_only) or the submission from outside an allocation; returns the exit code."""
    cfg.validate()
    script = render_sbatch(cfg, config_path=config_path, overrides=overrides)
    os.makedirs(os.path.dirname(log_path(cfg)), exist_ok=True)  # Slurm opens the log before the script runs
    if print_only:
        out.write(script)
        return 0
    verdict = check_submission(cfg, script)
    job = _sbatch(["--parsable"], script).split(";")[0].strip()
    log_file = log_path(cfg).replace("%j", job)
    print(f"submitted batch job {job} ({verdict.splitlines()[-1] if verdict else ''}); log {log_file}", flush=True)
    if cfg.slurm.detach:
        print(f"detached: `squeue -j {job}` shows it, `scancel {job}` stops it", flush=True)
        return 0
    return follow(
        job, log_file, queue_timeout_s=cfg.slurm.queue_timeout_s, node_timeout_s=cfg.slurm.node_timeout_s, out=out
    )


def job_state(job: str) -> tuple[str, str] | None:
    """(state, reason) of a queued or running job; None once squeue no longer lists it."""
    text = slurm_cmd(["squeue", "--noheader", "--jobs", job, "--format", "%T|%r"]).strip()
    if not text:
        return None
    state, _, reason = text.splitlines()[0].partition("|")
    return state.strip(), reason.strip()


def final_state(job: str) -> tuple[str, int]:
    """(JobState, exit code) of a finished job from slurmctld's memory of it (kept MinJobAge seconds)."""
    try:
        text = slurm_cmd(["scontrol", "show", "job", "-o", job])
    except SlurmError:
        return "UNKNOWN", 1
    state = re.search(r"JobState=(\S+)", text)
    code = re.search(r"\bExitCode=(\d+):(\d+)", text)
    status = int(code.group(1)) if code else 1
    signal = int(code.group(2)) if code else 0
    return (state.group(1) if state else "UNKNOWN"), (status or (128 + signal if signal else 0))


def _cancel(job: str, why: str, timeout_s: float = 60.0) -> None:
    print(f"cancelling job {job}: {why}", file=sys.stderr, flush=True)
    try:
        slurm_cmd(["scancel", job])
    except SlurmError as e:
        print(f"scancel {job} failed: {e}", file=sys.stderr, flush=True)
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if job_state(job) is None:
                return
        except SlurmError:
            pass
        time.sleep(0.5)
    print(f"job {job} is still listed {timeout_s:.0f}s after scancel", file=sys.stderr, flush=True)


class _LogTail:
    def __init__(self, path: str, out: TextIO) -> None:
        self.path, self.out, self.offset = path, out, 0

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        if chunk:
            self.offset += len(chunk)
            self.out.write(chunk.decode(errors="replace"))
            self.out.flush()


def follow(
    job: str, log_file: str, *, queue_timeout_s: float | None, node_timeout_s: float, out: TextIO = sys.stdout
) -> int:
    """Stream the job's log until it ends; its exit code. Ctrl-C (KeyboardInterrupt) cancels the job: 130."""
    submitted = time.monotonic()
    unavailable_since: float | None = None
    last_reason = ""
    started = False
    logtail = _LogTail(log_file, out)
    try:
        while True:
            try:
                st = job_state(job)
            except SlurmError as e:  # slurmctld busy: try again
                log.warning("%s", e)
                time.sleep(_POLL_S)
                continue
            logtail.pump()
            if st is None:
                break
            state, reason = st
            if state == "PENDING":
                kind = classify_reason(reason)
                waited = time.monotonic() - submitted
                if reason != last_reason:
                    print(f"job {job} pending: {reason}", file=sys.stderr, flush=True)
                    last_reason = reason
                if kind == "cannot_start":
                    _cancel(job, f"Slurm says it cannot start as asked ({reason})")
                    return 1
                if kind == "nodes_unavailable":
                    unavailable_since = unavailable_since or time.monotonic()
                    if time.monotonic() - unavailable_since > node_timeout_s:
                        _cancel(
                            job,
                            f"its nodes did not come up within {node_timeout_s:.0f}s (slurm.node_timeout_s): {reason}",
                        )
                        return 1
                else:
                    unavailable_since = None
                if queue_timeout_s is not None and waited > queue_timeout_s:
                    _cancel(job, f"not started after {queue_timeout_s:.0f}s (slurm.queue_timeout_s): {reason}")
                    return 1
            elif not started:
                started = True
                print(f"job {job} {state.lower()}", file=sys.stderr, flush=True)
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        _cancel(job, "interrupted")
        logtail.pump()
        return 130
    logtail.pump()
    state, code = final_state(job)
    print(f"job {job} ended: {state}, exit code {code}", file=sys.stderr, flush=True)
    return code if state in ("COMPLETED", "FAILED") else max(code, 1)


def needs_submission(cfg: RunConfig) -> bool:
    return cfg.launcher == "slurm" and not in_allocation()


__all__ = ["classify_reason", "cli", "follow", "job_cpus_per_node", "needs_submission", "render_sbatch", "submit"]


def cli(
    cfg: RunConfig,
    config_path: str | None,
    overrides: list[str],
    *,
    print_sbatch: bool,
    check: Callable[[RunConfig], None] | None = None,
) -> int | None:
    """run.py's hook: the exit code when this invocation is a submission or `--print-sbatch`, else None (the run
    goes on here: launcher=local, or inside an allocation). `check` (run.py's checks before launch: model,
    dataset, reward, template) runs before anything is written or submitted, so a run that cannot work never
    waits in the queue."""
    if not (print_sbatch or needs_submission(cfg)):
        return None
    try:
        if cfg.launcher != "slurm":
            raise ConfigError("--print-sbatch: needs launcher=slurm (the job runs its steps through srun)")
        if check is not None:
            check(cfg)
        return submit(cfg, config_path=config_path, overrides=overrides, print_only=print_sbatch)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except SlurmError as e:
        print(f"slurm error: {e}", file=sys.stderr)
        return 1
