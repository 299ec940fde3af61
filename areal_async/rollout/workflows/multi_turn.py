"""Multi-turn episodes: the model acts, an environment answers, and the whole conversation becomes ONE trajectory.

    reset(sample) -> observation ──tokenize──> ids            (loss_mask 0, version -1)
    loop:  agenerate(ids) -> output ids, logprobs, versions   (loss_mask 1: exactly the generated tokens)
           step(decoded text) -> feedback, reward, done
           ids += output ids + tokenized feedback             (loss_mask 0)

Token in, token out: the next turn's input is the previous input ids + the generated ids + the feedback's ids. The
model's text is never re-tokenised, so the trained tokens are exactly the sampled ones and their behaviour
logprobs stay valid (re-tokenising "12+3" can give different ids than the model produced). Interrupted generation
resumes inside a turn (the client does it), so one turn may span several policy versions; `versions` records which.

Observations are either plain text (appended as is: for base models and plain-text tasks such as arith; the
model's EOS token stays in the context before the feedback, because it was generated) or chat messages (rendered
with the tokenizer's chat template). For chat, only the *new* messages are rendered (`ChatTokens`, rollout/chat.py),
and the model's turn is closed with the template's own end-of-turn text, minus whatever part of it the model
already generated.

The environment API is two coroutines (`Env` below); `CheckerEnv` is a ready-made one: it grades each attempt with
a reward function and answers "wrong, try again" until the attempts run out. `make_workflow` is what
`rollout.workflow: multi_turn` builds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import msgspec

from areal_async.config import MultiTurnConfig
from areal_async.rollout.chat import ChatTokens
from areal_async.rollout.workflow_api import Generator, ScoreFn, score_sample
from areal_async.tokenizer import Tokenizer
from areal_async.types import Sample, SamplingParams, Trajectory

__all__ = [
    "ChatTokens",
    "CheckerEnv",
    "Env",
    "EnvFactory",
    "EpisodeResult",
    "MultiTurnConfig",
    "MultiTurnWorkflow",
    "Observation",
    "make_workflow",
]

Observation = str | list[dict]  # plain text, or chat messages ({"role", "content", ...})


@runtime_checkable
class Env(Protocol):
    """One episode's environment. A fresh instance per episode (see `EnvFactory`); methods may await anything."""

    async def reset(self, sample: Sample) -> Observation:
        """The first observation: the prompt as text, or as chat messages."""
        ...

    async def step(self, action: str) -> tuple[Observation, float, bool]:
        """React to the model's decoded turn: (feedback observation, reward for this step, episode done)."""
        ...


EnvFactory = Callable[[Sample], Env]


# ---- the workflow ---------------------------------------------------------------------------------------------------


class EpisodeResult(msgspec.Struct, kw_only=True):
    """A finished episode before it becomes a Trajectory (kept for tests and logging)."""

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    prompt_len: int
    reward: float
    turns: int
    step_rewards: list[float]
    turn_outputs: list[list[int]]  # the generated ids of each turn, as returned by the client
    turn_inputs: list[list[int]]  # the input ids of each turn, as sent to the client
    finish: str  # "done" (the env ended it), "truncated", "max_turns", "max_tokens", "abort"
    interruptions: int = 0


