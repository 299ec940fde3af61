"""What a launcher=ray run asks the Ray cluster for, and whether the cluster can give it, checked before anything
starts (`bundles`, `check_fits`).

A Ray placement group reserves bundles of resources on nodes; here a server is one bundle (`CPU`, `GPU` and the
custom resources of ray.server_resources) and each node of the trainer job one bundle (train.nproc ranks' worth),
the trainer bundles in one STRICT_SPREAD group: one torchrun agent per node, as under Slurm. Ray is the final judge
(a group that does not fit stays pending, and the launcher fails after ray.placement_timeout_s), but the common
impossibilities are found here first, from the nodes' totals, with errors naming the key to change: fewer nodes
than train.nnodes that fit a trainer bundle, a server bundle no node fits, more CPUs or GPUs than the cluster has.
Pure functions of the config and the node list: tested without Ray. No torch here.
"""

from __future__ import annotations

import contextlib
import ipaddress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from areal_async.config import ConfigError

if TYPE_CHECKING:
    from areal_async.config import RunConfig

__all__ = ["Bundles", "RayNode", "bundles", "check_fits", "check_reachable"]


@dataclass(frozen=True)
class RayNode:
    """An alive node of the Ray cluster: its id, address, host name and total resources."""

    node_id: str
    ip: str
    hostname: str
    resources: dict[str, float] = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        return f"{self.hostname} ({self.ip})"


@dataclass(frozen=True)
class Bundles:
    """The resources of one server's bundle and of one trainer node's bundle."""

    server: dict[str, float]
    trainer: dict[str, float]
    num_servers: int
    trainer_nodes: int


def _on_gpu(device: str, cluster_has_gpus: bool) -> bool:
    return device.startswith("cuda") or (device == "auto" and cluster_has_gpus)


def bundles(cfg: RunConfig, cluster_has_gpus: bool) -> Bundles:
    """What each server and each trainer node reserves (see RayConfig's keys for the defaults)."""
    r, srv, t = cfg.ray, cfg.server, cfg.train
    server_gpus = r.gpus_per_server
    if server_gpus is None:
        server_gpus = srv.gpus_per_server if srv.backend == "sglang" else int(_on_gpu(srv.device, cluster_has_gpus))
    rank_gpus = r.gpus_per_trainer
    if rank_gpus is None:
        rank_gpus = int(_on_gpu(t.device, cluster_has_gpus))
    server = {"CPU": float(r.cpus_per_server if r.cpus_per_server is not None else srv.torch_threads + 1)}
    trainer = {"CPU": float((r.cpus_per_trainer if r.cpus_per_trainer is not None else t.torch_threads + 1) * t.nproc)}
    if server_gpus:
        server["GPU"] = float(server_gpus)
    if rank_gpus:
        trainer["GPU"] = float(rank_gpus * t.nproc)
    server.update(r.server_resources)
    trainer.update(r.trainer_resources)
    num_servers = 0 if srv.backend == "external" else srv.num_servers
    return Bundles(
        {k: v for k, v in server.items() if v}, {k: v for k, v in trainer.items() if v}, num_servers, t.nnodes
    )


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) >= v for k, v in need.items())


def _take(need: dict[str, float], have: dict[str, float]) -> None:
    for k, v in need.items():
        have[k] = have.get(k, 0.0) - v


def _keys(need: dict[str, float], role: str) -> str:
    """The config keys behind a bundle's resources, for an error message."""
    keys = [f"ray.cpus_per_{role}"]
    if "GPU" in need:
        keys.append(f"ray.gpus_per_{role}")
    if any(k not in ("CPU", "GPU") for k in need):
        keys.append(f"ray.{role}_resources")
    return ", ".join(keys)


def _show(need: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(need.items())) + "}"


def check_fits(b: Bundles, nodes: list[RayNode]) -> None:
    """Raise ConfigError, naming the key, when the cluster's alive `nodes` cannot hold the run's bundles: a
    greedy layout of their totals (trainer bundles on distinct nodes first, then the servers) must succeed. Ray may
    still find the cluster too busy (other jobs' reservations): that shows as a placement timeout."""
    listing = ", ".join(f"{n.describe()}: {_show(n.resources)}" for n in nodes) or "no node"
    if not nodes:
        raise ConfigError("ray.address: the Ray cluster has no alive node")
    for res in sorted({*b.server, *b.trainer}):
        total = sum(n.resources.get(res, 0.0) for n in nodes)
        need = b.server.get(res, 0.0) * b.num_servers + b.trainer.get(res, 0.0) * b.trainer_nodes
        if need > total:
            roles = [
                r
                for r, bundle, n in (("server", b.server, b.num_servers), ("trainer", b.trainer, 1))
                if n and res in bundle
            ]
            named = {"CPU": "ray.cpus_per_{}", "GPU": "ray.gpus_per_{}"}.get(res, "ray.{}_resources")
            key = ", ".join(named.format(role) for role in roles)
            raise ConfigError(
                f"{key}: the run asks for {need:g} {res} ({b.num_servers} server(s) x {b.server.get(res, 0.0):g}, "
                f"{b.trainer_nodes} trainer node(s) x {b.trainer.get(res, 0.0):g}), the Ray cluster has {total:g} "
                f"({listing})"
            )
    room = {n.node_id: dict(n.resources) for n in nodes}
    trainer_ok = [n for n in nodes if _fits(b.trainer, n.resources)]
    if len(trainer_ok) < b.trainer_nodes:
        raise ConfigError(
            f"train.nnodes: {b.trainer_nodes} trainer node(s), one torchrun agent each, need as many nodes with "
            f"{_show(b.trainer)} ({_keys(b.trainer, 'trainer')}); the Ray cluster has {len(trainer_ok)} ({listing})"
        )
    # the trainer nodes: those that keep the most room for servers afterwards
    trainer_ok.sort(key=lambda n: -sum(n.resources.get(k, 0.0) for k in b.server))
    for n in trainer_ok[: b.trainer_nodes]:
        _take(b.trainer, room[n.node_id])
    for i in range(b.num_servers):
        spot = max(
            (nid for nid, have in room.items() if _fits(b.server, have)),
            key=lambda nid: room[nid].get("CPU", 0.0),
            default=None,
        )
        if spot is None:
            raise ConfigError(
                f"server.num_servers: server {i} of {b.num_servers} does not fit beside the trainers: each needs "
                f"{_show(b.server)} ({_keys(b.server, 'server')}), what is left is "
                + ", ".join(f"{n.describe()}: {_show(room[n.node_id])}" for n in nodes)
            )
        _take(b.server, room[spot])


def _loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


def check_reachable(cfg: RunConfig, nodes: list[RayNode], here: str) -> None:
    """Servers on nodes other than the controller's (address `here`) must bind an address the controller reaches,
    and such a server needs an API key (it takes weight updates from whoever reaches it)."""
    srv = cfg.server
    if srv.backend == "external" or all(n.ip == here for n in nodes):
        return
    others = [n for n in nodes if n.ip != here]
    if _loopback(srv.host):
        raise ConfigError(
            f"server.host: {srv.host} cannot be reached from the controller ({here}) on the Ray cluster's other "
            f"nodes ({others[0].describe()}, ...); bind 0.0.0.0 and set server.api_key"
        )
    if not srv.api_key:
        raise ConfigError(
            f"server.api_key: servers bound to {srv.host} on other nodes take weight updates from anyone who reaches "
            "them; set a key"
        )
