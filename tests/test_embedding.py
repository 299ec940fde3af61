"""Embedding (areal_async.embed, docs/embedding.md): the two examples trained end to end, in this process, on the
shipped tiny model: a custom environment with its own reward, and an `openai` SDK agent that calls a tool through
the proxy. Each run is real (embedded server, torchrun trainer, the asynchronous controller); what is checked is
what a user relies on: the steps trained, the trajectories handed back (tokens, logprobs, per-token versions), the
user's reward and tool actually called, and the run's outputs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from types import ModuleType

import pytest

from areal_async import embed

pytestmark = pytest.mark.timeout(400)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
SMALL = [
    "model.path=tiny",
    "steps=2",
    "schedule.batch_size=2",
    "rollout.group_size=2",
    "schedule.eval_every=0",
    "eval.num_prompts=4",
    "schedule.filter_uniform_reward=false",
    "server.device=cpu",
    "train.device=cpu",
]


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(REPO, "examples", f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_alignment(t: embed.Trajectory, steps: int) -> int:
    """Per-token fields line up; only generated tokens are trained, each stamped with a policy version the run
    had; context tokens carry version -1. Returns the number of generated tokens."""
    n = len(t.input_ids)
    assert len(t.loss_mask) == len(t.logprobs) == len(t.versions) == n and t.prompt_len > 0
    assert all(m == 0 for m in t.loss_mask[: t.prompt_len])
    for m, lp, v in zip(t.loss_mask, t.logprobs, t.versions):
        if m:
            assert 0 <= v <= steps and lp <= 0.0
        else:
            assert v == -1 and lp == 0.0
    return sum(t.loss_mask)


def check_outputs(result: embed.RunResult, steps: int) -> None:
    assert result.steps == steps and len(result.metrics("train")) == steps
    assert [r["version"] for r in result.trained_index() if "version" in r] == list(range(1, steps + 1))
    assert result.summary["max_staleness_seen"] <= result.summary["eta"]
    assert result.final_model and os.path.isfile(os.path.join(result.final_model, "config.json"))
    assert result.checkpoints  # the checkpoint saved at the end, which a rerun resumes from


def test_import_is_light_and_starts_nothing():
    """`import areal_async` loads no embedding code until used, and the facade and both examples import without
    torch (the controller side never needs it)."""
    probe = (
        "import sys, areal_async\n"
        "assert 'areal_async.embed' not in sys.modules\n"
        "assert areal_async.train is areal_async.embed.train\n"
        "import importlib.util\n"
        "for n in ('custom_env', 'openai_agent'):\n"
        f"    s = importlib.util.spec_from_file_location(n, {EXAMPLES!r} + '/' + n + '.py')\n"
        "    s.loader.exec_module(importlib.util.module_from_spec(s))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'openai')))\n"
    )
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "[]"


async def test_reward_fn_adapts_plain_and_async_rewards():
    calls = []

    def plain(completion, answer):
        calls.append((completion, answer))
        return 1.0 if completion == answer else 0.0

    async def with_prompt(completion, answer, prompt=""):
        return len(prompt), "why"

    assert await embed.reward_fn(plain)("7", "7", "What is 3+4?", {"task": "arith"}) == (1.0, None)
    assert calls == [("7", "7")]  # called with only what it accepts
    assert await embed.reward_fn(with_prompt)("x", "y", "abc") == (3.0, "why")
    score, why = await embed.reward_fn(lambda c, a: 1 / 0)("x", "y")
    assert score == 0.0 and why.startswith("ZeroDivisionError")
    assert (await embed.reward_fn(lambda c, a: float("nan"))("x", "y"))[0] == 0.0


def test_custom_environment_with_its_own_reward_trains(tmp_path):
    """examples/custom_env.py: HintEnv and its reward drive a real run of 2 steps."""
    mod = example("custom_env")
    graded: list[tuple[str, str]] = []
    groups: list[tuple[embed.Sample, list[embed.Trajectory]]] = []

    def counting_reward(completion: str, answer: str) -> float:
        graded.append((completion, answer))
        return mod.exact_answer(completion, answer)

    result = mod.main(
        [*SMALL, f"run_dir={tmp_path / 'run'}", "rollout.max_new_tokens=24"],
        reward=counting_reward,
        on_group=lambda sample, trajs: groups.append((sample, trajs)),
    )
    check_outputs(result, 2)
    trained = {i for r in result.trained_index() for i in r.get("trained", [])}
    assert len(trained) == 2 * 2  # batch_size groups per step
    seen = [(s, t) for s, ts in groups for t in ts]
    assert len(seen) >= 2 * 2 * 2 and all(len(ts) == 2 for _, ts in groups)  # group_size episodes per group
    stepped = 0
    for _sample, t in seen:
        assert check_alignment(t, 2) >= 1
        assert 1 <= t.info["turns"] <= 3
        # the trajectory's reward is the environment's: the reward of the correct try over the tries it took
        assert t.reward in (0.0, 1.0, 0.5, 1.0 / 3)
        stepped += t.info["turns"] - (t.info["finish"] == "truncated")
    # every turn the environment saw was graded by the reward passed in (more in flight when the run stopped)
    assert len(graded) >= stepped >= 1
    answers = {s.answer for s, _ in seen}
    assert {a for _, a in graded} >= answers - {s.answer for s, t in seen if t.info["finish"] == "truncated"}


# ---- an openai SDK agent with a tool ------------------------------------------------------------------------------

PROMPT, ANSWER = "What is 17+25?", "42"
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17+25"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> str:
    """The shipped tiny model, taught one agent conversation (call the calculator, then answer with its result),
    so that sampling through the whole stack makes real tool calls. Built with torch here, in the test only."""
    import torch
    import transformers

    from areal_async.model_store import resolve_model_path
    from areal_async.rollout.chat import ChatTokens
    from areal_async.tokenizer import Tokenizer

    path = str(tmp_path_factory.mktemp("tool_model") / "ckpt")
    shutil.copytree(resolve_model_path("tiny"), path)
    tok = Tokenizer(path)
    ct = ChatTokens(tok)
    eos = tok.eos_token_ids[0]
    p1 = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    o1 = tok.encode(TOOL_CALL) + [eos]
    mid = ct.close_turn_ids(o1) + ct.delta_ids([{"role": "tool", "content": ANSWER}])
    o2 = tok.encode(f"#### {ANSWER}") + [eos]
    seq = p1 + o1 + mid + o2
    train = torch.tensor([0] * len(p1) + [1] * len(o1) + [0] * len(mid) + [1] * len(o2), dtype=torch.bool)[1:]
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a step this small is ~30 ms on one thread and many times that on a busy machine's two
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        ids = torch.tensor([seq])  # [1, T]
        for _ in range(600):
            logits = model(ids).logits[0, :-1]  # [T-1, V]
            loss = torch.nn.functional.cross_entropy(logits[train], ids[0, 1:][train])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 0.005:  # ~150 steps: the taught replies are then sampled nearly always at T=0.7
                break
        model.save_pretrained(path)
    finally:
        torch.set_num_threads(threads)
    return path


def test_openai_sdk_agent_with_a_tool_trains_through_the_proxy(tool_model, tmp_path):
    """examples/openai_agent.py: the SDK agent's tool call is made, its result fed back in the next request, and
    the episodes train as token-exact trajectories in a real run of 2 steps."""
    mod = example("openai_agent")
    data = tmp_path / "one_problem.jsonl"
    data.write_text(json.dumps({"prompt": PROMPT, "answer": ANSWER}) + "\n")
    tool_inputs: list[str] = []
    graded: list[str] = []
    groups: list[list[embed.Trajectory]] = []

    def counting_calculator(expression: str) -> str:
        tool_inputs.append(expression)
        return mod.calculator(expression)

    def counting_reward(completion: str, answer: str) -> float:
        graded.append(completion)
        return mod.exact_answer(completion, answer)

    agent = mod.make_agent(counting_reward, {"calculator": counting_calculator})
    result = mod.main(
        [
            *SMALL,
            f"model.path={tool_model}",
            f"run_dir={tmp_path / 'run'}",
            f"data.name={data}",
            f"data.eval_path={data}",
            "rollout.temperature=0.7",
        ],
        agent=agent,
        on_group=lambda sample, trajs: groups.append(trajs),
    )
    check_outputs(result, 2)
    assert tool_inputs and graded  # the model called the tool, and the agent's reward graded its answers
    episodes = {t.info["episode"] for ts in groups for t in ts}
    assert len(episodes) >= 2 * 2 * 2 and len(graded) >= len(episodes)  # every episode handed back was graded
    from areal_async.tokenizer import Tokenizer

    tok = Tokenizer(tool_model)
    fed_back = 0
    for t in (t for ts in groups for t in ts):
        assert check_alignment(t, 2) >= 1
        if t.info["calls"] < 2:
            continue
        # an agent loop keeps the episode token-exact: ONE trajectory holding both calls, the tool's answer as
        # context (loss mask 0) between the model's tool call and its final answer (both trained)
        assert t.info["export"] == "concat"
        gen = tok.decode([i for i, m in zip(t.input_ids, t.loss_mask) if m])
        ctx = tok.decode([i for i, m in zip(t.input_ids[t.prompt_len :], t.loss_mask[t.prompt_len :]) if not m])
        assert "<tool_call>" in gen
        assert any(mod.calculator(x) in ctx for x in tool_inputs)
        fed_back += 1
    assert fed_back >= 1


def test_the_docs_workflow_listing_runs(tmp_path):
    """docs/embedding.md's route 1 (a workflow of one's own) is a complete program: run as written, 2 steps."""
    with open(os.path.join(REPO, "docs", "embedding.md")) as f:
        text = f.read()
    listing = text.split("## Route 1", 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0]
    script = tmp_path / "route1.py"
    script.write_text(listing)
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, str(script), *SMALL, f"run_dir={run_dir}", "rollout.max_new_tokens=24"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1].startswith("2 steps; max staleness")
    with open(run_dir / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 2 and summary["max_staleness_seen"] <= summary["eta"]
    assert os.path.isfile(os.path.join(summary["final_checkpoint"], "config.json"))
