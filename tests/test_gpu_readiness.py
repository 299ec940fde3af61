"""What a first GPU run would meet, checked on a CPU: gloo stands in for nccl, FakeSGLang for SGLang.

- both ends of the weight-update group start with the same NCCL_CUMEM_ENABLE (server/cli.py, train/worker.py)
- broadcast sync with interruptible=false is refused (buckets would interleave with requests)
- a member lost mid-bucket ends trainer rank 0's broadcast with a BroadcastError, not a watchdog kill; a new group
  leaves the superseded one
- the buckets go to the group's members, not to whoever is reachable
- a paused SGLang's /health blocks: the heartbeat must not call such a server hung
- abort(rid) reaches a resubmitted segment on a server that aborts by exact rid
- older SGLang: the weight version from /get_model_info; in-place pauses refused before 0.5.6
- the trainer's LM head matmul runs in fp32; the rendezvous address is one torch's agent recognises
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
from fake_fleet import until

from areal_async.inference.client import InferenceClient
from areal_async.inference.transport import AdminError, InferenceError
from areal_async.testing.fake_sglang import FIRST, NUM
from areal_async.types import SamplingParams

pytestmark = pytest.mark.timeout(120)

PROMPT = [FIRST, FIRST + 1]


def expected(n: int) -> list[int]:
    return [FIRST + (2 + k) % NUM for k in range(n)]


def client(urls: list[str], **kw) -> InferenceClient:
    kw = {"backoff_s": 0.01, "probe_interval_s": 0.05, "unavailable_timeout_s": 10.0, "health_timeout_s": 0.2, **kw}
    return InferenceClient(urls, **kw)


# ---- NCCL environment -------------------------------------------------------------------------------------------


def test_server_defaults_cumem_off_like_the_trainer():
    from areal_async.config import TrainConfig
    from areal_async.server.cli import nccl_environment
    from areal_async.train.worker import nccl_environment as trainer_env

    server: dict[str, str] = {}
    trainer: dict[str, str] = {}
    assert nccl_environment(server) == "0"
    trainer_env(TrainConfig(weight_sync="broadcast"), trainer)
    assert server["NCCL_CUMEM_ENABLE"] == trainer["NCCL_CUMEM_ENABLE"] == "0"
    # a value the user set wins on both ends (they inherit the same environment)
    assert nccl_environment({"NCCL_CUMEM_ENABLE": "1"}) == "1"


def test_serve_main_sets_it_before_torch_loads():
    """In a fresh interpreter: after serve.main's environment step NCCL_CUMEM_ENABLE is 0 and torch is not yet
    imported (NCCL reads the variable when the first communicator is made)."""
    code = textwrap.dedent("""
        import os, sys
        os.environ.pop("NCCL_CUMEM_ENABLE", None)
        import areal_async.server.cli as s
        assert "torch" not in sys.modules, "serve imports torch at module level"
        print(s.nccl_environment(os.environ), "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "False"]


# ---- broadcast without a pause ----------------------------------------------------------------------------------


def test_broadcast_with_waiting_updates_is_a_config_error():
    from areal_async.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="schedule.interruptible"):
        load_config(None, ["train.weight_sync=broadcast", "schedule.interruptible=false"])
    # the same updates by disk, or broadcast in sync mode (nothing in flight during an update), are fine
    load_config(None, ["train.weight_sync=disk", "schedule.interruptible=false"])
    load_config(None, ["train.weight_sync=broadcast", "schedule.interruptible=false", "mode=sync"])


async def test_update_weights_refuses_a_bucketed_sync_without_a_pause():
    from areal_async.rollout.broadcast_sync import ElasticBroadcastSync
    from areal_async.rollout.weight_sync import update_weights

    class Trainer:
        called = False

        async def broadcast_weights(self, servers, version, *, flush_cache=True):
            Trainer.called = True

    with pytest.raises(ValueError, match="paused"):
        await update_weights(
            ElasticBroadcastSync(Trainer(), None, "127.0.0.1", ranks_per_server=1, backend="gloo"), None, 1, "wait"
        )
    assert not Trainer.called


# ---- a member lost mid-bucket (gloo) ----------------------------------------------------------------------------


