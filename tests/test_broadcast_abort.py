"""A weight-group member that fails a bucket mid-broadcast, on a CPU: gloo stands in for nccl, FakeSGLang servers
that really join the group and receive (gloo_member) for SGLang, and trainer rank 0 is the real RPC service
(train/worker.py's TrainerService and its WeightBroadcaster) over a stand-in engine holding a few large tensors.

What must hold when member B fails bucket k and stays alive:
- the update ends with the trainer's BroadcastError at once, through the abort RPC, not at rank 0's per-bucket
  deadline (set far beyond the hang guards here);
- rank 0 is idle again afterwards: a blocking call (queued behind any running one) is answered;
- B is posted no bucket after k (its next receives would pair with the rest of bucket k's sends);
- B and the member left part-way leave rotation, and the next update forms a new group without B and succeeds.
Plus the rank-0 side alone: an abort while sending stops the broadcast and, with two trainer ranks, both answer
(rank 0 keeps taking part in the FSDP gathers after it stopped sending).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import textwrap

import pytest
from fake_fleet import until

from areal_async.inference.client import InferenceClient
from areal_async.testing.fake_sglang import FakeSGLang

pytestmark = pytest.mark.timeout(180)

DEADLINE_S = 600.0  # rank 0's per-bucket deadline: every wait below is bounded far under it
GUARD_S = 60.0  # hang guard of one update

# rank 0's RPC service over an engine that holds six 32 MB tensors (one bucket each at the BUCKET size used below).
# What follows a failed bucket is more than a member's socket buffers take unread (here up to 32 MB + 4 MB), so
# rank 0 cannot finish without the failed member and, without the abort, would wait for its deadline
_TRAINER = textwrap.dedent("""
    import asyncio, json, os, sys, torch, torch.distributed as dist
    from torch import nn
    from areal_async.net.rpc import RpcServer
    from areal_async.train.broadcast import WeightBroadcaster, plan_buckets
    from areal_async.train.worker import TrainerService
    from areal_async.types import TrainerInfo

    run_dir, secret, deadline = sys.argv[1], bytes.fromhex(sys.argv[2]), float(sys.argv[3])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    class Engine:
        def __init__(self):
            self.model = nn.Module()
            for i in range(6):
                self.model.register_parameter(f"w{i}", nn.Parameter(torch.full((4096, 2048), float(i + 1))))
            self.wb = WeightBroadcaster(timeout_s=deadline)
            self.version = 0

        def info(self):
            return TrainerInfo(rank=0, world_size=1, version=self.version, device="cpu", num_params=6 << 23)

        def weight_plan(self, bucket_bytes):
            return plan_buckets(self.model, skip=set(), dtype=torch.float32, bucket_bytes=bucket_bytes)

        def open_broadcast(self, group_name, world_size, host, port):
            return self.wb.open_store(group_name, world_size, host, port)

        def init_broadcast(self, req):
            self.wb.init_group(req, torch.device("cpu"))

        def broadcast(self, req):
            return self.wb.broadcast(self.model, group_name=req.group_name, skip=set(), dtype=torch.float32,
                                     bucket_bytes=req.bucket_bytes)

        def _weight_broadcaster(self):
            return self.wb

    async def main():
        server = RpcServer(secret, name="trainer-rank0")
        TrainerService(Engine(), server).register()
        address = await server.start_tcp("127.0.0.1", 0)
        os.makedirs(os.path.join(run_dir, "trainer"), exist_ok=True)
        with open(os.path.join(run_dir, "trainer", "rank0.json.tmp"), "w") as f:
            json.dump({"address": address, "rank": 0, "world_size": 1, "pid": os.getpid()}, f)
        os.replace(os.path.join(run_dir, "trainer", "rank0.json.tmp"), os.path.join(run_dir, "trainer", "rank0.json"))
        await server.serve_forever()

    asyncio.run(main())
    sys.stdout.flush()
    os._exit(0)  # a gloo send abandoned with its group may keep a thread blocked: do not wait for it
