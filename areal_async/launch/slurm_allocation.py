"""The Slurm job this controller runs in (`Allocation`: its nodes and the CPUs it holds on each; its steps,
`list_steps`; its nodes' health, `node_health`, `lost_nodes`), and the one way this package calls Slurm's client
commands (`slurm_cmd`, failing with `SlurmError` in Slurm's own words).

Apart from launch/slurm.py, which starts steps in the allocation, because reading an allocation does not depend on
what runs in it, and launch/sbatch.py uses the same client commands to submit and follow a job from outside any
allocation. No torch here.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
from dataclasses import dataclass

from areal_async.config import ConfigError

log = logging.getLogger(__name__)

_SLURM_TIMEOUT_S = 30.0  # one squeue/scontrol/scancel call


class SlurmError(RuntimeError):
    """A Slurm command failed or Slurm refused a request; the message carries Slurm's words."""


def slurm_cmd(args: list[str], timeout_s: float = _SLURM_TIMEOUT_S) -> str:
    """Run a Slurm client command; its stdout, or SlurmError with its stderr."""
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SlurmError(f"{args[0]} not found: launcher=slurm needs the Slurm client commands on PATH") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(args[:2])} did not answer within {timeout_s:.0f}s (is slurmctld up?)") from None
    if p.returncode != 0:
        raise SlurmError(f"{' '.join(args)}: {(p.stderr or p.stdout).strip()}")
    return p.stdout


def in_allocation(env: dict[str, str] | os._Environ = os.environ) -> bool:
    return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))


