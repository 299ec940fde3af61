"""Embedding areal_async in your own program: what to import, what to implement, what you get back.

Everything here is a thin layer over the run (`areal_async.run`), the workflows (`areal_async.rollout.workflows`)
and the agent proxy (`areal_async.agent`); it exists so that one module names the whole public surface, with types.
Importing it never imports torch (the controller side never does: only the server and trainer processes do).

What you implement, one of:

- an environment (`Env`: `async reset(sample) -> observation`, `async step(text) -> (observation, reward,
  done)`), turned into a workflow by `env_workflow(make_env)`;
- an agent written against the `openai` SDK (`async agent(ctx: AgentContext) -> reward | None`), turned into a
  workflow by `agent_workflow(agent)`: it talks to an OpenAI-compatible proxy that records every call's tokens;
- a workflow of your own (`Workflow`: `async run(generator, sample) -> list[Trajectory] | None`);
- and, with any of them, a reward `(completion, answer, prompt="", **meta) -> float`, in process through
  `reward_fn(fn)` or, also for the held-out eval, named in the config as `data.reward=module:function`.

What you get back: `train(...)` runs the whole thing (servers, torchrun trainers, the asynchronous controller) and
returns a `RunResult` (the summary, metrics.jsonl records, checkpoints, the final HF model directory); `on_group`
hands you every finished group of trajectories as it is made (token ids, loss mask, behaviour logprobs and the
policy version of every generated token). See docs/embedding.md for the three routes and the guarantees.
"""

from __future__ import annotations

import asyncio
import glob
import inspect
import json
import logging
import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Union

from areal_async.agent import AgentWorkflow, OpenAIProxy, PolicySampling
from areal_async.agent.episode import ExportMode
from areal_async.agent.workflow import AgentContext, AgentFn
from areal_async.config import load_config
from areal_async.rollout import ledger
from areal_async.rollout.workflow_api import Generator, ScoreFn, Workflow, trajectory_from_generation
from areal_async.rollout.workflows import build_workflow
from areal_async.rollout.workflows.multi_turn import CheckerEnv, Env, EnvFactory, MultiTurnWorkflow, Observation
from areal_async.session.run import run, setup_logging
from areal_async.types import GenerationResult, Sample, SamplingParams, Trajectory

if TYPE_CHECKING:
    from areal_async.config import RunConfig
    from areal_async.launch import Launcher
    from areal_async.tokenizer import Tokenizer

__all__ = [
    "AgentContext",
    "AgentFn",
    "CheckerEnv",
    "Env",
    "EnvFactory",
    "ExportMode",
    "GenerationResult",
    "Generator",
    "GroupCallback",
    "Observation",
    "RewardLike",
    "RunResult",
    "Sample",
    "SamplingParams",
    "ScoreFn",
    "Trajectory",
    "Workflow",
    "WorkflowFactory",
    "agent_workflow",
    "atrain",
    "env_workflow",
    "reward_fn",
    "rollout_sampling",
    "train",
    "trajectory_from_generation",
]

log = logging.getLogger("areal_async.embed")  # the name it has always logged under

WorkflowFactory = Callable[["RunConfig", "Tokenizer", ScoreFn], Workflow]
"""What the run calls once the tokenizer exists: `f(cfg, tokenizer, score)`, `score` being the config's reward."""

RewardValue = Union[float, "tuple[float, str | None]"]
RewardLike = Callable[..., RewardValue | Awaitable[RewardValue]]
"""`fn(completion, answer, prompt="", **meta) -> float` (or `(float, reason)`), plain or async."""

GroupCallback = Callable[[Sample, "list[Trajectory]"], None | Awaitable[None]]
"""`on_group(sample, trajectories)`: called with every group a workflow finishes, before the run checks it."""


# ---- rewards ------------------------------------------------------------------------------------------------------


def reward_fn(fn: RewardLike) -> ScoreFn:
    """Adapt a plain reward function to the run's `ScoreFn` (which returns `(reward, failure reason)` and never
    raises), so one function serves `CheckerEnv`, the single-turn workflow or your own code.

    `fn` is called as `fn(completion, answer, prompt=..., **meta)` with only the keywords it accepts, directly on
    the event loop: keep it cheap, or make it async. A raise, or a value that is not a finite number, scores 0.0
    with the reason, as a failing reward does in a run. For a slow or untrusted reward, name it in the config
    instead (`data.reward=package.module:function`): the run calls those in worker processes with a timeout."""
    try:
        params = inspect.signature(fn).parameters.values()
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        takes_prompt = var_kw or any(p.name == "prompt" for p in params)
    except (TypeError, ValueError):
        var_kw = takes_prompt = True

    async def score(
        completion: str, answer: str, prompt: str = "", meta: Mapping[str, Any] | None = None
    ) -> tuple[float, str | None]:
        kw: dict[str, Any] = dict(meta or {}) if var_kw else {}
        if takes_prompt:
            kw["prompt"] = prompt
        try:
            value: Any = fn(completion, answer, **kw)
            if inspect.isawaitable(value):
                value = await value
        except Exception as e:  # a reward bug costs its sample's score, not the run
            return 0.0, f"{type(e).__name__}: {e}"
        reason = None
        if isinstance(value, tuple):
            value, reason = value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return 0.0, f"reward returned {value!r}, not a finite number"
        return float(value), reason

    return score


