"""LoRA on SGLang (issue 23, items 2-4 for SGLang): the launcher's LoRA flags, adapter sync through
/load_lora_adapter and /unload_lora_adapter with eta + 1 versions loaded, every request pinned to the adapter of the
version it started under (its tokens all carry that version), the proof after each update, the loud failure when an
adapter never arrives, and a short controller run end to end.

Against the fake SGLang (areal_async/testing/fake_sglang.py, which follows SGLang 0.5's LoRA protocol: names are
registered at load, unregistered at once at unload, whose answer waits for the requests under the adapter) and
against SGLang's own answers written down in tests/fixtures/sglang/lora.json. No SGLang process runs here."""

from __future__ import annotations

import asyncio
import json
import math
import os

import pytest
from aiohttp import web

from areal_async.config import ConfigError, RunConfig, ScheduleConfig, from_dict
from areal_async.inference.client import InferenceClient
from areal_async.inference.lora_window import AdapterWindow, adapter_name
from areal_async.launch.processes import sglang_server_cmd
from areal_async.launch.sglang_lora import adapter_window, sglang_lora_args
from areal_async.rollout.lora_sync import AdapterSync
from areal_async.rollout.weight_sync import AdapterNotServed, update_weights
from areal_async.testing.fake_sglang import tok_logprob
from areal_async.train.messages import DeltaPublishResult
from areal_async.types import SamplingParams

pytestmark = pytest.mark.timeout(60)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "sglang")


class AdapterTrainer:
    """The trainers' side the sync sees: `publish_delta` writes `root/v<k>` as adapters (train/lora_publish.py)."""

    def __init__(self) -> None:
        self.published: list[tuple[int, int]] = []  # (version, keep)

    async def publish_delta(self, version, root, keep=2, *, served_dtype="float32", force_full=False, identity=True):
        assert not identity  # SGLang applies adapters per request: no merged identity is asked for
        self.published.append((version, keep))
        from areal_async.protocol.weight_identity import Identity

        return DeltaPublishResult(
            path=os.path.join(root, f"v{version}"),
            seconds=0.0,
            num_bytes=1000,
            kind="adapter",
            identity=Identity(version=version, dtype=served_dtype, digests={}, combined=""),
            changed=10,
            total=100,
            full_bytes=100_000,
        )


