"""The controller's handle on the trainer ranks: connect to all of them, fan every call out, merge the answers.

Torch-free (the controller may run without torch). Every trainer method is a collective, so every call goes to
every rank and calls never overlap (one lock): the ranks then see the same calls in the same order. A train step
splits the batch by prompt group (groups are never split, so group advantages stay rank-local), balanced across
ranks by token count, and each rank receives only its own shard. The ranks reduce their statistics among
themselves, so rank 0's stats are the global ones.

Weight broadcast to inference servers (see train/broadcast.py for the trainer side) is driven from here too:
`init_broadcast_group` and `broadcast_weights` take any object with the two InferenceClient fan-out methods (the
receive loops beside the trainer's send are in train/broadcast_driver.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any, TypeVar

from areal_async.net.rank_registry import rank_file
from areal_async.net.rpc import RpcAuthError, RpcClient, RpcError
from areal_async.protocol.weight_identity import Identity
from areal_async.train.broadcast_driver import (
    BroadcastIncomplete,
    WeightReceivers,
    both,
    broadcast_to_members,
    receive_all,
)
from areal_async.train.errors import BatchError, PeerFailure, TrainerFailure, kind_of
from areal_async.train.messages import (
    AbortBroadcastRequest,
    AbortBroadcastResult,
    BroadcastEndpoint,
    DeltaBroadcastPlan,
    DeltaBroadcastPrepare,
    DeltaPublishRequest,
    DeltaPublishResult,
    DeltaSendRequest,
    IdentityRequest,
    OpenBroadcastRequest,
    WeightPlan,
    WeightPlanRequest,
)
from areal_async.train.packing import balance_across_ranks
from areal_async.types import (
    EPISODE_WEIGHT_KEY,
    BroadcastRequest,
    BroadcastResult,
    CheckpointRequest,
    CheckpointResult,
    Empty,
    InitBroadcastRequest,
    PublishRequest,
    PublishResult,
    TrainerInfo,
    TrainStepRequest,
    TrainStepResult,
    Trajectory,
    pack_trajectories,
)

__all__ = [
    "TrainerGroup",
    "TrainerError",
    "BroadcastIncomplete",
    "WeightReceivers",
    "split_by_rank",
    "validate_trajectories",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
_ERROR_GRACE_S = 10.0  # after one rank fails, how long the others get to report their own error
# ... and after contact with a rank was lost: the others wait for it in a collective and have nothing to add (a
# moment still collects ranks lost at the same time, as when one torchrun agent stops all of its workers)
_LOST_GRACE_S = 1.0
_ABORT_TIMEOUT_S = 30.0  # an abort is served on rank 0's event loop, beside any running call: it answers at once
# the baseline weight travels as float32: outside its normal range it would arrive as 0, a subnormal or inf
_WEIGHT_MIN, _WEIGHT_MAX = 1.1754943508222875e-38, 3.4028234663852886e38


class TrainerError(RuntimeError):
    """A trainer call failed; `rank` says where, `host` on which host that rank ran ("name (address)", as it
    registered; "" when unknown), `cause` is the RpcError / ConnectionError / TimeoutError, and `kind` the
    trainer's error type (train/errors.py) when the rank raised one of ours, else None. The message names the host,
    so a run that loses a rank on another node says which node went away."""

    def __init__(self, method: str, rank: int, cause: BaseException, host: str = "") -> None:
        what = f"{cause.remote_type}: {cause.remote_message}" if isinstance(cause, RpcError) else repr(cause)
        super().__init__(f"trainer rank {rank}{f' on {host}' if host else ''}: {method} failed: {what}")
        self.method = method
        self.rank = rank
        self.host = host
        self.cause = cause
        self.kind: type[TrainerFailure] | None = _kind(cause)
        # ranks that had not answered when the call gave up on them (busy, perhaps stuck in a collective)
        self.unanswered: list[int] = []

    @property
    def bad_input(self) -> bool:
        """The trainer rejected the batch (nothing was trained): the caller's data is at fault."""
        return self.kind is not None and issubclass(self.kind, BatchError)


