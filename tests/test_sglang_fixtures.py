"""The client against SGLang's own answers: the bodies in tests/fixtures/sglang/ (SGLang 0.5.x's field names and
shapes, see its README) replayed over real HTTP by a server that only plays them back, so nothing here was shaped
by our embedded server or by the fake. Generation (JSON and a cumulative SSE stream, stop/length/abort answers,
an abort from elsewhere resumed with the tokens so far), the admin calls a run makes (pause, weight updates,
weight-update groups, info), and the broadcast layout read from /get_server_info."""

from __future__ import annotations

import json
import math
import os

import pytest
from aiohttp import web

from areal_async.inference.client import AdminError, InferenceClient, InferenceError
from areal_async.rollout.broadcast_group import BroadcastLayoutError, plan_group
from areal_async.types import SamplingParams

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "sglang")


def fixture(name: str):
    with open(os.path.join(FIXTURES, name), "rb") as f:
        data = f.read()
    return data if name.endswith(".sse") else json.loads(data)


ADMIN = fixture("admin.json")


class Replay:
    """Answers every request with a recorded body: /generate from a queue (one fixture per call), the admin
    endpoints from admin.json (a name can be switched to its failing variant), info from its fixtures."""

    def __init__(self) -> None:
        self.generate: list[str] = []  # fixture names, one per /generate call
        self.received: list[dict] = []  # /generate bodies
        self.admin_calls: list[tuple[str, dict | None]] = []
        self.variant: dict[str, str] = {}  # endpoint -> admin.json key to answer with instead
        self.server_info = fixture("get_server_info.json")
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Replay:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_get("/get_model_info", self._model_info)
        for name in (
            "pause_generation",
            "continue_generation",
            "update_weights_from_disk",
            "init_weights_update_group",
            "update_weights_from_distributed",
            "destroy_weights_update_group",
            "abort_request",
            "flush_cache",
        ):
            app.router.add_post("/" + name, self._admin(name))
        app.router.add_get("/health", self._admin("health"))
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.server_info)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response(fixture("get_model_info.json"))

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        name = self.generate.pop(0)
        if name == "bad_request":
            entry = ADMIN["bad_request"]
            return web.json_response(entry["body"], status=entry["status"])
        if name.endswith(".sse"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in fixture(name).split(b"\n\n"):
                if event.strip():
                    await resp.write(event + b"\n\n")
            await resp.write_eof()
            return resp
        return web.json_response(fixture(name))

    def _admin(self, name: str):
        async def handle(request: web.Request) -> web.Response:
            raw = await request.read()
            self.admin_calls.append((name, json.loads(raw) if raw.strip() else None))
            entry = ADMIN[self.variant.get(name, name)]
            if "body" in entry:
                return web.json_response(entry["body"], status=entry["status"])
            return web.Response(text=entry["text"], status=entry["status"])

        return handle


@pytest.fixture
async def replay():
    r = await Replay().start()
    yield r
    await r.close()


PROMPT = [21, 22, 23]


async def test_json_answer_reads_tokens_logprobs_versions_and_finish(replay):
    replay.generate = ["generate_length.json", "generate_stop.json"]
    async with InferenceClient([replay.url], stream=False) as c:
        r = await c.agenerate(PROMPT, SamplingParams(max_new_tokens=4, temperature=1.0))
        want = fixture("generate_length.json")
        assert r.output_ids == want["output_ids"]
        assert r.output_logprobs == [t[0] for t in want["meta_info"]["output_token_logprobs"]]
        assert r.output_versions == [0] * 4  # "default": the launch weights, version 0
        assert r.finish_reason == "length" and r.num_interruptions == 0
        sent = replay.received[0]
        assert sent["input_ids"] == PROMPT and sent["return_logprob"] is True and sent["stream"] is False
        assert sent["sampling_params"]["max_new_tokens"] == 4
        stop = await c.agenerate([29, 30], SamplingParams(max_new_tokens=8))
    assert stop.finish_reason == "stop" and stop.matched_stop == 2 and stop.output_ids == [31, 2]
    assert stop.output_versions == [7, 7]  # SGLang labels the whole answer with its weight_version


async def test_cumulative_stream_is_read_event_by_event(replay):
    replay.generate = ["generate_stream.sse"]
    async with InferenceClient([replay.url], stream=True) as c:
        r = await c.agenerate(PROMPT, SamplingParams(max_new_tokens=4))
    want = fixture("generate_length.json")
    assert r.output_ids == want["output_ids"] and r.finish_reason == "length"
    assert r.output_logprobs == [t[0] for t in want["meta_info"]["output_token_logprobs"]]
    assert replay.received[0]["stream"] is True


async def test_abort_from_elsewhere_resumes_with_the_tokens_so_far(replay):
    """An abort the client did not cause (another controller, an operator): it backs off and resubmits the prompt
    plus the two tokens it got, asking for what is left; the tokens keep the versions that made them."""
    replay.generate = ["generate_abort.json", "generate_resumed.json"]
    async with InferenceClient([replay.url], stream=False, backoff_s=0.01) as c:
        r = await c.agenerate(PROMPT, SamplingParams(max_new_tokens=4))
    assert r.output_ids == [24, 25, 26, 27] and r.output_versions == [0, 0, 1, 1]
    assert r.num_interruptions == 1 and r.finish_reason == "length"
    again = replay.received[1]
    assert again["input_ids"] == PROMPT + [24, 25] and again["sampling_params"]["max_new_tokens"] == 2
    assert again["rid"].startswith(replay.received[0]["rid"])  # a prefix abort by rid still reaches it
    assert math.isclose(r.output_logprobs[2], -0.35667494393873245)


async def test_validation_error_is_a_clear_error(replay):
    replay.generate = ["bad_request"]
    async with InferenceClient([replay.url], stream=False, max_retries=0) as c:
        with pytest.raises(InferenceError, match="Input should be a valid integer"):
            await c.agenerate(PROMPT, SamplingParams(max_new_tokens=4))


async def test_admin_calls_read_sglang_answers(replay):
    # the recorded server ran with its radix cache, where an in-place pause is refused (test_in_place_refusals);
    # as launched for an in-place run it has none
    replay.server_info = {**replay.server_info, "disable_radix_cache": True}
    async with InferenceClient([replay.url]) as c:
        await c.pause("in_place")
        await c.resume()
        assert [n for n, _ in replay.admin_calls] == ["pause_generation", "continue_generation"]
        assert replay.admin_calls[0][1] == {"mode": "in_place"}

        out = await c.update_weights_from_disk("/ckpt/v1", 1)
        assert out[replay.url]["success"] is True
        assert c.weight_target is not None and c.weight_target.version == 1
        replay.variant["update_weights_from_disk"] = "update_weights_from_disk_failed"
        with pytest.raises(AdminError, match="repository not found"):
            await c.update_weights_from_disk("/ckpt/v9", 9)
        replay.variant.clear()

        await c.init_weights_update_group("10.0.0.2", 29500, ranks_per_server=[2], group_name="g1", backend="nccl")
        init = next(body for n, body in replay.admin_calls if n == "init_weights_update_group")
        assert init == {
            "master_address": "10.0.0.2",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": "g1",
            "backend": "nccl",
        }
        replay.variant["init_weights_update_group"] = "init_weights_update_group_failed"
        with pytest.raises(AdminError, match="timed out"):
            await c.init_weights_update_group("10.0.0.2", 29500, group_name="g2", backend="nccl")
        assert await c.destroy_weights_update_group("g1") == {
            replay.url: {"success": True, "message": "Succeeded to destroy custom process group."}
        }
        replay.variant["destroy_weights_update_group"] = "destroy_weights_update_group_missing"
        assert await c.destroy_weights_update_group("g1", [replay.url]) == {replay.url: None}  # already gone

        info = (await c.model_info())[replay.url]  # /model_info is 404 on this version: /get_model_info
        assert info["model_path"] == "/models/Qwen2.5-7B-Instruct" and info["weight_version"] == "default"
        assert (await c.health()) == {replay.url: True}
        assert replay.url in await c.flush_cache()


async def test_in_place_refusals(replay):
    """An in-place pause on the recorded SGLang (radix cache on) is refused before anything is sent: requests that
    keep running across the update would leave old-weight KV in a cache new requests reuse."""
    async with InferenceClient([replay.url]) as c:
        with pytest.raises(AdminError, match="disable-radix-cache"):
            await c.pause("in_place")
    assert replay.admin_calls == []


async def test_broadcast_layout_from_get_server_info(replay):
    """tp_size=2 in SGLang's ServerArgs: the server holds two ranks of the weight-update group; dp_size=2 without
    DP attention is refused before any rank waits in a rendezvous."""
    async with InferenceClient([replay.url]) as c:
        info = (await c.server_info())[replay.url]
        assert info["tp_size"] == 2 and info["version"] == "0.5.6"
        plan = await plan_group(c, [replay.url], None, default_ranks=1, backend="nccl")
        assert plan.ranks == [2] and plan.backend == "nccl"
        replay.server_info = {**replay.server_info, "dp_size": 2}
        with pytest.raises(BroadcastLayoutError, match="dp_size=2"):
            await plan_group(c, [replay.url], None, default_ranks=1, backend="nccl")
