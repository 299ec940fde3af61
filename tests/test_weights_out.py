"""Weights leaving the trainer: the published HF directory (transformers and our server load it and agree with each
other), atomic publishing and pruning, sharded checkpoints, and the SGLang-style broadcast from a torchrun trainer
into an embedded server over real HTTP, on CPU with gloo.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import secrets

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from error_bounds import checkpoint_logit_bound, gamma

from areal_async.launch import Processes
from areal_async.train.client import TrainerError, TrainerGroup
from areal_async.types import Trajectory

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

# The loss options ride along on this job (a torchrun start costs seconds): the behaviour logprobs stand in for the
# proximal ones, plus an entropy bonus and a KL penalty to the frozen initial policy.
ENTROPY_COEF, KL_COEF = 0.01, 0.1
# pinned to the CPU: fp32 logprobs are compared, also on a GPU host
CFG = {
    "device": "cpu",
    "micro_batch_tokens": 64,
    "optim": {"lr": 1e-3},
    "loss": {"prox_logp": "behav", "entropy_coef": ENTROPY_COEF, "kl_coef": KL_COEF},
}
PROBES = [[3, 17, 42, 8, 64, 23, 5, 90, 31], [50, 2, 77, 13, 13, 60]]  # token sequences whose logprobs we compare


def make_batch(rng: random.Random, version: int) -> list[Trajectory]:
    trajs = []
    for g in range(3):
        for _ in range(3):
            p, r = rng.randrange(3, 8), rng.randrange(4, 20)
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


def hf_logprobs(path: str) -> list[list[float]]:
    """Per-token logprobs of the probes under transformers (the reference loader)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for ids in PROBES:
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            out.append([lp[t - 1, ids[t]].item() for t in range(1, len(ids))])
    return out


