"""A run's registration endpoint: processes the controller started elsewhere (trainer ranks on other nodes, Slurm
server steps) report the address they serve on, so the controller needs no filesystem in common with them. Also the
one spelling of where a trainer rank's address file lives (`rank_file`). Torch-free.
"""

# Why not rank files: `run_dir/trainer/rank<r>.json` written by the ranks only reaches the controller through a
# shared filesystem, and NFS attribute caching can keep a stale file visible for seconds. Here the controller listens
# with an `RpcServer` (areal_async/net/rpc.py: HMAC handshake with the run's RPC secret, so a stranger who reaches the
# port can register nothing and learns nothing), and each process reports over it once it listens. A process finds
# the endpoint through its environment, which the launcher sets (srun and torchrun pass it on): `AREAL_REGISTRY`
# (tcp://host:port) and `AREAL_RPC_SECRET` (hex; the secret is never on a command line).
#
# What the controller receives for a trainer rank it writes as the same rank file, in its own run directory, so that
# `TrainerGroup.connect` reads one layout whichever way the ranks were found.
#
# An address reported by a process that listens on every interface (0.0.0.0) names the interface on this node's
# route to the controller (`route_address`): the one the controller can reach it back at.

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Literal

import msgspec

from areal_async.atomic_write import write_json_atomic
from areal_async.net.address import host_address
from areal_async.net.rpc import RpcClient, RpcServer

log = logging.getLogger(__name__)

REGISTRY_ENV = "AREAL_REGISTRY"
SECRET_ENV = "AREAL_RPC_SECRET"


def read_secret() -> bytes:
    """The run's shared RPC secret from AREAL_RPC_SECRET (hex, at least 16 bytes): what trainer ranks, Slurm steps
    and agents started by hand authenticate with. Raises ValueError saying what is wrong."""
    raw = os.environ.get(SECRET_ENV, "")
    if not raw:
        raise ValueError(f"{SECRET_ENV} is not set")
    try:
        secret = bytes.fromhex(raw.strip())
    except ValueError:
        raise ValueError(f"{SECRET_ENV} is not hex") from None
    if len(secret) < 16:
        raise ValueError(f"{SECRET_ENV} must hold at least 16 bytes (32 hex digits), got {len(secret)}")
    return secret


class Registration(msgspec.Struct, forbid_unknown_fields=True):
    kind: Literal["rank", "step"]
    name: str  # "rank3", "server0"
    address: str  # tcp://host:port it serves on, as reachable from the controller
    node: str  # the reporting node's host name
    pid: int
    rank: int = -1  # trainer ranks
    world_size: int = 0
    slurm_step: str | None = None  # "<job>.<step>" when it runs as a Slurm step


class Ack(msgspec.Struct):
    accepted: bool = True


