"""The launch seam: a `Launcher` turns a checked config into a running `Cluster`; run.py knows nothing else.

    cluster = await launcher.launch(cfg, model_path=..., trainer_resume=...)   # servers healthy, trainers starting
    await supervise(body(cluster), cluster, on_event)                           # body = the RL run
    await cluster.shutdown()

What a run needs from a cluster is small: the servers' URLs (`servers`), how to reach the trainer ranks
(`trainers`: the rendezvous directory their rank files appear in, the RPC secret, and the address the servers can
reach trainer rank 0 at for a weight broadcast), a `watch` that reports what happens to the processes, and
`shutdown`. Implementations today: `LocalLauncher` (embedded or SGLang servers and one torchrun job on this host)
and `ExternalLauncher` (servers already running, given as URLs; torchrun here, multi-node through
`train.torchrun_args`), both in launch/local.py, and `SlurmLauncher` (launch/slurm.py).

Failures are events, not exits. `watch(on_event)` calls the handler with a `ClusterEvent` for everything that
happens and keeps watching; only a handler that raises ends the watch (and `supervise` then cancels the run with
that error). A run's handler is launch/membership.py's `failure_policy`: servers join and leave; with
`recovery.enabled` (the default) dead and hung parts are restarted (below), otherwise any child that dies ends the
run with its log tail (`end_run_on_failure`). What the protocol is shaped for, without run() changing:
- a Slurm launcher (launch/slurm.py): servers as `srun` job steps, the trainers as one `srun` step running torchrun
  across its nodes, the controller on the batch host; the ranks report to the controller's registry
  (net/rank_registry.py), which writes the rank files `TrainerGroup.connect` reads, and its watch reports a failed
  step as `ProcessExited`.
- fault recovery (launch/recovery.py, `recovery.enabled`; docs/recovery.md): `failure_policy` puts `RunRecovery`
  in front of the fleet handler. A dead or hung server is restarted by the cluster (`restart_server`; announced as
  `ServerJoined` under its old name) and gets the current weights before it serves again; a dead trainer makes the
  run restart the trainers from the last checkpoint (`restart_trainers`) and roll the controller back to it. Only
  "nothing left to serve or train with" ends a run. A cluster without those methods (`RestartableCluster`) leaves
  that failure to end the run, or, for servers it did not start, to the client, which re-admits them when they
  answer again.
- servers joining a running job: `ServerJoined` as well (a new name and URL), and `ServerLeft` when one is to leave
  (launch/membership.py: URLs added to and removed from run_dir/servers.txt, handled by `failure_policy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

from areal_async.launch.processes import ChildFailed

if TYPE_CHECKING:
    from areal_async.config import RunConfig

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ServerHandle:
    name: str  # "server0", ...: stable across restarts
    url: str  # base URL, e.g. http://10.0.0.3:30000


@dataclass(frozen=True)
class TrainerHandle:
    """How the controller reaches the trainer ranks (`TrainerGroup.connect(rendezvous_dir, world_size, secret)`)."""

    world_size: int
    rendezvous_dir: str  # the run directory: ranks write trainer/rank<r>.json into it
    secret: bytes  # the RPC channel's shared secret (the ranks got it from their environment)
    master_address: str  # where inference servers reach trainer rank 0 (broadcast weight sync)


@dataclass(frozen=True)
class ProcessExited:
    """A server or trainer process ended that should still be running."""

    role: Literal["server", "trainer", "other"]
    name: str
    exit_code: int | None
    log_path: str
    log_tail: str
    url: str | None = None  # servers
    pid: int | None = None  # the process that exited (tells a dead job from the one that replaced it)

    def describe(self) -> str:
        return f"{self.name} exited with code {self.exit_code}; log tail ({self.log_path}):\n{self.log_tail}"


@dataclass(frozen=True)
class ServerJoined:
    """A server (re)started by the launcher, or added to a running job, answers /health. It serves the weights it
    was started with until the run gives it the current ones. Emitted for URLs added to run_dir/servers.txt
    (launch/membership.py)."""

    name: str
    url: str


@dataclass(frozen=True)
class ServerLeft:
    """A server added to a running job is to leave it (its URL was taken out of run_dir/servers.txt): drain it."""

    name: str
    url: str


ClusterEvent = ProcessExited | ServerJoined | ServerLeft
EventHandler = Callable[[ClusterEvent], Awaitable[None]]


class Cluster(Protocol):
    """What a launcher hands the run. Attributes may change while it runs (a server restarted at a new URL)."""

    servers: list[ServerHandle]
    trainers: TrainerHandle

    async def watch(self, on_event: EventHandler) -> None:
        """Report every event to `on_event`, in order, until cancelled; re-raise what the handler raises."""
        ...

    async def shutdown(self) -> None:
        """Stop everything this cluster started (idempotent). External servers are left running."""
        ...


class Launcher(Protocol):
    async def launch(self, cfg: RunConfig, *, model_path: str, trainer_resume: str | None = None) -> Cluster:
        """Start what `cfg` asks for and return once the servers answer /health (the trainers may still be loading;
        the run connects to them). `model_path` is the resolved base model directory; `trainer_resume` a trainer
        checkpoint to start from. On failure, everything started is stopped before the error propagates."""
        ...


# ---- handling events ----------------------------------------------------------------------------------------------


async def end_run_on_failure(event: ClusterEvent) -> None:
    """Today's policy for processes: a dead child ends the run, with its log tail. (A run's handler,
    launch/membership.py `failure_policy`, handles servers joining and leaving and passes the rest here.)"""
    if isinstance(event, ProcessExited):
        raise ChildFailed(event.describe())
    raise ChildFailed(f"{event.name} at {event.url}: {type(event).__name__} has no handler here")


async def supervise(
    body: Awaitable[T], cluster: Cluster, on_event: EventHandler, *, diagnosis_grace_s: float = 2.0
) -> T:
    """Await `body` while `cluster.watch(on_event)` runs beside it. When the handler raises, `body` is cancelled
    (its own cleanup runs) and the handler's error is raised instead of whatever the cancellation caused.

    When `body` fails first (an RPC to a trainer that just died breaks before the watch polls), the watch gets
    `diagnosis_grace_s` to report the death: its error, which names the process and carries its log tail, is raised
    instead, chained to the body's."""
    main = asyncio.ensure_future(body)
    watch = asyncio.ensure_future(cluster.watch(on_event))
    try:
        await asyncio.wait({main, watch}, return_when=asyncio.FIRST_COMPLETED)
        if main.done():
            if main.cancelled() or main.exception() is None:
                return main.result()
            await asyncio.wait({watch}, timeout=diagnosis_grace_s)
            if watch.done() and not watch.cancelled() and watch.exception() is not None:
                raise watch.exception() from main.exception()
            return main.result()
        main.cancel()
        with contextlib.suppress(BaseException):
            await main
        watch.result()  # the handler's error
        raise ChildFailed("the cluster watch ended while the run was going on")
    finally:
        for t in (main, watch):
            t.cancel()
        await asyncio.gather(main, watch, return_exceptions=True)
