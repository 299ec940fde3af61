"""Broadcast weight sync whose torch.distributed group follows the fleet: `ElasticBroadcastSync`, the transport
`train.weight_sync=broadcast` uses (`connect_weights`). A process group cannot grow or shrink, so when the
servers that should receive the weights change (one joins, leaves, dies, hangs or comes back) the next update forms
a new group under a new name; broadcast_group.py plans each group's ranks and backend. How it fits with disk sync,
the interrupt modes and versions: docs/weights.md. No torch here (the trainer ranks and the servers hold the group).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

from areal_async.rollout.broadcast_group import plan_group
from areal_async.rollout.outcomes import TrainerLost
from areal_async.train.client import BroadcastIncomplete, TrainerError
from areal_async.train.errors import BroadcastError

__all__ = ["ElasticBroadcastSync"]

log = logging.getLogger(__name__)


class _Members:
    """The client's two broadcast calls, with the group's membership limited to `urls`."""

    def __init__(self, client: Any, urls: tuple[str, ...]) -> None:
        self.client = client
        self.urls = list(urls)

    async def init_weights_update_group(self, master_address: str, master_port: int, **kw: Any) -> Any:
        return await self.client.init_weights_update_group(master_address, master_port, urls=self.urls, **kw)

    async def update_weights_from_distributed(self, *args: Any, urls: list[str] | None = None, **kw: Any) -> Any:
        """One bucket to the members, or to `urls` among them (the trainer gives each member a loop of its own)."""
        targets = self.urls if urls is None else [u for u in urls if u in self.urls]
        return await self.client.update_weights_from_distributed(*args, urls=targets, **kw)

    def weight_group_members(self, group_name: str) -> list[str]:
        del group_name  # this view is of one group
        return list(self.urls)

    def weights_update_abandoned(self, errors: dict[str, BaseException]) -> None:
        self.client.weights_update_abandoned(errors)


def _ranks_agreed(error: Any) -> bool:
    """Every trainer rank answered a failed broadcast with a BroadcastError (rank 0's, the others' Peer twin):
    rank 0 stopped sending and still took part in every gather, so no rank is stuck in a collective and the
    broadcast can be retried on a new group. A rank that did not answer, or another kind of error, may be stuck."""
    kind = getattr(error, "kind", None)
    return kind is not None and issubclass(kind, BroadcastError) and not getattr(error, "unanswered", [None])


class ElasticBroadcastSync:
    """Broadcast weight sync (trainer rank 0 -> every server) whose group follows the fleet: when the servers that
    should be in it differ from the group's members, the next `apply` first forms a new group under a new name.

    Who should be in it: every server the client knows, except one that is down and was a member (dead, hung or
    being restarted: a group with it would never form, a broadcast to it fails) and a newcomer that stays down for
    `settle_s` (it gets one wait). A server that comes back (restarted under its old URL) holds the launch weights:
    `publish_current`, the client's `weight_source`, has the trainers publish a checkpoint of the version it must
    hold (when they still hold it), and the next update brings it into a new group anyway. A member that failed a
    bucket (TrainerGroup.broadcast_failures) stays out until it is back in rotation. A broadcast that fails (a
    member died or failed a bucket in the middle: the trainer client aborts rank 0's sending at once) forms a new
    group and sends again. With several trainer ranks that holds when every rank answered with a BroadcastError
    (rank 0 stopped sending but finished the FSDP gathers with the others); otherwise the other ranks may be stuck
    in a gather rank 0 left, so it is a trainer failure (`TrainerLost`: the run rolls back). After a trainer
    restart, `set_trainers`: the new job is in no group."""

    latest_checkpoint: str | None = None
    bucketed = True  # rollout/weight_sync.py: never applied without a pause

    def __init__(
        self,
        trainers: Any,
        client: Any,
        master_address: str,
        *,
        ranks_per_server: int,
        backend: str,
        api_key: str | None = None,
        settle_s: float = 10.0,
        catch_up_root: str | None = None,
        max_attempts: int = 2,
        verify: bool = True,
    ) -> None:
        self.trainers = trainers
        self.client = client
        self.master_address = master_address
        self.ranks_per_server = ranks_per_server
        self.backend = backend
        self.api_key = api_key
        self.settle_s = settle_s  # how long a newcomer not yet probed by the client may hold back a new group
        self.catch_up_root = catch_up_root  # where publish_current writes (None: no catch-up checkpoints)
        self.max_attempts = max_attempts
        self.group_name: str | None = None
        self.members: tuple[str, ...] = ()
        self.generation = 0
        self.run_token = secrets.token_hex(4)
        self._waited: set[str] = set()  # newcomers that had their wait
        self._failed: set[str] = set()  # members that failed a bucket of a broadcast (TrainerGroup.broadcast_failures)
        self.verify = verify  # policy identity after every broadcast
        self._served_dtype: str | None = None
        self._delta_off = False  # the trainers said train.delta_sync is off
        self._adapters = False  # the trainers send adapters (train.lora)
        self.stats: dict[str, float] = {
            "identity_check_s": 0.0,
            "identity_mismatches": 0,
            "full_updates": 0,
            "delta_updates": 0,
            "delta_refused": 0,
            "delta_skipped": 0,
            "delta_bytes": 0,
            "full_bytes": 0,
            "changed_elements": 0,
            "total_elements": 0,
        }

    def set_trainers(self, trainers: Any) -> None:
        self.trainers = trainers
        self.members = ()

    def _states(self) -> dict[str, str]:
        return {u: s["state"] for u, s in self.client.stats()["servers"].items()}

    def _targets(self, *, newcomers_down: bool) -> tuple[str, ...]:
        states = self._states()
        # a member that failed a bucket stays out until it is back in rotation (it caught up by other means): alive
        # and reachable, it may well fail the next broadcast the same way, and every member's failure aborts one
        self._failed = {u for u in self._failed if states.get(u) not in (None, "serving")}
        return tuple(
            u
            for u in self.client.urls
            if u not in self._failed
            and (states.get(u) != "down" or (newcomers_down and u not in self.members and u not in self._waited))
        )

    async def form_group(self) -> None:
        members = self._targets(newcomers_down=False)
        if not members:
            raise RuntimeError("no inference server is reachable to form a weight-update group with")
        self.generation += 1
        # unique per run: a persistent server still holding an earlier run's group (same process, same torch
        # group registry) refuses a name it has seen
        name = f"areal-{self.run_token}-{self.generation}"
        # each server's ranks (its tensor-parallel size) and the backend come from the servers (broadcast_group.py)
        plan = await plan_group(
            self.client,
            list(members),
            (getattr(self.trainers, "infos", None) or [None])[0],
            default_ranks=self.ranks_per_server,
            backend=self.backend,
        )
        # rank 0 hosts the group's store on a port it binds itself; the address is the launcher's view of where
        # the servers reach rank 0 (the same host's address for a local run, the trainer node's under Slurm)
        await self.trainers.init_broadcast_group(
            _Members(self.client, members),
            num_server_ranks=plan.num_server_ranks,
            master_address=self.master_address,
            ranks_per_server=plan.ranks,
            group_name=name,
            backend=plan.backend,
        )
        old, self.group_name, self.members = self.group_name, name, members
        log.info(
            "weight-update group %s (%s): trainer rank 0 and %d server(s), %d server rank(s)",
            name,
            plan.backend,
            len(members),
            plan.num_server_ranks,
        )
        if old is not None:
            await self._destroy_on_servers(old, members)

    async def _members_settled(self) -> None:
        """Wait (bounded) until no newcomer the client knows is still 'down' (not probed yet): every member must
        answer the group's rendezvous. A newcomer gets this wait once."""
        new = [u for u in self._targets(newcomers_down=True) if u not in self.members]
        deadline = time.monotonic() + self.settle_s
        while time.monotonic() < deadline:
            states = self._states()
            if all(states.get(u) != "down" for u in new):
                break
            await asyncio.sleep(0.1)
        self._waited.update(new)

    async def _destroy_on_servers(self, name: str, urls: tuple[str, ...]) -> None:
        """The servers leave the old group (the client knows who joined it); an unknown name is no failure."""
        results = await self.client.destroy_weights_update_group(name)
        for url, r in results.items():
            if isinstance(r, BaseException):
                log.warning("%s could not destroy weight-update group %s: %s", url, name, r)

    async def prepare(self, version: int) -> None:
        del version

    async def apply(self, version: int, *, flush_cache: bool) -> None:
        for attempt in range(1, self.max_attempts + 1):
            if self._targets(newcomers_down=True) != self.members:  # a version boundary after the fleet changed
                await self._members_settled()
                await self.form_group()
            try:
                if await self._send_delta(version, flush_cache):
                    return
                await self.trainers.broadcast_weights(
                    self.client, version, group_name=self.group_name, flush_cache=flush_cache
                )
                await self._verify(version)
                return
            except (TrainerError, BroadcastIncomplete) as e:
                if isinstance(e, TrainerError) and e.bad_input:
                    raise
                if self.trainers.world_size > 1 and isinstance(e, TrainerError) and not _ranks_agreed(e):
                    raise TrainerLost(
                        f"the weight broadcast of version {version} failed ({e}); with "
                        f"{self.trainers.world_size} trainer ranks the others may be stuck in a "
                        "collective"
                    ) from e
                if attempt == self.max_attempts:
                    raise
                log.warning(
                    "weight broadcast of version %d failed (%s): forming a new group and sending again",
                    version,
                    str(e).splitlines()[0],
                )
                self.members = ()
            finally:
                self._failed.update(getattr(self.trainers, "broadcast_failures", None) or {})

    async def _takes_deltas(self) -> bool:
        """Every member says it takes a delta (`weights_delta` in /get_server_info: the embedded server)."""
        if not hasattr(self.client, "server_info"):
            return False
        infos = await self.client.server_info(list(self.members))
        return bool(infos) and all(isinstance(i, dict) and i.get("weights_delta") for i in infos.values())

    async def _send_delta(self, version: int, flush_cache: bool) -> bool:
        """With train.delta_sync: prepare the delta of `version` and send it (True), or say a full broadcast is
        due (False: delta sync off, no base yet, a member that cannot take one). A member that refuses the delta
        (its base is not the trainer's) leaves rotation and catches up with a full load (weight_source); a member
        known beforehand not to hold the base (its /weights_fingerprint) makes the version go in full."""
        if self._delta_off or not hasattr(self.trainers, "prepare_delta_broadcast"):
            return False
        if not await self._takes_deltas():
            return False
        plan = await self.trainers.prepare_delta_broadcast(version, await self._served())
        if plan.kind == "off":
            self._delta_off = True
            return False
        if plan.kind == "adapter":
            await self._send_adapter(plan, flush_cache)
            return True
        self.stats["full_bytes"] += plan.full_bytes
        if plan.kind != "delta":
            self.stats["full_updates"] += 1
            return False
        held = await self.client.weights_fingerprints(list(self.members))
        behind = sorted(u for u in self.members if held.get(u) != plan.base_combined)
        if behind:  # a member without the delta's base would refuse it: everyone gets the full weights instead
            log.info("version %d goes in full: %s do not hold the delta's base", version, ", ".join(behind))
            self.stats["full_updates"] += 1
            self.stats["delta_skipped"] += 1
            return False
        await self.trainers.broadcast_delta(
            _Members(self.client, self.members), plan, group_name=self.group_name, flush_cache=flush_cache
        )
        self.stats["delta_updates"] += 1
        self.stats["delta_bytes"] += plan.num_bytes
        self.stats["changed_elements"] += plan.changed
        self.stats["total_elements"] += plan.total
        refused = getattr(self.trainers, "broadcast_failures", None) or {}
        if refused:  # they received it and kept their weights: the version goes again, in full, to the group
            self.stats["delta_refused"] += len(refused)
            log.warning(
                "the delta of version %d was refused (%s): broadcasting it in full",
                version,
                "; ".join(f"{u}: {why}" for u, why in refused.items()),
            )
            return False
        if self.verify and plan.identity is not None:
            t0 = time.perf_counter()
            verdicts = await self.client.verify_weights(plan.identity)
            self.stats["identity_check_s"] += time.perf_counter() - t0
            self.stats["identity_mismatches"] += sum(1 for v in verdicts.values() if not v.ok and not v.unknown)
        return True

    async def _send_adapter(self, plan: Any, flush_cache: bool) -> None:
        """train.lora: the adapters alone, one bucket, merged by every member into the base it keeps. There is no
        full broadcast to fall back to (the trainers' full weights are base + adapters): a member that refuses
        leaves rotation and catches up from the adapter directory `publish_current` writes; when no member serves
        the adapter, the run stops (rollout/weight_sync.py `adapter_reached`)."""
        from areal_async.rollout.weight_sync import adapter_reached

        self._adapters = True
        await self.trainers.broadcast_delta(
            _Members(self.client, self.members), plan, group_name=self.group_name, flush_cache=flush_cache
        )
        self.stats["adapter_updates"] = self.stats.get("adapter_updates", 0) + 1
        self.stats["delta_bytes"] += plan.num_bytes
        self.stats["full_bytes"] += plan.full_bytes
        self.stats["changed_elements"] += plan.changed
        self.stats["total_elements"] += plan.total
        refused = getattr(self.trainers, "broadcast_failures", None) or {}
        if refused:
            log.warning(
                "the adapters of version %d were refused (%s): those servers catch up from disk",
                plan.version,
                "; ".join(f"{u}: {why}" for u, why in refused.items()),
            )
        if self.verify and plan.identity is not None:
            t0 = time.perf_counter()
            verdicts = await self.client.verify_weights(plan.identity)
            self.stats["identity_check_s"] += time.perf_counter() - t0
            self.stats["identity_mismatches"] += sum(1 for v in verdicts.values() if not v.ok and not v.unknown)
            adapter_reached(plan.version, f"broadcast to {', '.join(self.members)}", verdicts)

    async def _served(self) -> str:
        """The servers' dtype (asked once; SGLang's "auto" read as bf16, what it serves these models in)."""
        if self._served_dtype is None:
            infos = await self.client.server_info() if hasattr(self.client, "server_info") else {}
            dtypes = sorted(
                "bfloat16" if i.get("dtype") in (None, "auto") else str(i["dtype"])
                for i in infos.values()
                if isinstance(i, dict)
            )
            self._served_dtype = dtypes[0] if dtypes else "float32"
        return self._served_dtype

    async def _verify(self, version: int) -> None:
        """Policy identity after a broadcast (inference/identity.py): the trainers' digests of what they sent
        (no second gather when the servers serve the dtype sent), checked on every server that took it."""
        if not self.verify or not hasattr(self.trainers, "identity") or not hasattr(self.client, "verify_weights"):
            return
        t0 = time.perf_counter()
        try:
            expected = await self.trainers.identity(await self._served())
        except TrainerError as e:  # the update itself succeeded: an unverified one is reported, not failed
            log.warning("identity of version %d not checked: the trainers could not give it: %s", version, e)
            return
        if expected.version != version:
            log.warning("identity of version %d not checked: the trainers hold version %d", version, expected.version)
            return
        verdicts = await self.client.verify_weights(expected)
        self.stats["identity_check_s"] += time.perf_counter() - t0
        self.stats["identity_mismatches"] += sum(1 for v in verdicts.values() if not v.ok and not v.unknown)

    async def final_adapter(self, version: int) -> str | None:
        """train.lora: an adapter directory of `version` the trainers write now (None: not an adapter run)."""
        if not self._adapters or self.catch_up_root is None or self.trainers.version != version:
            return None
        return await self.publish_current(version)

    async def publish_current(self, version: int) -> str:
        """The client's `weight_source`: an HF checkpoint of `version` for a server that came back."""
        held = self.trainers.version
        if held != version or self.catch_up_root is None:
            raise RuntimeError(f"the trainers hold version {held}, not {version} (an update is under way)")
        if self._adapters:  # train.lora: the adapter directory (a server keeps its base and merges it)
            pub = await self.trainers.publish_delta(
                version, self.catch_up_root, keep=1, served_dtype=await self._served()
            )
            return pub.path
        return (await self.trainers.publish(version, self.catch_up_root, keep=1)).path
