"""The client's contract with SGLang, checked against real SGLang servers and against the fake, with the same checks.

Every check below runs on each target:
- `fake-<release>`: areal_async/testing/fake_sglang.py set up as that release (`FakeSGLang.like`), always;
- `real`: a real SGLang server launched by the project's own launcher code from the interpreter in
  AREAL_SGLANG_PYTHON (`make sglang` builds one; .ci/sglang_leg.sh runs this module once per release), serving
  SmolLM2-135M-Instruct on the CPU. Without the variable the real target skips, saying so; with
  AREAL_REQUIRE_SGLANG=1 (CI) it fails instead.
A check the fake passes and the real server fails (or the other way round) is drift, caught in the same CI run.
Beside the checks, every answer a real server of each release gave to a fixed script of exchanges is recorded in
tests/fixtures/sglang/<release>/answers.json (scripts/record_sglang_fixtures.py; testing/sglang_record.py): the
fake set up as that release must answer the same script alike (fields, statuses, the messages the client matches),
and in CI the live server must still answer as recorded.
Checks that only a real engine can answer (weights that really change, a gloo weight broadcast from the project's
trainer side, its radix cache, a stopped process, a run end to end) follow the shared ones. Tests marked
`sglang_real` need the real server.
"""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import aiohttp
import pytest

from areal_async.inference.client import AdminError, InferenceClient
from areal_async.inference.dialect import parse_release
from areal_async.testing import sglang_record
from areal_async.testing.fake_sglang import LORA_OFF, LORA_OFF_GENERATE, FakeSGLang, next_tok
from areal_async.types import SamplingParams

PYTHON = os.environ.get("AREAL_SGLANG_PYTHON", "")
RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "sglang")
REQUIRED = os.environ.get("AREAL_REQUIRE_SGLANG") == "1"
FAKE_RELEASES = ["0.5.10", "0.5.23"]


def _real_release() -> str | None:
    if not PYTHON:
        return None
    out = subprocess.run(
        [PYTHON, "-c", "import importlib.metadata as m; print(m.version('sglang'))"], capture_output=True, text=True
    )
    return out.stdout.strip() or None


def _no_real(why: str) -> None:
    if REQUIRED:
        pytest.fail(f"AREAL_REQUIRE_SGLANG=1 but {why}")
    pytest.skip(why)


class Target:
    """One server under test: its URL, release, and whether it is the real engine."""

    def __init__(self, url: str, release: str, real: bool, model: str = "", pid: int = 0) -> None:
        self.url = url
        self.release = release
        self.version = parse_release(release)
        self.real = real
        self.model = model  # the checkpoint it serves (real)
        self.pid = pid  # its HTTP front's process (real)


