"""Per-token versions with adapters (train.lora): an adapter version is merged into the server's weights and swapped in
like full weights, so a request interrupted by an adapter update (abort and resume, or paused in place) records the
version of each of its tokens exactly, and each token's behaviour logprob is the one transformers + peft gives
under the adapter of that version (for tokens after an abort and resume; in place, the KV made before the swap
stays, as with full weights). Then a whole run (`python -m areal_async.run`, real torchrun trainer, embedded
server, the async controller) with train.lora: the staleness bound over per-token versions, interrupted
trajectories carrying two versions, adapter-only updates, and the outputs (the last adapter directory, a merged
final model transformers loads).
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from test_e2e import COMMON, records, run_cli
from test_interruption import PROMPTS, greedy, stream_progress
from test_lora_sync import LoRATrainer

from areal_async.inference.client import InferenceClient

pytestmark = pytest.mark.timeout(600)
N_NEW = 200


def peft_logprobs(base: str, adapter: str | None, seqs: list[list[int]]):
    """log p(seq[t] | seq[:t]) for t >= 1 under transformers (+ peft with `adapter`), fp32. [T - 1] per sequence."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        peft = pytest.importorskip("peft")
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [T, V]
            out.append(logp[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return out


async def _under_way(url: str, prompt: list[int], tokens: int = 30) -> asyncio.Task:
    seen = [0]
    observer = asyncio.create_task(stream_progress(url, prompt, seen))
    while seen[0] < tokens:
        assert not observer.done(), f"the observer ended before {tokens} tokens"
        await asyncio.sleep(0.005)
    return observer


async def test_adapter_updates_mid_generation_record_exact_versions(tiny_ckpt, tmp_path):
    """v1 by abort and resume (requests resubmitted with their tokens so far), then v2 with the requests paused in
    place: every response is versions 0 | 1 | 2 in order, and each token of versions 0 and 1 has its version's
    logprob under peft (those of 2 attend to KV of version 1, as with full weights)."""
    import torch

    from areal_async.server.app import start_server

    trainer = LoRATrainer(tiny_ckpt)
    root = str(tmp_path / "weights")
    trainer.step(scale=0.3)
    v1 = await trainer.publish_delta(1, root, served_dtype="float32")
    trainer.step(scale=0.3)
    v2 = await trainer.publish_delta(2, root, served_dtype="float32")
    async with (
        await start_server(tiny_ckpt, port=0, device="cpu", dtype="float32") as server,
        InferenceClient([server.url]) as client,
    ):
        tasks = [asyncio.create_task(client.agenerate(p, greedy(N_NEW), rid=f"r{i}")) for i, p in enumerate(PROMPTS)]
        observer = await _under_way(server.url, PROMPTS[0])
        await client.pause(mode="abort")
        await observer
        await client.update_weights_from_disk(v1.path, 1)
        await client.resume()
        # 30 more tokens under v1, as before v1: the responses (200 tokens) must still be running when paused in
        # place (waiting for 100 here let every one of them end first on a slow, busy machine: no span into v2)
        observer = await _under_way(server.url, PROMPTS[1], tokens=30)
        await client.pause(mode="in_place")
        await client.update_weights_from_disk(v2.path, 2, flush_cache=False)  # in place: the KV stays
        await client.resume()
        results = await asyncio.gather(*tasks)
        await observer
    seqs = [p + r.output_ids for p, r in zip(PROMPTS, results)]
    ref = {0: peft_logprobs(tiny_ckpt, None, seqs), 1: peft_logprobs(tiny_ckpt, v1.path, seqs)}
    ref[2] = peft_logprobs(tiny_ckpt, v2.path, seqs)
    spans = 0
    for p, r, i in zip(PROMPTS, results, range(len(PROMPTS))):
        assert len(r.output_ids) == N_NEW and r.num_interruptions >= 1
        vs = r.output_versions
        assert vs == sorted(vs) and vs[0] == 0 and set(vs) <= {0, 1, 2}
        off = len(p) - 1
        got = torch.tensor(r.output_logprobs)
        # the in-place tokens of version 2 attend to KV that version 1 made (by design, as SGLang's in-place
        # pause), so only versions 0 and 1 are compared with a whole forward
        for v in set(vs) - {2}:
            idx = torch.tensor([k for k, x in enumerate(vs) if x == v])
            assert (got[idx] - ref[v][i][off + idx]).abs().max().item() < 1e-3, (i, v)
            others = [ref[o][i][off + idx] for o in ref if o != v]
            assert all((o - ref[v][i][off + idx]).abs().max().item() > 1e-3 for o in others)  # they can tell
        spans += 2 in vs and 1 in vs
    assert spans >= 1  # some response went on in place from version 1 into version 2


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["disk", "broadcast"])
def test_a_lora_run_trains_adapters_within_the_staleness_bound(tiny_ckpt, tmp_path, sync):
    run_dir = str(tmp_path / "lora")
    p = run_cli(
        [
            f"model.path={tiny_ckpt}",
            f"run_dir={run_dir}",
            "mode=async",
            "eta=1",
            "total_steps=4",
            "schedule.eval_every=0",
            # one request at a time: generation stays the slow side even when a loaded machine slows the trainer,
            # so every update finds requests in flight to interrupt (with 4, CI at load 5 once found none)
            "server.max_running_requests=1",
            f"train.weight_sync={sync}",
            "train.lora.rank=4",
            "train.lora.alpha=8",
            "train.optim.lr=1e-2",
            "train.loss.entropy_coef=0.05",  # the random tiny model earns no reward: the entropy bonus moves it
            *COMMON,
        ],
        timeout=400,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    assert s["steps"] == 4 and s["max_staleness_seen"] <= 1
    train = records(run_dir, "train")
    assert [r["version"] for r in train] == [1, 2, 3, 4]
    assert all(r["staleness_max"] <= 1 for r in train)
    assert any(r["interrupted_frac"] > 0 for r in train), train
    assert any(r["multi_version_frac"] > 0 for r in train), train
    # the versions went to the server as adapters alone; the last adapters are kept as peft loads them, and the
    # final model is merged and loads with transformers
    if sync == "disk":
        assert sorted(os.listdir(os.path.join(run_dir, "weights", "v3"))) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]  # (v4 is the final merged checkpoint publish_final wrote)
    adapter = os.path.join(run_dir, "final_adapter")
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    import torch
    import transformers

    final = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "final"), dtype=torch.float32)
    assert not any("lora" in n for n in final.state_dict())
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    moved = {n for n, t in final.state_dict().items() if not torch.equal(t, base.state_dict()[n])}
    assert moved and all(n.endswith("_proj.weight") for n in moved)  # only adapted layers differ
    ids = [[5, 9, 14, 22, 31, 40, 7, 3]]
    with_adapter = peft_logprobs(tiny_ckpt, adapter, ids)[0]
    merged = peft_logprobs(os.path.join(run_dir, "final"), None, ids)[0]
    assert (with_adapter - merged).abs().max().item() < 1e-5  # the adapters are the final model's


def test_a_lora_target_the_model_lacks_is_found_before_launch(tiny_ckpt, tmp_path):
    run_dir = str(tmp_path / "never")
    p = run_cli(
        [f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "train.lora.rank=4", "train.lora.target_modules=[qkv]"]
    )
    assert p.returncode == 2 and "train.lora.target_modules: ['qkv'] match no linear layer" in p.stderr, p.stderr
    assert not os.path.exists(run_dir)
