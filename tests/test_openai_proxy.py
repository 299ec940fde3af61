"""The OpenAI-compatible proxy, driven by the official `openai` SDK, over the real embedded server and client.

A tiny model is first taught one agent conversation (call the `add` tool, then state the result), so that greedy
decoding through the whole stack produces a real tool call and a real final answer; the test then plays the
agent's side with the SDK exactly as an agent framework would, and checks what the proxy recorded for training.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import pytest

from areal_async.agent import AgentWorkflow, Episode, OpenAIProxy, PolicySampling, parse_tool_calls
from areal_async.agent.episode import CallRecord
from areal_async.inference.client import InferenceClient
from areal_async.rollout.workflows.multi_turn import ChatTokens
from areal_async.testing.interrupt import swap_weights_mid_generation
from areal_async.tokenizer import Tokenizer
from areal_async.types import Sample

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(180)

USER = [{"role": "user", "content": "What is 2+3? Use the add tool."}]
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The answer is 5."
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@pytest.fixture(scope="module")
def agent_ckpt(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint, overfitted on one tool-using conversation until greedy decoding reproduces it."""
    import torch
    import transformers

    path = str(tmp_path_factory.mktemp("agent") / "ckpt")
    shutil.copytree(tiny_ckpt, path)
    tok = Tokenizer(path)
    ct = ChatTokens(tok)
    eos = tok.eos_token_ids[0]
    p1 = tok.apply_chat_template(USER, add_generation_prompt=True)
    o1 = tok.encode(TOOL_CALL) + [eos]
    mid = ct.close_turn_ids(o1) + ct.delta_ids([{"role": "tool", "content": "5"}])
    o2 = tok.encode(ANSWER) + [eos]
    seq = p1 + o1 + mid + o2
    train = torch.tensor([0] * len(p1) + [1] * len(o1) + [0] * len(mid) + [1] * len(o2), dtype=torch.bool)[1:]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ids = torch.tensor([seq])  # [1, T]
    for _ in range(400):
        logits = model(ids).logits[0, :-1]  # [T-1, V]
        target = ids[0, 1:]
        loss = torch.nn.functional.cross_entropy(logits[train], target[train])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bool((logits[train].argmax(-1) == target[train]).all()) and loss.item() < 0.1:
            break
    model.save_pretrained(path)
    return path


@pytest.fixture
async def stack(agent_ckpt):
    """(proxy, client, server): the real embedded server, the real InferenceClient, the proxy over them."""
    from areal_async.server.app import start_server

    async with await start_server(agent_ckpt, port=0, device="cpu") as server, InferenceClient([server.url]) as client:
        # the policy samples greedily here, so the SDK agents (temperature=0) are sampled as they ask
        proxy = OpenAIProxy(
            client, Tokenizer(agent_ckpt), model_name="tiny-agent", policy=PolicySampling(temperature=0.0)
        )
        await proxy.start()
        try:
            yield proxy, client, server
        finally:
            await proxy.close()


def sdk(proxy: OpenAIProxy, key: str):
    return openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)