def _wait_healthy(child, timeout_s: float) -> None:
    """Until the launched server answers /health (a plain poll: the fixture may be set up inside a running loop)."""
    import urllib.error
    import urllib.request

    from areal_async.launch.processes import tail

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            pytest.fail(f"SGLang exited ({child.proc.returncode}):\n{tail(child.log_path)}")
        try:
            with urllib.request.urlopen(child.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    pytest.fail(f"SGLang not healthy after {timeout_s:.0f}s:\n{tail(child.log_path)}")


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    """A real SGLang server, started as `server.backend=sglang` starts one for an in-place run (launch/
    sglang_server.py: no radix cache), so that every check, in-place updates included, runs on it."""
    release = _real_release()
    if release is None:
        _no_real("AREAL_SGLANG_PYTHON names no interpreter with SGLang (make sglang; .ci/sglang_leg.sh)")
    from areal_async.launch.processes import Processes
    from areal_async.testing.real_model import smollm2_path

    model = smollm2_path()
    procs = Processes(str(tmp_path_factory.mktemp("sglang")))
    child = procs.start_sglang_server(
        0, model, host="127.0.0.1", port=0, api_key=None, extra_args=["--max-total-tokens", "16384"],
        python=PYTHON, device="cpu", radix_cache=False, threads=2,
    )  # fmt: skip
    try:
        _wait_healthy(child, 600)
        yield Target(child.url or "", release, True, model, child.proc.pid)
    finally:
        procs.shutdown()


@pytest.fixture(params=[*[f"fake-{r}" for r in FAKE_RELEASES], "real"])
async def target(request):
    if request.param == "real":
        real = request.getfixturevalue("real_server")
        async with aiohttp.ClientSession() as http:  # each check starts at version 0, as on a new fake
            await http.post(real.url + "/continue_generation", json={})
            await http.post(real.url + "/update_weight_version", json={"new_version": "0"})
        yield real
        return
    fake = await FakeSGLang.like(request.param.split("-", 1)[1], token_delay=0.01).start()
    try:
        yield Target(fake.url, fake.sglang_version or "", False)
    finally:
        fake.paused = fake.hung = False
        fake._resumed.set()
        await fake.kill()


def client(t: Target, **kw) -> InferenceClient:
    return InferenceClient([t.url], backoff_s=0.05, probe_interval_s=0.2, **kw)


def long(t: Target) -> int:
    """A generation long enough to be caught in flight: a real CPU server makes tens of tokens a second."""
    return 400 if t.real else 120


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


async def in_flight(t: Target, c: InferenceClient, n: int) -> None:
    """Until `n` requests have made tokens on the server (a real CPU server needs a moment to prefill)."""
    await asyncio.sleep(2.0 if t.real else 0.3)


# ---- shared checks: the fake and the real server must answer alike --------------------------------------------


async def test_detected_as_its_release(target):
    async with client(target) as c:
        await c.agenerate(PROMPT, greedy(2))
        d = c._pool.router.servers[target.url].dialect
        assert d.engine == "sglang" and d.version == target.version
        assert d.version_spans == (target.version >= (0, 5, 19))
        assert d.weight_update_sessions == (target.version >= (0, 5, 21))


async def test_greedy_generation_is_exact_and_repeatable(target):
    async with client(target) as c:
        a = await c.agenerate(PROMPT, greedy(12, ignore_eos=True))
        b = await c.agenerate(PROMPT, greedy(12, ignore_eos=True))
    assert a.finish_reason == "length" and len(a.output_ids) == 12
    assert a.output_ids == b.output_ids
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in a.output_logprobs)
    assert a.output_versions == [0] * 12
    if not target.real:
        assert a.output_ids[0] == next_tok(PROMPT[-1])


async def test_streamed_and_json_answers_agree(target):
    async with client(target, stream=False) as c:
        plain = await c.agenerate(PROMPT, greedy(10, ignore_eos=True))
    async with client(target, stream=True) as c:
        streamed = await c.agenerate(PROMPT, greedy(10, ignore_eos=True))
    assert streamed.output_ids == plain.output_ids and streamed.output_versions == plain.output_versions


async def test_abort_by_rid_returns_the_tokens_so_far(target):
    async with client(target) as c:
        task = asyncio.create_task(c.agenerate(PROMPT, greedy(3000, ignore_eos=True), rid="conf-abort"))
        await in_flight(target, c, 1)
        await c.abort("conf-abort")
        res = await asyncio.wait_for(task, 60)
    assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 3000


async def test_pause_abort_resumes_under_the_new_label(target):
    async with client(target) as c:
        tasks = [asyncio.create_task(c.agenerate(PROMPT, greedy(long(target), ignore_eos=True))) for _ in range(2)]
        await in_flight(target, c, 2)
        await c.pause("abort")
        await c.update_weight_version(1)
        await c.resume()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
    for r in results:
        assert len(r.output_ids) == long(target) and r.num_interruptions >= 1
        assert r.output_versions[0] == 0 and r.output_versions[-1] == 1
        assert r.output_versions == sorted(r.output_versions)


async def test_in_place_update_versions(target):
    """An in-place pause keeps the requests on the server across a weight load. From 0.5.19 every token's version
    is exact (meta_info.weight_versions); before, the whole answer carries the final label."""
    path = target.model or "/fake/ckpt/v1"
    async with client(target) as c:
        tasks = [asyncio.create_task(c.agenerate(PROMPT, greedy(long(target), ignore_eos=True))) for _ in range(2)]
        await in_flight(target, c, 2)
        await c.pause("in_place")
        await c.update_weights_from_disk(path, 1, flush_cache=False)
        await c.resume()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
    for r in results:
        assert len(r.output_ids) == long(target) and r.num_interruptions == 0
        if target.version >= (0, 5, 19):
            assert r.output_versions[0] == 0 and r.output_versions[-1] == 1
            assert r.output_versions == sorted(r.output_versions)
        else:
            assert set(r.output_versions) == {1}


async def test_version_label_is_read_back(target):
    async with client(target) as c:
        await c.update_weight_version(7)
        server = c._pool.router.servers[target.url]
        assert await c._fleet.server_version(server) == 7
        await c.update_weight_version(0)


