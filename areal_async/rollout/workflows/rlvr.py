"""Single-turn RL with verifiable rewards: n samples of one prompt, each scored by a reward function."""

from __future__ import annotations

import asyncio

from areal_async.rollout.prompts import prompt_ids
from areal_async.rollout.workflow_api import Generator, ScoreFn, score_sample, trajectory_from_generation
from areal_async.tokenizer import Tokenizer
from areal_async.types import Sample, SamplingParams, Trajectory


class RLVRWorkflow:
    """One prompt group: `group_size` independent samples. Samples of one group share a session key so that a
    router keeps them on one server, where the prompt's KV prefix can be reused."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        score: ScoreFn,
        sampling: SamplingParams,
        group_size: int,
        use_chat_template: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.score = score
        self.sampling = sampling
        self.group_size = group_size
        self.use_chat_template = use_chat_template

    def prompt_ids(self, sample: Sample) -> list[int]:
        return prompt_ids(self.tokenizer, sample, self.use_chat_template)

    async def run(self, client: Generator, sample: Sample) -> list[Trajectory] | None:
        ids = self.prompt_ids(sample)
        key = f"s{sample.id}"
        if self.group_size == 1:  # no gather: it would wrap the one call in a task of its own
            gens = [await client.agenerate(ids, self.sampling, session_key=key)]
        else:
            gens = await asyncio.gather(
                *(client.agenerate(ids, self.sampling, session_key=key) for _ in range(self.group_size))
            )
        if any(g.finish_reason == "abort" for g in gens):  # the group is dropped (manager.py): score nothing
            return [trajectory_from_generation(ids, g, 0.0, interruptions=g.num_interruptions) for g in gens]
        texts = [self.tokenizer.decode(g.output_ids) for g in gens]
        if len(texts) == 1:
            scores = [await score_sample(self.score, texts[0], sample)]
        else:
            scores = await asyncio.gather(*(score_sample(self.score, t, sample) for t in texts))
        return [
            trajectory_from_generation(
                ids, g, reward, interruptions=g.num_interruptions, **({"reward_error": why} if why else {})
            )
            for g, (reward, why) in zip(gens, scores)
        ]