async def test_tool_calling_agent_loop_with_the_openai_sdk(stack):
    proxy, _client, _server = stack
    eid = proxy.start_episode()
    oai = sdk(proxy, eid)
    messages = list(USER)
    r1 = await oai.chat.completions.create(
        model="tiny-agent", messages=messages, tools=[ADD_TOOL], temperature=0, logprobs=True, max_tokens=100
    )
    ch = r1.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert len(ch.logprobs.content) == r1.usage.completion_tokens

    # the agent runs the tool and sends everything back, as agent frameworks do
    args = json.loads(call.function.arguments)
    messages += [
        ch.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    r2 = await oai.chat.completions.create(
        model="tiny-agent", messages=messages, tools=[ADD_TOOL], temperature=0, logprobs=True, max_tokens=100
    )
    assert r2.choices[0].message.content == ANSWER and r2.choices[0].finish_reason == "stop"
    assert r2.model_extra["areal"]["continued_call"] == r1.id  # token-exact continuation of call 1

    # reward through the HTTP endpoint, with the episode id as the key
    async with aiohttp.ClientSession() as s:
        async with s.post(
            proxy.base_url + "/reward", json={"reward": 1.0}, headers={"Authorization": f"Bearer {eid}"}
        ) as resp:
            assert resp.status == 200

    ep = proxy.episode(eid)
    c1, c2 = ep.calls
    assert c2.prompt_ids[: len(c1.prompt_ids) + len(c1.output_ids)] == c1.prompt_ids + c1.output_ids
    (traj,) = proxy.finish_episode(eid)
    assert traj.info["export"] == "concat" and traj.reward == 1.0
    assert traj.input_ids == c2.prompt_ids + c2.output_ids
    trained = [t for t, m in zip(traj.input_ids, traj.loss_mask) if m]
    assert trained == c1.output_ids + c2.output_ids  # exactly the sampled tokens, nothing re-tokenised
    tok = proxy.tok
    assert tok.decode(c1.output_ids) == TOOL_CALL and tok.decode(c2.output_ids) == ANSWER
    sdk_lps = [t.logprob for t in ch.logprobs.content] + [t.logprob for t in r2.choices[0].logprobs.content]
    assert [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m] == pytest.approx(sdk_lps)
    assert all(v == 0 for v, m in zip(traj.versions, traj.loss_mask) if m)
    assert all(v == -1 for v, m in zip(traj.versions, traj.loss_mask) if not m)
    with pytest.raises(openai.AuthenticationError):  # a finished episode's key no longer works
        await oai.chat.completions.create(model="tiny-agent", messages=USER, max_tokens=4)


async def test_completions_models_streaming_and_errors(stack):
    proxy, _client, _server = stack
    eid = proxy.start_episode()
    oai = sdk(proxy, eid)
    models = await oai.models.list()
    assert [m.id for m in models.data] == ["tiny-agent"]

    c = await oai.completions.create(model="tiny-agent", prompt="What is 2+3?", max_tokens=6, temperature=0, logprobs=1)
    ch = c.choices[0]
    assert len(ch.logprobs.tokens) == len(ch.logprobs.token_logprobs) == c.usage.completion_tokens
    assert "".join(ch.logprobs.tokens).startswith(ch.text)
    assert all(lp <= 0 for lp in ch.logprobs.token_logprobs)

    # token-id prompts and n > 1
    ids = proxy.tok.encode("2+3=")
    c2 = await oai.completions.create(model="tiny-agent", prompt=ids, max_tokens=5, n=2, temperature=1.0)
    assert len(c2.choices) == 2 and c2.usage.prompt_tokens == len(ids)  # once per prompt, as SGLang and OpenAI

    # a text prompt that extends an earlier prompt + its returned text continues that call's tokens
    first = proxy.episode(eid).calls[0]
    if first.text is not None:  # the output decodes exactly to the returned text (no special tokens in it)
        await oai.completions.create(model="tiny-agent", prompt="What is 2+3?" + ch.text + " ok", max_tokens=3)
        last = proxy.episode(eid).calls[-1]
        assert last.prompt_ids[: len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids

    # streaming, read by the SDK
    stream = await oai.chat.completions.create(
        model="tiny-agent", messages=USER, tools=[ADD_TOOL], temperature=0, stream=True, max_tokens=100
    )
    chunks = [chunk async for chunk in stream]
    tool_deltas = [tc for chunk in chunks for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    assert tool_deltas and tool_deltas[0].function.name == "add"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(model="tiny-agent", messages=USER, n=0)
    with pytest.raises(openai.BadRequestError):
        await oai.completions.create(model="tiny-agent", prompt="x", echo=True)
    with pytest.raises(openai.AuthenticationError):
        await sdk(proxy, "ep-never-issued").completions.create(model="tiny-agent", prompt="x", max_tokens=2)
    assert proxy.episode(eid).summary()["calls"]  # every successful call recorded


async def test_per_call_rewards_discounting_and_export(stack):
    proxy, _client, _server = stack
    eid = proxy.start_episode(group_id=7)
    oai = sdk(proxy, eid)
    r1 = await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    r2 = await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "other"}], max_tokens=4)
    async with aiohttp.ClientSession() as s:
        url = proxy.base_url + "/reward"
        async with s.post(url, json={"reward": 0.5, "call_id": r1.id}, headers={"X-Episode-Id": eid}) as resp:
            assert resp.status == 200
        async with s.post(url, json={"reward": 1, "call_id": "nope"}, headers={"X-Episode-Id": eid}) as resp:
            assert resp.status == 404
        async with s.get(proxy.base_url + "/episode", headers={"X-Episode-Id": eid}) as resp:
            summary = await resp.json()
    assert [c["call_id"] for c in summary["calls"]] == [r1.id, r2.id] and not summary["linear"]
    proxy.set_reward(eid, 2.0)  # the episode's reward goes to the last call
    assert proxy.episode(eid).returns(discount=0.5) == [0.5 + 0.5 * 2.0, 2.0]
    with pytest.raises(ValueError):  # unrelated prompts cannot be concatenated
        proxy.episode(eid).to_trajectories(mode="concat")
    trajs = proxy.finish_episode(eid, discount=0.5)
    assert [t.reward for t in trajs] == [1.5, 2.0] and {t.group_id for t in trajs} == {7}
    for t in trajs:
        assert t.info["export"] == "per_call" and len(t.input_ids) == len(t.loss_mask) == len(t.versions)
        assert sum(t.loss_mask) == len(t.input_ids) - t.prompt_len