def route_address(target_host: str) -> str:
    """This host's address on its route to `target_host` (no packet is sent: a UDP connect only picks the route)."""
    family = socket.AF_INET6 if ":" in target_host.strip("[]") else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((target_host.strip("[]"), 9))
            return s.getsockname()[0]
    except OSError:  # no route: an address other hosts can reach, never gethostbyname(gethostname()) (127.0.1.1)
        return host_address()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def _join(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def reachable_address(bound: str, registry: str) -> str:
    """`bound` (tcp://host:port as the listener reports it) with a wildcard host replaced by the interface on the
    route to the registry."""
    host, port = _split(bound)
    if host in ("0.0.0.0", "::", ""):
        host = route_address(_split(registry)[0])
    return _join(host, port)


def _write_atomic(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, data)  # a unique temporary name: the rank and the Registry may write one file at once


def rank_files_dir(run_dir: str) -> str:
    """Where a run's trainer rank files live: `run_dir/trainer/`."""
    return os.path.join(run_dir, "trainer")


def rank_file(run_dir: str, rank: int) -> str:
    """`run_dir/trainer/rank<r>.json`: the one spelling of the file that says where trainer rank `rank` listens
    (written by the rank or by the Registry, read by TrainerGroup.connect, cleared by the launcher)."""
    return os.path.join(rank_files_dir(run_dir), f"rank{rank}.json")


def slurm_step_id(env: dict[str, str] | os._Environ = os.environ) -> str | None:
    """'<job>.<step>' when this process runs as a Slurm step (so the controller can cancel that step), else None."""
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
    return f"{job}.{step}" if job and step else None


class Registry:
    """The controller side. `start()` listens; `env()` is what a reporting process needs besides the secret."""

    def __init__(self, secret: bytes, rank_dir: str) -> None:
        self._server = RpcServer(secret, max_frame_bytes=64 << 10, name="registry")
        self._server.register("register", self._register, Registration)
        self.rank_dir = rank_dir  # rank files go to rank_dir/trainer/
        self.address = ""
        self.entries: dict[str, Registration] = {}
        self._changed = asyncio.Event()

    async def start(self, host: str = "127.0.0.1", advertise: str | None = None) -> str:
        """Listen on `host` (0.0.0.0 when processes on other nodes report); the address handed out names
        `advertise` (default: the bound host)."""
        trainer_dir = rank_files_dir(self.rank_dir)
        if os.path.isdir(trainer_dir):  # ours, from an earlier job in this run directory: stale by definition
            for name in os.listdir(trainer_dir):
                if name.startswith("rank") and name.endswith(".json"):
                    os.remove(os.path.join(trainer_dir, name))
        bound = await self._server.start_tcp(host, 0)
        _, port = _split(bound)
        self.address = _join(advertise or _split(bound)[0], port)
        log.info("registry listening on %s (handed out as %s)", bound, self.address)
        return self.address

    def env(self) -> dict[str, str]:
        """The variables that point a process the launcher starts at this registry."""
        return {REGISTRY_ENV: self.address}

    def _register(self, reg: Registration) -> Ack:
        if reg.kind == "rank":
            if not 0 <= reg.rank < max(reg.world_size, 1):
                raise ValueError(f"rank {reg.rank} outside world size {reg.world_size}")
            _write_atomic(
                rank_file(self.rank_dir, reg.rank),
                {
                    "address": reg.address,
                    "rank": reg.rank,
                    "world_size": reg.world_size,
                    "pid": reg.pid,
                    "node": reg.node,
                    "slurm_step": reg.slurm_step,
                },
            )
        self.entries[reg.name] = reg
        log.info(
            "registered %s at %s (node %s, pid %d%s)",
            reg.name,
            reg.address,
            reg.node,
            reg.pid,
            f", Slurm step {reg.slurm_step}" if reg.slurm_step else "",
        )
        self._changed.set()
        return Ack()

    async def wait_for(self, name: str) -> Registration:
        """The registration of `name` once it has arrived (the caller bounds the wait)."""
        while name not in self.entries:
            self._changed.clear()
            await self._changed.wait()
        return self.entries[name]

    async def close(self) -> None:
        """Stop listening and remove the rank files this registry wrote (the ranks are gone by now)."""
        await self._server.close()
        for reg in self.entries.values():
            if reg.kind == "rank":
                try:
                    os.remove(rank_file(self.rank_dir, reg.rank))
                except OSError:
                    pass


async def report(reg: Registration, *, registry: str, secret: bytes, timeout_s: float = 60.0) -> None:
    """Report `reg` to the registry at `registry`, retrying until `timeout_s` (it is up before anything starts,
    so a failure here means the controller cannot be reached: the caller should exit with the error)."""
    client = await RpcClient.connect(registry, secret, timeout=timeout_s, max_frame_bytes=64 << 10)
    try:
        await client.call("register", reg, Ack, timeout=timeout_s)
    finally:
        await client.close()


def report_sync(reg: Registration, *, registry: str, secret: bytes, timeout_s: float = 60.0) -> None:
    """`report` for a process with no event loop of its own (a Slurm step's wrapper)."""
    asyncio.run(report(reg, registry=registry, secret=secret, timeout_s=timeout_s))


async def announce_rank(run_dir: str, rank: int, world_size: int, address: str, secret: bytes) -> str | None:
    """A trainer rank says where it listens: to the controller's registry when the environment names one, else as
    `run_dir/trainer/rank<r>.json` (which it returns, to be removed on exit)."""
    registry = os.environ.get(REGISTRY_ENV)
    node = socket.gethostname()
    if not registry:
        path = rank_file(run_dir, rank)
        _write_atomic(
            path, {"address": address, "rank": rank, "world_size": world_size, "pid": os.getpid(), "node": node}
        )
        return path
    reg = Registration(
        kind="rank",
        name=f"rank{rank}",
        address=reachable_address(address, registry),
        node=node,
        pid=os.getpid(),
        rank=rank,
        world_size=world_size,
        slurm_step=slurm_step_id(),
    )
    await report(reg, registry=registry, secret=secret)
    return None
