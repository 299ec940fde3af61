"""Who joins a weight-update group, with how many ranks, over which backend: asked of the servers themselves.

A broadcast group is trainer rank 0 plus every server rank. SGLang joins each tensor-parallel worker of a server as
its own rank, `rank_offset + tp_rank`, so a server of tp_size 4 holds ranks offset..offset+3 and the next server
starts after them; a count of one rank per server would make the second server's workers collide with the first's.
The count comes from the server (GET /get_server_info reports SGLang's ServerArgs: `tp_size`, `dp_size`,
`pp_size`, `enable_dp_attention`), and from the config (`server.gpus_per_server`) only for a server that does not
say. Layouts SGLang cannot update by broadcast are refused with the reason, before any rank waits:
- `dp_size` > 1 without `enable_dp_attention`: SGLang's tokenizer manager asserts on it ("dp_size must be 1 or dp
  attention must be enabled for update weights from distributed"); with DP attention the tp_size workers span
  every replica and join as tp_size ranks.
- `pp_size` > 1: every pipeline stage would join as rank_offset + tp_rank, the same ranks twice.

The backend: nccl when trainer rank 0 is on CUDA, unless a member is on a GPU that another member uses too (the
embedded server and trainer reporting the same GPU UUID: one GPU with one trainer and one server). NCCL refuses
two ranks of one communicator on one device ("Duplicate GPU detected"), so such a group goes over gloo (host
memory: slower, but it works). SGLang servers do not report their GPU; the local launcher refuses to put one on a
trainer's GPU when the broadcast is on (launch/placement.py). Controller side: no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["GroupPlan", "BroadcastLayoutError", "server_ranks", "group_backend", "plan_group"]


class BroadcastLayoutError(RuntimeError):
    """A server whose parallel layout cannot receive a weight broadcast; the message says why and what to do."""


@dataclass(frozen=True)
class GroupPlan:
    ranks: list[int]  # per member server, in the client's order: how many group ranks it holds
    backend: str  # "nccl" or "gloo"
    reason: str = ""  # why gloo, when nccl was asked for

    @property
    def num_server_ranks(self) -> int:
        return sum(self.ranks)


def _int(info: Mapping[str, Any], key: str, default: int) -> int:
    value = info.get(key)
    try:
        return int(value) if value is not None else default
    except (TypeError, ValueError):
        return default


def server_ranks(url: str, info: Mapping[str, Any] | None, default: int) -> int:
    """The group ranks server `url` holds, from its /get_server_info answer (None: it gave none; `default`)."""
    if not info:
        return default
    tp, dp, pp = _int(info, "tp_size", default), _int(info, "dp_size", 1), _int(info, "pp_size", 1)
    if dp > 1 and not info.get("enable_dp_attention"):
        raise BroadcastLayoutError(
            f"{url} runs dp_size={dp} without --enable-dp-attention: SGLang cannot update such a server by "
            "broadcast (dp_size must be 1 or dp attention must be enabled); use train.weight_sync=disk, or one "
            "server per replica (server.num_servers)"
        )
    if pp > 1:
        raise BroadcastLayoutError(
            f"{url} runs pp_size={pp}: every pipeline stage would join the weight-update group as the same ranks "
            "(rank_offset + tp_rank); use train.weight_sync=disk"
        )
    if tp < 1:
        raise BroadcastLayoutError(f"{url} reports tp_size={tp}")
    return tp


def group_backend(requested: str, trainer_gpu: str, server_gpus: list[str]) -> tuple[str, str]:
    """(backend, reason): gloo instead of nccl when two members share a GPU (their reported UUIDs)."""
    if requested != "nccl":
        return requested, ""
    known = [g for g in server_gpus if g]
    if trainer_gpu and trainer_gpu in known:
        return "gloo", f"a server is on trainer rank 0's GPU ({trainer_gpu})"
    if len(set(known)) < len(known):
        return "gloo", "two servers are on one GPU"
    return "nccl", ""


async def plan_group(client: Any, urls: list[str], trainer: Any, *, default_ranks: int, backend: str) -> GroupPlan:
    """Ask every member server for its layout (`client.server_info`) and plan the group. `trainer` is trainer
    rank 0's TrainerInfo (its `gpu_uuid`). A server that cannot be asked counts `default_ranks`."""
    infos = await client.server_info(urls) if hasattr(client, "server_info") else {}
    got = {u: (i if isinstance(i, Mapping) else None) for u, i in infos.items()}
    for u, i in infos.items():
        if not isinstance(i, Mapping):
            log.warning(
                "%s: no /get_server_info answer (%s); counting %d rank(s) (server.gpus_per_server)", u, i, default_ranks
            )
    ranks = [server_ranks(u, got.get(u), default_ranks) for u in urls]
    chosen, reason = group_backend(
        backend, getattr(trainer, "gpu_uuid", "") or "", [str((got.get(u) or {}).get("gpu_uuid") or "") for u in urls]
    )
    if chosen != backend:
        log.warning(
            "weight broadcast over %s instead of %s: %s (NCCL refuses two ranks on one GPU); give the "
            "servers and trainers their own GPUs for nccl",
            chosen,
            backend,
            reason,
        )
    return GroupPlan(ranks=ranks, backend=chosen, reason=reason)
