"""Multi-turn episodes over the real embedded server and InferenceClient: token in, token out.

The client is wrapped in a recorder (it forwards to the real client and keeps what went in and came out), so the
tests can check that each turn's input is exactly the previous input + the generated ids + the feedback's ids,
and that the trajectory trains on exactly the generated tokens with their behaviour logprobs and versions.
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import msgspec
import pytest

from areal_async.inference.client import InferenceClient
from areal_async.rollout.workflows.multi_turn import (
    ChatTokens,
    CheckerEnv,
    MultiTurnConfig,
    MultiTurnWorkflow,
    make_workflow,
)
from areal_async.testing.interrupt import swap_weights_mid_generation
from areal_async.tokenizer import Tokenizer
from areal_async.types import GenerationResult, Sample, SamplingParams

pytestmark = pytest.mark.timeout(180)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Recorder:
    """A Generator that forwards to the real client and records every call."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[tuple[list[int], GenerationResult]] = []

    async def agenerate(self, input_ids, sampling, **kw) -> GenerationResult:
        g = await self.inner.agenerate(input_ids, sampling, **kw)
        self.calls.append((list(input_ids), g))
        return g


class ScriptedEnv:
    """Feedback that names the turn; reward 0.25 per turn; done after `turns` turns."""

    def __init__(self, turns: int = 3, chat: bool = False) -> None:
        self.turns, self.chat, self.t = turns, chat, 0

    async def reset(self, sample):
        return [{"role": "user", "content": sample.prompt}] if self.chat else sample.prompt

    async def step(self, action):
        self.t += 1
        fb = f"Feedback {self.t}: try harder.\n"
        obs = [{"role": "tool", "content": fb}] if self.chat else fb
        return obs, 0.25, self.t >= self.turns


@pytest.fixture
async def server_client(tiny_ckpt):
    from areal_async.server.app import start_server

    async with await start_server(tiny_ckpt, port=0, device="cpu") as server, InferenceClient([server.url]) as client:
        yield server, client


def check_token_in_token_out(tok_feedback, ep, calls):
    """The invariants of a multi-turn trajectory against the recorded generate calls."""
    assert len(calls) == ep.turns
    for t, (inp, g) in enumerate(calls):
        assert inp == ep.turn_inputs[t] and list(g.output_ids) == ep.turn_outputs[t]
        if t + 1 < len(calls):
            nxt = calls[t + 1][0]
            assert nxt[: len(inp) + len(g.output_ids)] == inp + list(g.output_ids)  # never re-tokenised
            tok_feedback(t, nxt[len(inp) + len(g.output_ids) :])
    last_in, last_g = calls[-1]
    assert ep.input_ids == last_in + list(last_g.output_ids)
    n = len(ep.input_ids)
    assert len(ep.loss_mask) == len(ep.logprobs) == len(ep.versions) == n
    trained = [i for i, m in zip(ep.input_ids, ep.loss_mask) if m]
    assert trained == [i for _, g in calls for i in g.output_ids]  # the tokens trained are the tokens generated
    assert [lp for lp, m in zip(ep.logprobs, ep.loss_mask) if m] == [lp for _, g in calls for lp in g.output_logprobs]
    assert [v for v, m in zip(ep.versions, ep.loss_mask) if m] == [v for _, g in calls for v in g.output_versions]
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(ep.versions, ep.logprobs, ep.loss_mask) if not m)
    assert ep.loss_mask[: ep.prompt_len] == [0] * ep.prompt_len and ep.prompt_len == len(calls[0][0])


async def test_text_episode_token_in_token_out(server_client, tiny_ckpt):
    _server, client = server_client
    tok = Tokenizer(tiny_ckpt)
    rec = Recorder(client)
    wf = MultiTurnWorkflow(
        tok, lambda s: ScriptedEnv(3), SamplingParams(max_new_tokens=12), 1, max_turns=5, truncated_reward=None
    )
    ep = await wf.episode(rec, Sample(id=0, prompt="What is 1+2?\n", answer="3"))
    assert ep.turns == 3 and ep.finish == "done" and ep.reward == pytest.approx(0.75)

    def feedback(t, ids):  # plain-text feedback is appended as its own tokens, nothing else
        assert ids == tok.encode(f"Feedback {t + 1}: try harder.\n")

    check_token_in_token_out(feedback, ep, rec.calls)
    traj = wf.to_trajectory(ep, group_id=5)
    assert traj.input_ids == ep.input_ids and traj.reward == ep.reward and traj.group_id == 5
    assert traj.info["turns"] == 3 and traj.prompt_len == ep.prompt_len


