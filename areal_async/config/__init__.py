"""Typed run configuration. `from areal_async.config import RunConfig, load_config, ConfigError` is the public
surface; the trainer's sections are in `trainer`, the sections of where processes live in `cluster`, the generic
pieces in `base`, `files`, `types`."""

from areal_async.config.base import ConfigError
from areal_async.config.cluster import RayConfig, RecoveryConfig, RendezvousConfig, SlurmConfig
from areal_async.config.run_config import (
    GREEDY_TEMPERATURE,
    RESERVED_REWARD_ARGS,
    DataConfig,
    EvalConfig,
    MetricsConfig,
    ModelConfig,
    MultiTurnConfig,
    RolloutConfig,
    RunConfig,
    ScheduleConfig,
    ServerConfig,
    WandbConfig,
    from_dict,
    load_config,
    logprob_temperature,
    to_dict,
)
from areal_async.config.trainer import AdvantageConfig, LoRAConfig, LossConfig, OptimConfig, TrainConfig

__all__ = [
    "GREEDY_TEMPERATURE",
    "RESERVED_REWARD_ARGS",
    "AdvantageConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LossConfig",
    "MetricsConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "LoRAConfig",
    "OptimConfig",
    "RayConfig",
    "RecoveryConfig",
    "RendezvousConfig",
    "RolloutConfig",
    "RunConfig",
    "ScheduleConfig",
    "ServerConfig",
    "SlurmConfig",
    "TrainConfig",
    "WandbConfig",
    "from_dict",
    "load_config",
    "logprob_temperature",
    "to_dict",
]
