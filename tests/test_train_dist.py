"""The trainer's process-group plumbing that a CPU can check: the weight-update group is never split from a
device-bound default group, index-less CUDA devices get an index, error kinds survive the RPC channel as types,
rank 0's advertised address, and the NCCL environment a broadcast run needs."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap

import pytest
import torch

from areal_async.train import errors

pytestmark = pytest.mark.timeout(120)


def test_custom_group_unbinds_the_default_group_while_it_is_made():
    """With the default group bound to a device, torch's `_new_process_group_helper` would take that group's
    communicator as `split_from` (an ncclCommSplit among the trainers, not a group with the servers). Run in a
    subprocess: a default gloo group bound to cpu:0 stands in for the trainers' nccl one; the helper must see it
    unbound, the group must work, and the binding must come back."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        from areal_async.net.custom_group import new_custom_group, open_store

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        default = c10d._get_default_group()
        default.bound_device_id = torch.device("cpu", 0)
        seen = []
        real = c10d._new_process_group_helper
        def spy(*a, **kw):
            seen.append(c10d._get_default_group().bound_device_id)
            return real(*a, **kw)
        c10d._new_process_group_helper = spy
        store = open_store("127.0.0.1", 0, 1, 30.0)
        pg = new_custom_group("gloo", store, world_size=1, rank=0, group_name="wug", device="cpu", timeout_s=30)
        t = torch.ones(3)
        dist.broadcast(t, src=0, group=pg)
        assert seen == [None], seen
        assert default.bound_device_id == torch.device("cpu", 0)
        assert c10d._world.pg_group_ranks[pg] == {0: 0}
        print("ok", store.port)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok") and int(out.stdout.split()[1]) > 0  # port 0 bound a free port


def test_index_less_cuda_device_takes_the_current_device(monkeypatch):
    from areal_async.net.custom_group import concrete_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert concrete_device("cuda") == torch.device("cuda", 3)
    assert concrete_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert concrete_device("cpu") == torch.device("cpu")


def test_error_kinds_travel_over_rpc_as_types():
    """A trainer rank's error reaches the controller as its type: `TrainerError.kind`, `bad_input` and the
    first-hand / second-hand distinction come from the type, not from message text."""
    import asyncio

    from areal_async.net.rpc import RpcClient, RpcServer
    from areal_async.train.client import TrainerError, _secondhand
    from areal_async.types import Empty

    async def main():
        secret = secrets.token_bytes(32)
        server = RpcServer(secret, name="t")

        def bad(_: Empty) -> Empty:
            raise errors.BatchError("batch.input_ids: token ids must be in [0, 100)")

        def peer(_: Empty) -> Empty:
            raise errors.PeerBatchError("a message without the usual words")

        def boom(_: Empty) -> Empty:
            raise RuntimeError("another trainer rank")  # the old text match would have called this second-hand

        for name, fn in (("bad", bad), ("peer", peer), ("boom", boom)):
            server.register(name, fn, Empty, blocking=True)
        address = await server.start_tcp("127.0.0.1", 0)
        client = await RpcClient.connect(address, secret, timeout=10)
        got = {}
        for name in ("bad", "peer", "boom"):
            try:
                await client.call(name, Empty(), Empty, timeout=10)
            except Exception as e:  # noqa: BLE001 - the RpcError is what we inspect
                got[name] = TrainerError(name, 0, e)
        await client.close()
        await server.close()
        return got

    got = asyncio.run(main())
    assert got["bad"].kind is errors.BatchError and got["bad"].bad_input and not _secondhand(got["bad"].cause)
    assert got["peer"].kind is errors.PeerBatchError and got["peer"].bad_input and _secondhand(got["peer"].cause)
    assert got["boom"].kind is None and not got["boom"].bad_input and not _secondhand(got["boom"].cause)


def test_every_error_kind_has_a_peer_twin_of_the_same_kind():
    for kind in (errors.BatchError, errors.CheckpointError, errors.PublishError, errors.BroadcastError):
        twin = errors.peer_error(kind)
        assert issubclass(twin, kind) and issubclass(twin, errors.PeerFailure)
        assert errors.kind_of(f"{kind.__module__}.{kind.__qualname__}") is kind
        assert errors.kind_of(f"{twin.__module__}.{twin.__qualname__}") is twin
    assert errors.kind_of("builtins.ValueError") is None


def test_advertised_address(monkeypatch):
    from areal_async.train.dist import ADDRESS_ENV, host_address
    from areal_async.train.worker import advertised_address

    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    assert advertised_address("127.0.0.1") == "127.0.0.1"  # a loopback trainer: servers on this host
    assert advertised_address("10.1.2.3") == "10.1.2.3"  # a specific interface is what others reach
    wildcard = advertised_address("0.0.0.0")
    assert wildcard == host_address() and not wildcard.startswith("127.0.1.")  # never Debian's 127.0.1.1 alias
    monkeypatch.setenv(ADDRESS_ENV, "trainer-0.cluster")
    assert advertised_address("127.0.0.1") == "trainer-0.cluster" == host_address()


def test_worker_sets_nccl_cumem_for_broadcast_runs(monkeypatch):
    from areal_async.config import TrainConfig
    from areal_async.train.worker import nccl_environment

    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    env: dict[str, str] = {}
    nccl_environment(TrainConfig(weight_sync="broadcast"), env)
    assert env == {"NCCL_CUMEM_ENABLE": "0"}
    env = {"NCCL_CUMEM_ENABLE": "1"}  # the user's own choice stays
    nccl_environment(TrainConfig(weight_sync="broadcast"), env)
    assert env == {"NCCL_CUMEM_ENABLE": "1"}
    env = {}
    nccl_environment(TrainConfig(weight_sync="disk"), env)
    assert env == {}
    assert os.environ.get("NCCL_CUMEM_ENABLE") is None  # only the given mapping is touched
