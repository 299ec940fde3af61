"""What each Slurm step of a run runs: the `srun` line of a step (`srun_cmd`), the trainer step (one torchrun agent
per trainer node) and a server step (launch/step.py, which reports the server's address, then becomes the server).

Apart from launch/slurm.py, which decides when a step starts (at launch, and again when one is replaced mid-run),
because the command lines are the same every time and depend only on the config, the node and the job: a server
step started again after a fault, on its old node or another one, is built here exactly as at launch. No torch here.
"""

from __future__ import annotations

import asyncio
import re
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec

from areal_async.launch.node_assignment import NodeAssignment
from areal_async.launch.processes import (
    Child,
    ChildFailed,
    Processes,
    c10d_args,
    embedded_server_cmd,
    free_port,
    sglang_server_cmd,
    tail,
    thread_env,
    trainer_cmd,
)
from areal_async.launch.sglang_server import sglang_options
from areal_async.launch.slurm_allocation import Allocation
from areal_async.net.rank_registry import Registry

if TYPE_CHECKING:
    from areal_async.config import RunConfig

__all__ = [
    "SRUN_UNSET",
    "StepOwner",
    "node_address",
    "rdzv_port",
    "srun_cmd",
    "start_server_step",
    "start_trainer_step",
    "wait_or_fail",
]

T = TypeVar("T")


# What a batch job or salloc exports about its own request (or a site's defaults, such as DefMemPerCPU) and srun would
# read as options of our steps; some combinations are fatal to srun ("SLURM_MEM_PER_CPU, SLURM_MEM_PER_GPU, and
# SLURM_MEM_PER_NODE are mutually exclusive"). Every step gives its own, so srun runs without them.
SRUN_UNSET = frozenset(
    {
        "SLURM_CPUS_PER_TASK",
        "SLURM_TRES_PER_TASK",
        "SLURM_CPUS_PER_GPU",
        "SLURM_MEM_PER_CPU",
        "SLURM_MEM_PER_GPU",
        "SLURM_MEM_PER_NODE",
        "SLURM_NTASKS",
        "SLURM_NPROCS",
        "SLURM_NTASKS_PER_CORE",
        "SLURM_NTASKS_PER_GPU",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_NTASKS_PER_SOCKET",
        "SLURM_GPUS",
        "SLURM_GPUS_PER_NODE",
        "SLURM_GPUS_PER_TASK",
        "SLURM_GRES",
        "SLURM_DISTRIBUTION",
        "SLURM_EXCLUSIVE",
        "SLURM_OVERLAP",
        "SLURM_NNODES",
        "SLURM_JOB_NUM_NODES",
    }
)


class StepOwner(Protocol):
    """What starting a step needs of the cluster that owns it (launch/slurm.py's `SlurmCluster`)."""

    alloc: Allocation
    processes: Processes
    registry: Registry
    tag: str

    def step_name(self, name: str) -> str: ...


def srun_cmd(
    job_id: str,
    step_name: str,
    nodes: list[str],
    *,
    cpus_per_task: int,
    gpus_per_node: int,
    extra: list[str],
    label: bool = False,
) -> list[str]:
    """One task per node with exactly these CPUs and GPUs; the step dies whole when one task fails."""
    cmd = [
        "srun",
        f"--jobid={job_id}",
        f"--job-name={step_name}",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        f"--cpus-per-task={cpus_per_task}",
        "--exact",
        "--mem=0",
        "--kill-on-bad-exit=1",
        "--input=none",
    ]
    if gpus_per_node:
        cmd.append(f"--gres=gpu:{gpus_per_node}")
    if label:
        cmd.append("--label")
    return cmd + list(extra)


def rdzv_port(job_id: str, controller_node: str | None, first_trainer: str) -> int:
    """A port for the c10d store on the first trainer node: a free one when that is this node, else one derived
    from the job id (two jobs sharing a node then pick different ports)."""
    if controller_node == first_trainer:
        return free_port("0.0.0.0")
    return 29500 + int(re.sub(r"\D", "", job_id) or 0) % 20000