_MEMBER = textwrap.dedent("""
    import sys, time, torch
    from areal_async.server.weights import init_custom_group, receive_tensors
    port = int(sys.argv[1])
    pg = init_custom_group("gloo", f"tcp://127.0.0.1:{port}", 2, 1, "g1", torch.device("cpu"), 60)
    receive_tensors(pg, ["a"], ["float32"], [[1024, 1024]], torch.device("cpu"))  # bucket 0
    print("bucket0", flush=True)
    time.sleep(60)  # alive, in the group, and never receiving bucket 1 (an SGLang that failed an allocation)
""")

_TRAINER = textwrap.dedent("""
    import os, subprocess, sys, time, torch, torch.distributed as dist
    from torch import nn
    from areal_async.train.broadcast import WeightBroadcaster
    from areal_async.train.errors import BroadcastError
    from areal_async.types import InitBroadcastRequest
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = nn.Module()
    model.a = nn.Parameter(torch.ones(1024, 1024))
    model.b = nn.Parameter(torch.ones(4096, 4096))  # 64 MB: more than the socket buffers take unread
    wb = WeightBroadcaster(timeout_s=3.0)
    port = wb.open_store("g1", 2, "127.0.0.1", 0)
    member = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(port)], stdout=subprocess.PIPE, text=True)
    wb.init_group(InitBroadcastRequest(group_name="g1", world_size=2, master_address="127.0.0.1",
                                       master_port=port, backend="gloo"), torch.device("cpu"))
    t0 = time.monotonic()
    try:
        wb.broadcast(model, group_name="g1", skip=set(), dtype=torch.float32, bucket_bytes=4 << 20)
        print("NO ERROR")
    except BroadcastError as e:
        print("raised after %.1fs: %s" % (time.monotonic() - t0, e))
    print("groups left:", sorted(wb.groups))
    print("member:", member.stdout.readline().strip())
    # a new group supersedes every earlier one on this rank (one live group at a time)
    port2 = wb.open_store("g2", 2, "127.0.0.1", 0)
    wb.groups["g0"] = dist.new_group([0], backend="gloo")
    wb.open_store("g3", 2, "127.0.0.1", 0)
    print("after a new store:", sorted(wb.groups), sorted(wb.stores))
    member.kill()
    sys.stdout.flush()
    os._exit(0)  # the abandoned gloo send keeps a thread blocked: do not wait for it at exit
""")


