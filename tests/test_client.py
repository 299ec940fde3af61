"""InferenceClient against a stand-in SGLang app: wire format, retries, routing, failover, interruption logic.

The stand-in (`areal_async.testing.fake_sglang.FakeSGLang`) answers with SGLang 0.5.x's shapes and injects faults
on demand (see its docstring). The client against the real embedded server is tested at the end of this file, in
tests/test_interruption.py, and with real process signals in tests/test_client_faults.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from areal_async.inference.client import AdminError, InferenceClient, InferenceError, find_stop, parse_weight_version
from areal_async.inference.routing import Router
from areal_async.testing.fake_sglang import FIRST, NUM, tok_logprob, tok_text
from areal_async.types import SamplingParams

# ---- fixtures --------------------------------------------------------------------------------------------------


def fast_client(urls: list[str], **kw) -> InferenceClient:
    kw = {"backoff_s": 0.01, "probe_interval_s": 0.05, "unavailable_timeout_s": 10.0, **kw}
    return InferenceClient(urls, **kw)


PROMPT = [FIRST + 0, FIRST + 1]  # "ab": the stand-in continues c, d, e, ...


def letters(ids: list[int]) -> str:
    return "".join(tok_text(t) for t in ids)


# ---- pure helpers ----------------------------------------------------------------------------------------------


def test_parse_weight_version():
    assert parse_weight_version("default") == 0
    assert parse_weight_version("12") == 12
    assert parse_weight_version(3) == 3
    assert parse_weight_version(None) == 0
    assert parse_weight_version("v2-exp") == 0  # documented: foreign labels read as 0


def test_find_stop_places_match_on_completing_token():
    texts = ["ab", "c", "de", "f"]
    assert find_stop(texts, ["cd"], 0) == (2, "cd", 2)  # 'd' arrives with token 2
    assert find_stop(texts, ["zz"], 0) is None
    assert find_stop(texts, ["f", "bc"], 0) == (1, "bc", 1)  # earliest completing token wins
    assert find_stop(texts, ["bc"], 3) is None  # min_new_tokens: too early to stop
    assert find_stop(["a", "b", "a", "b"], ["ab"], 3) == (3, "ab", 2)  # a later occurrence still counts


def test_router_least_outstanding_and_sticky():
    r = Router(["http://a", "http://b/"])
    a, b = r.servers["http://a"], r.servers["http://b"]
    a.outstanding = 3
    assert r.pick() is b
    b.outstanding = 5
    assert r.pick() is a
    assert r.pick("k1") is a and r.pick("k1") is a
    a.outstanding = 100
    assert r.pick("k1") is a  # sticky beats load while healthy
    r.mark_down("http://a")
    assert r.pick("k1") is b and r.session_server("k1") == "http://b"  # moves, and stays moved
    r.mark_up("http://a")
    assert r.pick("k1") is b
    r.mark_down("http://b")
    r.mark_down("http://a")
    assert r.pick() is None
    with pytest.raises(ValueError):
        Router([])
    with pytest.raises(ValueError):
        Router(["http://a", "http://a/"])


def test_client_module_does_not_import_torch():
    mods = [
        "inference.client",
        "inference.routing",
        "inference.transport",
        "inference.resume",
        "inference.sglang_wire",
        "inference.fleet",
        "protocol.openai_requests",
        "protocol.openai_responses",
        "agent",
        "agent.workflow",
        "testing.fake_sglang",
    ]
    code = (
        f"import sys; import {', '.join('areal_async.' + m for m in mods)}; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- wire format -----------------------------------------------------------------------------------------------


async def test_payload_shape_auth_and_result(fakes):
    (srv,) = await fakes(1, version="7")
    async with fast_client([srv.url], api_key="sekret") as c:
        res = await c.agenerate(PROMPT, SamplingParams(max_new_tokens=5, temperature=0.0), rid="r1", return_text=True)
    body = srv.received[0]
    assert set(body) == {"input_ids", "sampling_params", "return_logprob", "stream", "rid"}
    assert body["return_logprob"] is True and body["stream"] is False and body["rid"] == "r1"
    assert body["input_ids"] == PROMPT
    assert body["sampling_params"]["max_new_tokens"] == 5 and body["sampling_params"]["temperature"] == 0.0
    assert srv.auth[0] == "Bearer sekret"
    assert letters(res.output_ids) == "cdefg" and res.text == "cdefg"
    assert res.output_logprobs == [tok_logprob(t, "7") for t in res.output_ids]
    assert res.output_versions == [7] * 5
    assert res.finish_reason == "length" and res.num_interruptions == 0 and res.server == srv.url
    assert res.input_ids == PROMPT


async def test_stop_string_and_default_version(fakes):
    (srv,) = await fakes(1)
    async with fast_client([srv.url]) as c:
        res = await c.agenerate(PROMPT, SamplingParams(max_new_tokens=20, stop=["ef"]), return_text=True)
    assert letters(res.output_ids) == "cdef"  # stop token kept in ids, like SGLang
    assert res.text == "cd" and res.finish_reason == "stop" and res.matched_stop == "ef"
    assert res.output_versions == [0] * 4  # "default" is version 0
    assert srv.received[0]["return_text_in_logprobs"] is True


async def test_bad_input(fakes):
    (srv,) = await fakes(1)
    async with fast_client([srv.url]) as c:
        with pytest.raises(InferenceError, match="max_new_tokens is too large") as ei:
            await c.agenerate(PROMPT, SamplingParams(max_new_tokens=20_000))
        assert ei.value.status == 400
        assert len(srv.received) == 1  # never retried
        with pytest.raises(ValueError):
            await c.agenerate([], SamplingParams())
        with pytest.raises(ValueError):
            await c.agenerate(PROMPT, SamplingParams(n=2))
        assert c.stats()["retries"] == 0


# ---- retries, routing, failover --------------------------------------------------------------------------------


async def test_retries_5xx_with_fresh_rids(fakes):
    (srv,) = await fakes(1)
    srv.fail_statuses = [500, 500]
    async with fast_client([srv.url], max_retries=3) as c:
        res = await c.agenerate(PROMPT, SamplingParams(max_new_tokens=3), rid="q")
        assert letters(res.output_ids) == "cde"
        assert c.stats()["retries"] == 2
        assert [b["rid"] for b in srv.received] == ["q", "q-1", "q-2"]
        srv.fail_statuses = [500] * 4  # max_retries=3: four attempts in all
        with pytest.raises(InferenceError, match="failed after 4 attempts"):
            await c.agenerate(PROMPT, SamplingParams(max_new_tokens=3), rid="z")
        assert c.stats()["servers"][srv.url]["healthy"]  # a 500 is not a dead server


async def test_least_outstanding_spreads_load(fakes):
    a, b = await fakes(2, token_delay=0.002)
    async with fast_client([a.url, b.url]) as c:
        results = await asyncio.gather(*(c.agenerate(PROMPT, SamplingParams(max_new_tokens=20)) for _ in range(20)))
        assert all(len(r.output_ids) == 20 for r in results)
        n_a, n_b = len(a.received), len(b.received)
        assert n_a + n_b == 20 and abs(n_a - n_b) <= 1
        # with a busy server, new work goes to the idle one
        busy = [asyncio.create_task(c.agenerate(PROMPT, SamplingParams(max_new_tokens=200))) for _ in range(2)]
        await a.wait_progress(1, 1)
        await b.wait_progress(1, 1)
        before_a, before_b = len(a.received), len(b.received)
        assert (before_a, before_b) == (n_a + 1, n_b + 1)
        await asyncio.gather(*busy)


async def test_sticky_sessions(fakes):
    a, b = await fakes(2)
    async with fast_client([a.url, b.url]) as c:
        for key in ("s1", "s2", "s3", "s4"):
            for _ in range(3):
                await c.agenerate(PROMPT, SamplingParams(max_new_tokens=2), session_key=key)
        pinned = {k: c.session_server(k) for k in ("s1", "s2", "s3", "s4")}
        assert set(pinned.values()) == {a.url, b.url}  # keys are spread
        for k, url in pinned.items():
            res = await c.agenerate(PROMPT, SamplingParams(max_new_tokens=2), session_key=k)
            assert res.server == url
        assert len(a.received) + len(b.received) == 16
        assert len(a.received) == 8  # 2 keys x 4 requests each


async def test_killed_server_fails_over_and_returns(fakes):
    a, b = await fakes(2, token_delay=0.005)
    async with fast_client([a.url, b.url]) as c:
        tasks = [asyncio.create_task(c.agenerate(PROMPT, SamplingParams(max_new_tokens=60))) for _ in range(8)]
        await a.wait_progress(4, 1)
        await b.wait_progress(4, 1)
        port = a.port
        await a.kill()
        results = await asyncio.gather(*tasks)
        assert all(len(r.output_ids) == 60 and r.finish_reason == "length" for r in results)
        assert all(letters(r.output_ids)[:3] == "cde" for r in results)
        st = c.stats()
        assert st["failovers"] >= 4 and not st["servers"][a.url]["healthy"]
        assert {r.server for r in results} == {b.url}
        # while a is down everything goes to b
        n_b = len(b.received)
        await asyncio.gather(*(c.agenerate(PROMPT, SamplingParams(max_new_tokens=2)) for _ in range(4)))
        assert len(b.received) == n_b + 4
        # restart on the same port: the background probe puts it back
        a2 = await fakes(1, port=port)
        for _ in range(200):
            if c.stats()["servers"][a.url]["healthy"]:
                break
            await asyncio.sleep(0.02)
        assert c.stats()["servers"][a.url]["healthy"]
        await asyncio.gather(*(c.agenerate(PROMPT, SamplingParams(max_new_tokens=2)) for _ in range(4)))
        assert len(a2[0].received) >= 1


async def test_all_down_waits_then_recovers_or_raises(fakes):
    (a,) = await fakes(1)
    port = a.port
    await a.kill()
    async with fast_client([a.url], unavailable_timeout_s=10.0) as c:
        task = asyncio.create_task(c.agenerate(PROMPT, SamplingParams(max_new_tokens=3)))
        await asyncio.sleep(0.3)
        assert not task.done()
        (a2,) = await fakes(1, port=port)
        res = await task
        assert letters(res.output_ids) == "cde"
    async with fast_client([a.url], unavailable_timeout_s=0.3) as c:
        await a2.kill()
        with pytest.raises(InferenceError, match="no healthy inference server"):
            await c.agenerate(PROMPT, SamplingParams(max_new_tokens=3))


async def test_503_takes_server_out(fakes):
    a, b = await fakes(2)
    a.health_status = 503
    a.fail_statuses = [503]
    async with fast_client([a.url, b.url]) as c:
        res = await c.agenerate(PROMPT, SamplingParams(max_new_tokens=2))
        assert res.server == b.url and c.stats()["failovers"] == 1
        assert not c.stats()["servers"][a.url]["healthy"]
        assert await c.health() == {a.url: False, b.url: True}
        a.health_status = 200
        for _ in range(200):
            if c.stats()["servers"][a.url]["healthy"]:
                break
            await asyncio.sleep(0.02)
        assert c.stats()["servers"][a.url]["healthy"]


# ---- interruption logic (the real-server version is tests/test_interruption.py) --------------------------------


async def test_pause_resume_resubmits_with_new_version(fakes):
    (srv,) = await fakes(1, token_delay=0.002)
    async with fast_client([srv.url]) as c:
        tasks = [
            asyncio.create_task(c.agenerate(PROMPT, SamplingParams(max_new_tokens=100, min_new_tokens=90), rid=f"g{i}"))
            for i in range(4)
        ]
        await srv.wait_progress(4, 5)
        await c.pause()
        assert c.paused
        await asyncio.sleep(0.05)  # interrupted requests wait for resume, they do not resubmit
        assert len(srv.received) == 4
        await c.update_weights_from_disk("/ckpt/v1", 1)
        await c.resume()
        results = await asyncio.gather(*tasks)
    for r in results:
        assert len(r.output_ids) == 100 and r.finish_reason == "length" and r.num_interruptions == 1
        expect = [FIRST + (2 + k) % NUM for k in range(100)]
        assert r.output_ids == expect  # seamless
        cut = r.output_versions.index(1)
        assert 0 < cut < 100 and r.output_versions == [0] * cut + [1] * (100 - cut)
        assert r.output_logprobs == [tok_logprob(t, "0" if k < cut else "1") for k, t in enumerate(r.output_ids)]
    resub = [b for b in srv.received[4:]]
    assert len(resub) == 4
    for b in resub:
        i = int(b["rid"].split("-")[0][1:])
        done = len(b["input_ids"]) - len(PROMPT)
        assert b["rid"] == f"g{i}-1" and b["sampling_params"]["max_new_tokens"] == 100 - done
        assert b["sampling_params"]["min_new_tokens"] == max(0, 90 - done)
    # SGLang loads without flushing, then is asked to flush apart (a refused flush inside the update can end
    # its scheduler: inference/sglang_dialect.py)
    update = (
        "update",
        {"model_path": "/ckpt/v1", "weight_version": "1", "abort_all_requests": False, "flush_cache": False},
    )
    assert update in srv.admin and srv.admin[srv.admin.index(update) + 1] == ("/flush_cache", {})
    assert c.stats()["interruptions"] == 4


async def test_abort_from_elsewhere_is_resubmitted(fakes):
    (srv,) = await fakes(1)
    srv.abort_after = [5, 0, 3]  # three aborts, one of them before any token
    async with fast_client([srv.url]) as c:
        res = await c.agenerate(PROMPT, SamplingParams(max_new_tokens=30))
        assert res.output_ids == [FIRST + (2 + k) % NUM for k in range(30)]
        assert res.num_interruptions == 3 and res.finish_reason == "length"
        srv.abort_after = [0] * 10  # aborted again and again with nothing made: give up with "abort"
        res = await c.agenerate(PROMPT, SamplingParams(max_new_tokens=30))
        assert res.finish_reason == "abort" and res.output_ids == []


async def test_stop_string_across_resubmission_boundary(fakes):
    (srv,) = await fakes(1)
    srv.abort_after = [3]  # first segment "cde" aborted; stop string "efg" spans the boundary
    async with fast_client([srv.url]) as c:
        res = await c.agenerate(PROMPT, SamplingParams(max_new_tokens=40, stop=["efg"]), return_text=True)
    assert letters(res.output_ids) == "cdefg"
    assert res.finish_reason == "stop" and res.matched_stop == "efg" and res.text == "cd"
    assert res.num_interruptions == 1
    assert len(res.output_logprobs) == len(res.output_versions) == 5


async def test_client_abort_ends_request(fakes):
    (srv,) = await fakes(1, token_delay=0.002)
    async with fast_client([srv.url]) as c:
        task = asyncio.create_task(c.agenerate(PROMPT, SamplingParams(max_new_tokens=5000), rid="victim"))
        await srv.wait_progress(1, 1)
        out = await c.abort("victim")
        assert out == {srv.url: None}
        res = await task
    assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 5000 and res.num_interruptions == 0
    assert res.output_ids == [FIRST + (2 + k) % NUM for k in range(len(res.output_ids))]


async def test_cancelled_request_is_aborted_on_server(fakes):
    (srv,) = await fakes(1, token_delay=0.002)
    async with fast_client([srv.url]) as c:
        task = asyncio.create_task(c.agenerate(PROMPT, SamplingParams(max_new_tokens=5000), rid="gone"))
        await srv.wait_progress(1, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if srv.num_inflight == 0:
                break
            await asyncio.sleep(0.01)
    assert ("abort", {"rid": "gone", "abort_all": False}) in srv.admin
    assert srv.num_inflight == 0


async def test_connection_cap_holds_generations_back_but_not_admin_calls(fakes):
    """Past `max_connections`, generations wait in the client (not counted as outstanding on any server), while
    pause/continue/health still get through at once: they must never queue behind the generations."""
    (srv,) = await fakes(1, token_delay=0.002)
    async with fast_client([srv.url], max_connections=2) as c:
        tasks = [
            asyncio.create_task(c.agenerate(PROMPT, SamplingParams(max_new_tokens=5000), rid=f"cap{i}"))
            for i in range(5)
        ]
        await srv.wait_progress(2, 1)
        await asyncio.sleep(0.05)
        assert srv.num_inflight == 2 and c.stats()["servers"][srv.url]["outstanding"] == 2
        assert (await asyncio.wait_for(c.health(), 5)) == {srv.url: True}
        await asyncio.wait_for(c.pause(), 5)  # the two on the wire come back aborted and wait for resume
        await asyncio.wait_for(c.resume(), 5)
        await srv.wait_progress(2, 1)
        assert srv.num_inflight == 2
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert [a[0] for a in srv.admin[:2]] == ["pause", "continue"]


# ---- admin fan-out ---------------------------------------------------------------------------------------------


async def test_failed_weight_load_leaves_rotation_until_it_holds_the_weights(fakes):
    """A server whose load fails keeps its old weights: it must not serve (nor be relabelled) until it has loaded
    the current ones, which it retries by itself; a load that fails everywhere changes nothing and raises."""
    a, b = await fakes(2)
    b.update_ok = False
    async with fast_client([a.url, b.url]) as c:
        res = await c.update_weights_from_disk("/ckpt/v3", 3)  # one server took it: the run goes on
        assert res[a.url]["success"] is True
        assert isinstance(res[b.url], InferenceError) and "cannot load" in str(res[b.url])
        st = c.stats()
        assert st["servers"][b.url]["state"] == "syncing" and not st["servers"][b.url]["healthy"]
        assert st["weight_load_failures"] >= 1
        n_b = len(b.received)
        await asyncio.gather(*(c.agenerate(PROMPT, SamplingParams(max_new_tokens=2)) for _ in range(6)))
        assert len(b.received) == n_b  # old weights never serve
        await c.update_weight_version(4)  # relabels a only: b's old weights must not become "4"
        assert ("version", {"new_version": "4", "abort_all_requests": False}) in a.admin
        assert not any(kind == "version" for kind, _ in b.admin)
        info = await c.model_info()
        assert info[a.url]["weight_version"] == "4" and info[b.url]["weight_version"] == "default"
        b.update_ok = True  # the retry in the background now succeeds, under the current label
        await _wait_healthy(c, b.url)
        assert b.version == "4"
        assert (
            "update",
            {"model_path": "/ckpt/v3", "weight_version": "4", "abort_all_requests": False, "flush_cache": False},
        ) in b.admin and ("/flush_cache", {}) in b.admin
        n_b = len(b.received)
        out = await asyncio.gather(*(c.agenerate(PROMPT, SamplingParams(max_new_tokens=2)) for _ in range(6)))
        assert all(r.output_versions == [4, 4] for r in out) and len(b.received) > n_b
        a.update_ok = b.update_ok = False
        with pytest.raises(AdminError) as ei:  # nobody took it: the target stays, both keep serving
            await c.update_weights_from_disk("/ckpt/bad", 5)
        assert set(ei.value.results) == {a.url, b.url}
        assert c.weight_target.version == 4 and all(s["healthy"] for s in c.stats()["servers"].values())
        res = await c.pause(mode="in_place")
        assert set(res) == {a.url, b.url} and all(r["status"] == "ok" for r in res.values())
        await c.resume()
        assert not c.paused


async def test_distributed_update_payloads(fakes):
    a, b = await fakes(2)
    async with fast_client([a.url, b.url]) as c:
        await c.init_weights_update_group("10.0.0.1", 29555, ranks_per_server=[2, 1], backend="gloo")
        await c.update_weights_from_distributed(["w"], ["float32"], [[2, 3]], 7)
        await c.flush_cache()
        with pytest.raises(ValueError):
            await c.init_weights_update_group("10.0.0.1", 29555, ranks_per_server=[1])
    init = {
        "master_address": "10.0.0.1",
        "master_port": 29555,
        "world_size": 4,
        "group_name": "weight_update_group",
        "backend": "gloo",
    }
    assert ("/init_weights_update_group", {**init, "rank_offset": 1}) in a.admin  # trainer is rank 0
    assert ("/init_weights_update_group", {**init, "rank_offset": 3}) in b.admin  # after a's two ranks
    upd = {
        "names": ["w"],
        "dtypes": ["float32"],
        "shapes": [[2, 3]],
        "group_name": "weight_update_group",
        "flush_cache": False,  # SGLang is asked to flush apart, after the update (inference/sglang_dialect.py)
        "abort_all_requests": False,
        "weight_version": "7",
    }
    assert ("/update_weights_from_distributed", upd) in a.admin and ("/update_weights_from_distributed", upd) in b.admin
    assert ("/flush_cache", {}) in a.admin


async def test_restarted_server_catches_up_weights(fakes):
    a, b = await fakes(2)
    async with fast_client([a.url, b.url]) as c:
        await c.update_weights_from_disk("/ckpt/v5", 5)
        port = a.port
        await a.kill()
        assert (await c.health())[a.url] is False
        (a2,) = await fakes(1, port=port)  # comes back with its launch weights
        for _ in range(200):
            if c.stats()["servers"][a.url]["healthy"]:
                break
            await asyncio.sleep(0.02)
        assert c.stats()["servers"][a.url]["healthy"]
        assert (
            a2.version == "5"
            and (
                "update",
                {"model_path": "/ckpt/v5", "weight_version": "5", "abort_all_requests": False, "flush_cache": False},
            )
            in a2.admin
        )


async def test_closed_client_refuses(fakes):
    (srv,) = await fakes(1)
    c = fast_client([srv.url])
    await c.agenerate(PROMPT, SamplingParams(max_new_tokens=1))
    await c.close()
    with pytest.raises(InferenceError, match="closed"):
        await c.agenerate(PROMPT, SamplingParams(max_new_tokens=1))


# ---- against the real embedded server --------------------------------------------------------------------------


async def _wait_healthy(c: InferenceClient, url: str) -> None:
    for _ in range(500):
        if c.stats()["servers"][url]["healthy"]:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{url} never came back")


@pytest.mark.timeout(120)
async def test_real_server_greedy_and_many_concurrent(tiny_ckpt):
    from areal_async.server.app import start_server

    prompt = [10, 11, 12, 13, 14]
    async with await start_server(tiny_ckpt, port=0, device="cpu") as server, fast_client([server.url]) as c:
        one = await c.agenerate(
            prompt, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True), return_text=True
        )
        two = await c.agenerate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
        assert one.output_ids == two.output_ids and len(one.output_ids) == 24
        assert max(abs(a - b) for a, b in zip(one.output_logprobs, two.output_logprobs)) < 1e-4
        assert all(lp <= 0 for lp in one.output_logprobs) and one.output_versions == [0] * 24
        assert isinstance(one.text, str) and one.text
        lengths = [8 + (7 * i) % 25 for i in range(64)]
        results = await asyncio.gather(
            *(
                c.agenerate([10 + i % 50, 11, 12], SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=1.0))
                for i, n in enumerate(lengths)
            )
        )
        assert [len(r.output_ids) for r in results] == lengths
        assert all(r.finish_reason == "length" and len(r.output_logprobs) == len(r.output_ids) for r in results)
        assert c.stats()["tokens"] == 48 + sum(lengths) and c.stats()["retries"] == 0
        # a request the server rejects: clear error, nothing retried
        with pytest.raises(InferenceError) as ei:
            await c.agenerate([10**9], SamplingParams(max_new_tokens=4))
        assert ei.value.status == 400 and c.stats()["retries"] == 0


@pytest.mark.timeout(120)
async def test_real_servers_routing_and_failover(tiny_ckpt):
    from areal_async.server.app import start_server

    a = await start_server(tiny_ckpt, port=0, device="cpu")
    b = await start_server(tiny_ckpt, port=0, device="cpu")
    restarted = None
    try:
        async with fast_client([a.url, b.url]) as c:
            greedy = SamplingParams(max_new_tokens=300, temperature=0.0, ignore_eos=True)
            prompts = [[10 + i, 20, 30 + i] for i in range(8)]
            ref = await asyncio.gather(*(c.agenerate(p, greedy) for p in prompts))
            st = c.stats()["servers"]
            assert st[a.url]["requests"] == st[b.url]["requests"] == 4  # least outstanding: an even split
            for key in ("alpha", "beta", "gamma"):
                first = await c.agenerate(prompts[0], SamplingParams(max_new_tokens=2), session_key=key)
                again = await c.agenerate(prompts[0], SamplingParams(max_new_tokens=2), session_key=key)
                assert first.server == again.server == c.session_server(key)

            # kill a with requests in flight: they fail over to b and still come out exactly as before
            tasks = [asyncio.create_task(c.agenerate(p, greedy)) for p in prompts]
            for _ in range(2000):  # until a's four are admitted: they cannot finish 300 tokens before the kill
                if a.engine.num_running() == 4:
                    break
                await asyncio.sleep(0.005)
            assert a.engine.num_running() == 4
            port = int(a.url.rsplit(":", 1)[1])
            await a.close()
            results = await asyncio.gather(*tasks)
            assert [r.output_ids for r in results] == [r.output_ids for r in ref]
            # a's requests left it either as a failover (the connection dropped mid-request) or as an interruption
            # (a closing server aborts what it runs, and the resubmission goes to b): which one depends on timing
            moved = c.stats()["failovers"] + c.stats()["interruptions"]
            assert moved >= 1 and not c.stats()["servers"][a.url]["healthy"], c.stats()
            assert {r.server for r in results} == {b.url}

            restarted = await start_server(tiny_ckpt, port=port, device="cpu")
            await _wait_healthy(c, a.url)
            more = await asyncio.gather(*(c.agenerate(p, SamplingParams(max_new_tokens=4)) for p in prompts))
            assert {r.server for r in more} == {a.url, b.url}
    finally:
        for s in (a, b, restarted):
            if s is not None:
                await s.close()