async def test_a_server_labelled_otherwise_is_reloaded_before_it_serves(target):
    """A server used before the run (an external fleet) still labelled 2 is brought to the run's weights (its
    checkpoint, version 0) before it serves, not taken as it is."""
    from areal_async.inference.client import WeightTarget

    path = target.model or "/fake/ckpt/base"
    async with client(target) as c:
        await c.update_weight_version(2)
    async with client(target) as c:
        c.weight_target = WeightTarget(0, path)
        await c.bring_to_target()
        server = c._pool.router.servers[target.url]
        assert server.state == "serving" and await c._fleet.server_version(server) == 0
        res = await c.agenerate(PROMPT, greedy(3))
    assert res.output_versions == [0, 0, 0]


async def test_unknown_sampling_key_and_malformed_body(target):
    async with aiohttp.ClientSession() as http:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "no_such_key": 1}, "rid": "conf-strict"}
        async with http.post(target.url + "/generate", json=body) as r:
            assert (r.status == 400) == (target.version >= (0, 5, 22)), r.status
    async with client(target) as c:  # the client never sends such a key
        assert len((await c.agenerate(PROMPT, greedy(2))).output_ids) == 2


async def test_liveness_ignores_a_pause_the_client_did_not_make(target):
    """Paused from outside (an in-place pause by another controller, or a long weight load), SGLang's /health waits
    for /continue_generation; the heartbeat asks the engine's liveness path instead and keeps the server."""
    async with client(target, health_timeout_s=0.5, max_health_failures=2) as c:
        task = asyncio.create_task(c.agenerate(PROMPT, greedy(200, ignore_eos=True)))
        await in_flight(target, c, 1)
        async with aiohttp.ClientSession() as http:
            await http.post(target.url + "/pause_generation", json={"mode": "in_place"})
            await asyncio.sleep(4.0)  # 8 health deadlines
            assert c.stats()["servers"][target.url]["state"] == "serving"
            await http.post(target.url + "/continue_generation", json={})
        res = await asyncio.wait_for(task, 300)
    assert len(res.output_ids) == 200 and c.stats()["servers_lost"] == 0


async def test_weight_update_sessions_exist_from_0_5_21(target):
    """From 0.5.21 a broadcast update runs between POST /begin_weight_update and /end_weight_update (the dialect
    wraps every bucket; inference/sglang_dialect.py); before, neither path exists."""
    async with aiohttp.ClientSession() as http:
        for path in ("/begin_weight_update", "/end_weight_update"):
            async with http.post(target.url + path, json={}) as r:
                assert r.status == (200 if target.version >= (0, 5, 21) else 404), (path, r.status)


async def test_lora_is_refused_where_the_server_has_none(target, tmp_path):
    """Runtime LoRA needs `--enable-lora` at launch, and SGLang's LoRA layers cannot run on a CPU (they pin host
    memory, which needs a CUDA driver: docs/inference.md, "LoRA"), so every server here has none. The client's own
    LoRA calls (inference/lora_window.py) must read that refusal as SGLang words it, on the fake as on the real."""
    from areal_async.inference.lora_window import load_adapter, probe_adapter, unload_adapter

    async with client(target) as c:
        await c.agenerate(PROMPT, greedy(1))
        server = c._pool.router.servers[target.url]
        assert await load_adapter(c._pool, server, 1, str(tmp_path)) == f"HTTP 400: {LORA_OFF}"
        assert await unload_adapter(c._pool, server, 1) == f"HTTP 400: {LORA_OFF}"
        probe = await probe_adapter(c._pool, server, 1)
        assert probe == f"HTTP 400: LoRA adapter 'areal-v1' was requested, but LoRA is not enabled. {LORA_OFF_GENERATE}"
        assert (await c.agenerate(PROMPT, greedy(2))).finish_reason == "length"  # the refusals left it serving


# ---- the fake and the live server against the recorded answers ------------------------------------------------


def _recorded(release: str) -> dict:
    path = os.path.join(RECORDED, release, "answers.json")
    if not os.path.exists(path):
        pytest.fail(f"no answers recorded for SGLang {release}: scripts/record_sglang_fixtures.py <its python>")
    return sglang_record.load(path)