def test_member_lost_mid_bucket_raises_on_trainer_rank_0():
    """The member takes bucket 0 and then never posts bucket 1's receive. Before, rank 0 waited in the work
    (with nccl: a stream synchronise until the watchdog tore the process down at the group timeout); now the
    per-bucket deadline raises a BroadcastError, drops the group, and the controller can form a new one."""
    out = subprocess.run([sys.executable, "-c", _TRAINER, _MEMBER], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "NO ERROR" not in out.stdout, out.stdout
    assert lines[0].startswith("raised after") and "bucket 1" in lines[0], lines
    assert float(lines[0].split()[2].rstrip("s:")) < 30  # the 3 s deadline, not the group's timeout
    assert lines[1] == "groups left: []"
    assert lines[2] == "member: bucket0"
    assert lines[3] == "after a new store: [] ['g3']", lines


async def test_buckets_go_to_the_group_members_even_when_one_is_down(fakes):
    """The trainer sends every bucket to every member of the group, so the fan-out goes to the members: one that
    is down still gets its call (which fails fast), and a server outside the group gets none."""
    a, b, outside = await fakes(3)
    async with client([a.url, b.url, outside.url]) as c:
        await c.init_weights_update_group("127.0.0.1", 1234, group_name="g", backend="gloo", urls=[a.url, b.url])
        await c.update_weights_from_distributed(["w"], ["bfloat16"], [[2]], None, group_name="g")
        await b.kill()  # lost between buckets
        c._pool.server_failed(c._pool.router.servers[b.url], "killed")
        res = await c.update_weights_from_distributed(["w2"], ["bfloat16"], [[2]], 1, group_name="g")
        assert set(res) == {a.url, b.url}
        assert isinstance(res[b.url], BaseException) and not isinstance(res[a.url], BaseException)
        dist_calls = lambda f: [p for p, _ in f.admin if p == "/update_weights_from_distributed"]  # noqa: E731
        assert len(dist_calls(a)) == 2 and dist_calls(outside) == []


# ---- the heartbeat vs a paused SGLang ---------------------------------------------------------------------------


async def test_paused_server_whose_health_blocks_is_not_called_hung(fakes):
    """SGLang's /health waits for continue while paused. With requests held in place for several heartbeat
    periods (each probe would time out), the server stays in rotation and the requests finish after resume."""
    (a,) = await fakes(1, token_delay=0.01)
    a.sglang_health = True
    a.health_pause_timeout = 5.0
    async with client([a.url], stream=True) as c:
        tasks = [asyncio.create_task(c.agenerate(PROMPT, SamplingParams(max_new_tokens=40))) for _ in range(2)]
        await a.wait_progress(2, 3)
        await c.pause("in_place")
        probes = a.health_calls
        await asyncio.sleep(1.0)  # 20 heartbeat periods; 2 unanswered 0.2 s probes would mark it hung
        assert c.stats()["servers"][a.url]["state"] == "serving"
        assert a.health_calls == probes  # not probed at all while paused
        await c.resume()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        assert all(r.output_ids == expected(40) for r in results)
        assert c.stats()["servers_lost"] == 0


async def test_a_hung_server_still_ends_a_pause(fakes):
    """The other side of leaving pause calls to the heartbeat: they carry their own bound."""
    a, b = await fakes(2)
    async with client([a.url, b.url]) as c:
        a.hung = True
        res = await asyncio.wait_for(c.pause(), 10)
        assert isinstance(res[a.url], InferenceError) and res[b.url]["status"] == "ok"
        assert c.stats()["servers"][a.url]["state"] == "down"
        await asyncio.wait_for(c.resume(), 10)


# ---- abort(rid) after a resubmission ----------------------------------------------------------------------------


async def test_abort_reaches_the_resubmitted_segment(fakes):
    """After an interruption the request runs as "{rid}-1"; an SGLang that matches rids exactly must get that
    rid, or the request runs to its end."""
    (a,) = await fakes(1, token_delay=0.01)
    a.exact_abort = True
    async with client([a.url], stream=True) as c:
        task = asyncio.create_task(c.agenerate(PROMPT, SamplingParams(max_new_tokens=400), rid="r"))
        await a.wait_progress(1, 3)
        await c.pause()
        await c.resume()
        await until(lambda: "r-1" in a._inflight)
        await c.abort("r")
        res = await asyncio.wait_for(task, 10)
        assert res.finish_reason == "abort" and len(res.output_ids) < 400
        assert ("abort", {"rid": "r-1", "abort_all": False}) in a.admin


# ---- older SGLang -----------------------------------------------------------------------------------------------


async def test_version_read_from_get_model_info_on_an_older_server(fakes):
    (a,) = await fakes(1, version="7")
    a.model_info_path = "/get_model_info"
    async with client([a.url]) as c:
        server = c._pool.router.servers[a.url]
        assert await c._fleet.server_version(server) == 7


def test_in_place_allowed_by_reported_version():
    from areal_async.inference.fleet import in_place_supported, sglang_version

    assert sglang_version({"version": "0.5.3.post1"}) == (0, 5, 3)
    assert not in_place_supported({"version": "0.5.3.post1"})
    assert in_place_supported({"version": "0.5.6"}) and in_place_supported({"version": "0.5.10rc0"})
    assert in_place_supported({})  # does not say: let be
    assert in_place_supported({"version": "0.1.0", "api_key_required": False})  # our embedded server


async def test_in_place_pause_refused_on_an_old_sglang(fakes):
    old, new = await fakes(2)
    old.sglang_version, new.sglang_version = "0.5.3", "0.5.6"
    async with client([old.url, new.url]) as c:
        with pytest.raises(AdminError, match="0.5.6"):
            await c.pause("in_place")
        assert not c.is_paused() and not old.paused and not new.paused  # nothing was paused
        await c.pause("abort")  # abort mode works on both
        await c.resume()


# ---- trainer numerics and addresses -----------------------------------------------------------------------------


def test_lm_head_matmul_runs_in_fp32():
    """bf16 hidden states and head weight: the log-probabilities are those of the fp32 matmul (not of a bf16
    one, whose rounding would reach the importance ratios), forward and backward."""
    import torch

    from areal_async.train.lm_head import LMHead, logprobs_from_hidden

    g = torch.Generator().manual_seed(0)
    h = (torch.randn(64, 32, generator=g) * 3).bfloat16().requires_grad_()  # [M, H]
    w = (torch.randn(500, 32, generator=g)).bfloat16().requires_grad_()  # [V, H]
    t = torch.randint(0, 500, (64,), generator=g)
    lp, _ = logprobs_from_hidden(h, LMHead(w, None), t, chunk_tokens=16, keep_bytes=0)
    ref = torch.log_softmax(h.detach().float() @ w.detach().float().T, -1).gather(1, t[:, None])[:, 0]
    bf16 = torch.log_softmax((h.detach() @ w.detach().T).float(), -1).gather(1, t[:, None])[:, 0]
    assert (lp.detach() - ref).abs().max() < 1e-4
    assert (bf16 - ref).abs().max() > 1e-3  # the difference this removes is real at these scales
    lp.sum().backward()
    assert h.grad is not None and w.grad is not None and torch.isfinite(w.grad.float()).all()


def test_rendezvous_host_is_one_torch_recognises(monkeypatch):
    import socket

    from areal_async.net import address as netaddr

    monkeypatch.setattr(netaddr, "host_address", lambda: "10.1.2.3")
    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(2, 1, 6, "", ("10.1.2.3", 0))])
    assert netaddr.rendezvous_host() == "10.1.2.3"
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(2, 1, 6, "", ("127.0.1.1", 0))])
    assert netaddr.rendezvous_host() == "node7"  # never the loopback-only 127.0.1.1
    src = open(os.path.join(os.path.dirname(os.path.dirname(netaddr.__file__)), "launch", "local.py")).read()
    assert "socket.gethostbyname" not in src