async def server_logprobs(url: str) -> tuple[list[list[float]], str]:
    """Input-token logprobs of the probes from the server's /generate (max_new_tokens=0), and its weight version."""
    out, version = [], ""
    async with aiohttp.ClientSession() as s:
        for ids in PROBES:
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
            async with s.post(url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                meta = (await r.json())["meta_info"]
            out.append([x[0] for x in meta["input_token_logprobs"][1:]])
            version = meta["weight_version"]
    return out, version


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def rounding_gap(ckpt: str, want: list[list[float]]) -> float:
    """How far two fp32 forwards of `ckpt` (server, transformers) may put the probes' logprobs apart: the decoder
    bound (error_bounds.decoder_logit_bound) at these logprobs' magnitude. Weights that differ by more are really
    different; the same weights must agree within it."""
    scale = max(abs(x) for row in want for x in row)
    return checkpoint_logit_bound(ckpt, max(len(p) for p in PROBES), scale)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setup(tiny_ckpt, tmp_path_factory):
    """One trainer rank (torchrun) and one embedded server (in process), both starting from the base model."""
    from areal_async.inference.client import InferenceClient
    from areal_async.server.app import start_server

    root = tmp_path_factory.mktemp("weights_out")
    secret = secrets.token_bytes(32)
    launcher = Processes(str(root / "run"))
    child = launcher.start_trainers(
        model=tiny_ckpt, nproc=1, config_json=json.dumps(CFG), seed=1, secret_hex=secret.hex(), torch_threads=1
    )
    server = client = group = None
    try:
        server = await start_server(tiny_ckpt, port=0, device="cpu")  # loads while the trainer loads
        watch = asyncio.ensure_future(launcher.watch())
        connect = asyncio.ensure_future(TrainerGroup.connect(launcher.run_dir, 1, secret, timeout=180))
        await asyncio.wait([watch, connect], return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if not connect.done():  # the trainer died first: ChildFailed with its log tail
            connect.cancel()
            watch.result()
        group = connect.result()
        client = InferenceClient([server.url])
        initial = (await group.save_checkpoint(str(root / "initial"))).path  # version 0, for any test order
        yield {
            "group": group,
            "server": server,
            "client": client,
            "root": root,
            "rng": random.Random(5),
            "base": tiny_ckpt,
            "child": child,
            "initial": initial,
        }
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
        if server is not None:
            await server.close()


async def test_loss_options_enter_loss_and_stats(setup):
    """From the initial weights (the trainer checkpoint taken before any test ran), the first step's KL to the
    reference is exactly 0, the second's is not."""
    group = setup["group"]
    await group.load_checkpoint(setup["initial"])
    assert group.version == 0
    stats = []
    for _ in range(2):
        stats.append((await group.train_step(make_batch(setup["rng"], group.version), group.version)).stats)
    assert stats[0]["kl_ref"] == 0.0 and stats[1]["kl_ref"] > 0
    for s in stats:
        assert s["imp_weight_mean"] == 1.0 and s["imp_weight_masked_frac"] == 0.0  # prox := behav
        assert s["entropy"] > 0  # measured in the training forward, there being no prox pass
        # each term a token mean in fp32 over at most 9 x 27 = 243 tokens, summed in its own order: gamma(243)
        # relative to each term, plus the three roundings of the combination
        parts = abs(s["pg_loss"]) + KL_COEF * abs(s["kl_ref"]) + ENTROPY_COEF * abs(s["entropy"])
        assert s["loss"] == pytest.approx(
            s["pg_loss"] + KL_COEF * s["kl_ref"] - ENTROPY_COEF * s["entropy"], abs=gamma(243 + 3) * parts
        )


async def test_published_checkpoint_loads_everywhere_with_identical_logprobs(setup):
    group, root = setup["group"], setup["root"]
    await group.train_step(make_batch(setup["rng"], group.version), group.version)
    pub = await group.publish(group.version, str(root / "pub"))
    names = set(os.listdir(pub.path))
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    } <= names
    with (
        open(os.path.join(setup["base"], "tokenizer_config.json")) as a,
        open(os.path.join(pub.path, "tokenizer_config.json")) as b,
    ):
        assert a.read() == b.read()  # copied byte for byte: chat template and special tokens cannot drift
    from safetensors import safe_open

    with safe_open(os.path.join(pub.path, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied to the embedding: written once, as transformers does
        assert pub.num_bytes == sum(f.get_tensor(k).numel() * 4 for k in f.keys())

    want = hf_logprobs(pub.path)
    tol = rounding_gap(pub.path, want)
    assert max_gap(want, hf_logprobs(setup["base"])) > tol  # the trained weights are really different
    await setup["client"].update_weights_from_disk(pub.path, group.version)
    got, version = await server_logprobs(setup["server"].url)
    assert version == str(group.version)
    assert max_gap(got, want) <= tol


async def test_broadcast_into_embedded_server(setup):
    """Trainer rank 0 and the server form a gloo group; the controller drives the trainer's broadcast and the
    server's /update_weights_from_distributed (small buckets: several HTTP calls) at the same time."""
    group, client, root = setup["group"], setup["client"], setup["root"]
    await group.train_step(make_batch(setup["rng"], group.version), group.version)
    pub_path = (await group.publish(group.version, str(root / "pub"))).path
    reference = hf_logprobs(pub_path)
    tol = rounding_gap(pub_path, reference)
    before, label = await server_logprobs(setup["server"].url)
    assert max_gap(before, reference) > tol and label != str(group.version)  # the server has an older version

    # no address or port given: rank 0 reports its own (127.0.0.1 for a trainer serving loopback) and binds a
    # free port for the store
    assert (await group.info())[0].host == "127.0.0.1"
    endpoint = await group.init_broadcast_group(client, num_server_ranks=1, backend="gloo")
    assert endpoint.address == "127.0.0.1" and endpoint.port > 0
    plan = await group.weight_plan(bucket_bytes=64 << 10)
    calls = []
    receive = client.update_weights_from_distributed

    async def spy(names, dtypes, shapes, version, **kw):
        calls.append((version, kw["flush_cache"]))
        assert (await server_logprobs(setup["server"].url))[1] == label  # still labelled as before
        return await receive(names, dtypes, shapes, version, **kw)

    client.update_weights_from_distributed = spy
    try:
        result = await group.broadcast_weights(client, group.version, bucket_bytes=64 << 10)
    finally:
        del client.update_weights_from_distributed
    assert len(result.buckets) == len(plan.buckets) > 1
    assert result.num_bytes == plan.num_bytes
    # only the last bucket carries the version and the flush: no bucket in between is labelled v+1
    assert calls == [(None, False)] * (len(plan.buckets) - 1) + [(group.version, True)]
    # rank 0 held about one bucket of gathered tensors at a time, not the whole model
    biggest = max(sum(math.prod(s) * 4 for s in b.shapes) for b in plan.buckets)
    assert result.held_peak_bytes == biggest < plan.num_bytes
    assert "lm_head.weight" not in {n for b in plan.buckets for n in b.names}
    got, version = await server_logprobs(setup["server"].url)
    assert version == str(group.version)
    assert max_gap(got, reference) <= tol

    # and again after another step, through the same group
    await group.train_step(make_batch(setup["rng"], group.version), group.version)
    await group.broadcast_weights(client, group.version, bucket_bytes=64 << 10)
    reference = hf_logprobs((await group.publish(group.version, str(root / "pub"))).path)
    got, version = await server_logprobs(setup["server"].url)
    assert version == str(group.version) and max_gap(got, reference) <= rounding_gap(pub_path, reference)


async def test_publish_is_atomic_prunes_and_fails_cleanly(setup):
    group, root = setup["group"], setup["root"]
    pub_root = root / "pruned"
    os.makedirs(pub_root / ".tmp-v99")  # debris of a publish that died half way
    for v in (1, 2, 3):
        await group.publish(v, str(pub_root), keep=2)
    assert sorted(os.listdir(pub_root)) == ["v2", "v3"]
    await group.publish(3, str(pub_root), keep=2)  # the same version again (after a resume) replaces it
    assert sorted(os.listdir(pub_root)) == ["v2", "v3"]

    blocker = root / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(TrainerError, match="publishing version 4"):
        await group.publish(4, str(blocker / "sub"))
    assert (await group.info())[0].version == group.version  # the trainer is fine and in step
    await group.publish(4, str(pub_root), keep=2)


async def test_sharded_publish_loads_in_transformers_and_engine_loader(tiny_ckpt, tmp_path):
    """Past max_shard_bytes the weights go to several files with an index, as transformers writes them."""
    import torch
    import transformers

    from areal_async.server.weights import load_checkpoint
    from areal_async.train.publish import publish_hf

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    res = publish_hf(
        model,
        source_dir=tiny_ckpt,
        root=str(tmp_path),
        version=7,
        dtype=torch.float32,
        skip={"lm_head.weight"},
        max_shard_bytes=40_000,
    )
    files = sorted(f for f in os.listdir(res.path) if f.endswith(".safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    with open(os.path.join(res.path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == res.num_bytes
    again = transformers.AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    for name, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[name]), name
    _, tensors = load_checkpoint(res.path)  # the embedded engine's loader reads the index too
    assert np.array_equal(tensors["model.norm.weight"].numpy(), model.model.norm.weight.detach().numpy())