""")

BUCKET = 32 << 20


@pytest.fixture
async def rig(tmp_path):
    """Trainer rank 0 (a subprocess), two gloo-member fakes and an inference client over them."""
    from areal_async.train.client import TrainerGroup

    secret = secrets.token_bytes(32)
    log = open(tmp_path / "trainer.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(tmp_path), secret.hex(), str(DEADLINE_S)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    log.close()
    fakes = [await FakeSGLang().start() for _ in range(2)]
    for f in fakes:
        f.gloo_member = True
    c = InferenceClient([f.url for f in fakes], backoff_s=0.01, probe_interval_s=0.05, health_timeout_s=1.0)
    group = None
    try:
        group = await TrainerGroup.connect(str(tmp_path), 1, secret, timeout=120)
        yield group, c, fakes, tmp_path
    finally:
        if group is not None:
            await group.close()
        proc.kill()
        proc.wait(30)
        await c.close()
        for f in fakes:
            await f.kill()


def dist_calls(f: FakeSGLang) -> list[dict]:
    return [b for p, b in f.admin if p == "/update_weights_from_distributed"]


def sync_for(group, c, **kw):
    from areal_async.rollout.broadcast_sync import ElasticBroadcastSync

    kw = {"ranks_per_server": 1, "backend": "gloo", "settle_s": 1.0, "max_attempts": 1, **kw}
    return ElasticBroadcastSync(group, c, "127.0.0.1", **kw)


async def apply(sync, version: int, bucket: int = BUCKET) -> None:
    from areal_async.train import client as trainer_client

    real = trainer_client.TrainerGroup.broadcast_weights

    async def with_bucket(self, servers, v, **kw):  # BUCKET: one tensor a bucket
        return await real(self, servers, v, bucket_bytes=bucket, **kw)

    trainer_client.TrainerGroup.broadcast_weights = with_bucket
    try:
        await asyncio.wait_for(sync.apply(version, flush_cache=True), GUARD_S)
    finally:
        trainer_client.TrainerGroup.broadcast_weights = real


async def test_member_failing_a_bucket_aborts_the_update_and_the_next_group_leaves_it_out(rig):
    from areal_async.train.client import TrainerError
    from areal_async.train.errors import BroadcastError

    group, c, (a, b), _ = rig
    b.fail_bucket = 1  # receives bucket 0, then fails bucket 1 without receiving any of it, and stays alive
    sync = sync_for(group, c)
    with pytest.raises(TrainerError) as failed:
        await apply(sync, 1)
    assert failed.value.kind is not None and issubclass(failed.value.kind, BroadcastError)
    assert "aborted" in str(failed.value) and b.url in str(failed.value)  # the abort ended it, naming B
    assert "was not received within" not in str(failed.value)  # not rank 0's deadline
    first = sync.group_name
    # B was posted buckets 0 and 1 and nothing after its failure
    assert [call["names"] for call in dist_calls(b)] == [["w0"], ["w1"]]
    assert [(g, i) for g, i, _ in b.buckets] == [(first, 0), (first, 1)]
    assert group.broadcast_failures.keys() == {b.url}
    # both hold a mix of versions now: out of rotation
    states = {u: s["state"] for u, s in c.stats()["servers"].items()}
    assert states[b.url] == "syncing" and states[a.url] == "syncing"

    # rank 0 is idle: a blocking call (served after any running one) answers
    plan = await asyncio.wait_for(group.weight_plan(BUCKET), GUARD_S)
    assert len(plan.buckets) == 6

    # the next update: a new group of A alone, every bucket, and A back in rotation at version 1
    await apply(sync, 1)
    assert sync.group_name != first and sync.members == (a.url,)
    assert [(g, i, names) for g, i, names in a.buckets if g == sync.group_name] == [
        (sync.group_name, i, [f"w{i}"]) for i in range(6)
    ]
    assert len(dist_calls(b)) == 2  # still nothing more for B
    assert dist_calls(a)[-1].get("weight_version") == "1"
    await asyncio.wait_for(until(lambda: c.stats()["servers"][a.url]["state"] == "serving", 30.0, 0.02), GUARD_S)
    assert c.stats()["servers"][b.url]["state"] == "syncing"


async def test_member_failing_mid_bucket_is_retried_without_it_in_the_same_update(rig):
    """Buckets of two tensors; B takes the first tensor of bucket 1, then fails it. With the default two attempts
    one apply ends well: the retry forms a group without B."""
    group, c, (a, b), _ = rig
    b.fail_bucket, b.fail_after_tensors = 1, 1
    sync = sync_for(group, c, max_attempts=2)
    await apply(sync, 3, bucket=2 * BUCKET)
    assert sync.members == (a.url,)
    first = {g for g, _, _ in b.buckets}
    assert len(first) == 1 and first != {sync.group_name}
    assert [names for _, _, names in b.buckets] == [["w0", "w1"], ["w2"]]  # nothing after its failure
    assert len(dist_calls(b)) == 2
    assert [names for g, _, names in a.buckets if g == sync.group_name] == [["w0", "w1"], ["w2", "w3"], ["w4", "w5"]]
    assert a.version == "3"
    await asyncio.wait_for(until(lambda: c.stats()["servers"][a.url]["state"] == "serving", 30.0, 0.02), GUARD_S)


# ---- rank 0's side alone, with two trainer ranks ----------------------------------------------------------------

_MEMBER = textwrap.dedent("""
    import sys, time, torch
    from areal_async.server.weights import init_custom_group, receive_tensors
    port = int(sys.argv[1])
    pg = init_custom_group("gloo", f"tcp://127.0.0.1:{port}", 2, 1, "g1", torch.device("cpu"), 60)
    receive_tensors(pg, ["w0"], ["float32"], [[2048, 2048]], torch.device("cpu"))  # bucket 0
    print("bucket0", flush=True)
    time.sleep(120)  # alive, in the group, and never receiving bucket 1