class MultiTurnWorkflow:
    """`group_size` episodes of `env_factory(sample)` per sample; each episode is one Trajectory.

    The trajectory reward is the sum of the step rewards (an environment that wants discounting or a final-only
    reward computes it in `step`).

    Truncated turns: a turn cut off by `max_new_tokens` is not shown to the environment; the episode ends there
    with `truncated_reward` (None: pass it on like any other turn; with `ignore_eos` every turn ends by length,
    so the rule does not apply). Why: when the reward can be read from a
    cut-off text (an answer line followed by rambling), nothing teaches the model to stop, and in multi-turn
    episodes, where failed episodes hold more turns (and more end-of-turn tokens) than successful ones, the
    group-relative gradient pushes the end-of-sequence token down until the policy never stops.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        env_factory: EnvFactory,
        sampling: SamplingParams,
        group_size: int,
        *,
        max_turns: int = 2,
        max_total_tokens: int = 1024,
        chat: bool = False,
        truncated_reward: float | None = 0.0,
    ) -> None:
        if max_turns < 1 or group_size < 1:
            raise ValueError("max_turns and group_size must be >= 1")
        self.tok = tokenizer
        self.env_factory = env_factory
        self.sampling = sampling
        self.group_size = group_size
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.chat = chat
        self.truncated_reward = truncated_reward
        self._chat_tokens: ChatTokens | None = None

    @property
    def chat_tokens(self) -> ChatTokens:
        if self._chat_tokens is None:
            self._chat_tokens = ChatTokens(self.tok)
        return self._chat_tokens

    def _first_ids(self, obs: Observation) -> tuple[list[int], bool]:
        """(prompt ids, chat mode) for the first observation."""
        if isinstance(obs, str) and not self.chat:
            return self.tok.encode(obs), False
        messages = [{"role": "user", "content": obs}] if isinstance(obs, str) else list(obs)
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        assert isinstance(ids, list)
        return ids, True

    def _feedback_ids(self, obs: Observation, output_ids: list[int], chat: bool) -> list[int]:
        if not chat:
            if not isinstance(obs, str):
                raise TypeError("a plain-text episode got chat messages as feedback; return a str from step()")
            return self.tok.encode(obs)
        messages = [{"role": "user", "content": obs}] if isinstance(obs, str) else list(obs)
        return self.chat_tokens.close_turn_ids(output_ids) + self.chat_tokens.delta_ids(messages)

    async def episode(self, client: Generator, sample: Sample, index: int = 0) -> EpisodeResult:
        env = self.env_factory(sample)
        obs = await env.reset(sample)
        ids, chat = self._first_ids(obs)
        if len(ids) >= self.max_total_tokens:
            raise ValueError(
                f"sample {sample.id}: the prompt has {len(ids)} tokens, max_total_tokens is {self.max_total_tokens}"
            )
        n0 = len(ids)
        mask, lps, vers = [0] * n0, [0.0] * n0, [-1] * n0
        step_rewards: list[float] = []
        outs: list[list[int]] = []
        ins: list[list[int]] = []
        finish, interruptions = "max_turns", 0
        key = f"s{sample.id}-e{index}"  # one server per episode: each turn's prompt is the last one's prefix
        for _turn in range(self.max_turns):
            budget = min(self.sampling.max_new_tokens, self.max_total_tokens - len(ids))
            if budget <= 0:
                finish = "max_tokens"
                break
            sp = msgspec.structs.replace(self.sampling, max_new_tokens=budget)
            ins.append(list(ids))
            gen = await client.agenerate(list(ids), sp, session_key=key)
            out = list(gen.output_ids)
            outs.append(out)
            interruptions += gen.num_interruptions
            ids += out
            mask += [1] * len(out)
            lps += list(gen.output_logprobs)
            vers += list(gen.output_versions)
            if gen.finish_reason == "abort":  # aborted by someone on purpose (not an interruption): stop here
                finish = "abort"
                break
            if gen.finish_reason == "length" and self.truncated_reward is not None and not sp.ignore_eos:
                step_rewards.append(float(self.truncated_reward))
                finish = "truncated"
                break
            obs, reward, done = await env.step(self.tok.decode(out))
            step_rewards.append(float(reward))
            if done:
                finish = "done"
                break
            fb = self._feedback_ids(obs, out, chat)
            room = self.max_total_tokens - len(ids)
            if len(fb) >= room:  # no room left for the model to answer the feedback
                finish = "max_tokens"
                break
            ids += fb
            mask += [0] * len(fb)
            lps += [0.0] * len(fb)
            vers += [-1] * len(fb)
        return EpisodeResult(
            input_ids=ids,
            loss_mask=mask,
            logprobs=lps,
            versions=vers,
            prompt_len=n0,
            reward=sum(step_rewards),
            turns=len(outs),
            step_rewards=step_rewards,
            turn_outputs=outs,
            turn_inputs=ins,
            finish=finish,
            interruptions=interruptions,
        )

    @staticmethod
    def to_trajectory(ep: EpisodeResult, group_id: int = -1) -> Trajectory:
        info: dict[str, Any] = {"turns": ep.turns, "finish": ep.finish, "interruptions": ep.interruptions}
        if ep.step_rewards:
            info["first_reward"] = ep.step_rewards[0]
        return Trajectory(
            input_ids=ep.input_ids,
            loss_mask=ep.loss_mask,
            logprobs=ep.logprobs,
            versions=ep.versions,
            reward=ep.reward,
            group_id=group_id,
            prompt_len=ep.prompt_len,
            info=info,
        )

    async def run(self, client: Generator, sample: Sample) -> list[Trajectory] | None:
        eps = await asyncio.gather(*(self.episode(client, sample, i) for i in range(self.group_size)))
        trajs = [self.to_trajectory(e) for e in eps if e.turns > 0]
        return trajs or None


# ---- a ready-made environment: grade, and let the model retry ----------------------------------------------------


class CheckerEnv:
    """Grade each attempt with a reward function; on a wrong answer say so and let the model try again.

    Attempt k (0-based) that is correct ends the episode with reward `retry_discount ** k`; a wrong attempt scores
    0 and, while attempts remain, gets `feedback` back (formatted with the sample's prompt).
    """

    def __init__(
        self,
        score: ScoreFn,
        *,
        max_attempts: int = 2,
        feedback: str = "Wrong, try again.\n{prompt}",
        retry_discount: float = 0.5,
        threshold: float = 0.5,
    ) -> None:
        self.score = score
        self.max_attempts = max_attempts
        self.feedback = feedback
        self.retry_discount = retry_discount
        self.threshold = threshold
        self.sample: Sample | None = None
        self.attempt = 0
        self.last_reason: str | None = None

    async def reset(self, sample: Sample) -> Observation:
        self.sample, self.attempt = sample, 0
        return sample.messages if sample.messages is not None else sample.prompt

    async def step(self, action: str) -> tuple[Observation, float, bool]:
        assert self.sample is not None, "reset() first"
        reward, self.last_reason = await score_sample(self.score, action, self.sample)
        k = self.attempt
        self.attempt += 1
        if reward >= self.threshold:
            return "", float(reward) * self.retry_discount**k, True
        done = self.attempt >= self.max_attempts
        return self.feedback.format(prompt=self.sample.prompt, answer_text=action), 0.0, done


def make_workflow(cfg: Any, tokenizer: Tokenizer, score: ScoreFn) -> MultiTurnWorkflow:
    """`rollout.workflow: multi_turn`: CheckerEnv over the run's reward, options from `rollout.multi_turn`."""
    r = cfg.rollout
    raw = getattr(r, "multi_turn", None) or {}
    mt = (
        raw
        if isinstance(raw, MultiTurnConfig)
        else msgspec.convert(  # a mapping, from a hand-made cfg
            msgspec.to_builtins(raw), MultiTurnConfig, strict=False
        )
    )
    mt.validate("rollout.multi_turn")
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    chat = mt.chat or bool(getattr(getattr(cfg, "data", None), "apply_chat_template", False))

    def env_factory(_sample: Sample) -> Env:
        return CheckerEnv(score, max_attempts=mt.max_turns, feedback=mt.feedback, retry_discount=mt.retry_discount)

    return MultiTurnWorkflow(
        tokenizer,
        env_factory,
        sampling,
        r.group_size,
        max_turns=mt.max_turns,
        max_total_tokens=mt.max_total_tokens,
        chat=chat,
        truncated_reward=mt.truncated_reward,
    )