async def test_chat_episode_renders_only_the_new_messages(server_client, tiny_ckpt):
    _server, client = server_client
    tok = Tokenizer(tiny_ckpt)
    rec = Recorder(client)
    wf = MultiTurnWorkflow(
        tok,
        lambda s: ScriptedEnv(2, chat=True),
        SamplingParams(max_new_tokens=10),
        1,
        max_turns=4,
        truncated_reward=None,
    )
    ep = await wf.episode(rec, Sample(id=0, prompt="hello", answer=""))
    assert ep.turns == 2

    def feedback(t, ids):
        # the tiny model's EOS is <|endoftext|>, not ChatML's <|im_end|>: the whole end-of-turn text is added
        text = tok.decode(ids, skip_special_tokens=False)
        assert text == (
            f"<|im_end|>\n<|im_start|>tool\nFeedback {t + 1}: try harder.\n<|im_end|>\n<|im_start|>assistant\n"
        )

    check_token_in_token_out(feedback, ep, rec.calls)
    assert ep.turn_inputs[0] == tok.apply_chat_template([{"role": "user", "content": "hello"}])


async def test_group_and_token_budget(server_client, tiny_ckpt):
    _server, client = server_client
    tok = Tokenizer(tiny_ckpt)
    sample = Sample(id=3, prompt="What is 1+2?\n", answer="3")
    wf = MultiTurnWorkflow(
        tok,
        lambda s: ScriptedEnv(10),
        SamplingParams(max_new_tokens=16, ignore_eos=True),
        3,
        max_turns=10,
        max_total_tokens=60,
    )
    trajs = await wf.run(client, sample)
    assert len(trajs) == 3
    for t in trajs:
        assert len(t.input_ids) <= 60 and t.info["finish"] == "max_tokens"
    with pytest.raises(ValueError, match="max_total_tokens"):
        await MultiTurnWorkflow(tok, lambda s: ScriptedEnv(), SamplingParams(), 1, max_total_tokens=5).episode(
            client, sample
        )


async def test_interrupted_turn_resumes_inside_the_episode(server_client, tiny_ckpt, tiny_ckpt_b):
    """Weights change while a turn is generating: the turn resumes, its tokens carry versions 0 then 1, and the
    next turn starts from exactly what was generated."""
    server, client = server_client
    tok = Tokenizer(tiny_ckpt)
    rec = Recorder(client)
    wf = MultiTurnWorkflow(
        tok,
        lambda s: ScriptedEnv(2),
        SamplingParams(max_new_tokens=250, ignore_eos=True, temperature=0.0),
        1,
        max_turns=2,
        max_total_tokens=1000,
    )
    task = asyncio.create_task(wf.episode(rec, Sample(id=0, prompt="What is 1+2?\n", answer="3")))
    await swap_weights_mid_generation(server.url, client, tiny_ckpt_b, 1, max_new_tokens=250)
    ep = await task
    assert ep.turns == 2 and ep.interruptions >= 1
    first = [v for v in rec.calls[0][1].output_versions]
    assert first[0] == 0 and first[-1] == 1 and first == sorted(first)
    assert set(rec.calls[1][1].output_versions) == {1}
    check_token_in_token_out(lambda t, ids: None, ep, rec.calls)


