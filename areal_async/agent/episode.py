"""What an agent did in one episode: every model call with its exact tokens, and the rewards it earned.

An episode is a list of calls (one per OpenAI request choice) in the order they were made. Each call keeps the
prompt ids that were generated from, the output ids, the behaviour logprob and the policy version of every output
token, so it can be trained on exactly as it was sampled.

Rewards: set per call (`set_reward(r, call_id=...)`) and/or for the whole episode (`set_reward(r)`, credited to the
last call). Each call's return is its own reward plus the discounted return of the calls after it,

    G_i = r_i + discount * G_{i+1},      G_last = r_last + episode_reward

so with discount 1 every call is credited with everything that followed it, and with discount 0 only with its own.

Export (`to_trajectories`), documented choice:
- "concat": ONE trajectory for the whole episode, legal only when each call's prompt starts with the previous
  call's prompt + output (a linear conversation whose history the proxy kept token-exact). Tokens between one
  call's output and the next call's new output (tool results, user turns, template text) get loss_mask 0;
  the reward is the first call's return G_0.
- "per_call": one trajectory per call (prompt + output), reward G_i. Always possible. Each carries
  `info["episode_weight"] = 1 / number of calls` (and `info["episode_calls"]`). The trainer weighs every
  trajectory by it in its group's baseline (the weighted mean, and the weighted std for grpo; a weighted
  leave-one-out mean for rloo) and in the optional batch normalisation, so every episode counts once however many
  calls it made (see agent/workflow.py and train/advantages.py). The loss itself is not weighted: every trained
  token is one term of it.
- "auto" (default): concat when legal, else per_call.
Only trainable episodes export: their calls were sampled at the policy's settings (recorded per call, and copied
into `info["temperature"]`), the settings the trainer computes logprobs at.
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec

from areal_async.types import EPISODE_WEIGHT_KEY, Trajectory

ExportMode = Literal["auto", "concat", "per_call"]


class CallRecord(msgspec.Struct, kw_only=True):
    call_id: str  # "<response id>" or "<response id>/<choice index>" when n > 1
    kind: str  # "chat" or "completion"
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]  # [len(output_ids)]
    output_versions: list[int]  # [len(output_ids)]
    finish_reason: str
    reward: float | None = None
    created: float = 0.0
    # chat calls: the request messages and the assistant message returned, to recognise a continuation later
    messages: list[dict] | None = None
    response_message: dict | None = None
    tools_json: str | None = None  # the request's tools, canonical JSON: a continuation must use the same tools
    text: str | None = None  # completions: prompt text + returned text, when the returned text is token-exact
    # the sampling the call was generated with (the policy's, on trainable calls)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    trainable: bool = True


class Episode:
    def __init__(self, episode_id: str, *, group_id: int = 0, meta: dict | None = None) -> None:
        self.id = episode_id
        self.group_id = group_id
        self.meta = dict(meta or {})
        self.calls: list[CallRecord] = []
        self.episode_reward: float | None = None
        self.created = time.time()

    def add(self, call: CallRecord) -> None:
        self.calls.append(call)

    def call(self, call_id: str) -> CallRecord:
        for c in self.calls:
            if c.call_id == call_id:
                return c
        raise KeyError(f"episode {self.id}: no call {call_id!r}")

    def set_reward(self, reward: float, call_id: str | None = None) -> None:
        """Reward one call (by id) or, without a call id, the episode as a whole. Setting again replaces."""
        reward = float(reward)
        if reward != reward or reward in (float("inf"), float("-inf")):
            raise ValueError(f"reward must be finite, got {reward}")
        if call_id is None:
            self.episode_reward = reward
        else:
            self.call(call_id).reward = reward

    def returns(self, discount: float = 1.0) -> list[float]:
        """G_i for every call (see the module docstring)."""
        g = 0.0
        out = [0.0] * len(self.calls)
        for i in range(len(self.calls) - 1, -1, -1):
            r = self.calls[i].reward or 0.0
            if i == len(self.calls) - 1:
                r += self.episode_reward or 0.0
            g = r + discount * g
            out[i] = g
        return out

    def is_linear(self) -> bool:
        """True when every call's prompt extends the previous call's prompt + output, token for token."""
        for prev, cur in zip(self.calls, self.calls[1:]):
            seq = prev.prompt_ids + prev.output_ids
            if len(cur.prompt_ids) < len(seq) or cur.prompt_ids[: len(seq)] != seq:
                return False
        return True

    def to_trajectories(self, discount: float = 1.0, mode: ExportMode = "auto") -> list[Trajectory]:
        if not self.calls:
            return []
        if mode not in ("auto", "concat", "per_call"):
            raise ValueError(f"unknown export mode {mode!r}")
        if not all(c.trainable for c in self.calls):
            raise ValueError(
                f"episode {self.id} was not trainable: its calls were sampled as the agent asked, not "
                "at the policy's settings"
            )
        temps = {c.temperature for c in self.calls}
        if len(temps) > 1:
            raise ValueError(f"episode {self.id}: calls were sampled at different temperatures {sorted(temps)}")
        linear = self.is_linear()
        if mode == "concat" and not linear:
            raise ValueError(f"episode {self.id}: calls do not extend each other's tokens; use per_call export")
        g = self.returns(discount)
        base_info: dict = {"episode": self.id, "calls": len(self.calls)}
        temp = self.calls[0].temperature
        if temp is not None:
            base_info["temperature"] = temp
        if mode == "per_call" or not linear:
            out = []
            for i, c in enumerate(self.calls):
                n_p, n_o = len(c.prompt_ids), len(c.output_ids)
                out.append(
                    Trajectory(
                        input_ids=c.prompt_ids + c.output_ids,
                        loss_mask=[0] * n_p + [1] * n_o,
                        logprobs=[0.0] * n_p + c.output_logprobs,
                        versions=[-1] * n_p + c.output_versions,
                        reward=g[i],
                        group_id=self.group_id,
                        prompt_len=n_p,
                        info={
                            **base_info,
                            "export": "per_call",
                            "call": i,
                            "finish": c.finish_reason,
                            "episode_calls": len(self.calls),
                            EPISODE_WEIGHT_KEY: 1.0 / len(self.calls),
                        },
                    )
                )
            return out
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        for c in self.calls:
            new_prompt = c.prompt_ids[len(ids) :]  # everything since the last output: environment tokens
            ids += new_prompt + c.output_ids
            mask += [0] * len(new_prompt) + [1] * len(c.output_ids)
            lps += [0.0] * len(new_prompt) + c.output_logprobs
            vers += [-1] * len(new_prompt) + c.output_versions
        return [
            Trajectory(
                input_ids=ids,
                loss_mask=mask,
                logprobs=lps,
                versions=vers,
                reward=g[0],
                group_id=self.group_id,
                prompt_len=len(self.calls[0].prompt_ids),
                info={**base_info, "export": "concat", "finish": self.calls[-1].finish_reason},
            )
        ]

    def summary(self) -> dict:
        return {
            "id": self.id,
            "group_id": self.group_id,
            "calls": [
                {
                    "call_id": c.call_id,
                    "kind": c.kind,
                    "prompt_tokens": len(c.prompt_ids),
                    "completion_tokens": len(c.output_ids),
                    "finish_reason": c.finish_reason,
                    "reward": c.reward,
                }
                for c in self.calls
            ],
            "episode_reward": self.episode_reward,
            "linear": self.is_linear(),
        }
