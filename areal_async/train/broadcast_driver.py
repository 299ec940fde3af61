"""The controller's side of one weight broadcast to the inference servers: the trainer ranks send each bucket
(`TrainerGroup.broadcast`) while the servers receive it (`WeightReceivers`, which `InferenceClient` fits): one fan-out
per bucket, or one receive loop per group member, with the trainer's send aborted at a member's first failure.

Apart from train/client.py because it is its own protocol, between two parties the client only connects: the
trainer side is train/broadcast.py, the server side the /update_weights_from_distributed route. `TrainerGroup`
(`broadcast_weights`, `init_broadcast_group`) drives it with these. Torch-free, like the client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from areal_async.train.messages import WeightPlan
from areal_async.types import BroadcastRequest, BroadcastResult

__all__ = ["BroadcastIncomplete", "BroadcastSender", "WeightReceivers", "both", "broadcast_to_members", "receive_all"]

# the broadcast's log lines keep the name they had when this was part of train/client.py
log = logging.getLogger("areal_async.train.client")


class BroadcastSender(Protocol):
    """What the broadcast uses of the trainer side (train/client.py's `TrainerGroup`): named here, so that client.py
    imports this module and not the other way round."""

    broadcast_failures: dict[str, str]  # url -> why, the members the last broadcast left part-way

    async def broadcast(self, req: BroadcastRequest) -> BroadcastResult: ...

    async def abort_broadcast(self, group_name: str, reason: str = "") -> bool: ...


class WeightReceivers(Protocol):
    """What broadcast needs of the inference side: `inference.client.InferenceClient` fits.

    Two more methods are used when present (InferenceClient has both): `weight_group_members(group_name)`, the
    servers that joined the group (then each member gets a receive loop of its own, see `broadcast_weights`), and
    `weights_update_abandoned(errors)`, told of the members a broadcast left part-way (url -> why)."""

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        *,
        ranks_per_server: int | list[int] = 1,
        group_name: str = ...,
        backend: str = ...,
    ) -> Any: ...

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None,
        *,
        group_name: str = ...,
        flush_cache: bool = ...,
        abort_all_requests: bool = ...,
        urls: list[str] | None = ...,
    ) -> Any: ...

    # version None: the bucket carries no weight_version (the server keeps its label until the last bucket)


class BroadcastIncomplete(RuntimeError):
    """The trainer sent every bucket, but members stopped short: their receive loops ended when another member
    failed and the broadcast was being aborted. `incomplete`: url -> why; those servers left rotation."""

    def __init__(self, message: str, incomplete: dict[str, str]) -> None:
        super().__init__(message)
        self.incomplete = incomplete


async def receive_all(
    servers: WeightReceivers, plan: WeightPlan, version: int, group_name: str, flush_cache: bool
) -> None:
    """Every bucket to every server in one fan-out per bucket (receivers that do not say who is in the group)."""
    last = len(plan.buckets) - 1
    for i, spec in enumerate(plan.buckets):
        await servers.update_weights_from_distributed(
            spec.names,
            spec.dtypes,
            spec.shapes,
            version if i == last else None,
            group_name=group_name,
            flush_cache=flush_cache and i == last,
        )


async def broadcast_to_members(
    group: BroadcastSender,
    servers: WeightReceivers,
    members: list[str],
    plan: WeightPlan,
    req: BroadcastRequest,
    flush_cache: bool,
    *,
    send: Awaitable[BroadcastResult] | None = None,
    extra: dict[str, Any] | None = None,
) -> BroadcastResult:
    """The trainer's broadcast beside one receive loop per member (see `TrainerGroup.broadcast_weights`).
    `send`: the trainer's side when it is not `group.broadcast(req)` (a prepared delta); `extra`: fields added to
    every bucket's announcement (the delta's base and result)."""
    n = len(plan.buckets)
    received = {u: 0 for u in members}  # buckets each member has taken
    failures: dict[str, BaseException] = {}
    gone: set[str] = set()  # members removed from the client during the update
    stopped = False  # set once rank 0 is being aborted: no member gets another bucket
    abort: asyncio.Future | None = None
    trainer = asyncio.ensure_future(send if send is not None else group.broadcast(req))
    more = {"extra": extra} if extra else {}

    def failed(url: str, bucket: int, error: BaseException) -> None:
        nonlocal stopped, abort
        if abort is not None and abort.done():
            # after rank 0 stopped: a consequence of the abort (the group went away under this member's
            # receive), not a failure of its own; it is left part-way, and may join the next group
            log.info(
                "weight broadcast of version %d: %s stopped in bucket %d after the abort: %s",
                req.version,
                url,
                bucket,
                error,
            )
            return
        failures[url] = error
        log.warning("weight broadcast of version %d: %s failed bucket %d of %d: %s", req.version, url, bucket, n, error)
        if abort is None and not trainer.done():
            stopped = True
            abort = asyncio.ensure_future(
                group.abort_broadcast(req.group_name, f"inference server {url} failed bucket {bucket} of {n}: {error}")
            )

    async def receive(url: str) -> None:
        for i, spec in enumerate(plan.buckets):
            if stopped:
                return
            last = i == n - 1
            try:
                answer = await servers.update_weights_from_distributed(
                    spec.names,
                    spec.dtypes,
                    spec.shapes,
                    req.version if last else None,
                    group_name=req.group_name,
                    flush_cache=flush_cache and last,
                    urls=[url],
                    **more,
                )
                outcome = answer.get(url) if isinstance(answer, dict) else None
                if not isinstance(answer, dict) or url not in answer:
                    outcome = RuntimeError(f"{url} is no longer one of the inference servers")
            except Exception as e:  # AdminError ("failed on every server": its only one): that server's error
                results = getattr(e, "results", None)
                outcome = (
                    results[url] if isinstance(results, dict) and isinstance(results.get(url), BaseException) else e
                )
            if isinstance(outcome, BaseException):
                known = getattr(servers, "urls", None)
                if isinstance(known, list) and url not in known:
                    # removed from the client meanwhile (a server leaving is drained, then forgotten): a leave,
                    # not a failure; as before, the others go on and the next update forms a group without it
                    log.info("weight broadcast of version %d: %s left during bucket %d", req.version, url, i)
                    gone.add(url)
                    return
                failed(url, i, outcome)
                return
            received[url] = i + 1

    loops = [asyncio.ensure_future(receive(u)) for u in members]
    try:
        result = await trainer
        await asyncio.gather(*loops)  # the trainer sent everything: each member's receives can complete
    finally:
        for t in loops:  # after a trainer failure no member's pending receive can complete
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        if abort is not None:
            await asyncio.gather(abort, return_exceptions=True)
        left = {
            u: failures.get(u) or RuntimeError(f"the broadcast stopped after {received[u]} of {n} buckets")
            for u in members
            if received[u] < n
        }
        group.broadcast_failures = {u: str(e) for u, e in failures.items()}
        abandoned = getattr(servers, "weights_update_abandoned", None)
        if left and abandoned is not None:
            abandoned(left)
    short = {u: str(e) for u, e in left.items() if u not in failures and u not in gone}
    if short:
        raise BroadcastIncomplete(
            f"weight broadcast of version {req.version}: {len(failures)} member(s) failed"
            f" and {len(short)} stopped short of the last bucket",
            short,
        )
    return result


async def both(a, b) -> tuple[Any, Any]:
    """Run two awaitables concurrently; if either fails, cancel the other and raise."""
    ta, tb = asyncio.ensure_future(a), asyncio.ensure_future(b)
    done, pending = await asyncio.wait([ta, tb], return_when=asyncio.FIRST_EXCEPTION)
    for t in done:
        if t.exception() is not None:
            for p in pending:
                p.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            raise t.exception()
    return ta.result(), tb.result()
