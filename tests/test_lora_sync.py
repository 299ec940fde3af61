"""Adapter-only sync (train.lora) over disk, against embedded servers over real HTTP: only the adapters travel, a
server merges each version into the base it keeps, bit-exact against the trainer's identity over many versions
(no drift) and for a server restarted on its launch weights; its logprobs equal transformers + peft on the same
adapter directory and transformers on the merged checkpoint; a bad adapter is refused naming the cause with the
old weights serving; and a run whose adapter never reaches the servers stops within the step (DiskSync).

The trainer is train/lora_publish.py's publisher over a transformers model in this process with train/lora.py's
adapters (one rank: its collectives are no-ops), its adapters moved by random steps; tests/test_lora_train.py runs
the adapters through real torchrun trainers.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from areal_async.inference.client import InferenceClient
from areal_async.types import SamplingParams

pytestmark = pytest.mark.timeout(180)

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "v_proj", "down_proj"]


class LoRATrainer:
    """`publish_delta` of TrainerGroup over an AdapterPublisher in this process."""

    def __init__(self, base: str) -> None:
        import torch
        import transformers

        from areal_async.train.lora import initial_adapters, inject_lora, lora_modules
        from areal_async.train.lora_publish import AdapterPublisher

        transformers.utils.logging.disable_progress_bar()
        self.base = base
        self.model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        inject_lora(self.model, rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=TARGETS)
        missing, unexpected = self.model.load_state_dict(initial_adapters(self.model, seed=3), strict=False)
        assert not unexpected and all("lora" not in n for n in missing)
        self.lora = {n: m.lora_scale for n, m in lora_modules(self.model).items()}
        self.skip = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        self.publisher = AdapterPublisher()
        self.gen = torch.Generator().manual_seed(11)

    def step(self, scale: float = 0.05) -> None:
        """Move every adapter as a train step would (B leaves zero at the first one)."""
        import torch

        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if "lora_" in n:
                    p.add_(torch.randn(p.shape, generator=self.gen), alpha=scale)

    async def publish_delta(self, version: int, root: str, keep: int = 2, *, served_dtype: str, force_full=False):
        del force_full  # adapters are always sent alone
        return await asyncio.to_thread(
            self.publisher.publish,
            self.model,
            lora=self.lora,
            rank=RANK,
            alpha=ALPHA,
            dropout=0.0,
            source_dir=self.base,
            root=root,
            version=version,
            keep=keep,
            served=served_dtype,
            skip=self.skip,
        )

    def merged_checkpoint(self, dest: str) -> str:
        """The full HF checkpoint the trainer's `publish` writes with train.lora (train/lora.py's merge)."""
        import torch

        from areal_async.train.lora import merged_tensors
        from areal_async.train.publish import iter_full_tensors, publish_hf

        stream = merged_tensors(
            iter_full_tensors(self.model, skip=self.skip, dtype=torch.float32, to_cpu=True), self.lora, torch.float32
        )
        return publish_hf(self.model, source_dir=self.base, root=dest, version=0, tensors=stream).path


@pytest.fixture
async def servers(tiny_ckpt):
    from areal_async.server.app import start_server

    made = []

    async def make(n: int, dtype: str):
        out = []
        for _ in range(n):
            s = await start_server(tiny_ckpt, port=0, device="cpu", dtype=dtype)
            c = InferenceClient([s.url])
            made.append((s, c))
            out.append((s, c))
        return out

    yield make
    for s, c in made:
        await c.close()
        await s.close()


async def fingerprint(client: InferenceClient):
    import msgspec

    from areal_async.protocol.weight_identity import Identity

    (server,) = client._pool.router.servers.values()
    status, body = await client._pool.send(server, "GET", "/weights_fingerprint", None)
    assert status == 200, body
    return msgspec.json.decode(body, type=Identity)


async def load(url: str, path: str, version: int) -> dict:
    import aiohttp

    body = {"model_path": path, "weight_version": str(version), "flush_cache": True}
    async with aiohttp.ClientSession() as s, s.post(url + "/update_weights_from_disk", json=body) as r:
        return {"status": r.status, **(await r.json())}


@pytest.mark.parametrize("served", ["bfloat16", "float32"])
async def test_adapters_merge_bit_exact_over_many_versions_and_after_a_restart(tiny_ckpt, servers, tmp_path, served):
    """Only the adapter files travel, each version is merged from the kept base (a server that took all ten and
    a fresh one that took only the last hold the same bits), and the identity names what differs otherwise."""
    from areal_async.weights.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    trainer = LoRATrainer(tiny_ckpt)
    root = str(tmp_path / "weights")
    (a, ca), (b, cb) = await servers(2, served)
    base = await fingerprint(ca)
    for v in range(1, 11):
        trainer.step()
        pub = await trainer.publish_delta(v, root, served_dtype=served)
        assert pub.kind == "adapter"
        assert sorted(os.listdir(pub.path)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
        assert pub.num_bytes < pub.full_bytes / 5  # the tiny model: adapters of 3 of its 7 linear kinds
        await ca.update_weights_from_disk(pub.path, v)
        verdicts = await ca.verify_weights(pub.identity)
        assert verdicts[a.url].ok and verdicts[a.url].method == "digests", verdicts
    adapted = {f"{m}.weight" for m in trainer.lora}
    got = await fingerprint(ca)
    assert {n for n in got.digests if got.digests[n] != base.digests[n]} == adapted  # nothing else moved
    # a server on its launch weights takes the newest adapter alone: the same bits as after ten merges
    answer = await load(b.url, pub.path, 10)
    assert answer["success"] and "merged into 6 layers" in answer["message"], answer
    assert (await fingerprint(cb)).digests == got.digests == pub.identity.digests
    assert sorted(os.listdir(root)) == ["v10", "v9"]  # keep=2
    # a server that missed the adapter serves the base: the identity names exactly the adapted weights
    from areal_async.protocol.weight_identity import differing

    assert set(differing(pub.identity.digests, base.digests)) == adapted


async def test_logprobs_equal_transformers_with_peft_and_the_merged_checkpoint(tiny_ckpt, servers, tmp_path):
    """fp32 serving: the server's behaviour logprobs of its own greedy tokens against transformers + peft loading
    the published adapter directory, and against transformers on the merged HF checkpoint, within 1e-3."""
    import torch
    import transformers

    peft = pytest.importorskip("peft")
    trainer = LoRATrainer(tiny_ckpt)
    for _ in range(3):
        trainer.step(scale=0.3)  # large: the adapted model's outputs differ clearly from the base's
    pub = await trainer.publish_delta(3, str(tmp_path / "weights"), served_dtype="float32")
    ((server, client),) = await servers(1, "float32")
    await client.update_weights_from_disk(pub.path, 3)
    prompt = [5, 17, 33, 8, 61, 2, 40]
    res = await client.agenerate(prompt, SamplingParams(max_new_tokens=24, temperature=1.0, top_k=1))
    assert res.output_versions == [3] * len(res.output_ids)
    seq = torch.tensor([prompt + res.output_ids])

    def logprobs_of(model) -> list[float]:
        with torch.no_grad():
            logits = model(seq).logits[0].float()  # [T, V]
        lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
        return lp.gather(-1, torch.tensor(res.output_ids)[:, None])[:, 0].tolist()

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    with_peft = peft.PeftModel.from_pretrained(base, pub.path).eval()
    want = logprobs_of(with_peft)
    assert max(abs(x - y) for x, y in zip(res.output_logprobs, want)) < 1e-3
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        trainer.merged_checkpoint(str(tmp_path / "merged")), dtype=torch.float32
    ).eval()
    assert max(abs(x - y) for x, y in zip(logprobs_of(merged), want)) < 1e-3
    plain = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    assert max(abs(x - y) for x, y in zip(logprobs_of(plain), want)) > 1e-2  # the adapter matters here


async def test_a_bad_adapter_is_refused_naming_the_cause_and_the_old_weights_serve(tiny_ckpt, servers, tmp_path):
    import shutil

    trainer = LoRATrainer(tiny_ckpt)
    trainer.step()
    pub = await trainer.publish_delta(1, str(tmp_path / "w"), served_dtype="float32")
    ((server, client),) = await servers(1, "float32")
    assert (await load(server.url, pub.path, 1))["success"]
    held = await fingerprint(client)
    cases = {}
    bad = str(tmp_path / "truncated")
    shutil.copytree(pub.path, bad)
    weights = os.path.join(bad, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    cases[bad] = "cannot read"
    wrong = str(tmp_path / "wrong_rank")
    shutil.copytree(pub.path, wrong)
    with open(os.path.join(wrong, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg["r"] = RANK + 1
    with open(os.path.join(wrong, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    cases[wrong] = "are not of rank r=5"
    for path, cause in cases.items():
        answer = await load(server.url, path, 2)
        assert not answer["success"] and cause in answer["message"], answer
        assert (await fingerprint(client)).digests == held.digests


async def test_a_run_whose_adapter_never_reaches_the_servers_stops_within_the_step(
    tiny_ckpt, servers, tmp_path, monkeypatch
):
    """A server whose adapter load silently does nothing (it answers success, merges nothing): DiskSync's
    identity check finds every server on other weights and raises AdapterNotServed in that same update."""
    from areal_async.rollout import weight_sync
    from areal_async.server import lora_load, weight_updates

    trainer = LoRATrainer(tiny_ckpt)
    (a, ca), (b, cb) = await servers(2, "bfloat16")
    client = InferenceClient([a.url, b.url])
    try:
        sync = weight_sync.DiskSync(trainer, client, str(tmp_path / "w"))
        trainer.step()
        await sync.prepare(1)
        await sync.apply(1, flush_cache=True)  # delivered: both prove it
        assert sync.stats["adapter_updates"] == 1 and sync.stats["identity_mismatches"] == 0

        def silent(path, spec, model, base):
            out, kept, how = lora_load.load_adapter(path, spec, model, base)
            return {}, kept, how  # claims the merge, changes nothing

        monkeypatch.setattr(weight_updates, "load_adapter", silent)
        trainer.step()
        await sync.prepare(2)
        with pytest.raises(weight_sync.AdapterNotServed, match="reached no server"):
            await sync.apply(2, flush_cache=True)
    finally:
        await client.close()


def test_lora_config_keys_are_validated(tiny_ckpt):
    """Bad train.lora values name their key before anything launches; a target no decoder layer has is named
    when the trainer builds the model."""
    from areal_async.config import ConfigError, RunConfig, TrainConfig, from_dict

    assert not TrainConfig().lora.enabled  # off by default
    cases = {
        "train.lora.rank: must be >= 0": {"rank": -1},
        "train.lora.alpha: must be > 0": {"rank": 4, "alpha": 0},
        "train.lora.dropout: must be in": {"rank": 4, "dropout": 1.0},
        "train.lora.target_modules: must name at least one": {"rank": 4, "target_modules": []},
        "train.lora.target_modules: 'lm_head'": {"rank": 4, "target_modules": ["lm_head"]},
        "train.lora.target_modules: 'q.proj' is not a module name": {"rank": 4, "target_modules": ["q.proj"]},
        "train.lora.target_modules: lists a name twice": {"rank": 4, "target_modules": ["q_proj", "q_proj"]},
    }
    for message, lora in cases.items():
        with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
            from_dict({"train": {"lora": lora}}, RunConfig).validate()
    with pytest.raises(ConfigError, match="train.delta_sync: with train.lora"):
        from_dict({"train": {"lora": {"rank": 4}, "delta_sync": True}}, RunConfig).validate()
    # LoRA on SGLang is accepted (rollout/lora_sync.py), with the adapters by disk, a bounded eta, launched locally
    from_dict({"train": {"lora": {"rank": 4}}, "server": {"backend": "sglang"}}, RunConfig).validate()
    sglang = {"backend": "sglang"}
    for message, extra in {
        "train.weight_sync: must be disk": {"train": {"lora": {"rank": 4}, "weight_sync": "broadcast"}},
        "schedule.eta: must be bounded": {"train": {"lora": {"rank": 4}}, "schedule": {"eta": None}},
        "launcher: must be local": {"train": {"lora": {"rank": 4}}, "launcher": "slurm"},
    }.items():
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            from_dict({**extra, "server": sglang}, RunConfig).validate()
    import transformers

    from areal_async.train.lora import inject_lora

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt)
    with pytest.raises(ValueError, match=r"train.lora.target_modules: \['qkv_proj'\] match no linear layer"):
        inject_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "qkv_proj"])


@pytest.mark.slow
def test_lora_benchmark_quick(tmp_path):
    """benchmarks/lora.py's smoke setting runs and writes its figures (no speed is asserted)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "lora.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "lora.py"), "--quick", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["train_step"]) == {"full", "lora"}
    w = result["weight_update"]
    assert w["lora"]["identity_checked"] and w["lora"]["bytes_per_update"] < w["full"]["bytes_per_update"]