def lora_cfg(**schedule) -> RunConfig:
    cfg = from_dict(
        {
            "server": {"backend": "sglang", "extra_args": ["--mem-fraction-static", "0.7"]},
            "train": {"lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}},
            "schedule": schedule,
        },
        RunConfig,
    )
    cfg.validate()
    return cfg


def test_the_launcher_starts_sglang_with_lora_sized_to_the_window():
    cfg = lora_cfg(eta=2)
    args = sglang_lora_args(cfg, list(cfg.server.extra_args))
    assert args == [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
        "--max-loras-per-batch",
        "4",  # eta + 1 adapter versions, and the base model's requests (SGLang counts them as one more)
    ]
    assert "--max-loaded-loras" not in args  # SGLang would evict adapters by itself
    cmd = sglang_server_cmd(
        "/m", host="h", port="1", api_key=None, extra_args=list(cfg.server.extra_args), lora_args=args
    )
    assert cmd[cmd.index("--enable-lora") - 2 : cmd.index("--enable-lora")] == ["--mem-fraction-static", "0.7"]
    assert adapter_window(cfg) == 3 and adapter_window(lora_cfg(mode="sync")) == 1
    # a flag the user set wins; without train.lora there are none
    assert "--max-loras-per-batch" not in sglang_lora_args(cfg, ["--max-loras-per-batch", "16"])
    plain = from_dict({"server": {"backend": "sglang"}}, RunConfig)
    assert sglang_lora_args(plain, []) == []
    with pytest.raises(ConfigError, match="--dp-size 2 with train.lora"):
        sglang_lora_args(cfg, ["--dp-size", "2"])
    # the local launcher passes them to every SGLang server it starts (restarts included: the same call)
    from areal_async.launch import local

    class Recorder:
        def __init__(self):
            self.lora_args = []

        def start_sglang_server(self, index, model, **kw):
            self.lora_args.append(kw["lora_args"])

    procs = Recorder()
    local._start_server(procs, cfg, "/m", 0, 0)
    local._start_server(procs, plain, "/m", 0, 0)
    assert procs.lora_args == [args, []]


async def fleet(fakes, n: int = 2, **kw):
    servers = await fakes(n, **kw)
    for s in servers:
        s.lora_enabled = True
    return servers


async def test_each_version_is_loaded_under_its_name_and_the_window_keeps_eta_plus_one(fakes, tmp_path):
    servers = await fleet(fakes)
    trainer = AdapterTrainer()
    async with InferenceClient([s.url for s in servers], stream=False) as c:
        sync = AdapterSync(trainer, c, str(tmp_path), window=2, keep_versions=2)
        for v in (1, 2, 3, 4):
            await sync.prepare(v)
            await update_weights(sync, c, v, "abort")
        await sync.drain()
        for s in servers:
            ops = [(op, b["lora_name"]) for op, b in s.lora_calls]
            assert [n for op, n in ops if op == "load"] == [f"areal-v{v}" for v in (1, 2, 3, 4)]
            assert [n for op, n in ops if op == "unload"] == ["areal-v1", "areal-v2"]
            # a version is unloaded only once the one that pushed it out of the window is loaded
            assert ops.index(("unload", "areal-v1")) > ops.index(("load", "areal-v3"))
            assert ops.index(("unload", "areal-v2")) > ops.index(("load", "areal-v4"))
            assert s.adapters == {"areal-v3": str(tmp_path / "v3"), "areal-v4": str(tmp_path / "v4")}
            assert not any(name == "pause" for name, _ in s.admin)  # pauseless: nothing in flight changes weights
            assert s.version == "4"  # relabelled: the label the fleet's catch-up compares
        # a server that comes back loads the whole window keeps every adapter of the window on disk
        assert trainer.published[0] == (1, 3)
        stats = c.stats()
        assert stats["adapter_loads"] == 8 and stats["adapter_unloads"] == 4
    assert sync.stats["adapter_updates"] == 4 and await sync.final_adapter(4) == str(tmp_path / "v4")


async def test_a_request_runs_under_the_adapter_it_started_with(fakes, tmp_path):
    """A request started before an update keeps its version for every token; one started after names the new
    adapter; a request interrupted (an abort from elsewhere) and resubmitted after the next update still names its
    own adapter (in the window), so all its tokens are of one version."""
    [s] = await fleet(fakes, 1, token_delay=0.01)
    async with InferenceClient([s.url], stream=False, backoff_s=0.01) as c:
        sync = AdapterSync(AdapterTrainer(), c, str(tmp_path), window=2)
        early = asyncio.create_task(c.agenerate([5], SamplingParams(max_new_tokens=8)))
        await s.wait_progress(1, 2)
        await sync.prepare(1)
        await update_weights(sync, c, 1, "abort")
        base = await early
        assert base.output_versions == [0] * 8 and base.num_interruptions == 0
        assert "lora_path" not in s.received[0]  # version 0 is the base model

        s.abort_after = [3]  # the next request is aborted after 3 tokens, as if by someone else
        pinned = asyncio.create_task(c.agenerate([5], SamplingParams(max_new_tokens=8)))
        while len(s.received) < 2:
            await asyncio.sleep(0.005)
        await sync.prepare(2)
        await update_weights(sync, c, 2, "abort")
        r = await pinned
    sent = [b.get("lora_path") for b in s.received if b["rid"].startswith("areal-lora-probe") is False]
    assert sent[1:] == ["areal-v1", "areal-v1"]  # the resubmission names the adapter it started under
    assert r.num_interruptions == 1 and r.output_versions == [1] * 8
    # the fake's logprobs carry the adapter that made the token (-0.001 * its version) on top of its label's
    for lp, t in zip(r.output_logprobs, r.output_ids):
        assert any(math.isclose(lp, tok_logprob(t, label) - 0.001) for label in ("1", "2"))


async def test_a_request_that_outlives_its_adapter_moves_on_to_the_newest(fakes, tmp_path):
    """Beyond the staleness bound (window of one, eta 0): the unload of version 1 waits for the request running
    under it (SGLang's unload), and a request interrupted while its adapter left the window resumes under the newest,
    its later tokens labelled with that version (as a resumed request's are with full weights)."""
    [s] = await fleet(fakes, 1, token_delay=0.01)
    async with InferenceClient([s.url], stream=False, backoff_s=0.05) as c:
        sync = AdapterSync(AdapterTrainer(), c, str(tmp_path), window=1)
        await sync.prepare(1)
        await update_weights(sync, c, 1, "abort")
        running = asyncio.create_task(c.agenerate([5], SamplingParams(max_new_tokens=10)))
        await s.wait_progress(1, 2)
        await sync.prepare(2)
        await update_weights(sync, c, 2, "abort")
        while "areal-v1" in s.adapters:  # unregistered at once by the background unload...
            await asyncio.sleep(0.002)
        assert sync._unloads and not running.done()  # ...whose answer waits for the request under it
        r = await running
        await sync.drain()
        assert r.output_versions == [1] * 10 and r.num_interruptions == 0  # it ran to the end under version 1

        s.abort_after = [3]
        moved = asyncio.create_task(c.agenerate([5], SamplingParams(max_new_tokens=6)))
        while len([b for b in s.received if b.get("lora_path") == "areal-v2"]) < 2:  # the probe and this request
            await asyncio.sleep(0.005)
        await sync.prepare(3)
        await update_weights(sync, c, 3, "abort")
        m = await moved
        assert c.stats()["adapter_repins"] == 1
    assert m.output_versions[:3] == [2, 2, 2] and m.output_versions[3:] == [3, 3, 3]


async def test_an_adapter_that_never_arrives_stops_the_run_in_that_update(fakes, tmp_path):
    """A server that answers success but does not list the adapter (the silent failure), one started without
    --enable-lora, one that refuses the directory: when no server serves it, AdapterNotServed, naming why; one
    server that fails alone leaves rotation and loads the window when it comes back."""
    trainer = AdapterTrainer()
    for fault, why in [("silent", "loaded adapters list areal-v1 at None"), ("off", "LoRA is not enabled")]:
        servers = await fleet(fakes)
        for s in servers:
            s.lora_silent = fault == "silent"
            s.lora_enabled = fault != "off"
        async with InferenceClient([s.url for s in servers], stream=False) as c:
            sync = AdapterSync(trainer, c, str(tmp_path), window=2)
            await sync.prepare(1)
            with pytest.raises(AdapterNotServed, match=why):
                await update_weights(sync, c, 1, "abort")
            assert sync.window.pin().version == 0  # new requests never name an adapter that did not arrive

    good, bad = await fleet(fakes)
    bad.lora_fail_paths = {str(tmp_path / "v1")}
    async with InferenceClient([good.url, bad.url], stream=False, probe_interval_s=0.05) as c:
        sync = AdapterSync(trainer, c, str(tmp_path), window=2)
        await sync.prepare(1)
        await update_weights(sync, c, 1, "abort")
        assert c.stats()["servers"][bad.url]["state"] == "syncing"
        r = await c.agenerate([5], SamplingParams(max_new_tokens=3))
        assert r.output_versions == [1, 1, 1] and good.received[-1]["lora_path"] == "areal-v1"
        bad.lora_fail_paths = set()
        await c.wait_serving(bad.url, timeout_s=10)  # its catch-up loaded the window
        assert bad.adapters == {"areal-v1": str(tmp_path / "v1")}


async def test_a_restarted_server_loads_the_window_before_it_serves(fakes, tmp_path):
    a, b = await fleet(fakes)
    async with InferenceClient([a.url, b.url], stream=False, probe_interval_s=0.05) as c:
        sync = AdapterSync(AdapterTrainer(), c, str(tmp_path), window=2)
        for v in (1, 2):
            await sync.prepare(v)
            await update_weights(sync, c, v, "abort")
        await b.kill()
        assert (await c.health())[b.url] is False
        [b2] = await fakes(1, port=b.port)  # a new process on the same port: no adapters, the launch label
        b2.lora_enabled = True
        for _ in range(500):
            if c.stats()["servers"][b.url]["healthy"]:
                break
            await asyncio.sleep(0.02)
        assert b2.adapters == {"areal-v1": str(tmp_path / "v1"), "areal-v2": str(tmp_path / "v2")}
        assert b2.version == "2" and c.stats()["servers"][b.url]["state"] == "serving"


async def test_a_server_that_recovers_during_a_load_takes_the_version_being_loaded(fakes, tmp_path):
    """While a version is being loaded it is not yet in the window (no request names it), but a server whose
    ready check runs meanwhile loads it too: it never returns to rotation (and to the relabel) without it."""
    [s] = await fleet(fakes, 1)
    async with InferenceClient([s.url], stream=False) as c:
        sync = AdapterSync(AdapterTrainer(), c, str(tmp_path), window=2)
        await sync.prepare(1)
        await update_weights(sync, c, 1, "abort")
        sync.window.pending = (2, str(tmp_path / "v2"))
        server = c._pool.router.servers[s.url]
        assert await c._pool.ready_check(server)
        assert sorted(s.adapters) == ["areal-v1", "areal-v2"]
        sync.window.pending = None
        s.lora_fail_paths = {str(tmp_path / "v1")}
        s.adapters.clear()  # a restarted server that cannot load an adapter of the window stays out
        assert not await c._pool.ready_check(server)


async def test_external_servers_that_are_not_ours_get_adapters_per_request(fakes, tmp_path):
    from areal_async.session.connect import _sglang_fleet

    [s] = await fakes(1)
    cfg = from_dict({"server": {"backend": "external", "urls": [s.url]}, "train": {"lora": {"rank": 4}}}, RunConfig)
    async with InferenceClient([s.url], stream=False) as c:
        assert await _sglang_fleet(cfg, c)  # SGLang's /get_server_info has no weights_delta
    assert await _sglang_fleet(lora_cfg(), None)
    embedded = from_dict({"train": {"lora": {"rank": 4}}}, RunConfig)
    assert not await _sglang_fleet(embedded, None)


async def test_a_rollback_replaces_the_versions_of_the_old_lineage(fakes, tmp_path):
    [s] = await fleet(fakes, 1)
    async with InferenceClient([s.url], stream=False) as c:
        sync = AdapterSync(AdapterTrainer(), c, str(tmp_path), window=3)
        for v in (1, 2, 3, 2):  # a rollback to 1 publishes version 2 again
            await sync.prepare(v)
            await update_weights(sync, c, v, "abort")
    ops = [(op, b["lora_name"]) for op, b in s.lora_calls]
    assert ops[3:] == [("unload", "areal-v2"), ("unload", "areal-v3"), ("load", "areal-v2")]
    assert sync.window.pin() == (2, "areal-v2") and sorted(s.adapters) == ["areal-v1", "areal-v2"]


def test_the_window_bounds():
    w = AdapterWindow(2)
    assert w.pin() == (0, None) and w.holds(0)
    assert w.admit(1, "/v1") == [] and w.holds(0) and w.holds(1)
    assert w.admit(2, "/v2") == [] and not w.holds(0) and w.holds(1) and w.holds(2)  # eta 1: v - 1 and v
    assert w.admit(3, "/v3") == [1] and not w.holds(1) and w.pin() == (3, "areal-v3")
    assert w.loaded == {2: "/v2", 3: "/v3"}
    assert adapter_name(7) == "areal-v7"
    with pytest.raises(ValueError):
        AdapterWindow(0)


# ---- SGLang's own answers (tests/fixtures/sglang/lora.json) -------------------------------------------------------


def lora_fixture() -> dict:
    with open(os.path.join(FIXTURES, "lora.json")) as f:
        return json.load(f)


async def test_the_client_reads_sglangs_recorded_lora_answers(tmp_path):
    """Load, unload and /generate answers as SGLang 0.5 sends them, replayed: the request bodies the client sends
    are the ones the fixture file records, and each recorded failure is read as SGLang means it."""
    fx = lora_fixture()
    answers: dict[str, list] = {k: list(v) for k, v in fx["answers"].items()}
    got: list[tuple[str, dict]] = []

    async def handle(request: web.Request) -> web.Response:
        name = request.path.strip("/")
        body = await request.json()
        got.append((name, body))
        entry = answers[name].pop(0)
        return web.json_response(entry["body"], status=entry["status"])

    app = web.Application()
    for name in ("load_lora_adapter", "unload_lora_adapter", "generate", "update_weight_version"):
        app.router.add_post("/" + name, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with InferenceClient([url], stream=False) as c:
            window = AdapterWindow(1)
            c.use_adapters(window)
            ok = await c.load_lora_adapter(1, fx["requests"]["load_lora_adapter"]["lora_path"])
            assert ok == {url: ""}
            window.admit(1, fx["requests"]["load_lora_adapter"]["lora_path"])
            assert await c.unload_lora_adapters([1]) == {url: ""}
            assert await c.unload_lora_adapters([1]) == {url: ""}  # "does not exist": gone already
            refused = await c.load_lora_adapter(2, "/runs/r/weights/v2")  # last: the server leaves rotation
            assert "rank 16 is incompatible" in refused[url]
        load, probe = got[0][1], got[1][1]
        assert load == fx["requests"]["load_lora_adapter"]
        assert probe["lora_path"] == "areal-v1" and probe["sampling_params"]["max_new_tokens"] == 1
        assert got[2] == ("unload_lora_adapter", fx["requests"]["unload_lora_adapter"])
        assert [n for n, _ in got] == ["load_lora_adapter", "generate"] + ["unload_lora_adapter"] * 2 + [
            "load_lora_adapter"
        ]
    finally:
        await runner.cleanup()


def test_the_fixture_answers_are_what_the_fake_answers(fakes):
    """The fake's LoRA answers have the fixture's fields (SGLang's LoRAUpdateOutput) and its error texts."""
    fx = lora_fixture()["answers"]
    success = fx["load_lora_adapter"][0]["body"]
    assert set(success) == {"success", "error_message", "loaded_adapters", "rid", "http_worker_ipc"}
    assert "not loaded" in fx["generate"][1]["body"]["error"]["message"]
    assert "does not exist" in fx["unload_lora_adapter"][1]["body"]["error_message"]


# ---- the controller end to end ------------------------------------------------------------------------------------


class LoRATrainer(AdapterTrainer):
    """The controller's trainer (tests/test_rollout.py's shape) that publishes adapters and records its batches."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[int, list]] = []

    async def train_step(self, trajectories, policy_version):
        from areal_async.types import TrainStepResult

        self.batches.append((policy_version, list(trajectories)))
        await asyncio.sleep(0.01)
        return TrainStepResult(version=policy_version + 1, stats={"loss": 0.0})


def lora_controller(tmp_path, client, trainer, weights, steps: int):
    from areal_async.rollout.controller import AsyncRLController
    from areal_async.rollout.samples import SampleStream
    from areal_async.rollout.workflows.rlvr import RLVRWorkflow
    from areal_async.types import Sample

    class Chars:
        def encode(self, text):
            return [5 + ord(c) % 20 for c in text]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    async def score(completion, answer, prompt="", meta=None):
        return float(len(completion) % 2), None

    samples = [Sample(id=i, prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(40)]
    wf = RLVRWorkflow(Chars(), score, SamplingParams(max_new_tokens=6), group_size=2)
    schedule = ScheduleConfig(batch_size=2, eta=1, total_steps=steps, eval_every=0)
    return AsyncRLController(
        schedule, client, trainer, wf, SampleStream(samples, seed=1), str(tmp_path), weights=weights
    )


async def test_a_short_run_on_sglang_trains_adapter_pinned_tokens_within_the_bound(fakes, tmp_path):
    """The real controller, client and adapter sync against two fake SGLang servers: every trained trajectory's
    tokens carry one version, the version of the adapter its requests named, at most eta old; the servers end
    holding the last eta + 1 adapters and were never paused."""
    servers = await fleet(fakes, 2, token_delay=0.002)
    trainer = LoRATrainer()
    async with InferenceClient([s.url for s in servers], stream=False) as c:
        weights = AdapterSync(trainer, c, str(tmp_path / "weights"), window=2)
        await lora_controller(tmp_path, c, trainer, weights, steps=4).run()
        await weights.drain()
    assert [v for v, _ in trainer.batches] == [0, 1, 2, 3]
    named = {b["rid"]: b.get("lora_path") for s in servers for b in s.received}
    for v, trajs in trainer.batches:
        for t in trajs:
            got = {x for x, m in zip(t.versions, t.loss_mask) if m}
            assert len(got) == 1 and v - 1 <= min(got) <= v  # pinned, and within eta = 1
    assert set(named.values()) >= {None, "areal-v1", "areal-v2", "areal-v3"}
    for s in servers:
        assert sorted(s.adapters) == ["areal-v3", "areal-v4"]
        assert not any(op == "pause" for op, _ in s.admin)


async def test_a_run_whose_adapter_never_reaches_sglang_stops_within_the_step(fakes, tmp_path):
    servers = await fleet(fakes, 2)
    for s in servers:
        s.lora_silent = True  # answers success, registers nothing
    trainer = LoRATrainer()
    async with InferenceClient([s.url for s in servers], stream=False) as c:
        weights = AdapterSync(trainer, c, str(tmp_path / "weights"), window=2)
        with pytest.raises(AdapterNotServed, match="reached no server as areal-v1"):
            await lora_controller(tmp_path, c, trainer, weights, steps=4).run()
    assert len(trainer.batches) == 1  # the first update stopped the run


def test_adapters_for_sglang_are_published_without_the_merged_identity(tiny_ckpt, tmp_path):
    """SGLang's adapter sync asks the trainers for no identity: the same peft directory, the same element count,
    but no gather of the base and no merge (what the embedded server's proof costs per version)."""
    import torch
    import transformers

    from areal_async.train.lora import initial_adapters, inject_lora, lora_modules
    from areal_async.train.lora_publish import AdapterPublisher

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    inject_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    model.load_state_dict(initial_adapters(model, seed=3), strict=False)
    lora = {n: m.lora_scale for n, m in lora_modules(model).items()}
    skip = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    kw = dict(lora=lora, rank=4, alpha=8.0, dropout=0.0, source_dir=tiny_ckpt, version=1, keep=2, skip=skip)
    full, bare = AdapterPublisher(), AdapterPublisher()
    a = full.publish(model, root=str(tmp_path / "a"), served="bfloat16", **kw)
    b = bare.publish(model, root=str(tmp_path / "b"), served="bfloat16", identity=False, **kw)
    assert a.identity.digests and not b.identity.digests and not bare.base and full.base
    assert (a.total, a.changed, a.num_bytes, a.kind) == (b.total, b.changed, b.num_bytes, b.kind)
    name = "adapter_model.safetensors"
    assert (tmp_path / "a" / "v1" / name).read_bytes() == (tmp_path / "b" / "v1" / name).read_bytes()
