"""A workflow that trains an agent written against the OpenAI SDK: each episode is one run of the agent against the
proxy, and a prompt's group is `group_size` such episodes. Controller side: no torch.

Baseline and grouping (what the trainer sees): the rollout manager makes the trajectories of one `run` one GRPO
group, and the group's baseline is the weighted mean reward over its trajectories. The default export ("auto")
gives one trajectory per episode whenever the proxy kept the episode token-exact (the usual agent loop), weight
1.0, so every episode counts once. An episode exported "per_call" gives one trajectory per call, so an episode
with more calls would count more in a plain mean: each per_call trajectory therefore carries
`info["episode_weight"] = 1 / calls` (and `info["episode_calls"]`), and the trainer weighs the group's mean (and
std, for grpo) and the batch normalisation by it (train/advantages.py), so every episode counts once. Example: two
episodes of a prompt, one of 1 call with reward 1 and one of 3 calls with reward 0: the baseline is 0.5 (the
mean over episodes), where the plain mean over the 4 trajectories would be 0.25. RLOO leaves out the trajectory
itself, not the rest of its episode (train/advantages.py `group_advantages`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from areal_async.agent.episode import ExportMode
from areal_async.agent.openai_proxy import OpenAIProxy
from areal_async.rollout.workflow_api import Generator
from areal_async.types import Sample, Trajectory

log = logging.getLogger(__name__)


@dataclass
class AgentContext:
    """What an agent function gets for one episode: where to send OpenAI requests and with which key."""

    base_url: str
    api_key: str  # the episode id
    sample: Sample
    proxy: OpenAIProxy

    def openai(self, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` client for this episode (base URL and key set; no retries, because a retried
        call would be sampled and recorded twice). Imports the SDK only when called."""
        from openai import AsyncOpenAI

        kwargs.setdefault("max_retries", 0)
        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


AgentFn = Callable[[AgentContext], Awaitable["float | None"]]


class AgentWorkflow:
    """Run `agent(ctx)` `group_size` times per sample against a started proxy; each run is an episode whose
    recorded calls become trajectories. The agent returns the episode reward (or sets rewards itself through
    the proxy and returns None). A failing agent loses only its own episode. Episodes are trainable: their calls
    are sampled with the proxy's `policy` settings (see openai_proxy.py)."""

    def __init__(
        self, proxy: OpenAIProxy, agent: AgentFn, group_size: int, *, discount: float = 1.0, export: ExportMode = "auto"
    ) -> None:
        self.proxy = proxy
        self.agent = agent
        self.group_size = group_size
        self.discount = discount
        self.export = export
        self._starting = asyncio.Lock()

    async def _one(self, client: Generator, sample: Sample) -> list[Trajectory]:
        eid = self.proxy.start_episode(generator=client, meta={"sample": sample.id}, trainable=True)
        try:
            reward = await self.agent(AgentContext(self.proxy.base_url, eid, sample, self.proxy))
            if reward is not None:
                self.proxy.set_reward(eid, reward)
            return self.proxy.finish_episode(eid, discount=self.discount, mode=self.export)
        except asyncio.CancelledError:
            self.proxy.discard_episode(eid)
            raise
        except Exception as e:
            log.warning("agent episode on sample %s failed: %s: %s", sample.id, type(e).__name__, e)
            self.proxy.discard_episode(eid)
            return []

    async def run(self, client: Generator, sample: Sample) -> list[Trajectory] | None:
        if self.proxy.url is None:  # a workflow built by a sync factory starts its proxy on first use
            async with self._starting:
                if self.proxy.url is None:
                    await self.proxy.start()
        eps = await asyncio.gather(*(self._one(client, sample) for _ in range(self.group_size)))
        trajs = [t for ep in eps for t in ep]
        return trajs or None
