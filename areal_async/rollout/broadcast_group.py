"""Broadcast weight sync whose process group follows the servers: a lost, restarted or new server, or a restarted
trainer job, makes the next update form a new group first.

A torch.distributed group has a fixed membership: once a server in it dies, a broadcast to the group fails (gloo:
"Connection closed by peer"; nccl would hang), and a restarted server cannot rejoin it. So before each update the
members are compared with the servers the client can reach (serving, or up and catching up); on a difference, or
after a failed broadcast, trainer rank 0 and those servers form a new group under a new name (a server keeps its
old groups: SGLang and the embedded server refuse to reuse a name) on a fresh port, and the update goes through it.

A server that comes back between updates holds the launch weights; broadcast weights have no checkpoint, so
`publish_current` (the client's `weight_source`) has the trainers publish one of the version the servers must hold,
when the trainers still hold it (right after a train step they are one version ahead: the catch-up is retried,
and the next update's new group brings the server along anyway).

A broadcast that fails halfway with several trainer ranks leaves the other ranks in FSDP all-gathers rank 0 will
not join: that is a trainer failure (`TrainerLost`, the run rolls back). With one rank the group is re-formed and
the update sent again. No torch here.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

log = logging.getLogger(__name__)

BASE_GROUP = "weight_update_group"


class _Members:
    """The client's two broadcast calls, with group membership limited to `urls`."""

    def __init__(self, client: Any, urls: list[str]) -> None:
        self.client = client
        self.urls = urls

    async def init_weights_update_group(self, master_address: str, master_port: int, **kw: Any) -> Any:
        return await self.client.init_weights_update_group(master_address, master_port, urls=self.urls, **kw)

    async def update_weights_from_distributed(self, *args: Any, **kw: Any) -> Any:
        return await self.client.update_weights_from_distributed(*args, **kw)


class RegroupingBroadcastSync:
    """A `WeightSync` (weight_sync.py) over broadcast. `form()` before the first update (connect_weights does),
    `set_trainers` after the trainer job was replaced."""

    latest_checkpoint: str | None = None

    def __init__(self, trainers: Any, client: Any, master_address: str, *, ranks_per_server: int, backend: str,
                 free_port: Callable[[], int], catch_up_root: str, max_attempts: int = 2) -> None:
        self.trainers = trainers
        self.client = client
        self.master_address = master_address
        self.ranks_per_server = ranks_per_server
        self.backend = backend
        self.free_port = free_port
        self.catch_up_root = catch_up_root
        self.max_attempts = max_attempts
        self.generation = 0
        self.group_name = BASE_GROUP
        self.members: list[str] = []
        self.regroups = 0  # groups formed after the first one

    def set_trainers(self, trainers: Any) -> None:
        """A new trainer job: it is in no group yet."""
        self.trainers = trainers
        self.members = []

    def _reachable(self) -> list[str]:
        states = self.client.stats()["servers"]
        return [u for u in self.client.urls if states.get(u, {}).get("state") in ("serving", "syncing")]

    async def form(self) -> None:
        """Trainer rank 0 and every reachable server form a new group (blocks until all have joined)."""
        urls = self._reachable()
        if not urls:
            raise RuntimeError("no inference server is reachable to form a weight broadcast group with")
        self.generation += 1
        name = BASE_GROUP if self.generation == 1 else f"{BASE_GROUP}_{self.generation}"
        await self.trainers.init_broadcast_group(_Members(self.client, urls), self.master_address, self.free_port(),
                                                 num_server_ranks=self.ranks_per_server * len(urls),
                                                 ranks_per_server=self.ranks_per_server, group_name=name,
                                                 backend=self.backend)
        if self.generation > 1:
            self.regroups += 1
            log.warning("weight broadcast group %s formed with %s (was %s)", name, urls, self.members or "none")
        self.group_name, self.members = name, urls

    async def prepare(self, version: int) -> None:
        del version

    async def apply(self, version: int, *, flush_cache: bool) -> None:
        from areal_async.launch.recovery import TrainerLost
        from areal_async.train.client import TrainerError

        for attempt in range(1, self.max_attempts + 1):
            if self._reachable() != self.members:
                await self.form()
            try:
                await self.trainers.broadcast_weights(self.client, version, group_name=self.group_name,
                                                      flush_cache=flush_cache)
                return
            except TrainerError as e:
                if e.bad_input:
                    raise
                if self.trainers.world_size > 1:
                    raise TrainerLost(f"the weight broadcast of version {version} failed ({e}); with "
                                      f"{self.trainers.world_size} trainer ranks the others may be stuck in a "
                                      "collective") from e
                if attempt == self.max_attempts:
                    raise
                log.warning("weight broadcast of version %d failed (%s): forming a new group and sending again",
                            version, str(e).splitlines()[0])
                self.members = []

    async def publish_current(self, version: int) -> str:
        """The client's `weight_source`: an HF checkpoint of `version` for a server that came back."""
        held = self.trainers.version
        if held != version:
            raise RuntimeError(f"the trainers hold version {held}, not {version} (an update is under way)")
        pub = await self.trainers.publish(version, os.path.join(self.catch_up_root), keep=1)
        return pub.path
