"""Delta sync over disk, bit-exact: the trainer's publisher (train/delta_publish.py) and embedded servers over real
HTTP. After any sequence of deltas (also for a server restarted on its launch weights, and after a trainer
rollback) a server's weights equal a full load bit for bit, proved by its per-parameter digests (SHA-256 of the
served bytes) against the trainer's. Bad deltas (truncated, corrupt, wrong base) are refused with the cause named,
the server keeps serving its previous weights, and DiskSync falls back to a full load.

The trainer here is the publisher driving a transformers model in this process (one rank: its collectives are
no-ops), stepped by sign-SGD at a small learning rate, which changes a fraction of the bf16 bits like an Adam step;
tests/test_weight_identity.py runs the published path through a real torchrun trainer.
"""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from areal_async.inference.client import InferenceClient
from areal_async.types import SamplingParams

pytestmark = pytest.mark.timeout(120)

SERVED = "bfloat16"


class LocalTrainer:
    """The two publishing calls of TrainerGroup over a DeltaPublisher in this process."""

    def __init__(self, base: str, full_every: int = 4, delta: bool = True) -> None:
        import torch
        import transformers

        from areal_async.train.delta_publish import DeltaPublisher

        transformers.utils.logging.disable_progress_bar()
        self.base = base
        self.model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        self.skip = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        self.publisher = DeltaPublisher()
        self.full_every = full_every
        self.delta = delta
        self.gen = torch.Generator().manual_seed(7)

    def step(self, lr: float = 2e-5) -> None:
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=self.gen).sign(), alpha=-lr)

    def state(self) -> dict:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def rollback(self, state: dict) -> None:
        """What a checkpoint load does to the trainer: other weights, and the publisher forgets its lineage."""
        self.model.load_state_dict(state)
        self.publisher.reset()

    async def publish_delta(self, version: int, root: str, keep: int = 2, *, served_dtype: str, force_full=False):
        import torch

        return await asyncio.to_thread(
            self.publisher.publish,
            self.model,
            source_dir=self.base,
            root=root,
            version=version,
            keep=keep,
            checkpoint_dtype=torch.float32,
            served=served_dtype,
            skip=self.skip,
            delta=self.delta,
            full_every=self.full_every,
            force_full=force_full,
        )


@pytest.fixture
async def servers(tiny_ckpt):
    """`await servers(n, dtype)`: n embedded servers serving in `dtype` (bf16 by default), from the base model, each
    with its own client."""
    from areal_async.server.app import start_server

    made = []

    async def make(n: int, dtype: str = SERVED):
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


async def load(client: InferenceClient, path: str, version: int) -> dict:
    (url,) = client.urls
    import aiohttp

    body = {"model_path": path, "weight_version": str(version), "flush_cache": True}
    async with aiohttp.ClientSession() as s, s.post(url + "/update_weights_from_disk", json=body) as r:
        return {"status": r.status, **(await r.json())}


@pytest.mark.parametrize("served", ["bfloat16", "float32"])
async def test_deltas_are_bit_exact_over_many_updates_and_across_a_restart(tiny_ckpt, servers, tmp_path, served):
    """fp32 serving holds the trainer's own fp32 values: the publisher must keep copies, not the parameters."""
    trainer = LocalTrainer(tiny_ckpt, full_every=4)
    root = str(tmp_path / "weights")
    (a, ca), (b, cb), (c, cc) = await servers(3, served)
    kinds, sparse = [], []
    for v in range(1, 11):
        trainer.step()
        pub = await trainer.publish_delta(v, root, served_dtype=served)
        kinds.append(pub.kind)
        if pub.kind == "delta":
            sparse.append(pub.changed / pub.total)
            assert pub.num_bytes < pub.full_bytes  # a delta ships less than the bf16 model
        await ca.update_weights_from_disk(pub.path, v)
        verdicts = await ca.verify_weights(pub.identity)
        assert verdicts[a.url].ok and verdicts[a.url].method == "digests", verdicts
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta", "delta", "delta", "full", "delta"]
    # sign-SGD moves every fp32 value; in bf16 most moves stay below an ulp
    assert all(0 < f < 0.9 for f in sparse) if served == "bfloat16" else all(0 < f <= 1 for f in sparse)
    # a server restarted on its launch weights loads the newest delta: it replays snapshot v9 + delta v10
    answer = await load(cb, pub.path, 10)
    assert answer["success"], answer
    assert "snapshot v9 + 1 delta(s)" in answer["message"]
    # bit for bit the same as a full load of version 10 (the trainer publishes it in full elsewhere)
    full = await trainer.publish_delta(10, str(tmp_path / "full"), served_dtype=served, force_full=True)
    assert full.kind == "full" and full.identity.digests == pub.identity.digests
    await cc.update_weights_from_disk(full.path, 10)
    fa, fb, fc = await fingerprint(ca), await fingerprint(cb), await fingerprint(cc)
    assert fa.digests == fb.digests == fc.digests == pub.identity.digests
    assert fa.version == fb.version == 10