def _kind(exc: BaseException) -> type[TrainerFailure] | None:
    return kind_of(exc.remote_type) if isinstance(exc, RpcError) else None


def _lost(exc: BaseException) -> bool:
    """Contact with the rank was lost (its process died, or its host went away): not an error it answered with."""
    return isinstance(exc, ConnectionError)


def _secondhand(exc: BaseException) -> bool:
    """The rank only heard that another rank failed (a Peer* error): not where the problem is."""
    kind = _kind(exc)
    return kind is not None and issubclass(kind, PeerFailure)


def validate_trajectories(trajs: list[Trajectory]) -> None:
    """Shape checks (and the baseline weight, when given) before anything is sent: a clear ValueError naming the
    trajectory, nothing trained."""
    if not trajs:
        raise ValueError("train_step needs at least one trajectory")
    for i, t in enumerate(trajs):
        n = len(t.input_ids)
        if n < 2:
            raise ValueError(f"trajectory {i}: needs at least 2 tokens, has {n}")
        for field in ("loss_mask", "logprobs", "versions"):
            if len(getattr(t, field)) != n:
                raise ValueError(f"trajectory {i}: len({field})={len(getattr(t, field))} != len(input_ids)={n}")
        if t.loss_mask[0]:
            raise ValueError(f"trajectory {i}: loss_mask[0] must be 0 (the first token has no context)")
        if EPISODE_WEIGHT_KEY in t.info:
            _check_weight(i, t.info[EPISODE_WEIGHT_KEY])
    if sum(t.response_len for t in trajs) == 0:
        raise ValueError("no trajectory has a trainable token (loss_mask is all 0)")


def _check_weight(i: int, w: object) -> None:
    """info["episode_weight"] is the trajectory's weight in its group's baseline (train/advantages.py)."""
    where = f"trajectory {i}: info[{EPISODE_WEIGHT_KEY!r}]"
    if isinstance(w, bool) or not isinstance(w, (int, float)):
        raise ValueError(f"{where} must be a number, got {type(w).__name__} {w!r}")
    if not math.isfinite(w) or w <= 0:
        raise ValueError(f"{where} must be finite and > 0, got {w!r}")
    if not _WEIGHT_MIN <= w <= _WEIGHT_MAX:
        raise ValueError(
            f"{where}={w!r} is outside the float32 range [{_WEIGHT_MIN:.3g}, {_WEIGHT_MAX:.3g}] it travels in"
        )


