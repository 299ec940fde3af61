"""InferenceClient: per-token versions inside one response, streaming, lost and hung servers, servers joining and
leaving, and weight catch-up, against the stand-in SGLang server (areal_async/testing/fake_sglang.py).

The same behaviour against real embedded server processes and real signals is in tests/test_client_faults.py.
"""

from __future__ import annotations

import asyncio

import pytest
from fake_fleet import until

from areal_async.inference.client import InferenceClient, InferenceError
from areal_async.inference.sglang_wire import span_versions
from areal_async.testing.fake_sglang import FIRST, NUM, tok_logprob

PROMPT = [FIRST + 0, FIRST + 1]  # "ab": the stand-in continues c, d, e, ...

pytestmark = pytest.mark.timeout(60)


def expected(n: int, start: int = 2) -> list[int]:
    return [FIRST + (start + k) % NUM for k in range(n)]


def client(urls: list[str], **kw) -> InferenceClient:
    kw = {"backoff_s": 0.01, "probe_interval_s": 0.05, "unavailable_timeout_s": 10.0, "health_timeout_s": 0.3, **kw}
    return InferenceClient(urls, **kw)


def sp(n: int, **kw):
    from areal_async.types import SamplingParams

    return SamplingParams(max_new_tokens=n, **kw)


# ---- per-token versions inside one response ------------------------------------------------------------------


def test_span_versions_reads_and_checks_spans():
    assert span_versions([(0, "1"), (3, "2")], 5, 0, "x") == [1, 1, 1, 2, 2]
    assert span_versions([(0, "1"), (3, "2")], 5, 2, "x") == [1, 2, 2]  # only the tokens not yet taken
    assert span_versions([(0, "default")], 2, 0, "x") == [0, 0]
    assert span_versions([], 0, 0, "x") == []
    for bad in ([(1, "1")], [(0, "1"), (0, "2")], [(0, "1"), (3, "2"), (2, "3")], [(0, "1"), (5, "2")], []):
        with pytest.raises(InferenceError, match="weight_version_spans"):
            span_versions(bad, 5, 0, "x")


@pytest.mark.parametrize("stream,incremental", [(False, False), (True, False), (True, True)])
async def test_spans_give_each_token_its_version(fakes, stream, incremental):
    """Weights change twice inside one response (a broadcast without interruption): every token says which."""
    (srv,) = await fakes(1, version="1")
    srv.spans, srv.incremental = True, incremental
    srv.version_at = [(5, "2"), (12, "3")]
    async with client([srv.url], stream=stream) as c:
        res = await c.agenerate(PROMPT, sp(20), return_text=True)
    assert res.output_ids == expected(20) and res.finish_reason == "length"
    want = [1] * 5 + [2] * 7 + [3] * 8
    assert res.output_versions == want
    assert res.output_logprobs == [tok_logprob(t, str(v)) for t, v in zip(res.output_ids, want)]
    assert res.text == "cdefghijklmnopqrstuv"
    assert srv.received[0]["stream"] is stream


async def test_without_spans_tokens_carry_the_answer_version(fakes):
    """Real SGLang reports one weight_version per answer: a whole JSON answer is stamped with it; a stream stamps
    each event's new tokens with the label it carried (exact at event granularity)."""
    (srv,) = await fakes(1, version="1")
    srv.version_at = [(5, "2")]
    async with client([srv.url]) as c:
        res = await c.agenerate(PROMPT, sp(10))
    assert res.output_versions == [2] * 10  # the label at the end: the only one this answer has
    srv.version, srv.version_at = "1", [(5, "2")]
    async with client([srv.url], stream=True) as c:
        res = await c.agenerate(PROMPT, sp(10))
    assert res.output_versions == [1] * 5 + [2] * 5


async def test_resumed_request_keeps_the_spans_of_each_segment(fakes):
    """Aborted from elsewhere after 8 tokens, resubmitted: each segment's spans stamp its own tokens."""
    (srv,) = await fakes(1, version="0")
    srv.spans = True
    srv.abort_after = [8]
    srv.version_at = [(4, "1"), (2, "2")]  # segment 1 switches to 1 at its 4th token; segment 2 to 2 at its 2nd
    async with client([srv.url]) as c:
        res = await c.agenerate(PROMPT, sp(20))
    assert res.num_interruptions == 1 and res.output_ids == expected(20)
    assert res.output_versions == [0] * 4 + [1] * 4 + [1] * 2 + [2] * 10
    assert srv.received[1]["input_ids"] == PROMPT + expected(8)
    assert srv.received[1]["sampling_params"]["max_new_tokens"] == 12


async def test_malformed_spans_are_an_error_not_a_guess(fakes):
    (srv,) = await fakes(1)
    srv.spans = True
    srv.mutate = lambda answer: answer["meta_info"].__setitem__("weight_version_spans", [[1, "2"]])
    async with client([srv.url]) as c:
        with pytest.raises(InferenceError, match="malformed weight_version_spans"):
            await c.agenerate(PROMPT, sp(6))


