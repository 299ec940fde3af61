"""A planned run as a user states it (GPU, model, GPU count and split, batch, lengths, schedule) -> the cost terms
and sizes the simulator takes (`Setting`).

Why a layer of its own: the simulator works in seconds per token; a user thinks in GPUs and model names. Every
derived term can still be replaced: `server_overrides` and `trainer_overrides` name `ServerCosts` and
`TrainerCosts` fields, `efficiency` holds the assumed efficiencies (costs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from areal_async.planner.costs import Efficiency, override, server_costs, trainer_costs
from areal_async.planner.lengths import LengthModel
from areal_async.planner.presets import gpu, model
from areal_async.planner.simulate import Setting


@dataclass
class Scenario:
    """One cluster and run. `gen_frac` of the GPUs serve (in servers of `tp` GPUs), the rest train."""

    gpu: str = "H800"
    model: str = "qwen2.5-1.5b"
    gpus: int = 128
    gen_frac: float = 0.75
    tp: int = 1
    batch_size: int = 512
    group_size: int = 16
    steps: int = 20
    lengths: LengthModel = field(default_factory=LengthModel)
    interrupt_mode: str = "abort"
    weight_sync: str = "disk"
    minibatches: int = 4
    max_concurrent_groups: int | None = None
    efficiency: Efficiency = field(default_factory=Efficiency)
    server_overrides: dict[str, Any] = field(default_factory=dict)
    trainer_overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def split(self) -> tuple[int, int]:
        """(generation GPUs, training GPUs): whole servers of `tp` GPUs, at least one on each side."""
        servers = max(1, round(self.gpus * self.gen_frac / self.tp))
        gen = min(servers * self.tp, self.gpus - 1)
        gen -= gen % self.tp
        if gen < self.tp or self.gpus - gen < 1:
            raise ValueError(f"{self.gpus} GPUs cannot hold a server of tp={self.tp} and a trainer")
        return gen, self.gpus - gen

    def with_split(self, gen_frac: float) -> Scenario:
        return replace(self, gen_frac=gen_frac)

    def setting(self) -> Setting:
        g, m = gpu(self.gpu), model(self.model)
        gen, train = self.split()
        server = override(
            server_costs(g, m, self.tp, self.efficiency, weight_sync=self.weight_sync), self.server_overrides
        )
        trainer = override(
            trainer_costs(g, m, train, self.efficiency, minibatches=self.minibatches, weight_sync=self.weight_sync),
            self.trainer_overrides,
        )
        return Setting(
            server=server,
            trainer=trainer,
            servers=gen // self.tp,
            lengths=self.lengths,
            batch_size=self.batch_size,
            group_size=self.group_size,
            steps=self.steps,
            max_concurrent_groups=self.max_concurrent_groups,
            interrupt_mode=self.interrupt_mode,
            seed=self.seed,
        )

    def describe(self) -> dict[str, Any]:
        """The inputs as plain data (for the JSON report)."""
        gen, train = self.split()
        d = {k: v for k, v in self.__dict__.items() if k not in ("lengths", "efficiency")}
        d["lengths"] = {k: v for k, v in self.lengths.__dict__.items() if k != "samples"}
        d["lengths"]["samples"] = len(self.lengths.samples)
        d["efficiency"] = dict(self.efficiency.__dict__)
        d["generation_gpus"], d["training_gpus"] = gen, train
        return d
