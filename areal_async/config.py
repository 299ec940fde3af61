"""Typed configuration: msgspec Structs, YAML files and dotted `key=value` overrides.

Each section is a small Struct owned by the concept it configures; `RunConfig` only composes them. Validation runs
in two layers: msgspec checks types on conversion (an unknown or ill-typed key is an error naming its dotted path),
and each section's `validate()` checks ranges and cross-field rules, again naming the key.
Leaf module: imports nothing of the package and never torch.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec
import yaml


class ConfigError(ValueError):
    """A config problem; the message names the offending key."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    def validate(self, prefix: str) -> None:  # overridden where there is something to check
        del prefix


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


class ModelConfig(_Section):
    """Which base model to start from."""

    path: str = "tiny"  # an HF checkpoint directory, or "tiny": the project's own tiny model, built and cached
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on CUDA


class DataConfig(_Section):
    """Prompt source: the synthetic task, or a JSONL/Parquet file of {prompt, answer} records."""

    name: str = "arith"  # "arith" (built in) or a path to .jsonl / .parquet
    eval_path: str | None = None  # held-out file for file datasets
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    num_train: int = 20000
    num_eval: int = 200
    seed: int = 0
    apply_chat_template: bool = False
    reward: str = "arith"  # reward registry name ("arith", "math", "code") or "module:function"


class ServerConfig(_Section):
    """Inference servers: embedded (our CPU/GPU server), sglang (launched), or external URLs."""

    backend: Literal["embedded", "sglang", "external"] = "embedded"
    num_servers: int = 1
    urls: list[str] = []  # for backend=external
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick free ports
    device: str = "auto"
    max_running_requests: int = 256
    max_total_tokens: int = 65536  # KV-cache token budget per server
    api_key: str | None = None
    extra_args: list[str] = []  # passed through to sglang.launch_server
    base_gpu_id: int = 0  # sglang: server i uses --base-gpu-id base_gpu_id + i * gpus_per_server
    gpus_per_server: int = 1
    startup_timeout_s: float = 300.0
    torch_threads: int = 1  # intra-op threads per embedded server process
    # embedded: requests share the KV of identical full prompt pages (SGLang's radix cache; sglang servers take
    # --disable-radix-cache in extra_args instead)
    prefix_cache: bool = True

    def validate(self, prefix: str) -> None:
        _check(self.num_servers >= 1, f"{prefix}.num_servers", "must be >= 1")
        _check(self.backend != "external" or bool(self.urls), f"{prefix}.urls", "required when backend=external")
        _check(self.max_total_tokens > 0, f"{prefix}.max_total_tokens", "must be > 0")


