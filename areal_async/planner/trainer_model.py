"""The simulated trainer and weight transport: what the controller sees in place of `TrainerGroup` and a
`WeightSync` (rollout/weight_sync.py), on the virtual clock.

The model (docs/planner.md, "The trainer"): a train step over a batch costs

    overhead_s + token_s * tokens + attn_s * sum(sequence_length^2) + comm_s

token_s carries the dense FLOPs per token (6 x params for the update, 2 x params for each extra forward pass such as
recomputing the proximal policy's logprobs) over the trainer's FLOP/s at its MFU; attn_s the causal attention, whose
cost grows with each sequence's square; comm_s the FSDP all-gathers and reduce-scatters not hidden behind compute.
Publishing a checkpoint (disk sync's prepare step) costs `publish_s`; the servers' load is `ServerCosts.load_s`.

The trainer also keeps the staleness of every trained token (by the version that sampled it), read from the
compact trajectories the planner's workflow builds (simulate.py): the controller's own histogram counts those
trajectories' segments, not tokens.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from areal_async.planner.fleet import SimFleet
from areal_async.types import CheckpointResult, PublishResult, TrainStepResult, Trajectory

TOKENS_KEY = "sim_tokens"  # response tokens of the group
PROMPT_KEY = "sim_prompt"  # prompt tokens of each sample
SAMPLES_KEY = "sim_samples"  # samples in the group
SUMSQ_KEY = "sim_sumsq"  # sum over samples of (prompt + response)^2
VERSION_PREFIX = "sim_v"  # sim_v<version>: response tokens sampled by that version
_VERSION_KEYS: dict[int, str] = {}  # version -> its key, made once (a plan writes one per group and version)
_KEY_VERSIONS: dict[str, int] = {}  # and back, for the trainer's tally


def version_key(version: int) -> str:
    """The info key of the tokens `version` sampled: VERSION_PREFIX + version."""
    key = _VERSION_KEYS.get(version)
    if key is None:
        key = _VERSION_KEYS[version] = f"{VERSION_PREFIX}{version}"
        _KEY_VERSIONS[key] = version
    return key


@dataclass
class TrainerCosts:
    """Every cost term of the trainer, in seconds (presets: costs.py; a profile: calibrate.py)."""

    token_s: float = 1e-6  # per trained token (prompt and response)
    attn_s: float = 0.0  # per sequence, times its length squared
    overhead_s: float = 0.0  # per step (optimizer, launches)
    comm_s: float = 0.0  # FSDP communication per step not hidden behind compute
    publish_s: float = 0.0  # writing a checkpoint for disk sync (0 for broadcast)

    def step_time(self, tokens: float, sumsq: float) -> float:
        return self.overhead_s + self.comm_s + self.token_s * tokens + self.attn_s * sumsq


class SimTrainer:
    """The `Trainer` protocol (rollout/controller.py) on the virtual clock; `busy_s` is its train and publish
    time, `staleness` the trained response tokens by staleness."""

    def __init__(self, costs: TrainerCosts) -> None:
        self.c = costs
        self.busy_s = 0.0
        self.train_s = 0.0
        self.steps = 0
        self.samples = 0
        self.tokens = 0
        self.staleness: Counter[int] = Counter()
        self.step_times: list[float] = []

    async def train_step(self, trajectories: list[Trajectory], policy_version: int) -> TrainStepResult:
        tokens = 0.0
        sumsq = 0.0
        samples = 0
        by_staleness: dict[int, int] = {}  # this step's tokens by staleness, added to the run's below
        versions = _KEY_VERSIONS
        for t in trajectories:
            info = t.info
            m = int(info[SAMPLES_KEY])
            samples += m
            tokens += float(info[TOKENS_KEY]) + m * float(info[PROMPT_KEY])
            sumsq += float(info[SUMSQ_KEY])
            for k, v in info.items():
                ver = versions.get(k)
                if ver is None:
                    if not k.startswith(VERSION_PREFIX):
                        continue
                    ver = int(k[len(VERSION_PREFIX) :])
                s = policy_version - ver
                by_staleness[s] = by_staleness.get(s, 0) + int(v)
        for s, n in by_staleness.items():
            self.staleness[s] += n
        dt = self.c.step_time(tokens, sumsq)
        await asyncio.sleep(dt)
        self.busy_s += dt
        self.train_s += dt
        self.steps += 1
        self.samples += samples
        self.tokens += int(tokens)
        self.step_times.append(dt)
        return TrainStepResult(version=policy_version + 1, stats={"sim_tokens": tokens})

    async def publish(self, version: int, root: str, keep: int = 2) -> PublishResult:
        await asyncio.sleep(self.c.publish_s)
        self.busy_s += self.c.publish_s
        return PublishResult(path=f"{root}/v{version}", seconds=self.c.publish_s, num_bytes=0)

    async def save_checkpoint(self, path: str) -> CheckpointResult:
        return CheckpointResult(path=path, version=self.steps, seconds=0.0)


class SimWeightSync:
    """The `WeightSync` protocol: `prepare` publishes (disk: the trainer writes a checkpoint while generation goes
    on), `apply` has every simulated server load the version."""

    def __init__(self, trainer: SimTrainer, fleet: SimFleet) -> None:
        self.trainer = trainer
        self.fleet = fleet
        self.latest_checkpoint: str | None = None

    async def prepare(self, version: int) -> None:
        await self.trainer.publish(version, "sim")

    async def apply(self, version: int, *, flush_cache: bool) -> None:
        await self.fleet.load_weights(version)