async def test_auto_streams_only_to_servers_with_incremental_events(fakes):
    """stream="auto" (the default): SSE where events carry only new tokens, one JSON answer where every event
    would resend the whole answer so far."""
    a, b = await fakes(2)
    a.incremental, a.spans = True, True
    async with client([a.url, b.url]) as c:
        # the first requests go out as JSON while the servers they reach are asked
        await asyncio.gather(*(c.agenerate(PROMPT, sp(3)) for _ in range(4)))
        await until(lambda: all(s.incremental_stream is not None for s in c._pool.router.servers.values()))
        n_a, n_b = len(a.received), len(b.received)
        res = await asyncio.gather(*(c.agenerate(PROMPT, sp(12)) for _ in range(6)))
    assert all(r.output_ids == expected(12) for r in res)
    assert a.received[n_a:] and all(body["stream"] is True for body in a.received[n_a:])
    assert b.received[n_b:] and all(body["stream"] is False for body in b.received[n_b:])


# ---- a server lost mid-request ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_killed_server_requests_continue_elsewhere(fakes, stream):
    """Streaming keeps the tokens of the segment in progress: the resubmission carries them. Without streaming the
    segment in progress is lost and generated again. Either way the result is the same seamless completion."""
    a, b = await fakes(2, token_delay=0.005)
    async with client([a.url, b.url], stream=stream) as c:
        tasks = [asyncio.create_task(c.agenerate(PROMPT, sp(80))) for _ in range(4)]
        await a.wait_progress(2, 10)
        n_b = len(b.received)
        await a.kill()
        results = await asyncio.gather(*tasks)
        assert all(r.output_ids == expected(80) and r.finish_reason == "length" for r in results)
        assert c.stats()["servers"][a.url]["state"] == "down"
        kept_count = c.stats()["failover_kept_tokens"]
    moved = b.received[n_b:]
    assert len(moved) == 2
    kept = [len(m["input_ids"]) - len(PROMPT) for m in moved]
    if stream:
        assert all(k >= 10 for k in kept) and kept_count == sum(kept)  # nothing generated was lost
        assert all(m["sampling_params"]["max_new_tokens"] == 80 - k for m, k in zip(moved, kept))
    else:
        assert kept == [0, 0] and kept_count == 0


async def test_hung_server_is_found_and_its_requests_move_on(fakes):
    """A server that stops answering (SIGSTOP) is found by the heartbeat and left; its requests continue on the
    other server from their streamed tokens; when it answers again it comes back."""
    a, b = await fakes(2, token_delay=0.005)
    async with client([a.url, b.url], stream=True) as c:
        tasks = [asyncio.create_task(c.agenerate(PROMPT, sp(100))) for _ in range(4)]
        await a.wait_progress(2, 10)
        a.hung = True
        results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        assert all(r.output_ids == expected(100) for r in results)
        st = c.stats()
        assert st["servers"][a.url]["state"] == "down" and st["servers_lost"] == 1
        assert {r.server for r in results} == {b.url}
        a.hung = False
        await until(lambda: c.stats()["servers"][a.url]["healthy"])
        assert c.stats()["servers_recovered"] == 1


async def test_admin_call_to_a_hung_server_does_not_hang_the_fleet(fakes):
    """pause() reaches every server at once; one that hangs is found by the heartbeat and its call ends, so a weight
    sync is never held hostage by a stopped process."""
    a, b = await fakes(2)
    async with client([a.url, b.url]) as c:
        a.hung = True
        res = await asyncio.wait_for(c.pause(), 10)
        assert isinstance(res[a.url], InferenceError) and res[b.url]["status"] == "ok"
        assert c.stats()["servers"][a.url]["state"] == "down"
        res = await asyncio.wait_for(c.resume(), 10)  # the down server is no longer asked
        assert set(res) == {b.url}


async def test_long_healthy_generation_is_not_cut_short(fakes):
    """The hang deadline is on /health, not on the generation: a generation far longer than health_timeout_s
    finishes on its server, with no failover."""
    (a, b) = await fakes(2, token_delay=0.01)
    async with client([a.url, b.url], health_timeout_s=0.1, max_health_failures=1) as c:
        res = await c.agenerate(PROMPT, sp(120))  # ~1.2 s, twelve health deadlines
        assert res.output_ids == expected(120)
        st = c.stats()
        assert st["failovers"] == 0 and st["servers_lost"] == 0 and st["retries"] == 0


# ---- servers joining and leaving ----------------------------------------------------------------------------------


