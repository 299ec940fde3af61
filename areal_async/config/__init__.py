"""Typed run configuration. `from areal_async.config import RunConfig, load_config, ConfigError` is the public
surface; the sections of where processes live are in `cluster`, the generic pieces in `base`, `files`, `types`."""

from areal_async.config.base import ConfigError
from areal_async.config.cluster import RecoveryConfig, RendezvousConfig, SlurmConfig
from areal_async.config.run_config import (
    GREEDY_TEMPERATURE,
    RESERVED_REWARD_ARGS,
    AdvantageConfig,
    DataConfig,
    EvalConfig,
    LossConfig,
    ModelConfig,
    MultiTurnConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    ScheduleConfig,
    ServerConfig,
    TrainConfig,
    from_dict,
    load_config,
    logprob_temperature,
    to_dict,
)

__all__ = [
    "GREEDY_TEMPERATURE",
    "RESERVED_REWARD_ARGS",
    "AdvantageConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LossConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "RecoveryConfig",
    "RendezvousConfig",
    "RolloutConfig",
    "RunConfig",
    "ScheduleConfig",
    "ServerConfig",
    "SlurmConfig",
    "TrainConfig",
    "from_dict",
    "load_config",
    "logprob_temperature",
    "to_dict",
]
