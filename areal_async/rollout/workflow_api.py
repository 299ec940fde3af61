"""The Workflow protocol: how one prompt becomes a group of trajectories.

A workflow is any object with `async def run(client, sample) -> list[Trajectory] | None`. It talks to the model only
through the `Generator` seam below (the InferenceClient satisfies it), so the same workflow runs against HTTP servers
or anything else that can generate. Returning None rejects the group (it is counted, never trained on).

What the rollout manager does with a group (manager.py): it numbers the group (every trajectory's `group_id` becomes
the sample's draw index; workflows leave it alone), and drops the whole group, never training it, when a
trajectory's `info["finish"]` is "abort" (its generation was cut off: repeated foreign aborts, an engine error), or
when a trajectory is malformed or has no generated token. Workflows report each trajectory's finish that way.
No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from areal_async.types import GenerationResult, Sample, SamplingParams, Trajectory


class Generator(Protocol):
    """What a workflow needs from the inference side (InferenceClient implements it)."""

    async def agenerate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        session_key: str | None = None,
        return_text: bool = False,
        priority: int | None = None,
    ) -> GenerationResult: ...


class ScoreFn(Protocol):
    """The run's reward: (reward, failure reason or None); never raises. `meta` is the sample's `Sample.meta`
    (per-sample settings of the reward, such as the code reward's wall_s, cpu_s and memory_mb); it is passed only
    when the sample has some, so a three-argument function still serves datasets without meta."""

    async def __call__(
        self, completion: str, answer: str, prompt: str = "", meta: Mapping[str, Any] | None = None
    ) -> tuple[float, str | None]: ...


async def score_sample(score: ScoreFn, completion: str, sample: Sample) -> tuple[float, str | None]:
    """Score a completion of `sample` (its answer, prompt and meta)."""
    if sample.meta:
        return await score(completion, sample.answer, sample.prompt, sample.meta)
    return await score(completion, sample.answer, sample.prompt)


@runtime_checkable
class Workflow(Protocol):
    """One sample in, one group of trajectories out (the group is the unit of the trainer's group-relative
    advantages). Generate through `client` only, so interrupted requests resume under new weights and every token
    keeps its version; return trajectories whose trained tokens, logprobs and versions are the generated ones
    (`trajectory_from_generation`), or None / [] to reject the group (counted as dropped, never trained). A raise
    drops the group too. `run` is called concurrently for many samples: keep per-sample state local."""

    async def run(self, client: Generator, sample: Sample) -> list[Trajectory] | None: ...


def trajectory_from_generation(
    prompt_ids: list[int], gen: GenerationResult, reward: float, **info: float | int | str | bool
) -> Trajectory:
    """A single-turn trajectory with the package's alignment convention (see areal_async.types); its group id is
    set by the rollout manager and `info["finish"]` is the generation's finish reason."""
    n_prompt = len(prompt_ids)
    return Trajectory(
        input_ids=list(prompt_ids) + list(gen.output_ids),
        loss_mask=[0] * n_prompt + [1] * len(gen.output_ids),
        logprobs=[0.0] * n_prompt + list(gen.output_logprobs),
        versions=[-1] * n_prompt + list(gen.output_versions),
        reward=float(reward),
        prompt_len=n_prompt,
        info={"finish": gen.finish_reason, **info},
    )