# ---- the workflows of the three routes ------------------------------------------------------------------------------


def rollout_sampling(cfg: RunConfig) -> SamplingParams:
    """The run's rollout sampling (`rollout.max_new_tokens`, temperature, top_p, top_k). Sample trained tokens
    with these: the trainer recomputes logprobs at the same temperature and cut-offs."""
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def env_workflow(
    make_env: EnvFactory,
    *,
    max_turns: int | None = None,
    max_total_tokens: int | None = None,
    chat: bool | None = None,
    truncated_reward: float | None | Literal["config"] = "config",
) -> WorkflowFactory:
    """A workflow factory over your environment: `rollout.group_size` episodes of `make_env(sample)` per prompt,
    each episode (every turn) one trajectory whose reward is the sum of the step rewards, trained on the model's
    tokens only (the environment's text has loss mask 0). Token in, token out: the model's text is never
    re-tokenised, so the trained tokens are the sampled ones.

    Options left unset come from the config's `rollout.multi_turn` section (max_turns 2, max_total_tokens 1024,
    truncated_reward 0.0); `chat` from `rollout.multi_turn.chat` or `data.apply_chat_template`. Sampling is the
    run's (`rollout_sampling`). See rollout/workflows/multi_turn.py for the turn loop."""

    def factory(cfg: RunConfig, tokenizer: Tokenizer, score: ScoreFn) -> Workflow:
        mt = cfg.rollout.multi_turn
        use_chat = chat if chat is not None else (mt.chat or bool(cfg.data.apply_chat_template))
        return MultiTurnWorkflow(
            tokenizer,
            make_env,
            rollout_sampling(cfg),
            cfg.rollout.group_size,
            max_turns=max_turns if max_turns is not None else mt.max_turns,
            max_total_tokens=max_total_tokens if max_total_tokens is not None else mt.max_total_tokens,
            chat=use_chat,
            truncated_reward=mt.truncated_reward if truncated_reward == "config" else truncated_reward,
        )

    return factory


