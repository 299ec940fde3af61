"""The Workflow protocol: how one prompt becomes a group of trajectories.

A workflow is any object with `async def run(client, sample) -> list[Trajectory] | None`. It talks to the model only
through the `Generator` seam below (the InferenceClient satisfies it), so the same workflow runs against HTTP servers
or anything else that can generate. Returning None rejects the group (it is counted, never trained on).
No torch here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from areal_async.types import GenerationResult, SamplingParams, Sample, Trajectory


class Generator(Protocol):
    """What a workflow needs from the inference side (InferenceClient implements it)."""

    async def agenerate(self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None,
                        session_key: str | None = None, return_text: bool = False,
                        priority: int | None = None) -> GenerationResult: ...


@runtime_checkable
class Workflow(Protocol):
    async def run(self, client: Generator, sample: Sample) -> list[Trajectory] | None: ...


def trajectory_from_generation(prompt_ids: list[int], gen: GenerationResult, reward: float, group_id: int,
                               **info: float | int | str | bool) -> Trajectory:
    """Build a single-turn trajectory with the module-wide alignment convention (see areal_async.types)."""
    n_prompt = len(prompt_ids)
    n_out = len(gen.output_ids)
    return Trajectory(
        input_ids=list(prompt_ids) + list(gen.output_ids),
        loss_mask=[0] * n_prompt + [1] * n_out,
        logprobs=[0.0] * n_prompt + list(gen.output_logprobs),
        versions=[-1] * n_prompt + list(gen.output_versions),
        reward=float(reward),
        group_id=group_id,
        prompt_len=n_prompt,
        info=dict(info),
    )
