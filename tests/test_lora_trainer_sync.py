"""Adapter-only sync from real torchrun trainers (2 ranks: the adapters' shards are gathered) to embedded servers,
by disk (DiskSync) and by broadcast (ElasticBroadcastSync, gloo): every version travels as its adapters alone
(bytes against the full model's), every server proves by digest that it serves the trainer's merge, a server
restarted on its launch weights catches up from the adapter directory, a rollback continues from the base the
servers keep, and the trainers' full publish is the merged model.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets

import pytest
from test_weight_identity import make_batch

from areal_async.inference.client import InferenceClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CFG = {
    "device": "cpu",
    "micro_batch_tokens": 64,
    "optim": {"lr": 1e-2},
    "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "gate_proj"]},
}


async def digests(url: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url + "/weights_fingerprint") as r:
        return (await r.json())["digests"]


async def test_adapters_by_disk_and_by_broadcast_from_torchrun_trainers(tiny_ckpt, tmp_path):
    from areal_async.launch import Processes
    from areal_async.rollout.broadcast_sync import ElasticBroadcastSync
    from areal_async.rollout.weight_sync import DiskSync
    from areal_async.server.app import start_server
    from areal_async.train.client import TrainerGroup

    secret = secrets.token_bytes(32)
    launcher = Processes(str(tmp_path / "run"))
    child = launcher.start_trainers(
        model=tiny_ckpt, nproc=2, config_json=json.dumps(CFG), seed=1, secret_hex=secret.hex(), torch_threads=1
    )
    group = client = solo = None
    servers = []
    try:
        servers.append(await start_server(tiny_ckpt, port=0, device="cpu", dtype="bfloat16"))
        group = await TrainerGroup.connect(launcher.run_dir, 2, secret, timeout=120)
        client = InferenceClient([servers[0].url], probe_interval_s=0.05)
        sync = DiskSync(group, client, str(tmp_path / "weights"))
        initial = (await group.save_checkpoint(str(tmp_path / "initial"))).path
        rng = random.Random(3)
        for _ in range(3):
            v = (await group.train_step(make_batch(rng, group.version), group.version)).version
            await sync.prepare(v)
            pub = sync._published[v]
            assert pub.kind == "adapter" and pub.num_bytes * 10 < pub.full_bytes
            await sync.apply(v, flush_cache=True)
        assert sync.stats["adapter_updates"] == 3 and sync.stats["identity_mismatches"] == 0
        assert client.stats()["identity_checks"] == 3
        assert sorted(os.listdir(pub.path)) == ["adapter_config.json", "adapter_model.safetensors"]
        # a server restarted on its launch weights catches up from the adapter directory, checked before it serves
        servers.append(await start_server(tiny_ckpt, port=0, device="cpu", dtype="bfloat16"))
        await client.add_server(servers[1].url, wait=True, timeout_s=60)
        assert client.stats()["identity_checks"] == 4
        assert await digests(servers[0].url) == await digests(servers[1].url) == pub.identity.digests
        # a rollback to version 0 and a step from there: the servers merge into the base they kept
        await group.load_checkpoint(initial)
        v = (await group.train_step(make_batch(rng, 0), 0)).version
        await sync.prepare(v)
        await sync.apply(v, flush_cache=True)
        assert sync.stats["identity_mismatches"] == 0

        # broadcast: the adapters as one bucket, merged by the member (one: servers in one process share torch's
        # registry of group names, so a second would refuse the group's name)
        fp32 = [await start_server(tiny_ckpt, port=0, device="cpu")]
        servers += fp32
        solo = InferenceClient([s.url for s in fp32], probe_interval_s=0.05)
        bcast = ElasticBroadcastSync(
            group,
            solo,
            "127.0.0.1",
            ranks_per_server=1,
            backend="gloo",
            settle_s=1,
            catch_up_root=str(tmp_path / "catch_up"),
        )
        solo.weight_source = bcast.publish_current
        await bcast.form_group()
        for _ in range(2):
            v = (await group.train_step(make_batch(rng, group.version), group.version)).version
            await solo.pause()
            try:
                await bcast.apply(v, flush_cache=True)
            finally:
                await solo.resume()
        st = bcast.stats
        assert st["adapter_updates"] == 2 and st["full_updates"] == 0 and st["identity_mismatches"] == 0, st
        assert solo.stats()["identity_checks"] == 2
        assert 0 < st["delta_bytes"] * 10 < st["full_bytes"]
        held = await digests(fp32[0].url)
        # a member restarted on its launch weights: publish_current (the client's weight_source) writes the
        # adapter directory it merges, and it serves the same bits
        path = await bcast.publish_current(v)
        assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors"]
        fresh = await start_server(tiny_ckpt, port=0, device="cpu")
        servers.append(fresh)
        async with InferenceClient([fresh.url]) as other:
            await other.update_weights_from_disk(path, v)
        assert await digests(fresh.url) == held
        # the trainers' full publish is the merged model (what publish_final copies to run_dir/final)
        merged = await group.publish(v, str(tmp_path / "final"))
        import torch
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(merged.path, dtype=torch.float32)
        assert not any("lora" in n for n in model.state_dict())
        from areal_async.weights.digest import tensor_digest

        for name, t in model.state_dict().items():
            if name in held and name.endswith(("q_proj.weight", "v_proj.weight", "gate_proj.weight")):
                assert tensor_digest(t) == held[name], name  # fp32 serving: the servers' merge, bit for bit
    finally:
        if solo is not None:
            await solo.close()
        if group is not None:
            try:
                await asyncio.wait_for(group.shutdown(), 60)
                child.proc.wait(60)
            except Exception:
                pass
        launcher.shutdown()
        if client is not None:
            await client.close()
        for s in servers:
            await s.close()
