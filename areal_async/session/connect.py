"""How a run's controller reaches what the launcher started: the trainer ranks (`connect_trainers`), the weight
transport between them and the servers (`connect_weights`, docs/weights.md), and the servers brought to a version
(`bring_servers_to`).

Apart from run.py because both the run's start (`train`) and its rollback after a trainer failure
(rollback.py) connect the same way.
"""

from __future__ import annotations

import os

from areal_async.config import RunConfig
from areal_async.inference.client import InferenceClient
from areal_async.launch import Cluster, ElasticBroadcastSync
from areal_async.launch.sglang_lora import adapter_window
from areal_async.rollout.lora_sync import AdapterSync
from areal_async.rollout.weight_sync import DiskSync, WeightSync
from areal_async.session.prepare import RunPlan
from areal_async.train.client import TrainerGroup

__all__ = ["bring_servers_to", "connect_trainers", "connect_weights"]


async def connect_trainers(cluster: Cluster, cfg: RunConfig) -> TrainerGroup:
    tr = cluster.trainers
    return await TrainerGroup.connect(
        tr.rendezvous_dir,
        tr.world_size,
        tr.secret,
        timeout=cfg.train.connect_timeout_s,
        unreachable_s=cfg.recovery.trainer_unreachable_s,
    )


async def connect_weights(
    plan: RunPlan,
    trainers: TrainerGroup | None,
    client: InferenceClient | None,
    cluster: Cluster,
    previous: WeightSync | None = None,
) -> WeightSync:
    """The weight transport `train.weight_sync` names (docs/weights.md). Broadcast first joins trainer rank 0 and
    every server rank into one torch.distributed group; the group follows the fleet (rollout/broadcast_sync.py),
    and a server that comes back catches up from a checkpoint the trainers publish on demand. `previous`: the
    transport of a trainer job that was replaced (broadcast keeps counting its groups, whose names the servers will
    not reuse)."""
    cfg = plan.cfg
    assert trainers is not None and client is not None
    if cfg.train.lora.enabled and await _sglang_fleet(cfg, client):  # adapters loaded per version, per request
        if isinstance(previous, AdapterSync):  # a replaced trainer job: the servers keep the window they hold
            previous.trainer = trainers
            return previous
        root = os.path.join(cfg.run_dir, "weights")
        return AdapterSync(trainers, client, root, window=adapter_window(cfg), keep_versions=cfg.train.keep_versions)
    if cfg.train.weight_sync == "disk":
        return DiskSync(trainers, client, os.path.join(cfg.run_dir, "weights"), cfg.train.keep_versions)
    if isinstance(previous, ElasticBroadcastSync):
        sync = previous
        sync.set_trainers(trainers)
        sync.master_address = cluster.trainers.master_address
    else:
        device = (await trainers.info())[0].device
        per_server = 1 if cfg.server.backend == "embedded" else cfg.server.gpus_per_server  # each TP rank receives
        sync = ElasticBroadcastSync(
            trainers,
            client,
            cluster.trainers.master_address,
            ranks_per_server=per_server,
            backend="nccl" if device.startswith("cuda") else "gloo",
            api_key=cfg.server.api_key,
            catch_up_root=os.path.join(cfg.run_dir, "weights"),
        )
    await sync.form_group()
    client.weight_source = sync.publish_current
    return sync


async def _sglang_fleet(cfg: RunConfig, client: InferenceClient) -> bool:
    """Do the servers apply adapters per request (SGLang) rather than merge them (the embedded server)? Launched:
    server.backend says; external: a server that does not say it is ours (`weights_delta`) is taken for SGLang."""
    if cfg.server.backend != "external":
        return cfg.server.backend == "sglang"
    infos = await client.server_info()
    return any(isinstance(i, dict) and not i.get("weights_delta") for i in infos.values())


async def bring_servers_to(weights: WeightSync, version: int) -> None:
    """Make every server hold the trainers' weights as `version` (after a resume or a rollback: nothing is in
    flight that could keep its KV cache)."""
    await weights.prepare(version)
    await weights.apply(version, flush_cache=True)
