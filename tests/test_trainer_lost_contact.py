"""How the controller names a trainer failure when contact with a rank is lost (its process died, or its host went
away): the rank it lost is the one named, with the host it registered from, and the call fails at once instead of
giving the ranks stuck in a collective with it the usual grace. Stand-in clients, no processes; the real cuts and
kills across hosts are in tests/test_netns_trainer_faults.py."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from areal_async.net.rpc import RpcError
from areal_async.net.rpc_connection import drop_when_unreachable
from areal_async.train import client as trainer_client
from areal_async.train.client import TrainerError, TrainerGroup
from areal_async.types import Empty, TrainerInfo

pytestmark = pytest.mark.timeout(60)


class StandIn:
    """An RpcClient stand-in: `call` fails after `after` seconds with `error`, or never answers (error None)."""

    def __init__(self, error: BaseException | None, after: float = 0.0) -> None:
        self.error, self.after = error, after

    async def call(self, method, request, response_type, *, timeout=None):
        await asyncio.sleep(self.after)
        if self.error is None:
            await asyncio.Event().wait()  # stuck in a collective with the lost rank
        raise self.error

    async def close(self) -> None:
        pass


def group(*clients: StandIn) -> TrainerGroup:
    n = len(clients)
    infos = [TrainerInfo(rank=r, world_size=n, version=0, device="cpu", num_params=1) for r in range(n)]
    hosts = [f"h{r} (10.0.0.{r + 2})" for r in range(len(clients))]
    return TrainerGroup(list(clients), infos, hosts)  # type: ignore[arg-type]


async def test_the_lost_rank_is_named_with_its_host_and_fails_the_call_at_once():
    g = group(StandIn(None), StandIn(ConnectionError("tcp://10.0.0.3:5000: connection lost: TimeoutError(110)")))
    t0 = time.monotonic()
    with pytest.raises(TrainerError) as failed:
        await g._call("train_step", Empty(), Empty)
    assert time.monotonic() - t0 < trainer_client._LOST_GRACE_S + 2 < trainer_client._ERROR_GRACE_S
    e = failed.value
    assert (e.rank, e.host, e.unanswered) == (1, "h1 (10.0.0.3)", [0])
    assert str(e).startswith("trainer rank 1 on h1 (10.0.0.3): train_step failed: ConnectionError(")


async def test_a_rank_that_answered_is_not_named_over_the_one_that_went_away():
    """A killed rank: the rank beside it answers the broken collective with an error of its own, first-hand as far
    as it knows; the rank whose connection closed is still the one named."""
    gloo = RpcError("RuntimeError", "Connection closed by peer [10.0.0.3]:41234")
    g = group(StandIn(gloo), StandIn(ConnectionError("peer closed the connection"), after=0.05))
    with pytest.raises(TrainerError) as failed:
        await g._call("train_step", Empty(), Empty)
    assert (failed.value.rank, failed.value.host) == (1, "h1 (10.0.0.3)")


def test_host_of_a_rank_file():
    assert trainer_client._host_of({"node": "h1", "address": "tcp://10.0.0.3:5000"}) == "h1 (10.0.0.3)"
    assert trainer_client._host_of({"address": "tcp://[fd00::3]:5000"}) == "fd00::3"
    assert trainer_client._host_of({}) == ""
    assert str(TrainerError("info", 0, ConnectionError("x"))).startswith("trainer rank 0: info failed")  # no host


def test_drop_when_unreachable_sets_the_kernel_bounds():
    if not hasattr(socket, "TCP_USER_TIMEOUT"):
        pytest.skip("not Linux")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        assert drop_when_unreachable(s, 10.0)
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10_000
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 2
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