async def test_interrupted_call_spans_versions(stack, tiny_ckpt_b):
    """A long completion in flight across a weight update resumes and records both versions."""
    proxy, client, server = stack
    eid = proxy.start_episode()
    oai = sdk(proxy, eid)
    task = asyncio.create_task(
        oai.completions.create(
            model="m", prompt=[5, 6, 7, 8], max_tokens=300, temperature=0, extra_body={"ignore_eos": True}
        )
    )
    # the swap's own probe must not reach its 20 tokens before this call reaches the server (a busy machine let it:
    # the call then started at version 1), so the swap starts once the engine runs the call
    for _ in range(2000):
        if server.engine.num_running() >= 1 or task.done():
            break
        await asyncio.sleep(0.005)
    assert server.engine.num_running() >= 1, "the call never started on the server"
    await swap_weights_mid_generation(server.url, client, tiny_ckpt_b, 1, max_new_tokens=300)
    resp = await task
    assert resp.usage.completion_tokens == 300
    (call,) = proxy.episode(eid).calls
    assert call.output_versions[0] == 0 and call.output_versions[-1] == 1
    assert call.output_versions == sorted(call.output_versions)


async def test_agent_workflow_runs_sdk_agents_as_a_group(stack):
    proxy, client, _server = stack

    async def agent(ctx) -> float:
        oai = sdk(ctx.proxy, ctx.api_key)
        msgs = [{"role": "user", "content": ctx.sample.prompt}]
        r = await oai.chat.completions.create(model="m", messages=msgs, tools=[ADD_TOOL], temperature=0, max_tokens=100)
        call = r.choices[0].message.tool_calls[0]
        msgs += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "5"},
        ]
        r2 = await oai.chat.completions.create(
            model="m", messages=msgs, tools=[ADD_TOOL], temperature=0, max_tokens=100
        )
        return 1.0 if r2.choices[0].message.content == f"The answer is {ctx.sample.answer}." else 0.0

    wf = AgentWorkflow(proxy, agent, group_size=3)
    trajs = await wf.run(client, Sample(id=1, prompt=USER[0]["content"], answer="5"))
    assert len(trajs) == 3 and all(t.reward == 1.0 and t.info["export"] == "concat" for t in trajs)
    assert proxy.num_episodes == 0  # finished episodes are released