def split_by_rank(trajs: list[Trajectory], world_size: int) -> list[list[Trajectory]]:
    """Whole prompt groups per rank, balanced by total tokens; within a rank, groups keep their batch order."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trajs):
        groups.setdefault(t.group_id, []).append(i)
    members = list(groups.values())
    tokens = [sum(len(trajs[i].input_ids) for i in m) for m in members]
    return [
        [trajs[i] for g in rank_groups for i in members[g]] for rank_groups in balance_across_ranks(tokens, world_size)
    ]


class TrainerGroup:
    """Connected clients of all trainer ranks. Create with `await TrainerGroup.connect(...)`."""

    def __init__(self, clients: list[RpcClient], infos: list[TrainerInfo], hosts: list[str] | None = None) -> None:
        self.clients = clients
        self.infos = infos
        # where each rank runs, "node (address)" from its rank file: what a failure names
        self.hosts = hosts if hosts is not None else [""] * len(clients)
        self._lock = asyncio.Lock()
        self._broadcast_plan: dict[tuple[str, int], WeightPlan] = {}
        # a call the caller gave up on (cancelled: Ctrl-C, a failed run) that the ranks may still be running: they
        # serve calls one at a time, so a later call (shutdown included) would only queue behind it
        self.abandoned: str | None = None
        # url -> why, for the members the last `broadcast_weights` lost (they failed a bucket): a caller that forms
        # weight-update groups leaves them out of the next one
        self.broadcast_failures: dict[str, str] = {}

    @property
    def world_size(self) -> int:
        return len(self.clients)

    @property
    def version(self) -> int:
        """The trainers' version as last reported (after connect, train_step or load_checkpoint)."""
        return self.infos[0].version

    # ---- connecting ----

    @classmethod
    async def connect(
        cls,
        run_dir: str,
        world_size: int,
        secret: bytes,
        timeout: float = 600.0,
        *,
        unreachable_s: float | None = None,
    ) -> TrainerGroup:
        """Wait for every `{run_dir}/trainer/rank{r}.json`, connect and authenticate, and check each rank's
        identity. `timeout` covers model loading on the ranks. A rank file left by an earlier job is retried
        until the new one replaces it. `unreachable_s`: a rank whose host answers nothing at the TCP level for that
        long (cut off, powered off) fails the call in progress with a ConnectionError naming the rank and its host
        (net/rpc_connection.py, `drop_when_unreachable`); a rank that is only busy or stopped never does."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        clients: list[RpcClient] = []
        hosts: list[str] = []
        try:
            for rank in range(world_size):
                client, host = await _connect_rank(run_dir, rank, world_size, secret, deadline)
                clients.append(client)
                hosts.append(host)
                if unreachable_s is not None:
                    client.drop_when_unreachable(unreachable_s)
            infos = await asyncio.gather(*(c.call("info", Empty(), TrainerInfo, timeout=30.0) for c in clients))
        except BaseException:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
            raise
        for rank, info in enumerate(infos):
            if info.rank != rank or info.world_size != world_size:
                await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
                raise ConnectionError(
                    f"{run_dir}: rank file {rank} leads to rank {info.rank} of {info.world_size}"
                    f" (expected {rank} of {world_size}); a stale job?"
                )
        return cls(clients, list(infos), hosts)

    # ---- fan-out ----

    async def _call(
        self,
        method: str,
        requests: list[Any] | Any,
        response_type: type[T],
        *,
        ranks: list[int] | None = None,
        timeout: float | None = None,
    ) -> list[T]:
        """Call `method` on `ranks` (default all) concurrently; one request per rank or the same for all."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        reqs = requests if isinstance(requests, list) else [requests] * len(ranks)
        tasks = [
            asyncio.ensure_future(self.clients[r].call(method, q, response_type, timeout=timeout))
            for r, q in zip(ranks, reqs)
        ]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            # asyncio.wait leaves its tasks running: cancel them here, or closing the clients later fails each
            # with "client closed", an exception nobody retrieves (printed as a traceback at exit)
            if not all(t.done() for t in tasks):
                self.abandoned = method
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        unanswered: list[int] = []
        if pending:  # a rank failed: the others usually fail too (they agree on errors); give them a moment
            lost = any(_lost(t.exception()) for t in done if not t.cancelled() and t.exception() is not None)
            _, pending = await asyncio.wait(pending, timeout=_LOST_GRACE_S if lost else _ERROR_GRACE_S)
            unanswered = [r for r, t in zip(ranks, tasks) if t in pending]
            for t in pending:
                t.cancel()
        failures = [
            (r, t.exception())
            for r, t in zip(ranks, tasks)
            if t.done() and not t.cancelled() and t.exception() is not None
        ]
        if failures:
            # a rank we lost contact with (the others only saw it leave a collective), else the rank that found the
            # problem rather than one that only heard about it
            primary = [f for f in failures if _lost(f[1])] or [f for f in failures if not _secondhand(f[1])] or failures
            rank, exc = primary[0]
            error = TrainerError(method, rank, exc, self.hosts[rank] if rank < len(self.hosts) else "")
            error.unanswered = unanswered
            raise error from exc
        return [t.result() for t in tasks]

    async def info(self) -> list[TrainerInfo]:
        self.infos = await self._call("info", Empty(), TrainerInfo, timeout=60.0)
        return self.infos

    async def train_step(self, trajectories: list[Trajectory], policy_version: int) -> TrainStepResult:
        """One train step on the whole batch. `policy_version` is the trainers' current version (v); the result
        carries v + 1 and the global stats. Raises ValueError for a malformed batch (nothing sent), TrainerError
        if a rank fails (`.bad_input` when the trainers rejected the data)."""
        validate_trajectories(trajectories)
        shards = split_by_rank(trajectories, self.world_size)
        total_resp = sum(t.response_len for t in trajectories)
        batches = [
            TrainStepRequest(batch=pack_trajectories(s, policy_version, total_resp, len(trajectories))) for s in shards
        ]
        async with self._lock:
            # the line that says a step is under way (what a signal sent "during a step" waits for)
            log.info(
                "train step %d -> %d: %d trajectories to %d rank(s)",
                policy_version,
                policy_version + 1,
                len(trajectories),
                self.world_size,
            )
            results = await self._call("train_step", batches, TrainStepResult)
        versions = {r.version for r in results}
        if len(versions) != 1:
            raise RuntimeError(f"trainer ranks disagree on the version after the step: {sorted(versions)}")
        for info in self.infos:
            info.version = results[0].version
        return results[0]

    async def publish(self, version: int, root: str, keep: int = 2) -> PublishResult:
        """Write `root/v<version>` as an HF checkpoint (atomic; older versions beyond `keep` removed)."""
        async with self._lock:
            results = await self._call("publish", PublishRequest(version=version, root=root, keep=keep), PublishResult)
        return results[0]

    async def publish_delta(
        self,
        version: int,
        root: str,
        keep: int = 2,
        *,
        served_dtype: str = "float32",
        force_full: bool = False,
        identity: bool = True,
    ) -> DeltaPublishResult:
        """Write `root/v<version>` as a full snapshot or a delta (train.delta_sync; train/delta_publish.py), or
        with train.lora as the adapters, and return the identity of what it holds as served in `served_dtype`
        (`identity=False`, adapters only: none, for servers that apply adapters per request)."""
        req = DeltaPublishRequest(
            version=version, root=root, keep=keep, served_dtype=served_dtype, force_full=force_full, identity=identity
        )
        async with self._lock:
            results = await self._call("publish_delta", req, DeltaPublishResult)
        return results[0]

    async def identity(self, served_dtype: str = "float32") -> Identity:
        """The identity of the weights the trainers hold now, as served in `served_dtype` (a gather)."""
        async with self._lock:
            results = await self._call("identity", IdentityRequest(served_dtype=served_dtype), Identity)
        return results[0]

    async def save_checkpoint(self, path: str) -> CheckpointResult:
        async with self._lock:
            return (await self._call("save_checkpoint", CheckpointRequest(path=path), CheckpointResult))[0]

    async def load_checkpoint(self, path: str) -> CheckpointResult:
        async with self._lock:
            result = (await self._call("load_checkpoint", CheckpointRequest(path=path), CheckpointResult))[0]
        for info in self.infos:
            info.version = result.version
        return result

    # ---- weight broadcast ----

    async def weight_plan(self, bucket_bytes: int = 256 << 20) -> WeightPlan:
        """How `broadcast` will bucket the weights (asked of rank 0; no collective)."""
        async with self._lock:
            return (
                await self._call("weight_plan", WeightPlanRequest(bucket_bytes=bucket_bytes), WeightPlan, ranks=[0])
            )[0]

    async def init_broadcast(self, req: InitBroadcastRequest) -> None:
        """Trainer side of the group (rank 0 joins; blocks until the servers join too)."""
        async with self._lock:
            await self._call("init_broadcast", req, Empty)

    async def broadcast(self, req: BroadcastRequest) -> BroadcastResult:
        """Trainer side of one weight broadcast (servers must be receiving concurrently)."""
        async with self._lock:
            return (await self._call("broadcast", req, BroadcastResult))[0]

    async def open_broadcast(self, req: OpenBroadcastRequest) -> BroadcastEndpoint:
        """Trainer rank 0 hosts the group's rendezvous store and says where (its TrainerInfo.host, the port)."""
        async with self._lock:
            return (await self._call("open_broadcast", req, BroadcastEndpoint, ranks=[0]))[0]

    async def init_broadcast_group(
        self,
        servers: WeightReceivers,
        *,
        num_server_ranks: int,
        ranks_per_server: int | list[int] = 1,
        master_address: str | None = None,
        master_port: int | None = None,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> BroadcastEndpoint:
        """Trainer rank 0 and every server rank form one group: rank 0 hosts the store first, then both sides'
        rendezvous run concurrently. The address defaults to the one rank 0 reports (TrainerInfo.host: loopback
        for a trainer serving 127.0.0.1, a routable address for one on all interfaces, or AREAL_TRAINER_ADDRESS),
        the port to a free one rank 0 binds; pass either to override (the address must reach rank 0's host from
        every server). Returns where the group met."""
        world_size = 1 + num_server_ranks
        endpoint = await self.open_broadcast(
            OpenBroadcastRequest(group_name=group_name, world_size=world_size, port=master_port or 0)
        )
        address = master_address or endpoint.address
        req = InitBroadcastRequest(
            master_address=address,
            master_port=endpoint.port,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        await both(
            self.init_broadcast(req),
            servers.init_weights_update_group(
                address, endpoint.port, ranks_per_server=ranks_per_server, group_name=group_name, backend=backend
            ),
        )
        return BroadcastEndpoint(address=address, port=endpoint.port)

    async def abort_broadcast(self, group_name: str, reason: str = "") -> bool:
        """Ask trainer rank 0 to abort weight-update group `group_name` now, beside the broadcast call it may be
        running (not under the call lock, which that call holds): rank 0 stops sending, the call ends with a
        BroadcastError, and the other ranks finish their gathers. Returns whether a broadcast was running; never
        raises for a rank that cannot be reached (the broadcast's own deadline still ends it then)."""
        try:
            answer = await self.clients[0].call(
                "abort_broadcast",
                AbortBroadcastRequest(group_name=group_name, reason=reason),
                AbortBroadcastResult,
                timeout=_ABORT_TIMEOUT_S,
            )
        except (TimeoutError, RpcError, ConnectionError, OSError) as e:
            log.warning("could not abort weight-update group %s on trainer rank 0: %s", group_name, e)
            return False
        return answer.running

    async def prepare_delta_broadcast(self, version: int, served_dtype: str) -> DeltaBroadcastPlan:
        """The delta broadcast of `version` (train/delta_broadcast.py; a gather on every rank)."""
        req = DeltaBroadcastPrepare(version=version, served_dtype=served_dtype)
        async with self._lock:
            return (await self._call("prepare_delta_broadcast", req, DeltaBroadcastPlan))[0]

    async def broadcast_delta(
        self, servers: WeightReceivers, plan: DeltaBroadcastPlan, *, group_name: str, flush_cache: bool = True
    ) -> BroadcastResult:
        """Send a prepared delta (one bucket of payloads) to the group's members, each of which checks its base
        and the result before it swaps anything in. A member that refuses is left part-way like one that failed
        a bucket: it leaves rotation and catches up with a full load (`broadcast_failures`)."""
        assert plan.identity is not None
        if plan.kind == "adapter":  # train.lora: the servers merge the adapters (server/lora_load.py)
            extra: dict = {"lora": {"r": plan.lora_rank, "lora_alpha": plan.lora_alpha}}
        else:
            extra = {
                "delta": {"dtype": plan.identity.dtype, "base": plan.base_combined, "result": plan.identity.combined}
            }
        req = BroadcastRequest(version=plan.version, group_name=group_name, bucket_bytes=0)
        members_of = getattr(servers, "weight_group_members", None)
        members = list(members_of(group_name)) if members_of is not None else []
        self.broadcast_failures = {}

        async def send() -> BroadcastResult:
            async with self._lock:
                return (
                    await self._call(
                        "send_delta", DeltaSendRequest(group_name=group_name, version=plan.version), BroadcastResult
                    )
                )[0]

        one = WeightPlan(buckets=[plan.spec], num_bytes=plan.num_bytes)
        return await broadcast_to_members(self, servers, members, one, req, flush_cache, send=send(), extra=extra)

    async def broadcast_weights(
        self,
        servers: WeightReceivers,
        version: int,
        *,
        group_name: str = "weight_update_group",
        bucket_bytes: int = 256 << 20,
        flush_cache: bool = True,
    ) -> BroadcastResult:
        """Send the current weights to every server as `version`: one trainer broadcast, and per bucket one
        /update_weights_from_distributed call per member, in the order the trainer sends them. Only the last bucket
        carries `version` and `flush_cache`, so no server labels weights v+1 (or drops its cache) before it has all
        of them; pause generation around the call, or requests between buckets run on a mix of v and v+1.

        When `servers` names the group's members, each member has a receive loop of its own, so one member's
        failure is seen at once, not when the bucket's slowest member returns (with nccl, the others wait in that
        bucket for the failed member forever). At a member's first failure its loop ends (its next receives would
        pair with the rest of the failed bucket's sends) and, while the trainer is still sending, rank 0 is told to
        abort the group and no member gets another bucket: the call then raises the trainer's TrainerError (a
        BroadcastError) within moments, not at the per-bucket deadline. Every member left part-way holds a mix of
        versions and leaves rotation; the failed ones are in `broadcast_failures` for the next group to leave out.
        A member failure after the trainer finished fails only that member, as before."""
        plan = self._broadcast_plan.get((group_name, bucket_bytes))
        if plan is None:  # the layout never changes: ask once per (group, bucket size)
            plan = self._broadcast_plan[(group_name, bucket_bytes)] = await self.weight_plan(bucket_bytes)
        req = BroadcastRequest(version=version, group_name=group_name, bucket_bytes=bucket_bytes)
        members_of = getattr(servers, "weight_group_members", None)
        members = members_of(group_name) if members_of is not None else None
        self.broadcast_failures = {}
        if members is None:  # receivers that do not say who is in the group: one fan-out per bucket
            result, _ = await both(self.broadcast(req), receive_all(servers, plan, version, group_name, flush_cache))
        else:
            result = await broadcast_to_members(self, servers, list(members), plan, req, flush_cache)
        if result.buckets != plan.buckets:
            raise RuntimeError("the trainer broadcast a different weight layout than it announced")
        return result

    # ---- lifecycle ----

    async def shutdown(self) -> None:
        """Ask every rank to exit (after any call in progress), then close the connections. After an abandoned
        call (see `abandoned`) the ranks are still busy with it and would take the request only once it ends, which
        for a long train step is minutes: then only the connections close, and the launcher stops the processes."""
        if self.abandoned is not None:
            log.info(
                "not asking the trainer ranks to exit: they are still running the abandoned %s call; the "
                "launcher stops them",
                self.abandoned,
            )
            await self.close()
            return
        async with self._lock:
            try:
                await self._call("shutdown", Empty(), Empty, timeout=120.0)
            except TrainerError as e:
                if not isinstance(e.cause, ConnectionError):
                    raise
            finally:
                await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    async def __aenter__(self) -> TrainerGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _host_of(meta: dict[str, Any]) -> str:
    """Where a rank runs, from its rank file: "node (address)", either alone when the other is missing."""
    node = str(meta.get("node") or "")
    address = str(meta.get("address") or "").removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if node and address and node != address:
        return f"{node} ({address})"
    return node or address


async def _connect_rank(
    run_dir: str, rank: int, world_size: int, secret: bytes, deadline: float
) -> tuple[RpcClient, str]:
    loop = asyncio.get_running_loop()
    path = rank_file(run_dir, rank)
    last_error: BaseException | None = None
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise ConnectionError(f"trainer rank {rank} did not come up: {path}: {last_error or 'no rank file'}")
        try:
            with open(path) as f:
                meta = json.load(f)
            if meta.get("world_size") != world_size:
                raise ConnectionError(f"world_size {meta.get('world_size')} in the rank file, expected {world_size}")
            client = await RpcClient.connect(meta["address"], secret, timeout=min(remaining, 5.0))
            return client, _host_of(meta)
        except RpcAuthError:  # the rank is up and refused our secret: retrying will not help
            raise
        except (FileNotFoundError, json.JSONDecodeError, KeyError, ConnectionError, OSError) as e:
            last_error = e
        await asyncio.sleep(min(0.2, max(deadline - loop.time(), 0)))