def expand_counts(spec: str) -> list[int]:
    """SLURM_JOB_CPUS_PER_NODE's compressed form: '16' -> [16]; '8(x2),4' -> [8, 8, 4]."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot read the CPU counts {spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _count_ids(ids: str) -> int:
    """'0-2,5' -> 4"""
    n = 0
    for part in ids.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def hostnames(nodelist: str) -> list[str]:
    """A Slurm host list expression ('gpu[01-03],cpu7') as names, the way Slurm expands it."""
    return slurm_cmd(["scontrol", "show", "hostnames", nodelist]).split()


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: list[str]
    cpus: dict[str, int]  # CPUs the job holds on each node
    controller_node: str | None  # the node this controller runs on, when it is one of the job's

    @classmethod
    def current(cls, env: dict[str, str] | os._Environ = os.environ) -> Allocation:
        """The allocation this process runs in (sbatch, salloc, or SLURM_JOB_ID naming a running job)."""
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job:
            raise ConfigError(
                "launcher: slurm runs inside an allocation (SLURM_JOB_ID is not set); start it with "
                "`python -m areal_async.run launcher=slurm ...`, which submits a batch job, or under "
                "salloc/sbatch"
            )
        nodelist, cpus_spec = env.get("SLURM_JOB_NODELIST"), env.get("SLURM_JOB_CPUS_PER_NODE")
        if nodelist and cpus_spec:
            nodes = hostnames(nodelist)
            counts = expand_counts(cpus_spec)
            if len(counts) != len(nodes):
                raise SlurmError(f"SLURM_JOB_CPUS_PER_NODE={cpus_spec} does not match {len(nodes)} nodes")
            cpus = dict(zip(nodes, counts))
        else:  # attached by job id only: ask slurmctld
            nodes, cpus = _job_resources(job)
        me = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
        return cls(job, nodes, cpus, me if me in nodes else None)


def _job_resources(job: str) -> tuple[list[str], dict[str, int]]:
    text = slurm_cmd(["scontrol", "show", "job", "-d", job])
    state = re.search(r"JobState=(\S+)", text)
    if not state or state.group(1) != "RUNNING":
        raise ConfigError(f"launcher: SLURM_JOB_ID={job} is {state.group(1) if state else 'unknown'}, not RUNNING")
    nodes: list[str] = []
    cpus: dict[str, int] = {}
    for expr, ids in re.findall(r"\bNodes=(\S+) CPU_IDs=(\S+)", text):
        for node in hostnames(expr):
            nodes.append(node)
            cpus[node] = _count_ids(ids)
    if not nodes:
        raise SlurmError(f"scontrol show job -d {job}: no node list")
    return nodes, cpus


# ---- node health: which node of a step went away ------------------------------------------------------------------


@dataclass(frozen=True)
class NodeHealth:
    """One node as slurmctld sees it: `state` as scontrol prints it ("MIXED", "IDLE*": the trailing `*` is "not
    responding"), and when its slurmd last started (a new time means the node's slurmd, and whatever ran there,
    was restarted: a power loss or a reboot)."""

    state: str
    slurmd_started: str

    @property
    def responding(self) -> bool:
        s = self.state.upper()
        return not (s.endswith("*") or "NOT_RESPONDING" in s or s.startswith(("DOWN", "FAIL")))


def node_health(nodes: list[str]) -> dict[str, NodeHealth]:
    """`scontrol show node` for `nodes` ({} when slurmctld does not answer: no verdict, not a lost node)."""
    try:
        text = slurm_cmd(["scontrol", "show", "node", "-o", ",".join(nodes)])
    except SlurmError:
        return {}
    out = {}
    for line in text.splitlines():
        f = dict(re.findall(r"(\w+)=(\S+)", line))
        if "NodeName" in f:
            out[f["NodeName"]] = NodeHealth(f.get("State", "?"), f.get("SlurmdStartTime", "?"))
    return out


def lost_nodes(before: dict[str, NodeHealth], now: dict[str, NodeHealth]) -> dict[str, str]:
    """node -> why it went away since `before`: its slurmd does not answer, or it was restarted (what ran on the
    node died with it; Slurm still lists that node's part of our steps, which no scancel can end)."""
    out = {}
    for node, h in now.items():
        if not h.responding:
            out[node] = f"{h.state}: its slurmd does not answer (the node lost power or its network)"
        elif node in before and h.slurmd_started != before[node].slurmd_started:
            out[node] = (
                f"its slurmd restarted at {h.slurmd_started} (was up since {before[node].slurmd_started}): the node "
                "lost power or rebooted, and what ran there with it"
            )
    return out


# ---- the job's steps -----------------------------------------------------------------------------------------------


def list_steps(job_id: str) -> dict[str, str]:
    """step name -> "<job>.<step>" of the job's running steps."""
    out = slurm_cmd(["squeue", "--noheader", "--steps", "--jobs", job_id, "--format", "%i|%j"])
    steps = {}
    for line in out.splitlines():
        sid, _, name = line.strip().partition("|")
        if sid:
            steps[name] = sid
    return steps


def steps_or_none(job_id: str) -> dict[str, str] | None:
    try:
        return list_steps(job_id)
    except SlurmError as e:
        log.warning("cannot list the steps: %s", e)
        return None


def node_lost_message(step: str, lost: dict[str, str], nodes: list[str], timeout_s: float) -> str:
    if lost:
        where = "; ".join(f"node {n} went away ({why})" for n, why in lost.items())
    else:
        where = f"Slurm still lists it {timeout_s:.0f}s after scancel (slurm.node_timeout_s) on {','.join(nodes)}"
    return (
        f"the trainer step {step} cannot be replaced in this allocation: {where}; Slurm keeps that node's part of "
        f"the step, so resubmit the run once the node is back (or on other nodes)"
    )


def describe_steps(alloc: Allocation) -> str:
    """What holds the job's resources: 'job 28 holds 4 CPUs on vm; its running steps: 28.0 blocker (2 CPUs on
    vm), ...' (why a step cannot be created)."""
    holds = ", ".join(f"{n} CPUs on {node}" for node, n in alloc.cpus.items())
    try:
        text = slurm_cmd(["scontrol", "show", "step", "-o", alloc.job_id])
    except SlurmError as e:
        return f"job {alloc.job_id} holds {holds}; scontrol show step failed: {e}"
    steps = []
    for line in text.splitlines():
        f = dict(re.findall(r"(\w+)=(\S+)", line))
        if f.get("StepId", "").endswith((".batch", ".extern")) or f.get("State") == "PENDING":
            continue  # they hold no CPUs a step could use
        steps.append(
            f"{f.get('StepId')} {f.get('Name')} ({f.get('CPUs')} CPUs on {f.get('NodeList')}, "
            f"{f.get('State', '').lower()})"
        )
    return f"job {alloc.job_id} holds {holds}; its running steps: {', '.join(steps) or 'none'}"
