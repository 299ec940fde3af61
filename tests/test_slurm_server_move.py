"""SlurmCluster.restart_server's choice of node, against a scripted Slurm (no daemons, no processes): a server whose
node went away (its slurmd silent) starts again on another node of the job that has room, and the record names
both nodes; with no room anywhere the restart fails naming the lost node, and the policy's budget decides what
follows. The same on real nodes: tests/test_netns_slurm_faults.py and tests/test_slurm.py (which take a minute
each; this pins the rules in a second, including the case no real test reaches: no room)."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field

import pytest

from areal_async.config import load_config
from areal_async.launch import slurm
from areal_async.launch.api import ServerHandle, ServerJoined
from areal_async.launch.node_assignment import node_for_server, place
from areal_async.launch.processes import ChildFailed
from areal_async.launch.slurm_allocation import Allocation, NodeHealth
from areal_async.net.rank_registry import Registration


class Proc:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> None:
        return None  # still running


@dataclass
class Child:
    name: str
    proc: Proc
    log_path: str = "/nowhere.log"
    role: str = "server"
    url: str | None = None
    expected_exit: bool = False
    reported: bool = False


@dataclass
class Processes:
    children: list = field(default_factory=list)
    stopped: list = field(default_factory=list)

    def stop(self, child, grace_s: float = 10.0) -> None:
        self.stopped.append(child.proc.pid)
        child.expected_exit = True

    async def wait_healthy(self, servers, timeout_s, api_key=None, *, only=False) -> None:
        return None


class Registry:
    rank_dir = "/nowhere"

    def __init__(self) -> None:
        self.entries: dict[str, Registration] = {}

    async def wait_for(self, name: str) -> Registration:
        while name not in self.entries:
            await asyncio.sleep(0.01)
        return self.entries[name]


class ScriptedSlurm:
    """Job 7 on nodes a and b; node b's slurmd stopped answering, so Slurm keeps listing server1's old step 7.2."""

    def __init__(self, monkeypatch) -> None:
        self.steps = {"areal.t.server0": "7.1", "areal.t.server1": "7.2"}
        self.scancels: list[list[str]] = []
        monkeypatch.setattr(slurm, "list_steps", lambda job: dict(self.steps))
        monkeypatch.setattr(slurm, "steps_or_none", lambda job: dict(self.steps))
        monkeypatch.setattr(slurm, "node_health", self.health)
        monkeypatch.setattr(slurm, "slurm_cmd", self.cmd)

    @staticmethod
    def health(nodes: list[str]) -> dict[str, NodeHealth]:
        return {n: NodeHealth("IDLE+NOT_RESPONDING" if n == "b" else "MIXED", "t0") for n in nodes}

    def cmd(self, args: list[str], timeout_s: float = 30.0) -> str:
        self.scancels.append(args)
        return ""


def _cluster(monkeypatch, cpus_on_a: int) -> tuple[slurm.SlurmCluster, ScriptedSlurm, list[tuple[int, str]]]:
    fake = ScriptedSlurm(monkeypatch)
    common = ["server.host=0.0.0.0", "server.api_key=k", "server.torch_threads=2", "train.torch_threads=2"]
    cfg = load_config(None, ["launcher=slurm", "server.num_servers=2", "slurm.servers_per_node=1", *common])
    layout = place(cfg, ["a", "b"], "a")  # server0 and the trainer rank on a (3 + 3 CPUs), server1 on b
    alloc = Allocation("7", ["a", "b"], {"a": cpus_on_a, "b": 3}, "a")
    procs, registry = Processes(), Registry()
    procs.children.append(Child("server1", Proc(100)))
    servers = [ServerHandle("server0", "http://a:1"), ServerHandle("server1", "http://b:1")]
    cluster = slurm.SlurmCluster(alloc, procs, registry, "t", servers, 1, b"s" * 32, "/nowhere", "a")
    cluster.server_nodes = list(layout.server_nodes)
    cluster.trainer_nodes = list(layout.trainer_nodes)
    cluster.nodes_at_start = {"a": NodeHealth("MIXED", "t0"), "b": NodeHealth("MIXED", "t0")}
    cluster.node_timeout_s = 5.0
    cluster.room_for_server = functools.partial(node_for_server, layout, alloc, gpus_per_node=0, servers_apart=False)
    started: list[tuple[int, str]] = []

    def start_server(index: int, node: str) -> Child:
        started.append((index, node))
        step = cluster.step_name(f"server{index}")  # the new step's name (server1.1)
        fake.steps[step] = "7.3"
        registry.entries[f"server{index}"] = Registration(
            kind="step", name=f"server{index}", address=f"tcp://{node}:2", node=node, pid=200, slurm_step="7.3"
        )
        child = Child(f"server{index}", Proc(200))
        procs.children.append(child)
        return child

    cluster.start_server = start_server
    return cluster, fake, started


def test_a_server_whose_node_went_away_starts_on_another_node_with_room(monkeypatch):
    cluster, fake, started = _cluster(monkeypatch, cpus_on_a=9)
    handle = asyncio.run(cluster.restart_server("server1"))
    assert started == [(1, "a")] and handle == ServerHandle("server1", "http://a:2")
    assert cluster.server_nodes == ["a", "a"] and cluster.servers[1] == handle
    assert ["scancel", "--signal=KILL", "7.2"] in fake.scancels  # the old step was cancelled first
    where = cluster.server_where("server1")
    assert where.startswith("on node a (Slurm step 7.3), moved from b: node b went away (IDLE+NOT_RESPONDING"), where
    assert cluster.step_name("server1") == "areal.t.server1.1"  # never mistaken for the old step b keeps listed
    assert cluster._our_steps() == {"areal.t.server0": "7.1", "areal.t.server1.1": "7.3"}  # 7.2 left to Slurm
    assert cluster._joined == [ServerJoined("server1", "http://a:2")]


def test_with_no_room_left_the_restart_fails_naming_the_lost_node(monkeypatch):
    cluster, _, started = _cluster(monkeypatch, cpus_on_a=8)  # 3 + 3 used on a: 2 left, a server needs 3
    with pytest.raises(ChildFailed, match=r"^server1 cannot start again in job 7: node b went away \(IDLE\+NOT_RESP"):
        asyncio.run(cluster.restart_server("server1"))
    assert started == [] and cluster.server_nodes == ["a", "b"]
