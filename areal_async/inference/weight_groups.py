"""Weight-update groups: the servers joining and leaving the trainer's broadcast group (NCCL) for weight updates.

Apart from client.py because it is one protocol of its own: the rank layout of a group (the trainer is rank 0, each
server's tensor-parallel ranks after those of the servers before it), the blocking join the trainer must meet, and
which servers this client put in which group, so it can leave them (a persistent server can join a later run's
group) and broadcast to the members only. `WeightGroups` is a mixin of `InferenceClient`, whose `_pool`, `_groups`
and `urls` it uses; the broadcast itself is `InferenceClient.update_weights_from_distributed` (fleet.py).
"""

from __future__ import annotations

from typing import Any

from areal_async.inference.errors import InferenceError, raise_if_failed
from areal_async.inference.transport import ServerPool


class WeightGroups:
    """Forming and leaving weight-update groups on the servers."""

    # set by InferenceClient.__init__
    _pool: ServerPool
    _groups: dict[str, list[str]]  # weight-update groups this client formed -> the servers in them
    urls: list[str]

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        *,
        ranks_per_server: int | list[int] = 1,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        urls: list[str] | None = None,
    ) -> dict[str, Any]:
        """Every server (or those in `urls`: a group re-formed after a server was lost) joins the trainer's
        broadcast group. The trainer is rank 0; server i's ranks start after the ranks of servers 0..i-1
        (`ranks_per_server` = each server's tensor-parallel size). The calls block until the trainer joins too, so
        they run concurrently; the trainer must join while this is pending."""
        urls = self.urls if urls is None else [u.rstrip("/") for u in urls]
        per = [ranks_per_server] * len(urls) if isinstance(ranks_per_server, int) else list(ranks_per_server)
        if len(per) != len(urls) or min(per) < 1:
            raise ValueError("ranks_per_server must be >= 1 for each server")
        offsets = [1 + sum(per[:i]) for i in range(len(per))]
        world_size = 1 + sum(per)

        def payload(i: int, _url: str) -> dict:
            return {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": offsets[i],
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }

        servers = [self._pool.router.servers[u] for u in urls]
        results = await self._pool.fanout(
            "POST", "/init_weights_update_group", payload, servers=servers, check_success=True, admin=True
        )
        self._groups[group_name] = [u for u, r in results.items() if not isinstance(r, BaseException)]
        return raise_if_failed("init_weights_update_group", results)

    async def destroy_weights_update_group(self, group_name: str, urls: list[str] | None = None) -> dict[str, Any]:
        """The servers leave weight-update group `group_name` (default: those that joined it through this
        client). A server that no longer has it answers 400 "does not exist" (SGLang's answer): that counts as
        done. Returns url -> answer or exception; never raises for one server."""
        targets = self._groups.pop(group_name, None) if urls is None else list(urls)
        servers = [self._pool.router.servers[u] for u in targets or [] if u in self._pool.router.servers]
        if not servers:
            return {}
        results = await self._pool.fanout(
            "POST",
            "/destroy_weights_update_group",
            {"group_name": group_name},
            servers=servers,
            timeout=self._pool.probe_timeout(),
            admin=True,
        )
        return {
            u: (None if isinstance(r, InferenceError) and r.status == 400 and "not exist" in str(r) else r)
            for u, r in results.items()
        }

    def weight_group_members(self, group_name: str) -> list[str] | None:
        """The servers that joined weight-update group `group_name` through this client (None: none did here).
        The trainer's broadcast_weights gives each a receive loop of its own."""
        members = self._groups.get(group_name)
        return list(members) if members is not None else None