class SpyGenerator:
    """Records the SamplingParams of every call, then generates with the real client."""

    def __init__(self, client):
        self.client = client
        self.sampling = []

    async def agenerate(self, input_ids, sampling, **kw):
        self.sampling.append(sampling)
        return await self.client.agenerate(input_ids, sampling, **kw)


async def test_trainable_calls_are_sampled_at_the_policy_settings(stack):
    """The trainer computes logprobs at the policy's sampling; an agent's own temperature, top_p or penalties must
    not reach a trainable call: enforced (default, and said in the answer), or refused with sampling="reject"."""
    proxy, client, _server = stack
    spy = SpyGenerator(client)
    eid = proxy.start_episode(generator=spy)
    oai = sdk(proxy, eid)
    r = await oai.chat.completions.create(
        model="m", messages=USER, tools=[ADD_TOOL], temperature=1.3, top_p=0.5, frequency_penalty=0.5, max_tokens=100
    )
    assert r.model_extra["areal"]["overridden"] == ["temperature", "top_p", "frequency_penalty"]
    assert r.model_extra["areal"]["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    (sp,) = spy.sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.0, 1.0, -1, 0.0)
    assert r.choices[0].finish_reason == "tool_calls"  # greedy, as the policy samples: the taught tool call
    stream = await oai.chat.completions.create(
        model="m", messages=USER, temperature=0.9, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert chunks[-1].usage.completion_tokens == 5 and spy.sampling[-1].temperature == 0.0
    trajs = proxy.finish_episode(eid, mode="per_call")
    assert len(trajs) == 2 and all(t.info["temperature"] == 0.0 for t in trajs)

    strict = OpenAIProxy(client, proxy.tok, policy=PolicySampling(temperature=0.0), sampling="reject")
    async with strict:
        eid = strict.start_episode(generator=spy)
        oai = sdk(strict, eid)
        with pytest.raises(openai.BadRequestError, match="temperature=1.3 differs"):
            await oai.chat.completions.create(model="m", messages=USER, temperature=1.3, max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="presence_penalty"):
            await oai.chat.completions.create(model="m", messages=USER, presence_penalty=1.0, max_tokens=4)
        await oai.chat.completions.create(model="m", messages=USER, temperature=0, max_tokens=4)  # the policy's
        await oai.completions.create(model="m", prompt="2+3=", max_tokens=4)  # not given: the policy's
        assert [s.temperature for s in spy.sampling[-2:]] == [0.0, 0.0]
        assert len(strict.finish_episode(eid, mode="per_call")) == 2

        ev = strict.start_episode(generator=spy, trainable=False)  # evaluation: sampled as asked, never trained
        r = await sdk(strict, ev).completions.create(model="m", prompt="2+3=", max_tokens=4, temperature=1.3)
        assert spy.sampling[-1].temperature == 1.3 and r.model_extra["areal"]["trainable"] is False
        with pytest.raises(ValueError, match="not trainable"):
            strict.finish_episode(ev)


# ---- pure parts -------------------------------------------------------------------------------------------------


def test_per_call_export_counts_every_episode_once():
    """per_call: an episode of k calls gives k trajectories of weight 1/k each, so a weighted group baseline counts
    every episode once; a linear episode exports as one trajectory anyway."""
    mk = dict(output_logprobs=[-0.5], output_versions=[1], finish_reason="stop", kind="chat", temperature=1.0)
    ep = Episode("e3")
    for i in range(3):
        ep.add(CallRecord(call_id=f"c{i}", prompt_ids=[10 + i, 2], output_ids=[3], **mk))  # unrelated prompts
    ep.set_reward(1.0)
    trajs = ep.to_trajectories()
    assert len(trajs) == 3 and all(t.info["export"] == "per_call" for t in trajs)
    assert [t.info["episode_weight"] for t in trajs] == [1 / 3] * 3
    assert all(t.info["episode_calls"] == 3 and t.info["temperature"] == 1.0 for t in trajs)
    one = Episode("e1")
    one.add(CallRecord(call_id="a", prompt_ids=[1, 2], output_ids=[3], **mk))
    (t,) = one.to_trajectories()
    assert t.info["export"] == "concat" and "episode_weight" not in t.info
    mixed = Episode("m")
    mixed.add(CallRecord(call_id="a", prompt_ids=[1], output_ids=[3], **mk))
    mixed.add(CallRecord(call_id="b", prompt_ids=[2], output_ids=[3], **{**mk, "temperature": 0.5}))
    with pytest.raises(ValueError, match="different temperatures"):
        mixed.to_trajectories()


def test_parse_tool_calls():
    content, calls = parse_tool_calls(
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
        '</tool_call>\n<tool_call>{"name": "mul", "arguments": "{\\"x\\": 2}"}'
        "</tool_call>"
    )
    assert content == "Let me add."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1}),
        ("mul", {"x": 2}),
    ]
    assert len({c["id"] for c in calls}) == 2
    bad = '<tool_call>{not json}</tool_call> and <tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls(bad) == (bad, [])
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    assert parse_tool_calls('<tool_call>{"name": "f"') == ('<tool_call>{"name": "f"', [])  # cut short