class RolloutConfig(_Section):
    """The asynchronous schedule and sampling."""

    mode: Literal["async", "sync"] = "async"
    eta: int | None = 4  # max staleness in versions; None = unbounded (async only); sync forces 0
    interruptible: bool = True  # pause/abort/resume on weight updates; False waits for in-flight requests
    batch_size: int = 16  # B: prompt groups per train step
    group_size: int = 8  # n: samples per prompt
    max_concurrent_groups: int = 64  # cap on groups in flight
    max_new_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    filter_uniform_reward: bool = False  # drop groups whose rewards are all equal (DAPO dynamic sampling)
    reward_timeout_s: float = 10.0
    workflow: str = "rlvr"  # "rlvr", "multi_turn", or "module:callable" returning a Workflow
    multi_turn: dict[str, Any] = {}  # options of the multi_turn workflow, checked by its MultiTurnConfig

    def validate(self, prefix: str) -> None:
        _check(self.batch_size >= 1, f"{prefix}.batch_size", "must be >= 1")
        _check(self.group_size >= 1, f"{prefix}.group_size", "must be >= 1")
        _check(self.eta is None or self.eta >= 0, f"{prefix}.eta", "must be >= 0 or null")
        _check(self.max_concurrent_groups >= 1, f"{prefix}.max_concurrent_groups", "must be >= 1")
        _check(self.max_new_tokens >= 1, f"{prefix}.max_new_tokens", "must be >= 1")
        _check(self.temperature >= 0, f"{prefix}.temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, f"{prefix}.top_p", "must be in (0, 1]")

    @property
    def effective_eta(self) -> int | None:
        return 0 if self.mode == "sync" else self.eta


class LossConfig(_Section):
    """Decoupled PPO and its variants (see train/losses.py)."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # DAPO clip-higher; None = eps_clip
    dual_clip: float | None = None  # c > 1 bounds the loss of negative-advantage tokens
    decoupled: bool = True  # False = naive PPO: trust region centred on the behaviour policy
    prox_logp: Literal["recompute", "behav"] = "recompute"
    behav_imp_weight_cap: float | None = 5.0
    behav_imp_weight_mode: Literal["mask", "clamp"] = "mask"
    ratio_level: Literal["token", "sequence"] = "token"  # sequence = GSPO
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0

    def validate(self, prefix: str) -> None:
        _check(self.eps_clip > 0, f"{prefix}.eps_clip", "must be > 0")
        _check(self.dual_clip is None or self.dual_clip > 1, f"{prefix}.dual_clip", "must be > 1")
        _check(self.behav_imp_weight_cap is None or self.behav_imp_weight_cap > 1,
               f"{prefix}.behav_imp_weight_cap", "must be > 1 or null")


class AdvantageConfig(_Section):
    """Reward shaping and group-relative advantages."""

    estimator: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    batch_norm: bool = False
    reward_bias: float = 0.0
    reward_scale: float = 1.0
    reward_clip: float = 20.0
    overlong_max_len: int | None = None  # DAPO overlong penalty: L_max
    overlong_cache_len: int = 0  # L_cache
    overlong_factor: float = 1.0


class OptimConfig(_Section):
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0

    def validate(self, prefix: str) -> None:
        _check(self.lr > 0, f"{prefix}.lr", "must be > 0")
        _check(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0")


class TrainConfig(_Section):
    """FSDP2 trainer processes launched by torchrun."""

    nproc: int = 1
    device: str = "auto"  # auto: cuda when available, else cpu
    ppo_minibatches: int = 1
    micro_batch_tokens: int = 8192  # token budget of one micro-batch (padded slots in the rows/prefix layouts)
    # auto: each prompt group's shared prompt runs once (prefix) where the model allows, else padded rows (sdpa,
    # eager) or packing (flash attention); see train/engine.py. The others force one (all exact).
    layout: Literal["auto", "packed", "rows", "prefix"] = "auto"
    activation_checkpointing: bool = False
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    weight_sync: Literal["disk", "broadcast"] = "disk"
    keep_versions: int = 2
    checkpoint_every: int = 0  # steps; 0 = only at the end
    torchrun_args: list[str] = []
    torch_threads: int = 1  # intra-op threads per trainer rank (CPU)
    cuda_visible_devices: str | None = None  # e.g. "6,7": keeps trainers off the servers' GPUs on a shared node
    # sampling temperature of the rollouts (filled from rollout.temperature): logprobs are computed at it; 0 (greedy
    # rollouts) is scored at 1.0
    temperature: float = 1.0
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    advantage: AdvantageConfig = msgspec.field(default_factory=AdvantageConfig)
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)

    def validate(self, prefix: str) -> None:
        _check(self.nproc >= 1, f"{prefix}.nproc", "must be >= 1")
        _check(self.ppo_minibatches >= 1, f"{prefix}.ppo_minibatches", "must be >= 1")
        _check(self.micro_batch_tokens >= 16, f"{prefix}.micro_batch_tokens", "must be >= 16")
        _check(self.temperature >= 0, f"{prefix}.temperature", "must be >= 0")
        self.loss.validate(f"{prefix}.loss")
        self.optim.validate(f"{prefix}.optim")


class EvalConfig(_Section):
    every_steps: int = 10  # 0 = only before and after
    num_prompts: int = 200
    max_new_tokens: int = 96
    # queue priority of eval requests (larger goes first). None: 1 on embedded servers, so an eval beside running
    # rollouts is not stuck behind them; unset for sglang/external (SGLang needs --enable-priority-scheduling)
    priority: int | None = None


class RunConfig(_Section):
    """Top level of `python -m areal_async.run`."""

    run_dir: str = "runs/default"
    seed: int = 1
    total_steps: int = 60  # train steps (policy versions) to run
    resume: bool = True  # continue from run_dir's last checkpoint when there is one
    max_wall_s: float | None = None  # stop after this many seconds of training (then evaluate and save)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)

    def validate(self, prefix: str = "") -> None:
        _check(self.total_steps >= 1, "total_steps", "must be >= 1")
        for name in ("server", "rollout", "train"):
            getattr(self, name).validate(name)


# ---- loading ----------------------------------------------------------------------------------------------------


def _parse_value(text: str) -> Any:
    """Parse the right side of `key=value` as YAML, so `eta=4`, `urls=[a,b]` and `eta=null` do the right thing."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys (`train.optim.lr=1e-5`) in a nested dict. A bare `eta=2` is `rollout.eta=2`-style sugar only
    for the keys in `ALIASES`."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item}: overrides are key=value")
        key, _, value = item.partition("=")
        key = ALIASES.get(key.strip(), key.strip())
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{key}: {part} is not a section")
            node = nxt
        node[parts[-1]] = _parse_value(value)
    return raw


ALIASES = {"mode": "rollout.mode", "eta": "rollout.eta", "steps": "total_steps"}


def from_dict(raw: dict[str, Any], cls: type[msgspec.Struct] = RunConfig) -> Any:
    """Convert and validate; every error names the dotted key."""
    try:
        cfg = msgspec.convert(raw, cls, strict=False)
    except msgspec.ValidationError as e:
        # msgspec says "... - at `$.train.optim.lr`" or "Object contains unknown field `x` - at `$.train`"
        msg = str(e)
        where = ""
        if " - at `$" in msg:
            msg, _, where = msg.partition(" - at `$")
            where = where.rstrip("`").lstrip(".")
        if msg.startswith("Object contains unknown field"):
            field = msg.split("`")[1]
            key = f"{where}.{field}" if where else field
            raise ConfigError(f"{key}: unknown key") from None
        raise ConfigError(f"{where or '<root>'}: {msg}") from None
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate("")
    return cfg


def load_config(path: str | None = None, overrides: list[str] | None = None,
                cls: type[msgspec.Struct] = RunConfig) -> Any:
    """Load a YAML file (or the defaults when path is None) and apply overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        if not os.path.exists(path):
            raise ConfigError(f"config file not found: {path}")
        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        raw = loaded
    raw = apply_overrides(raw, overrides or [])
    return from_dict(raw, cls)


def to_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)
