"""Which node of a Slurm allocation runs which server and trainer step, and what each step asks Slurm for
(`place`, `check_allocation`; the local launcher's GPU-level plan is launch/placement.py).

Apart from launch/slurm.py because it is a pure function of the config and the job's node list: launch/sbatch.py
lays a run out with it before submitting the job (so a run that cannot fit fails at once), and every impossibility
is a ConfigError naming the key to change, checked before the first srun. No torch here.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal_async.config import ConfigError
from areal_async.launch.slurm_allocation import Allocation

if TYPE_CHECKING:
    from areal_async.config import RunConfig


@dataclass(frozen=True)
class NodeAssignment:
    """Which node of the allocation runs which server and trainer step, and what each step asks Slurm for (the
    local launcher's GPU-level plan is launch/placement.py's `Placement`)."""

    nodes: list[str]
    server_nodes: list[str]  # node of server i (empty for server.backend=external)
    trainer_nodes: list[str]
    cpus_per_server: int
    gpus_per_server: int
    cpus_per_trainer_node: int  # train.nproc ranks on each trainer node
    gpus_per_trainer_node: int

    def needs(self, node: str) -> tuple[int, int]:
        """(CPUs, GPUs) the steps on `node` ask for together."""
        n = self.server_nodes.count(node)
        t = int(node in self.trainer_nodes)
        return (
            n * self.cpus_per_server + t * self.cpus_per_trainer_node,
            n * self.gpus_per_server + t * self.gpus_per_trainer_node,
        )


def job_nodes(cfg: RunConfig) -> int:
    """Nodes a submitted job asks for: slurm.nodes, or enough for the trainers and slurm.servers_per_node (with
    slurm.servers_apart, the server nodes come on top of the trainers': one, or what servers_per_node needs)."""
    s, n = cfg.slurm, cfg.train.nnodes
    if s.nodes:
        return s.nodes
    if cfg.server.backend == "external":
        return n
    if s.servers_apart:
        return n + (math.ceil(cfg.server.num_servers / s.servers_per_node) if s.servers_per_node else 1)
    if s.servers_per_node:
        n = max(n, math.ceil(cfg.server.num_servers / s.servers_per_node))
    return n


def _loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


def place(cfg: RunConfig, nodes: list[str], controller_node: str | None) -> NodeAssignment:
    """Lay the run out on `nodes`; every impossibility is a ConfigError naming the key to change."""
    s, srv, t = cfg.slurm, cfg.server, cfg.train
    if s.nodes is not None:
        if s.nodes > len(nodes):
            raise ConfigError(f"slurm.nodes: {s.nodes} nodes asked for, the job has {len(nodes)} ({','.join(nodes)})")
        nodes = nodes[: s.nodes]
    if t.nnodes > len(nodes):
        raise ConfigError(f"train.nnodes: {t.nnodes} trainer nodes, the job has {len(nodes)} ({','.join(nodes)})")
    for key, bad, why in (
        ("train.torchrun_args", bool(t.torchrun_args), "under Slurm the rendezvous comes from train.nnodes"),
        (
            "train.cuda_visible_devices",
            t.cuda_visible_devices is not None,
            "under Slurm each step gets its GPUs from Slurm (slurm.gpus_per_node)",
        ),
        ("server.base_gpu_id", srv.base_gpu_id != 0, "under Slurm each server step gets its GPUs from Slurm"),
        ("train.rdzv.local_agents", t.rdzv.local_agents is not None, "is for launcher=local"),
        (
            "slurm.gpus_per_node",
            srv.backend in ("sglang", "vllm") and s.gpus_per_node == 0,
            "sglang servers need GPUs: set the GPUs each node has",
        ),
    ):
        if bad:
            raise ConfigError(f"{key}: {why}")
    server_nodes: list[str] = []
    if srv.backend != "external":
        pool = nodes[t.nnodes :] if s.servers_apart else nodes  # the nodes servers may run on
        if not pool:
            raise ConfigError(
                f"slurm.servers_apart: the trainers take all {len(nodes)} nodes of the job (train.nnodes="
                f"{t.nnodes}); raise slurm.nodes for the servers' own nodes"
            )
        per = s.servers_per_node or math.ceil(srv.num_servers / len(pool))
        if math.ceil(srv.num_servers / per) > len(pool):
            raise ConfigError(
                f"slurm.servers_per_node: {srv.num_servers} servers at {per} per node need "
                f"{math.ceil(srv.num_servers / per)} nodes, the job has {len(pool)}"
                f"{f' beside the {t.nnodes} trainer nodes (slurm.servers_apart)' if s.servers_apart else ''}"
            )
        server_nodes = [pool[i // per] for i in range(srv.num_servers)]
        remote = [n for n in server_nodes if n != controller_node]
        if remote and _loopback(srv.host):
            raise ConfigError(
                f"server.host: {srv.host} cannot be reached from the controller "
                f"({controller_node or socket.gethostname()}) on {remote[0]}; bind 0.0.0.0 and set "
                f"server.api_key"
            )
        if not _loopback(srv.host) and not srv.api_key:
            raise ConfigError(
                f"server.api_key: servers bound to {srv.host} take weight updates from anyone who "
                f"reaches them; set a key (the controller sends it)"
            )
    gpus = s.gpus_per_node > 0
    engine = srv.backend in ("sglang", "vllm")
    server_gpus = 0 if not gpus else (srv.gpus_per_server if engine else int(srv.device != "cpu"))
    p = NodeAssignment(
        nodes=nodes,
        server_nodes=server_nodes,
        trainer_nodes=nodes[: t.nnodes],
        cpus_per_server=s.cpus_per_server or srv.torch_threads + 1,
        gpus_per_server=server_gpus,
        cpus_per_trainer_node=t.nproc * (s.cpus_per_trainer or t.torch_threads + 1),
        gpus_per_trainer_node=t.nproc if gpus and t.device != "cpu" else 0,
    )
    for node in nodes:
        _, g = p.needs(node)
        if g > s.gpus_per_node:
            raise ConfigError(
                f"slurm.gpus_per_node: the steps on {node} need {g} GPUs "
                f"({p.server_nodes.count(node)} servers x {p.gpus_per_server}"
                f"{f' + {p.gpus_per_trainer_node} trainer ranks' if node in p.trainer_nodes else ''})"
                f", a node has {s.gpus_per_node}"
            )
    return p


def check_allocation(p: NodeAssignment, alloc: Allocation) -> None:
    for node in p.nodes:
        c, _ = p.needs(node)
        if c > alloc.cpus.get(node, 0):
            raise ConfigError(
                f"slurm.cpus_per_server: the steps on {node} need {c} CPUs "
                f"({p.server_nodes.count(node)} servers x {p.cpus_per_server}"
                f"{f' + trainers {p.cpus_per_trainer_node}' if node in p.trainer_nodes else ''}), "
                f"job {alloc.job_id} holds {alloc.cpus.get(node, 0)} there "
                f"(or lower slurm.cpus_per_trainer)"
            )


def node_for_server(
    p: NodeAssignment,
    alloc: Allocation,
    index: int,
    server_nodes: list[str],
    exclude: set[str],
    *,
    gpus_per_node: int,
    servers_apart: bool,
) -> str | None:
    """Where server `index` can start again now that its node (in `exclude`, with any other lost node) went away:
    a node of the run whose CPUs (those the job holds there) and GPUs (`gpus_per_node`) still fit one more server
    step beside what runs there (`server_nodes`: each server's node now; the trainers' nodes as laid out), the one
    with the most CPUs left first; None when no node has room. With `servers_apart`, trainer nodes are never
    chosen, as at launch. Why a function of the layout rather than Slurm's word: Slurm would only say "busy" after
    `slurm.node_timeout_s`, while the layout says at once which node can take the step."""
    others = [n for i, n in enumerate(server_nodes) if i != index]
    pool = [n for n in p.nodes if n not in exclude and not (servers_apart and n in p.trainer_nodes)]
    room: list[tuple[int, int, str]] = []
    for order, node in enumerate(pool):
        trainer = int(node in p.trainer_nodes)
        cpus = others.count(node) * p.cpus_per_server + trainer * p.cpus_per_trainer_node
        gpus = others.count(node) * p.gpus_per_server + trainer * p.gpus_per_trainer_node
        left = alloc.cpus.get(node, 0) - cpus
        if left >= p.cpus_per_server and gpus_per_node - gpus >= p.gpus_per_server:
            room.append((-left, order, node))
    return min(room)[2] if room else None