_LOAD = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist, transformers
    from torch.distributed.tensor import DTensor
    from areal_async.testing.tiny import make_tiny_checkpoint
    from areal_async.train.fsdp import load_sharded
    from areal_async.train.publish import iter_full_tensors
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    path = make_tiny_checkpoint(sys.argv[1], "qwen2", seed=0)
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)  # a bf16 checkpoint
    want = {k: v.float() for k, v in transformers.AutoModelForCausalLM.from_pretrained(path).state_dict().items()}
    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained
    def spy(*a, **kw):
        seen.append(str(kw.get("dtype")))
        return real(*a, **kw)
    transformers.AutoModelForCausalLM.from_pretrained = spy
    lm = load_sharded(path, torch.device("cpu"), torch.float32, False, trainable=True)
    sd = lm.model.state_dict()
    masters = {str(v.dtype) for v in sd.values() if v.is_floating_point()}
    exact = all(torch.equal(sd[k].full_tensor() if isinstance(sd[k], DTensor) else sd[k], want[k])
                for k in want if k in sd)
    gathered = []
    full = DTensor.full_tensor
    def spy_full(self, *a, **kw):
        gathered.append(str(self.dtype))
        return full(self, *a, **kw)
    DTensor.full_tensor = spy_full
    out = dict(iter_full_tensors(lm.model, skip=lm.tied_names, dtype=torch.bfloat16, to_cpu=True))
    print(json.dumps({"read_dtype": seen, "checkpoint_dtype": str(lm.checkpoint_dtype), "masters": sorted(masters),
                      "exact": exact, "gathered": sorted(set(gathered)),
                      "sent": sorted({str(t.dtype) for t in out.values() if t is not None})}))
""")


def test_rank0_reads_bf16_and_gathers_bf16(tmp_path):
    """A bf16 checkpoint: rank 0 reads it in bf16 (half the host memory of fp32), the shards hold the exact values
    as fp32 masters, and the publish/broadcast gather moves bf16 (the local shard is cast before the all-gather)."""
    import json

    out = subprocess.run(
        [sys.executable, "-c", _LOAD, str(tmp_path / "bf16")],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["read_dtype"] == ["torch.bfloat16"] and got["checkpoint_dtype"] == "torch.bfloat16"
    assert got["masters"] == ["torch.float32"] and got["exact"]
    assert got["gathered"] == ["torch.bfloat16"] and got["sent"] == ["torch.bfloat16"]


def test_lm_head_stays_fp32_under_autocast():
    import torch

    from areal_async.train.lm_head import LMHead, logprobs_from_hidden

    g = torch.Generator().manual_seed(1)
    h = torch.randn(16, 32, generator=g) * 3  # [M, H]
    w = torch.randn(300, 32, generator=g)  # [V, H]
    t = torch.randint(0, 300, (16,), generator=g)
    ref = torch.log_softmax(h @ w.T, -1).gather(1, t[:, None])[:, 0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = logprobs_from_hidden(h, LMHead(w, None), t, chunk_tokens=8)
    assert (lp - ref).abs().max() < 1e-4