@pytest.mark.parametrize("release", FAKE_RELEASES)
async def test_fake_answers_as_the_release_was_recorded(release, tmp_path):
    fake = await FakeSGLang.like(release, token_delay=0.01).start()
    fake.weights = {sglang_record.NORM: [1.0] * 576}
    try:
        got = await sglang_record.record(fake.url, model=str(tmp_path / "m"), scratch=str(tmp_path), real=False)
    finally:
        await fake.kill()
    assert sglang_record.differences(_recorded(release), got) == []


@pytest.mark.sglang_real
async def test_real_server_answers_as_recorded(real_server, tmp_path):
    """The live release still answers the script as recorded (a re-installed or patched venv would show here)."""
    t = real_server
    scratch = tmp_path / "not-a-checkpoint"
    scratch.mkdir()
    got = await sglang_record.record(t.url, model=t.model, scratch=str(scratch), real=True)
    assert sglang_record.differences(_recorded(t.release), got) == []


# ---- real engine only ------------------------------------------------------------------------------------------


def _scaled_copy(src: str, dst: str, factor: float) -> str:
    """A copy of the checkpoint with every RMSNorm weight scaled: other weights, visibly other logprobs."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {k: (v * factor if k.endswith("norm.weight") else v).contiguous() for k, v in tensors.items()}
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    assert torch.is_tensor(next(iter(out.values())))
    return dst


@pytest.mark.sglang_real
async def test_disk_update_changes_outputs_and_restores_bit_exactly(real_server, tmp_path):
    t = real_server
    other = _scaled_copy(t.model, str(tmp_path / "scaled"), 1.5)
    async with client(t) as c:
        before = await c.agenerate(PROMPT, greedy(8, ignore_eos=True))
        await c.update_weights_from_disk(other, 1)
        changed = await c.agenerate(PROMPT, greedy(8, ignore_eos=True))
        await c.update_weights_from_disk(t.model, 2)
        back = await c.agenerate(PROMPT, greedy(8, ignore_eos=True))
        await c.update_weight_version(0)
    assert changed.output_logprobs != before.output_logprobs and set(changed.output_versions) == {1}
    assert back.output_ids == before.output_ids and back.output_logprobs == before.output_logprobs


# trainer rank 0 as train.weight_sync=broadcast runs it (train/worker.py's TrainerService and its WeightBroadcaster)
# over a stand-in engine that holds the checkpoint's tensors with every RMSNorm weight scaled, under the names SGLang
# loads, and broadcasts them in the served dtype (bfloat16), as the real engine does
_TRAINER = textwrap.dedent("""
    import asyncio, json, os, sys, torch, torch.distributed as dist
    from safetensors.torch import load_file
    from torch import nn
    from areal_async.net.rpc import RpcServer
    from areal_async.train.broadcast import WeightBroadcaster, plan_buckets
    from areal_async.train.worker import TrainerService
    from areal_async.types import TrainerInfo

    run_dir, secret, model, factor = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    class Held(nn.Module):
        def __init__(self, tensors):
            super().__init__()
            self.tensors = tensors

        def state_dict(self, *args, **kwargs):
            return dict(self.tensors)

    class Engine:
        checkpoint_dtype = torch.bfloat16
        tied_names = set()

        def __init__(self):
            t = load_file(os.path.join(model, "model.safetensors"))
            self.model = Held({k: (v * factor if k.endswith("norm.weight") else v) for k, v in t.items()})
            self.wb = WeightBroadcaster(timeout_s=120.0)
            self.version = 0

        def info(self):
            n = sum(v.numel() for v in self.model.tensors.values())
            return TrainerInfo(rank=0, world_size=1, version=self.version, device="cpu", num_params=n)

        def bind_device(self):
            pass

        def weight_plan(self, bucket_bytes):
            return plan_buckets(self.model, skip=set(), dtype=torch.bfloat16, bucket_bytes=bucket_bytes)

        def open_broadcast(self, group_name, world_size, host, port):
            return self.wb.open_store(group_name, world_size, host, port)

        def init_broadcast(self, req):
            self.wb.init_group(req, torch.device("cpu"))

        def broadcast(self, req):
            self.version = req.version
            return self.wb.broadcast(self.model, group_name=req.group_name, skip=set(), dtype=torch.bfloat16,
                                     bucket_bytes=req.bucket_bytes)

        def _weight_broadcaster(self):
            return self.wb

    async def main():
        server = RpcServer(secret, name="trainer-rank0")
        TrainerService(Engine(), server).register()
        address = await server.start_tcp("127.0.0.1", 0)
        os.makedirs(os.path.join(run_dir, "trainer"), exist_ok=True)
        tmp = os.path.join(run_dir, "trainer", "rank0.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"address": address, "rank": 0, "world_size": 1, "pid": os.getpid()}, f)
        os.replace(tmp, os.path.join(run_dir, "trainer", "rank0.json"))
        await server.serve_forever()

    asyncio.run(main())
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.mark.sglang_real
@pytest.mark.timeout(600)
async def test_gloo_broadcast_from_the_trainer_equals_a_disk_load(real_server, tmp_path):
    """train.weight_sync=broadcast on a CPU: the project's trainer side (ElasticBroadcastSync forming a gloo group
    with SGLang's /init_weights_update_group, then WeightBroadcaster sending each bucket while the client posts
    /update_weights_from_distributed, inside begin/end sessions from 0.5.21) leaves SGLang serving exactly what a
    disk load of the same weights gives: the same logprobs, the same /get_weights_by_name values, and the policy
    identity check passes on it."""
    from areal_async.rollout.broadcast_sync import ElasticBroadcastSync
    from areal_async.train.client import TrainerGroup

    t = real_server
    scaled = _scaled_copy(t.model, str(tmp_path / "scaled"), 1.5)
    norm = {"name": sglang_record.NORM, "truncate_size": 1000}
    secret = secrets.token_bytes(32)
    with open(tmp_path / "trainer.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _TRAINER, str(tmp_path), secret.hex(), t.model, "1.5"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    group = sync = None
    try:
        group = await TrainerGroup.connect(str(tmp_path), 1, secret, timeout=120)
        async with client(t) as c, aiohttp.ClientSession() as http:

            async def served_norm() -> list:
                async with http.post(t.url + "/get_weights_by_name", json=norm) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            base = await c.agenerate(PROMPT, greedy(8, ignore_eos=True))
            await c.update_weights_from_disk(scaled, 1)
            want = await c.agenerate(PROMPT, greedy(8, ignore_eos=True))
            want_norm = await served_norm()
            await c.update_weights_from_disk(t.model, 0)
            assert (await c.agenerate(PROMPT, greedy(8, ignore_eos=True))).output_logprobs == base.output_logprobs

            sync = ElasticBroadcastSync(group, c, "127.0.0.1", ranks_per_server=1, backend="gloo", max_attempts=1)
            await c.pause("abort")
            try:
                await asyncio.wait_for(sync.apply(2, flush_cache=True), 300)
            finally:
                await c.resume()
            got = await c.agenerate(PROMPT, greedy(8, ignore_eos=True))
            got_norm = await served_norm()
            verdicts = await c.verify_weights(await group.identity("bfloat16"))
            await c.destroy_weights_update_group(sync.group_name or "")
            await c.update_weights_from_disk(t.model, 0)
        assert want.output_logprobs != base.output_logprobs
        assert got.output_ids == want.output_ids and got.output_logprobs == want.output_logprobs
        assert got.output_versions == [2] * 8
        assert got_norm == want_norm and len(got_norm) == 576
        assert [v.ok and not v.unknown for v in verdicts.values()] == [True], verdicts
        assert sync.stats["identity_mismatches"] == 0
    finally:
        if group is not None:
            await group.close()
        proc.kill()
        proc.wait(30)


@pytest.mark.sglang_real
async def test_stopped_front_is_found_hung_and_comes_back(real_server):
    t = real_server
    async with client(t, health_timeout_s=0.5, max_health_failures=2) as c:
        task = asyncio.create_task(c.agenerate(PROMPT, greedy(400, ignore_eos=True)))
        await in_flight(t, c, 1)
        os.kill(t.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            while c.stats()["servers"][t.url]["state"] == "serving" and time.monotonic() - start < 30:
                await asyncio.sleep(0.1)
            found = time.monotonic() - start
        finally:
            os.kill(t.pid, signal.SIGCONT)
        assert c.stats()["servers"][t.url]["state"] != "serving", "a stopped server stayed in rotation"
        assert found < 6 * 0.5 + 3, found  # hang_timeouts x health_timeout_s, plus a probe interval
        res = await asyncio.wait_for(task, 300)  # it comes back and the request resumes there
        st = c.stats()
    assert len(res.output_ids) == 400 and st["servers_lost"] == 1 and st["servers_recovered"] == 1


@pytest.mark.sglang_real
async def test_an_update_with_a_request_running_keeps_the_server(real_server):
    """An update asked with a flush while a request runs: up to 0.5.21 SGLang's own flush-after-update would fail an
    assertion that ends its scheduler, from 0.5.22 it answers 400; the dialect loads without it and flushes once
    the server lets it, so the update succeeds and the server lives on either release."""
    t = real_server
    async with client(t) as c:
        task = asyncio.create_task(c.agenerate(PROMPT, greedy(300, ignore_eos=True)))
        await in_flight(t, c, 1)
        results = await c.update_weights_from_disk(t.model, 3, flush_cache=True)
        assert not isinstance(results[t.url], BaseException), results
        res = await asyncio.wait_for(task, 300)
        assert len(res.output_ids) == 300 and c.stats()["servers_lost"] == 0
        assert (await c.agenerate(PROMPT, greedy(2))).output_versions == [3, 3]


@pytest.mark.sglang_real
async def test_no_old_weight_kv_after_an_in_place_update(real_server, tmp_path_factory):
    """After an in-place update (no flush: requests keep running), a new request whose prompt was cached under the
    old weights must get the logprobs a server holding only the new weights gives. The launcher turns SGLang's
    radix cache off for in-place runs (launch/sglang_server.py), as for this module's server; a second server
    with the cache on shows the trap is real: there the cached prefix's old KV is reused."""
    from areal_async.launch.processes import Processes

    t = real_server
    new = _scaled_copy(t.model, str(tmp_path_factory.mktemp("w") / "new"), 1.5)
    prompt = list(range(100, 164))  # 64 tokens: several cache pages
    procs = Processes(str(tmp_path_factory.mktemp("radix")))
    child = procs.start_sglang_server(
        1, t.model, host="127.0.0.1", port=0, api_key=None, extra_args=["--max-total-tokens", "8192"],
        python=PYTHON, device="cpu", radix_cache=True, threads=1,
    )  # fmt: skip
    try:
        await asyncio.to_thread(_wait_healthy, child, 600)
        lps = {}
        for name, url in (("radix", child.url or ""), ("no_radix", t.url)):
            async with InferenceClient([url]) as c, aiohttp.ClientSession() as http:
                await c.agenerate(prompt, greedy(1))  # caches the prompt (where a cache is on)
                if name == "radix":  # the client refuses in-place updates there; made by hand to show why
                    with pytest.raises(AdminError, match="disable-radix-cache"):
                        await c.pause("in_place")
                    await http.post(url + "/pause_generation", json={"mode": "in_place"})
                    body = {"model_path": new, "weight_version": "1", "flush_cache": False}
                    async with http.post(url + "/update_weights_from_disk", json=body) as r:
                        assert r.status == 200, await r.text()
                    await http.post(url + "/continue_generation", json={})
                else:
                    await c.pause("in_place")
                    await c.update_weights_from_disk(new, 1, flush_cache=False)
                    await c.resume()
                lps[name] = (await c.agenerate(prompt, greedy(4, ignore_eos=True))).output_logprobs
                await c.flush_cache()
                lps[name + "_fresh"] = (await c.agenerate(prompt, greedy(4, ignore_eos=True))).output_logprobs
                await c.update_weights_from_disk(t.model, 0)
        assert lps["no_radix"] == lps["no_radix_fresh"]
        assert lps["radix"] != lps["radix_fresh"], (
            "the radix cache did not reuse the old prefix: the test shows nothing"
        )
    finally:
        procs.shutdown()


@pytest.mark.sglang_real
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["abort", "in_place"])
def test_run_end_to_end_through_sglang(real_server, tmp_path, mode):
    """`python -m areal_async.run server.backend=sglang` on SmolLM2: two steps, every sample accounted for."""
    from areal_async.rollout import ledger

    run_dir = str(tmp_path / "run")
    args = [
        "--config", "configs/smollm2.yaml", f"run_dir={run_dir}", "server.backend=sglang", f"server.python={PYTHON}",
        "server.torch_threads=1", f"schedule.interrupt_mode={mode}", "schedule.total_steps=2", "schedule.eta=1",
        "schedule.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=48", "schedule.eval_every=0",
        "schedule.filter_uniform_reward=false", "data.num_eval=4", "eval.num_prompts=4", "eval.max_new_tokens=32",
    ]  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "areal_async.run", *args], cwd=root, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = ledger.read(os.path.join(run_dir, ledger.FILE_NAME))
    ledger.check_invariant(lines)
    out = proc.stdout + proc.stderr  # the run logs to stdout
    assert "taken out of rotation" not in out, out[-3000:]