async def test_a_rollback_starts_a_new_lineage_that_a_server_on_the_old_one_replays(tiny_ckpt, servers, tmp_path):
    trainer = LocalTrainer(tiny_ckpt, full_every=8)
    root = str(tmp_path / "weights")
    ((a, ca),) = await servers(1)
    trainer.step()
    await ca.update_weights_from_disk((await trainer.publish_delta(1, root, served_dtype=SERVED)).path, 1)
    at_1 = trainer.state()
    for v in (2, 3):
        trainer.step()
        old = await trainer.publish_delta(v, root, served_dtype=SERVED)
        assert old.kind == "delta"
        await ca.update_weights_from_disk(old.path, v)
    # the trainer rolls back to version 1 and trains 2 and 3 again, differently
    trainer.rollback(at_1)
    trainer.gen.manual_seed(99)
    trainer.step()
    new2 = await trainer.publish_delta(2, root, served_dtype=SERVED)
    assert new2.kind == "full"  # the lineage was forgotten
    trainer.step()
    new3 = await trainer.publish_delta(3, root, served_dtype=SERVED)
    assert new3.kind == "delta" and new3.identity.combined != old.identity.combined
    # the server holds the old version 3: same label as the new delta's base would suggest, other bits
    answer = await load(ca, new3.path, 3)
    assert answer["success"] and "snapshot v2 + 1 delta(s)" in answer["message"], answer
    assert (await fingerprint(ca)).digests == new3.identity.digests


async def test_bad_deltas_are_refused_naming_the_cause_and_the_old_weights_keep_serving(tiny_ckpt, servers, tmp_path):
    trainer = LocalTrainer(tiny_ckpt, full_every=8)
    root = str(tmp_path / "weights")
    (a, ca), (b, cb) = await servers(2)
    for v in (1, 2):
        trainer.step()
        pub = await trainer.publish_delta(v, root, served_dtype=SERVED)
        await ca.update_weights_from_disk(pub.path, v)
    held = await fingerprint(ca)
    trainer.step()
    d3 = await trainer.publish_delta(3, root, served_dtype=SERVED)
    data = os.path.join(d3.path, "delta.safetensors")

    truncated = str(tmp_path / "truncated")
    shutil.copytree(d3.path, truncated)
    with open(os.path.join(truncated, "delta.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(data) - 100)
    corrupt = str(tmp_path / "corrupt")
    shutil.copytree(d3.path, corrupt)
    with open(os.path.join(corrupt, "delta.safetensors"), "r+b") as f:
        f.seek(os.path.getsize(data) - 7)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    orphan = str(tmp_path / "elsewhere" / "v3")  # the delta without its chain: no snapshot beside it
    shutil.copytree(d3.path, orphan)

    for path, cause in ((truncated, "truncated"), (corrupt, "checksum mismatch")):
        answer = await load(ca, path, 3)
        assert answer["status"] == 400 and not answer["success"] and cause in answer["message"], answer
    # server b holds the launch weights, not the delta's base, and the snapshot is not there
    answer = await load(cb, orphan, 3)
    assert answer["status"] == 400 and "applies to v2" in answer["message"], answer
    assert "snapshot" in answer["message"] and "gone" in answer["message"]
    # nothing changed: a keeps serving version 2's weights under its label
    now = await fingerprint(ca)
    assert now.digests == held.digests and now.version == 2
    result = await ca.agenerate([5, 6, 7], SamplingParams(max_new_tokens=2, temperature=0.0))
    assert result.output_versions == [2, 2]
    # and the real delta still applies
    assert (await load(ca, d3.path, 3))["success"]
    assert (await fingerprint(ca)).digests == d3.identity.digests


async def test_disk_sync_falls_back_to_a_full_load_when_a_delta_is_refused(tiny_ckpt, servers, tmp_path):
    from areal_async.rollout.weight_sync import DiskSync

    trainer = LocalTrainer(tiny_ckpt, full_every=8)
    ((a, ca),) = await servers(1)
    sync = DiskSync(trainer, ca, str(tmp_path / "weights"))
    for v in (1, 2):
        trainer.step()
        await sync.prepare(v)
        await sync.apply(v, flush_cache=True)
    assert sync.stats["full_updates"] == 1 and sync.stats["delta_updates"] == 1
    assert sync.latest_checkpoint is None  # a delta is not an HF checkpoint: publish_final writes one
    trainer.step()
    await sync.prepare(3)
    path = sync._published[3].path
    with open(os.path.join(path, "delta.safetensors"), "r+b") as f:  # same size, other bytes
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    await sync.apply(3, flush_cache=True)
    assert sync.stats["delta_fallbacks"] == 1 and sync.stats["full_updates"] == 2
    assert sync._published[3].kind == "full" and sync.latest_checkpoint == sync._published[3].path
    assert (await fingerprint(ca)).digests == sync._published[3].identity.digests
    assert sync.stats["identity_mismatches"] == 0 and sync.stats["identity_check_s"] > 0
    assert ca.stats()["servers"][a.url]["state"] == "serving"


def test_delta_config_keys_are_validated():
    from areal_async.config import ConfigError, TrainConfig, from_dict

    with pytest.raises(ConfigError, match="delta_full_every: must be >= 1"):
        from_dict({"delta_full_every": 0}, TrainConfig)
    assert from_dict({"delta_sync": True, "weight_sync": "broadcast"}, TrainConfig).delta_sync  # both transports


async def test_a_fleet_with_sglang_gets_full_checkpoints(tiny_ckpt, fakes, tmp_path, caplog):
    """SGLang's /update_weights_from_disk reads HF checkpoints only: no delta is ever published for it."""
    from areal_async.rollout.weight_sync import DiskSync

    (fake,) = await fakes(1)
    fake.sglang_version = "0.5.6"
    trainer = LocalTrainer(tiny_ckpt, full_every=8)
    client = InferenceClient([fake.url])
    try:
        sync = DiskSync(trainer, client, str(tmp_path / "weights"))
        for v in (1, 2, 3):
            trainer.step()
            await sync.prepare(v)
            await sync.apply(v, flush_cache=True)
        assert sync.stats["full_updates"] == 3 and sync.stats["delta_updates"] == 0
        assert "cannot load a delta" in caplog.text
        assert [b["model_path"] for kind, b in fake.admin if kind == "update"] == [
            str(tmp_path / "weights" / f"v{v}") for v in (1, 2, 3)
        ]
    finally:
        await client.close()