def test_chat_tokens_close_turn(tiny_ckpt):
    tok = Tokenizer(tiny_ckpt)
    ct = ChatTokens(tok)
    assert ct.turn_end == "<|im_end|>\n"
    im_end = tok.token_to_id("<|im_end|>")
    # the model closed its turn itself: only the newline is added
    assert tok.decode(ct.close_turn_ids(tok.encode("42") + [im_end]), skip_special_tokens=False) == "\n"
    # cut off by length, or ended on another EOS: the whole end-of-turn text
    assert tok.decode(ct.close_turn_ids(tok.encode("42")), skip_special_tokens=False) == "<|im_end|>\n"
    assert (
        tok.decode(ct.delta_ids([{"role": "user", "content": "again"}]), skip_special_tokens=False)
        == "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )


async def test_checker_env_retries_with_discount():
    async def score(completion, answer, prompt):
        return (1.0 if completion.strip().endswith(answer) else 0.0), None

    env = CheckerEnv(score, max_attempts=3, feedback="Wrong, try again.\n{prompt}", retry_discount=0.5)
    sample = Sample(id=1, prompt="What is 2+2?\n", answer="4")
    assert await env.reset(sample) == sample.prompt
    assert await env.step("#### 5") == ("Wrong, try again.\nWhat is 2+2?\n", 0.0, False)
    assert await env.step("#### 4") == ("", 0.5, True)  # right on the second attempt: discounted once
    await env.reset(sample)
    for i in range(3):
        _obs, r, done = await env.step("#### 9")
        assert r == 0.0 and done == (i == 2)


def test_make_workflow_from_the_run_config(tiny_ckpt):
    from areal_async.config import load_config
    from areal_async.rollout.workflows import build_workflow

    cfg = load_config(os.path.join(REPO, "configs", "multiturn.yaml"))
    assert cfg.rollout.workflow == "multi_turn"

    async def score(c, a, p):
        return 0.0, None

    wf = build_workflow(cfg, Tokenizer(tiny_ckpt), score)
    assert isinstance(wf, MultiTurnWorkflow) and wf.group_size == cfg.rollout.group_size
    assert wf.max_turns == MultiTurnConfig().max_turns and not wf.chat
    # options given as a mapping (what a `rollout.multi_turn` config section would hold)
    fields = {f: getattr(cfg.rollout, f) for f in cfg.rollout.__struct_fields__}
    fields["multi_turn"] = {"max_turns": 3, "max_total_tokens": 300}
    cfg2 = SimpleNamespace(rollout=SimpleNamespace(**fields), data=cfg.data)
    wf2 = make_workflow(cfg2, Tokenizer(tiny_ckpt), score)
    assert wf2.max_turns == 3 and wf2.max_total_tokens == 300
    with pytest.raises(msgspec.ValidationError):
        cfg2.rollout.multi_turn = {"max_turnz": 3}
        make_workflow(cfg2, Tokenizer(tiny_ckpt), score)
    # the run config's section is typed: options set there reach the workflow, and bad ones never load
    cfg3 = load_config(
        os.path.join(REPO, "configs", "multiturn.yaml"),
        ["rollout.multi_turn.max_turns=3", "rollout.multi_turn.retry_discount=0.25"],
    )
    wf3 = build_workflow(cfg3, Tokenizer(tiny_ckpt), score)
    assert wf3.max_turns == 3 and wf3.env_factory(None).retry_discount == 0.25
    from areal_async.config import ConfigError

    with pytest.raises(ConfigError, match="^rollout.multi_turn.max_turnz: unknown key"):
        load_config(os.path.join(REPO, "configs", "multiturn.yaml"), ["rollout.multi_turn.max_turnz=3"])


async def test_custom_env_example(server_client, tiny_ckpt):
    """examples/custom_env.py: its environment's rules, and its workflow running an episode on the real server."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("custom_env", os.path.join(REPO, "examples", "custom_env.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    env = mod.HintEnv()
    sample = Sample(id=1, prompt="What is 5+4?\n", answer="9")
    await env.reset(sample)
    assert await env.step("5+4=12\n#### 12") == ("Wrong (too high). Try again.\nWhat is 5+4?\n", 0.0, False)
    assert (await env.step("gibberish"))[0].startswith("Wrong (no answer)")
    assert await env.step("#### 9") == ("", 1.0 / 3, True)

    from areal_async.config import load_config

    cfg = load_config(
        os.path.join(REPO, "configs", "multiturn.yaml"),
        ["rollout.workflow=custom_env:make_workflow", "rollout.group_size=2", "rollout.max_new_tokens=8"],
    )
    wf = mod.make_workflow(cfg, Tokenizer(tiny_ckpt), None)
    trajs = await wf.run(server_client[1], sample)
    assert len(trajs) == 2 and all(1 <= t.info["turns"] <= 3 for t in trajs)


async def test_truncated_turn_ends_the_episode(server_client, tiny_ckpt):
    """A turn cut off by max_new_tokens is not graded by the environment: the episode ends with truncated_reward."""
    _server, client = server_client
    tok = Tokenizer(tiny_ckpt)
    stepped: list[str] = []

    class Env(ScriptedEnv):
        async def step(self, action):
            stepped.append(action)
            return await super().step(action)

    sample = Sample(id=0, prompt="What is 1+2?\n", answer="3")
    rec = Recorder(client)
    wf = MultiTurnWorkflow(
        tok, lambda s: Env(3), SamplingParams(max_new_tokens=4, temperature=0.0), 1, max_turns=3, truncated_reward=-0.5
    )
    ep = await wf.episode(rec, sample)
    assert rec.calls[0][1].finish_reason == "length"  # a random model does not stop within 4 greedy tokens
    assert ep.finish == "truncated" and ep.turns == 1 and ep.reward == -0.5 and stepped == []
    check_token_in_token_out(lambda t, ids: None, ep, rec.calls)
    # truncated_reward=None: the cut-off turn goes to the environment like any other
    ep2 = await MultiTurnWorkflow(
        tok, lambda s: Env(3), SamplingParams(max_new_tokens=4, temperature=0.0), 1, max_turns=3, truncated_reward=None
    ).episode(client, sample)
    assert ep2.finish == "done" and ep2.turns == 3 and len(stepped) == 3


async def test_behaviour_logprobs_match_an_independent_forward(server_client, tiny_ckpt):
    """The logprobs stored in a multi-turn trajectory are those of the full sequence under the model: an HF
    transformers forward over the whole trajectory (feedback and all) reproduces them at every trained token."""
    import torch
    import transformers

    _server, client = server_client
    tok = Tokenizer(tiny_ckpt)
    wf = MultiTurnWorkflow(
        tok,
        lambda s: ScriptedEnv(3),
        SamplingParams(max_new_tokens=10, temperature=1.0),
        1,
        max_turns=3,
        truncated_reward=None,
    )
    ep = await wf.episode(client, Sample(id=0, prompt="What is 1+2?\n", answer="3"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([ep.input_ids])  # [1, T]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [T, V]
    ref = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]  # [T-1]: log p(ids[t] | ids[:t]) for t >= 1
    trained = [t for t, m in enumerate(ep.loss_mask) if m]
    assert trained and trained[0] > 0
    got = torch.tensor([ep.logprobs[t] for t in trained])
    want = ref[torch.tensor(trained) - 1]
    assert torch.allclose(got, want, atol=2e-3), (got - want).abs().max()