def start_trainer_step(
    owner: StepOwner,
    cfg: RunConfig,
    p: NodeAssignment,
    model_path: str,
    resume: str | None,
    generation: int = 0,
    *,
    secret: bytes,
    remote: bool,
    nodes: list[str] | None = None,
    overlap: bool = False,
) -> Child:
    """The trainer step: one torchrun agent on each of `p.trainer_nodes` (or `nodes`: the nodes left to a job that
    shrank, launch/shrink.py), from checkpoint `resume` (None: the base model); `generation` counts the steps
    started before it, so a replacement meets in a rendezvous of its own. `overlap` (srun --overlap): the step may
    use CPUs Slurm still counts as another step's, which it does for the old step's part on a node that went away
    (until that node answers again) and, measured on the namespace cluster, for the surviving nodes' part too."""
    t, alloc = cfg.train, owner.alloc
    nodes = list(p.trainer_nodes) if nodes is None else nodes
    nnodes = len(nodes)
    rdzv: list[str] = []
    if nnodes > 1:
        endpoint = (t.rdzv.endpoint if nnodes == t.nnodes else None) or (
            f"{nodes[0]}:{rdzv_port(alloc.job_id, alloc.controller_node, nodes[0])}"
        )
        run_id = f"{alloc.job_id}-{owner.tag}-{generation}"
        rdzv = c10d_args(nnodes=nnodes, endpoint=endpoint, run_id=run_id, timeout_s=t.rdzv.timeout_s)
    cmd = trainer_cmd(
        model=model_path,
        nproc=t.nproc,
        config_json=msgspec.json.encode(t).decode(),
        seed=cfg.seed,
        run_dir=cfg.run_dir,
        resume=resume,
        torchrun_args=rdzv,
        rpc_host="0.0.0.0" if remote else "127.0.0.1",
    )
    env = {**thread_env(t.torch_threads), "AREAL_RPC_SECRET": secret.hex()}
    if t.rdzv.discovery == "registry":
        env.update(owner.registry.env())
    srun = srun_cmd(
        alloc.job_id,
        owner.step_name("trainer"),
        nodes,
        cpus_per_task=p.cpus_per_trainer_node,
        gpus_per_node=p.gpus_per_trainer_node,
        extra=[*cfg.slurm.srun_args, *(["--overlap"] if overlap else [])],
        label=nnodes > 1,
    )
    return owner.processes.spawn("trainer", srun + cmd, env, role="trainer", unset=SRUN_UNSET)


def start_server_step(
    owner: StepOwner, cfg: RunConfig, p: NodeAssignment, model_path: str, secret: bytes, index: int, node: str
) -> Child:
    """Server `index` as a one-task step on `node`, on port `server.port + index` (0: a free one the step picks
    there); the step reports its address to the registry under the name `server<index>`."""
    srv = cfg.server
    port = str(srv.port + index) if srv.port else "{port}"
    if srv.backend == "embedded":
        cmd = embedded_server_cmd(
            model_path,
            host=srv.host,
            port=port,
            device=srv.device,
            max_total_tokens=srv.max_total_tokens,
            max_running_requests=srv.max_running_requests,
            api_key=srv.api_key,
            prefix_cache=srv.prefix_cache,
            dtype=cfg.model.dtype,
        )
    else:
        cmd = sglang_server_cmd(
            model_path, host=srv.host, port=port, base_gpu_id=0, tp_size=srv.gpus_per_server, **sglang_options(cfg)
        )
    name = f"server{index}"
    step = [
        sys.executable,
        "-m",
        "areal_async.launch.step",
        "--name",
        name,
        "--host",
        srv.host,
        "--port",
        str(srv.port + index if srv.port else 0),
        "--",
    ]
    env = {**thread_env(srv.torch_threads), "AREAL_RPC_SECRET": secret.hex(), **owner.registry.env()}
    srun = srun_cmd(
        owner.alloc.job_id,
        owner.step_name(name),
        [node],
        cpus_per_task=p.cpus_per_server,
        gpus_per_node=p.gpus_per_server,
        extra=cfg.slurm.srun_args,
    )
    return owner.processes.spawn(name, srun + step + cmd, env, role="server", unset=SRUN_UNSET)


async def wait_or_fail(
    awaitable: Awaitable[T], timeout_s: float, what: str, child: Child, *, exited: Callable[[], list[Child]]
) -> T:
    """`awaitable` within `timeout_s`, failing fast (with the log tail) when a child `exited()` names ends
    meanwhile (any child at launch; only the new step's srun when one is replaced mid-run)."""
    task = asyncio.ensure_future(awaitable)
    deadline = time.monotonic() + timeout_s
    try:
        while not task.done():
            for c in exited():
                c.reported = True
                raise ChildFailed(c.describe_exit())
            if time.monotonic() > deadline:
                raise ChildFailed(
                    f"{what} within {timeout_s:.0f}s; log tail ({child.log_path}):\n{tail(child.log_path)}"
                )
            await asyncio.wait({task}, timeout=0.2)
        return task.result()
    finally:
        task.cancel()


def node_address(node: str) -> str:
    """`node`'s address as this host resolves it (the name itself when it does not)."""
    try:
        return socket.gethostbyname(node)
    except OSError:
        return node