def test_episode_returns_and_concat_export():
    ep = Episode("e", group_id=3)
    mk = dict(output_logprobs=[-0.5, -0.25], output_versions=[2, 3], finish_reason="stop", kind="completion")
    ep.add(CallRecord(call_id="a", prompt_ids=[1, 2], output_ids=[3, 4], **mk))
    ep.add(CallRecord(call_id="b", prompt_ids=[1, 2, 3, 4, 9], output_ids=[5, 6], **mk))
    ep.set_reward(1.0, "a")
    ep.set_reward(4.0)
    assert ep.returns(1.0) == [5.0, 4.0] and ep.returns(0.0) == [1.0, 4.0]
    (t,) = ep.to_trajectories(discount=0.5)
    assert t.input_ids == [1, 2, 3, 4, 9, 5, 6]
    assert t.loss_mask == [0, 0, 1, 1, 0, 1, 1]
    assert t.versions == [-1, -1, 2, 3, -1, 2, 3]
    assert t.logprobs == [0.0, 0.0, -0.5, -0.25, 0.0, -0.5, -0.25]
    assert t.reward == 3.0 and t.prompt_len == 2 and t.group_id == 3
    assert len(ep.to_trajectories(mode="per_call")) == 2
    with pytest.raises(ValueError):
        ep.set_reward(float("nan"))
    with pytest.raises(KeyError):
        ep.set_reward(1.0, "zzz")


async def test_openai_agent_example_trains_through_the_proxy(stack):
    """examples/openai_agent.py's workflow, built the way `python -m areal_async.run` builds it, on the real
    server: its SDK agent runs unchanged and every call comes back as trajectories."""
    import importlib.util
    import os

    from areal_async.config import load_config
    from areal_async.rewards import RewardRunner

    _proxy, client, _server = stack
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("openai_agent", os.path.join(repo, "examples", "openai_agent.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = load_config(
        os.path.join(repo, "configs", "multiturn.yaml"), ["rollout.group_size=2", "rollout.max_new_tokens=6"]
    )
    async with RewardRunner(max_workers=1) as rr:

        async def score(c, a, p):
            return await rr.score("arith", c, a, prompt=p)

        wf = mod.make_workflow(cfg, _proxy.tok, score)
        try:
            trajs = await wf.run(client, Sample(id=4, prompt="What is 2+3?\n", answer="5"))
        finally:
            await wf.proxy.close()
    assert trajs and all(1 <= t.info["calls"] <= mod.MAX_TOOL_ROUNDS + 1 for t in trajs)
    for t in trajs:
        assert sum(t.loss_mask) >= 1 and len(t.input_ids) == len(t.versions) == len(t.logprobs)