""")

# two FSDP2 ranks (gloo); rank 0 sends to the member above; a thread asks for the abort once the member has
# bucket 0, as the controller's abort RPC would, from the RPC loop's thread
_RANKS = textwrap.dedent("""
    import os, subprocess, sys, threading, time, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from areal_async.train.broadcast import WeightBroadcaster
    from areal_async.train.errors import BroadcastError, PeerBroadcastError
    from areal_async.types import InitBroadcastRequest
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    wb = WeightBroadcaster(timeout_s=600.0)
    member = None
    if rank == 0:
        port = wb.open_store("g1", 2, "127.0.0.1", 0)
        member = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(port)], stdout=subprocess.PIPE, text=True)
        wb.init_group(InitBroadcastRequest(group_name="g1", world_size=2, master_address="127.0.0.1",
                                           master_port=port, backend="gloo"), torch.device("cpu"))
        def abort():
            member.stdout.readline()
            time.sleep(0.2)
            print("abort while running:", wb.request_abort("g1", "member failed bucket 1"), flush=True)
        threading.Thread(target=abort, daemon=True).start()
    try:
        wb.broadcast(model, group_name="g1", skip=set(), dtype=torch.float32, bucket_bytes=16 << 20)
        print(f"rank{rank}: NO ERROR", flush=True)
    except PeerBroadcastError as e:
        print(f"rank{rank}: peer error", flush=True)
    except BroadcastError as e:
        print(f"rank{rank}: {e}", flush=True)
    # both ranks are free: a collective of the default group still works
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank{rank}: after {t.item():g}", flush=True)
    if rank == 0:
        print("groups left:", sorted(wb.groups), "again:", wb.request_abort("g1", "x"), flush=True)
        member.kill()
    sys.stdout.flush()
    os._exit(0)
""")


def test_abort_stops_rank_0_and_every_trainer_rank_answers(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "--tee",
            "3",
            str(script),
            _MEMBER,
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = {line.split("]:", 1)[-1].strip() for line in out.stdout.splitlines()}
    assert "abort while running: True" in lines, out.stdout
    assert "rank0: weight-update group 'g1' aborted: member failed bucket 1" in lines, out.stdout
    assert "rank1: peer error" in lines, out.stdout
    assert {"rank0: after 2", "rank1: after 2"} <= lines, out.stdout
    assert "groups left: [] again: False" in lines, out.stdout
