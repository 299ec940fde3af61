"""Single-turn RL with verifiable rewards: n samples of one prompt, each scored by a reward function."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from areal_async.rollout.workflow_api import Generator, trajectory_from_generation
from areal_async.tokenizer import Tokenizer
from areal_async.types import SamplingParams, Sample, Trajectory

# (completion_text, answer, prompt) -> (reward, failure reason or None); never raises
ScoreFn = Callable[[str, str, str], Awaitable[tuple[float, str | None]]]


class RLVRWorkflow:
    """One prompt group: `group_size` independent samples. Samples of one group share a session key so that a
    router keeps them on one server, where the prompt's KV prefix can be reused."""

    def __init__(self, tokenizer: Tokenizer, score: ScoreFn, sampling: SamplingParams, group_size: int,
                 use_chat_template: bool = False) -> None:
        self.tokenizer = tokenizer
        self.score = score
        self.sampling = sampling
        self.group_size = group_size
        self.use_chat_template = use_chat_template

    def prompt_ids(self, sample: Sample) -> list[int]:
        if sample.messages is not None or self.use_chat_template:
            messages = sample.messages or [{"role": "user", "content": sample.prompt}]
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)  # type: ignore[return-value]
        return self.tokenizer.encode(sample.prompt)

    async def run(self, client: Generator, sample: Sample) -> list[Trajectory] | None:
        prompt_ids = self.prompt_ids(sample)
        key = f"s{sample.id}"
        if self.group_size == 1:  # no gather: it would wrap the one call in a task of its own
            gens = [await client.agenerate(prompt_ids, self.sampling, session_key=key)]
        else:
            gens = await asyncio.gather(*(client.agenerate(prompt_ids, self.sampling, session_key=key)
                                          for _ in range(self.group_size)))
        texts = [self.tokenizer.decode(g.output_ids) for g in gens]
        if len(texts) == 1:
            scores = [await self.score(texts[0], sample.answer, sample.prompt)]
        else:
            scores = await asyncio.gather(*(self.score(t, sample.answer, sample.prompt) for t in texts))
        return [
            trajectory_from_generation(prompt_ids, g, reward, group_id=0, finish=g.finish_reason,
                                       interruptions=g.num_interruptions, **({"reward_error": why} if why else {}))
            for g, (reward, why) in zip(gens, scores)
        ]