async def test_remove_server_drains_or_moves_its_requests(fakes):
    a, b = await fakes(2, token_delay=0.004)
    async with client([a.url, b.url], stream=True) as c:
        tasks = [asyncio.create_task(c.agenerate(PROMPT, sp(60))) for _ in range(4)]
        await b.wait_progress(2, 5)
        await c.remove_server(b.url, drain_timeout_s=None)  # wait for its requests to finish there
        results = await asyncio.gather(*tasks)
        assert sum(r.server == b.url for r in results) == 2 and b.url not in c.urls
        with pytest.raises(ValueError):
            await c.remove_server(a.url)  # the last one
        await c.add_server(b.url, wait=True, timeout_s=5)
        tasks = [asyncio.create_task(c.agenerate(PROMPT, sp(200))) for _ in range(4)]
        await b.wait_progress(2, 5)
        n_a = len(a.received)
        await c.remove_server(b.url, drain_timeout_s=0)  # move them now, with their tokens
        results = await asyncio.gather(*tasks)
        assert all(r.output_ids == expected(200) for r in results)
        moved = a.received[n_a:]
        assert len(moved) == 2 and all(len(m["input_ids"]) > len(PROMPT) + 2 for m in moved)


async def test_added_server_catches_up_before_it_serves(fakes):
    a, b = await fakes(2)
    async with client([a.url]) as c:
        await c.update_weights_from_disk("/ckpt/v2", 2)
        await c.add_server(b.url, wait=True, timeout_s=5)
        assert (
            b.version == "2"
            and (
                "update",
                {"model_path": "/ckpt/v2", "weight_version": "2", "abort_all_requests": False, "flush_cache": False},
            )
            in b.admin
        )
        assert ("continue", {}) in b.admin  # not paused: made sure it is not left paused either
        res = await asyncio.gather(*(c.agenerate(PROMPT, sp(2)) for _ in range(4)))
        assert {r.server for r in res} == {a.url, b.url} and all(r.output_versions == [2, 2] for r in res)


async def test_broadcast_weights_a_restarted_server_waits_for_a_checkpoint(fakes):
    """After a broadcast there is no checkpoint: a restarted server (launch weights) and one that failed a bucket
    (a mix of versions under the new label) must stay out until they get the current weights."""
    a, b = await fakes(2)
    async with client([a.url, b.url]) as c:
        await c.update_weights_from_distributed(["w1"], ["float32"], [[2]], 3)
        b.dist_ok = False
        await c.update_weights_from_distributed(["w2"], ["float32"], [[2]], 4)  # b took bucket 1 only ...
        b.dist_ok = True
        await c.update_weights_from_distributed(["w3"], ["float32"], [[2]], 4)  # ... so its label lies
        assert b.version == "4" and c.stats()["servers"][b.url]["state"] == "syncing"
        port = a.port
        await a.kill()
        assert (await c.health())[a.url] is False
        (a2,) = await fakes(1, port=port)  # restarted: launch weights
        await asyncio.sleep(0.5)
        st = c.stats()["servers"]
        assert st[a.url]["state"] == "syncing" and st[b.url]["state"] == "syncing"
        with pytest.raises(InferenceError, match="no healthy inference server"):
            await _no_server_within(c, 0.3)
        published: list[int] = []

        async def source(version: int) -> str:
            published.append(version)
            return f"/ckpt/published-v{version}"

        c.weight_source = source
        await c.wait_serving(a.url, 10)
        await c.wait_serving(b.url, 10)
        assert published == [4]  # published once, loaded by both
        for srv in (a2, b):
            assert (
                "update",
                {
                    "model_path": "/ckpt/published-v4",
                    "weight_version": "4",
                    "abort_all_requests": False,
                    "flush_cache": False,
                },
            ) in srv.admin and ("/flush_cache", {}) in srv.admin
        res = await c.agenerate(PROMPT, sp(2))
        assert res.output_versions == [4, 4]


async def _no_server_within(c: InferenceClient, seconds: float) -> None:
    c._pool.unavailable_timeout_s = seconds
    try:
        await c.agenerate(PROMPT, sp(2))
    finally:
        c._pool.unavailable_timeout_s = 10.0


async def test_load_weights_readmits_a_restarted_server(fakes):
    a, b = await fakes(2)
    async with client([a.url, b.url]) as c:
        await c.update_weights_from_distributed(["w"], ["float32"], [[2]], 7)
        port = b.port
        await b.kill()
        assert (await c.health())[b.url] is False
        (b2,) = await fakes(1, port=port)
        await asyncio.sleep(0.3)
        assert c.stats()["servers"][b.url]["state"] == "syncing"
        await c.load_weights(b.url, "/ckpt/v7", 7)  # what a launcher does after restarting it
        assert c.stats()["servers"][b.url]["healthy"] and b2.version == "7"
        with pytest.raises(InferenceError, match="cannot load"):
            b2.update_ok = False
            await c.load_weights(b.url, "/ckpt/v8", 8)