class AgentWorkflowFactory:
    """What `agent_workflow` returns: a workflow factory that also closes the proxies it started (`aclose`, which
    `train` calls when the run ends)."""

    def __init__(
        self,
        agent: AgentFn,
        *,
        export: ExportMode,
        discount: float,
        sampling: Literal["enforce", "reject"],
        max_context_tokens: int | None,
    ) -> None:
        self.agent = agent
        self.export: ExportMode = export
        self.discount = discount
        self.sampling: Literal["enforce", "reject"] = sampling
        self.max_context_tokens = max_context_tokens
        self.workflows: list[Any] = []

    def __call__(self, cfg: RunConfig, tokenizer: Tokenizer, score: ScoreFn) -> Workflow:

        r = cfg.rollout
        # trainable calls are sampled at the run's settings whatever the agent asks (see agent/openai_proxy.py)
        policy = PolicySampling(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        proxy = OpenAIProxy(
            None,
            tokenizer,
            policy=policy,
            sampling=self.sampling,
            default_max_tokens=r.max_new_tokens,
            max_context_tokens=self.max_context_tokens,
        )
        wf = AgentWorkflow(proxy, self.agent, r.group_size, discount=self.discount, export=self.export)
        self.workflows.append(wf)
        return wf

    async def aclose(self) -> None:
        """Stop the proxies this factory started (each starts on its workflow's first episode)."""
        for wf in self.workflows:
            if wf.proxy.url is not None:
                await wf.proxy.close()
        self.workflows.clear()


def agent_workflow(
    agent: AgentFn,
    *,
    export: ExportMode = "auto",
    discount: float = 1.0,
    sampling: Literal["enforce", "reject"] = "enforce",
    max_context_tokens: int | None = None,
) -> AgentWorkflowFactory:
    """A workflow factory over an agent written against the `openai` SDK. Per prompt, `rollout.group_size`
    episodes each run `await agent(ctx)`; the agent talks to `ctx.base_url` with `ctx.api_key` (the episode id;
    `ctx.openai()` builds that client), may use chat completions with `tools` (the model's `<tool_call>` blocks
    come back as OpenAI `tool_calls`) or completions, and returns the episode's reward (or None after setting
    rewards itself through `ctx.proxy`). Every call is recorded with its exact tokens, logprobs and versions and the
    episode becomes trajectories (`export`: one concatenated trajectory when the calls extend each other token for
    token, else one per call; see agent/episode.py). A failing agent loses its own episode only. Calls sample at
    the run's rollout settings (`sampling="enforce"` overrides what the agent asks; "reject" answers 400);
    `max_tokens` defaults to `rollout.max_new_tokens`."""
    return AgentWorkflowFactory(
        agent, export=export, discount=discount, sampling=sampling, max_context_tokens=max_context_tokens
    )


class _Tapped:
    """A workflow that hands each group it makes to `on_group` too; a failing callback is logged, never fatal."""

    def __init__(self, inner: Workflow, on_group: GroupCallback) -> None:
        self.inner = inner
        self.on_group = on_group

    async def run(self, client: Generator, sample: Sample) -> list[Trajectory] | None:
        trajs = await self.inner.run(client, sample)
        if trajs:
            try:
                out = self.on_group(sample, trajs)
                if inspect.isawaitable(out):
                    await out
            except Exception:
                log.exception("on_group failed on sample %s (the group is trained anyway)", sample.id)
        return trajs


def _tap(workflow: Any, on_group: GroupCallback | None) -> Any:
    if on_group is None:
        return workflow
    if workflow is None:
        return lambda cfg, tok, score: _Tapped(build_workflow(cfg, tok, score), on_group)
    if hasattr(workflow, "run"):
        return _Tapped(workflow, on_group)
    return lambda cfg, tok, score: _Tapped(workflow(cfg, tok, score), on_group)


# ---- the run ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunResult:
    """A finished run: `summary` is summary.json (steps, trained_samples, max_staleness_seen, evals, ...)."""

    run_dir: str
    summary: dict[str, Any]

    @property
    def steps(self) -> int:
        """Train steps done (= the policy version reached)."""
        return int(self.summary["steps"])

    @property
    def final_model(self) -> str | None:
        """The final weights as an HF checkpoint directory (`run_dir/final`; loads with transformers or serves)."""
        return self.summary.get("final_checkpoint")

    @property
    def checkpoints(self) -> list[str]:
        """The complete trainer checkpoints kept in `run_dir/checkpoints`, oldest first (a rerun resumes the last)."""
        return sorted(p for p in glob.glob(os.path.join(self.run_dir, "checkpoints", "*")) if os.path.isdir(p))

    def metrics(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The records of metrics.jsonl ("train" per step, "eval", "rollout", "recovery", ...), one kind or all."""
        with open(os.path.join(self.run_dir, "metrics.jsonl")) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        return [r for r in recs if kind is None or r.get("kind") == kind]

    def trained_index(self) -> list[dict[str, Any]]:
        """trained_index.jsonl: which sample draws each step trained or dropped (and why)."""

        return ledger.read(os.path.join(self.run_dir, ledger.FILE_NAME))


async def atrain(
    overrides: Sequence[str] = (),
    *,
    config: str | None = None,
    workflow: Any = None,
    on_group: GroupCallback | None = None,
    launcher: Launcher | None = None,
) -> RunResult:
    """`train` on a running event loop (for a program that is already async)."""

    cfg = load_config(config, list(overrides))
    try:
        summary = await run(cfg, _tap(workflow, on_group), launcher)
    finally:
        closer = getattr(workflow, "aclose", None)
        if closer is not None:
            await closer()
    return RunResult(cfg.run_dir, summary)


def train(
    overrides: Sequence[str] = (),
    *,
    config: str | None = None,
    workflow: Any = None,
    on_group: GroupCallback | None = None,
    launcher: Launcher | None = None,
    log_to_console: bool = False,
) -> RunResult:
    """One whole asynchronous RL run, as `python -m areal_async.run [--config FILE] [key=value ...]` does it, with
    your workflow: a `Workflow`, or a factory `f(cfg, tokenizer, score)` such as `env_workflow(...)` or
    `agent_workflow(...)`; None keeps `rollout.workflow` from the config.

    `overrides` are the command line's dotted `key=value` settings (`model.path=tiny`, `steps=20`, `run_dir=...`),
    checked before anything starts: a bad one raises `areal_async.config.ConfigError` naming the key. Then the
    servers and torchrun trainers start, the run trains `schedule.total_steps` steps, writes its run directory and
    tears everything down (also on an error, which is re-raised). `on_group(sample, trajectories)` sees every group
    a workflow finishes. `log_to_console`: the CLI's logging (console and run_dir/run.log; replaces the root
    logger's handlers), otherwise logging is left as your program set it. Blocks; call `atrain` from async code."""

    if log_to_console:
        setup_logging(load_config(config, list(overrides)).run_dir)
    return asyncio.run(atrain(overrides, config=config, workflow=workflow, on_group=on_group, launcher=launcher))
