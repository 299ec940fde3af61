"""The client against real embedded server processes and real signals: SIGKILL, SIGSTOP/SIGCONT, and a restart.

Each server is `python -m areal_async.serve` in its own process, reached over real HTTP. Greedy decoding makes the
expected output exact: a request that continues on another server from its tokens so far must come out token for
token as the uninterrupted run did.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from areal_async.inference.client import InferenceClient
from areal_async.types import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

N_NEW = 160
PROMPTS = [[10 + i, 20, 30 + i, 7] for i in range(4)]
GREEDY = SamplingParams(max_new_tokens=N_NEW, temperature=0.0, ignore_eos=True)


class ServerProcess:
    def __init__(self, proc: asyncio.subprocess.Process, url: str, log_path: str):
        self.proc, self.url, self.log_path = proc, url, log_path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            await self.proc.wait()


async def start(ckpt: str, tmp_path, name: str, port: int = 0) -> ServerProcess:
    from areal_async.server.cli import READY_PREFIX

    log_path = str(tmp_path / f"{name}.log")
    with open(log_path, "w") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "areal_async.serve",
            "--model",
            ckpt,
            "--port",
            str(port),
            "--max-total-tokens",
            "8192",
            "--device",
            "cpu",
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    line = (await asyncio.wait_for(proc.stdout.readline(), 240)).decode()
    if not line.startswith(READY_PREFIX):
        proc.kill()
        await proc.wait()
        raise AssertionError(f"server did not start: {line!r}\n{open(log_path).read()}")
    return ServerProcess(proc, line[len(READY_PREFIX) :].strip(), log_path)


@pytest.fixture
async def servers(tiny_ckpt, tmp_path):
    made: list[ServerProcess] = []

    async def make(n: int, port: int = 0) -> list[ServerProcess]:
        out = await asyncio.gather(*(start(tiny_ckpt, tmp_path, f"s{len(made) + i}", port) for i in range(n)))
        made.extend(out)
        return list(out)

    yield make
    for s in made:
        await s.stop()


def client(urls: list[str], **kw) -> InferenceClient:
    return InferenceClient(
        urls,
        stream=True,
        backoff_s=0.05,
        probe_interval_s=0.2,
        health_timeout_s=1.0,
        max_health_failures=2,
        unavailable_timeout_s=60.0,
        **kw,
    )


async def until_tokens(c: InferenceClient, n: int) -> None:
    for _ in range(6000):
        if c.stats()["tokens"] >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("no progress")


async def test_sigkill_mid_generation_loses_nothing(servers):
    a, b = await servers(2)
    async with client([a.url, b.url]) as c:
        ref = await asyncio.gather(*(c.agenerate(p, GREEDY) for p in PROMPTS))
        base = c.stats()["tokens"]
        assert base == len(PROMPTS) * N_NEW
        tasks = [asyncio.create_task(c.agenerate(p, GREEDY)) for p in PROMPTS]
        await until_tokens(c, base + len(PROMPTS) * 20)
        assert c.stats()["servers"][a.url]["outstanding"] >= 1
        a.signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        st = c.stats()
    assert [r.output_ids for r in results] == [r.output_ids for r in ref]
    assert all(r.finish_reason == "length" and len(r.output_logprobs) == N_NEW for r in results)
    for r, r0 in zip(results, ref):
        assert max(abs(x - y) for x, y in zip(r.output_logprobs, r0.output_logprobs)) < 1e-3
    assert st["servers"][a.url]["state"] == "down" and st["servers_lost"] == 1
    assert st["failover_kept_tokens"] > 0  # the killed server's streamed tokens were kept, not generated again
    assert st["tokens"] == 2 * len(PROMPTS) * N_NEW  # and every token was received exactly once


async def test_sigstop_is_detected_and_sigcont_returns(servers):
    a, b = await servers(2)
    async with client([a.url, b.url]) as c:
        ref = await asyncio.gather(*(c.agenerate(p, GREEDY) for p in PROMPTS))
        # a's requests must have streamed tokens when it stops, for the failover to have tokens to keep; on a busy
        # machine a may not have streamed any by then (the tokens counted are b's): then again, up to three times
        for _ in range(3):
            base, kept = c.stats()["tokens"], c.stats()["failover_kept_tokens"]
            tasks = [asyncio.create_task(c.agenerate(p, GREEDY)) for p in PROMPTS]
            await until_tokens(c, base + len(PROMPTS) * 20)
            a.signal(signal.SIGSTOP)  # the socket stays open; nothing answers
            try:
                results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
                st = c.stats()
                assert st["servers"][a.url]["state"] == "down"
            finally:
                a.signal(signal.SIGCONT)
            assert [r.output_ids for r in results] == [r.output_ids for r in ref]
            assert {r.server for r in results} == {b.url}
            await c.wait_serving(a.url, 60)  # it answers again: back in rotation
            if st["failover_kept_tokens"] > kept:
                break
        else:
            pytest.fail("no failover kept a stopped server's tokens in three tries")
        more = await asyncio.gather(*(c.agenerate(p, SamplingParams(max_new_tokens=4)) for p in PROMPTS))
        assert {r.server for r in more} == {a.url, b.url}


async def test_restarted_server_gets_the_current_weights_before_it_serves(servers, tiny_ckpt_b):
    a, b = await servers(2)
    async with client([a.url, b.url]) as c:
        await c.update_weights_from_disk(tiny_ckpt_b, 1)
        ref = await c.agenerate(PROMPTS[0], GREEDY)
        assert ref.output_versions == [1] * N_NEW
        port = a.port
        a.signal(signal.SIGKILL)
        await a.proc.wait()
        assert (await c.health())[a.url] is False
        (a2,) = await servers(1, port=port)  # comes back with the launch weights (version 0)
        await c.wait_serving(a.url, 120)
        info = await c.model_info()
        assert info[a.url]["weight_version"] == "1" and info[a.url]["model_path"] == tiny_ckpt_b
        outs = await asyncio.gather(*(c.agenerate(PROMPTS[0], GREEDY) for _ in range(4)))
        assert {r.server for r in outs} == {a2.url, b.url}
        assert all(r.output_ids == ref.output_ids and r.output_versions == [1] * N_NEW for r in outs)
