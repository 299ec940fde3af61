"""The trainer's sections: `TrainConfig` and what it is made of (the policy loss, advantages, the optimizer).

They are apart from config/run_config.py because they are one unit of their own: a trainer rank reads exactly
`TrainConfig` (train/worker.py gets it as JSON and converts it with `from_dict(d, TrainConfig)`), with nothing of the
controller's sections. `RunConfig` composes it as `train` and derives two of its fields (`optim.total_steps`,
`temperature`; see config/run_config.py). Every field is documented by the string literal under it (config/help.py
reads those for `--help`). Never torch.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from areal_async.config.base import Section, check, key_of
from areal_async.config.cluster import RendezvousConfig

__all__ = ["AdvantageConfig", "LoRAConfig", "LossConfig", "OptimConfig", "TrainConfig"]


class LossConfig(Section):
    """Decoupled PPO and its variants (train/losses.py)."""

    eps_clip: float = 0.2
    """PPO clip range: ratios outside [1 - eps_clip, 1 + eps_clip_high] get no gradient."""
    eps_clip_high: float | None = None
    """Upper clip range (DAPO's clip-higher); null: eps_clip."""
    dual_clip: float | None = None
    """c > 1 bounds the loss of negative-advantage tokens at c * |A| (dual-clip PPO); null: off."""
    decoupled: bool = True
    """Decoupled PPO: the trust region is centred on the proximal policy (the trainer's weights before the step),
    with an importance weight from behaviour to proximal; false: naive PPO centred on the behaviour policy."""
    prox_logp: Literal["recompute", "behav"] = "recompute"
    """Proximal logprobs: recompute them with the trainer's current weights (one extra forward), or use the
    behaviour logprobs (exact only when every token was made by the current version, as in sync mode)."""
    behav_imp_weight_cap: float | None = 5.0
    """Tokens whose behaviour-to-proximal importance weight exceeds this are handled by behav_imp_weight_mode;
    null: no cap."""
    behav_imp_weight_mode: Literal["mask", "clamp"] = "mask"
    """mask: such tokens get no gradient; clamp: their weight is clamped to the cap."""
    ratio_level: Literal["token", "sequence"] = "token"
    """token: per-token ratios (PPO); sequence: one length-normalised ratio per sequence (GSPO)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty towards the proximal policy, added to the loss; 0: off."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Which of Schulman's KL estimators the penalty uses (k3: unbiased and always >= 0)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (subtracted from the loss); 0: off."""

    def validate(self, prefix: str = "") -> None:
        check(self.eps_clip > 0, key_of(prefix, "eps_clip"), "must be > 0")
        check(
            self.eps_clip_high is None or self.eps_clip_high > 0, key_of(prefix, "eps_clip_high"), "must be > 0 or null"
        )
        check(self.dual_clip is None or self.dual_clip > 1, key_of(prefix, "dual_clip"), "must be > 1")
        check(
            self.behav_imp_weight_cap is None or self.behav_imp_weight_cap > 1,
            key_of(prefix, "behav_imp_weight_cap"),
            "must be > 1 or null",
        )
        check(self.kl_coef >= 0, key_of(prefix, "kl_coef"), "must be >= 0")


class AdvantageConfig(Section):
    """Reward shaping and group-relative advantages (train/advantages.py)."""

    estimator: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """grpo: (r - group mean) / group std; drgrpo: r - group mean (Dr. GRPO, no std); rloo: r - mean of the others."""
    batch_norm: bool = False
    """Also normalise advantages to zero mean and unit std over the whole batch."""
    reward_bias: float = 0.0
    """Added to every reward before scaling."""
    reward_scale: float = 1.0
    """Rewards are multiplied by this (after the bias)."""
    reward_clip: float = 20.0
    """Shaped rewards are clipped to [-reward_clip, reward_clip]."""
    overlong_max_len: int | None = None
    """DAPO's overlong penalty: L_max, the response length at which the full penalty applies; null: off."""
    overlong_cache_len: int = 0
    """L_cache: the penalty ramps up linearly over the last L_cache tokens before overlong_max_len."""
    overlong_factor: float = 1.0
    """The full overlong penalty (subtracted from the reward)."""

    def validate(self, prefix: str = "") -> None:
        check(self.reward_clip > 0, key_of(prefix, "reward_clip"), "must be > 0")
        check(
            self.overlong_max_len is None or self.overlong_max_len >= 1,
            key_of(prefix, "overlong_max_len"),
            "must be >= 1 or null",
        )
        check(self.overlong_cache_len >= 0, key_of(prefix, "overlong_cache_len"), "must be >= 0")
        check(
            self.overlong_max_len is None or self.overlong_cache_len <= self.overlong_max_len,
            key_of(prefix, "overlong_cache_len"),
            "must be <= overlong_max_len",
        )
        check(self.overlong_factor >= 0, key_of(prefix, "overlong_factor"), "must be >= 0")


class OptimConfig(Section):
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-4
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.999
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR after warm-up: constant, or decaying linearly / by a cosine to min_lr_ratio * lr at total_steps."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many steps."""
    total_steps: int = 60
    """Horizon of the LR schedule. In a run it is schedule.total_steps (derived; another value is an error)."""
    min_lr_ratio: float = 0.0
    """Final LR of the linear and cosine schedules, as a fraction of lr."""
    grad_clip: float = 1.0
    """Gradients are clipped to this global norm; 0: no clipping."""

    def validate(self, prefix: str = "") -> None:
        check(self.lr > 0, key_of(prefix, "lr"), "must be > 0")
        check(self.warmup_steps >= 0, key_of(prefix, "warmup_steps"), "must be >= 0")
        check(self.total_steps >= 1, key_of(prefix, "total_steps"), "must be >= 1")
        check(0 <= self.min_lr_ratio <= 1, key_of(prefix, "min_lr_ratio"), "must be in [0, 1]")
        check(self.grad_clip >= 0, key_of(prefix, "grad_clip"), "must be >= 0")


class LoRAConfig(Section):
    """Low-rank adapters (train/lora.py): the base weights stay frozen, only each target linear layer's A [r, in] and
    B [out, r] train (W = W0 + alpha / r * B @ A), and only they travel to the servers (docs/weights.md, "LoRA"):
    the embedded server merges each version; SGLang is started with --enable-lora and keeps eta + 1 versions
    loaded, each request running under the version it started with ("LoRA on SGLang")."""

    rank: int = 0
    """r, the adapters' rank; 0: off (full fine-tuning)."""
    alpha: float = 32.0
    """lora_alpha: the update is scaled by alpha / rank (peft's convention)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training. Keep 0 for RL: the proximal and current policies must agree
    at the same weights (a folded prox pass assumes it); > 0 makes the step's own logprobs noisy."""
    target_modules: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Linear layers of the decoder layers that get adapters, by the last part of their name (peft's matching);
    every name must match at least one layer."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self, prefix: str = "") -> None:
        check(self.rank >= 0, key_of(prefix, "rank"), "must be >= 0 (0: off)")
        check(self.alpha > 0, key_of(prefix, "alpha"), "must be > 0")
        check(0.0 <= self.dropout < 1.0, key_of(prefix, "dropout"), "must be in [0, 1)")
        check(bool(self.target_modules), key_of(prefix, "target_modules"), "must name at least one linear layer")
        for name in self.target_modules:
            check(
                bool(name) and name.replace("_", "").isalnum(),
                key_of(prefix, "target_modules"),
                f"{name!r} is not a module name (the last part of a linear layer's name, e.g. q_proj)",
            )
            check(
                name not in ("lm_head", "embed_tokens"),
                key_of(prefix, "target_modules"),
                f"{name!r}: adapters go on the decoder layers' linear layers only",
            )
        check(
            len(set(self.target_modules)) == len(self.target_modules),
            key_of(prefix, "target_modules"),
            "lists a name twice",
        )


class TrainConfig(Section):
    """FSDP2 trainer processes launched by torchrun (train/worker.py reads this section as JSON)."""

    nproc: int = 1
    """Trainer ranks on this node (torchrun --nproc_per_node)."""
    device: str = "auto"
    """auto: cuda when available, else cpu."""
    ppo_minibatches: int = 1
    """Optimizer steps per train step: the batch is split into this many minibatches."""
    micro_batch_tokens: int = 2048
    """Token budget of one micro-batch (padded slots in the rows/prefix layouts)."""
    layout: Literal["auto", "packed", "rows", "prefix"] = "auto"
    """auto: each prompt group's shared prompt runs once (prefix) where the model allows, else padded rows (sdpa,
    eager) or packing (flash attention); the others force one (all exact)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, more compute)."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """FSDP2 compute dtype (master weights stay fp32); auto: bf16 on CUDA, and on a CPU with a bf16 dot product
    (amx_bf16 or avx512_bf16, not capped by ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY) for models of hidden size
    512 and up; else fp32 (areal_async/host/cpu_features.py)."""
    weight_sync: Literal["disk", "broadcast"] = "disk"
    """disk: publish an HF checkpoint that the servers load; broadcast: torch.distributed from trainer rank 0."""
    keep_versions: int = 2
    """Published HF checkpoints kept on disk (older ones are removed)."""
    delta_sync: bool = False
    """Ship each version as a delta of the servers' served-dtype bits against the version before (only the
    changed elements, bit-exact): disk writes a delta directory, with a full snapshot every delta_full_every
    versions; broadcast sends the delta's payloads. Embedded servers only (real SGLang always gets full weights).
    docs/weights.md, "Delta sync"."""
    delta_full_every: int = 8
    """With delta_sync: a full snapshot at least every this many versions (the longest chain a server replays)."""
    nnodes: int = 1
    """Nodes the trainer job spans: one torchrun agent per node with nproc ranks each, joined by c10d rendezvous
    (launcher=local runs every agent on this host; launcher=slurm one per node of the trainer step)."""
    rdzv: RendezvousConfig = msgspec.field(default_factory=RendezvousConfig)
    """How the ranks of a multi-node job meet, and how the controller finds them."""
    torchrun_args: list[str] = []
    """torchrun's own arguments (a rendezvous set by hand); empty: --standalone, or the one train.nnodes makes."""
    torch_threads: int = 1
    """Intra-op threads per trainer rank (CPU)."""
    cuda_visible_devices: str | None = None
    """e.g. "6,7": keeps trainers off the servers' GPUs on a shared node."""
    temperature: float = 1.0
    """Logprobs are computed at the rollouts' sampling temperature, so behaviour and trainer logprobs agree; greedy
    rollouts (temperature 0) are scored at 1.0. In a run it is rollout.temperature (derived)."""
    connect_timeout_s: float = 300.0
    """How long the controller waits for every trainer rank to load the model and answer."""
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    """The policy loss."""
    advantage: AdvantageConfig = msgspec.field(default_factory=AdvantageConfig)
    """Rewards to advantages."""
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    """The optimizer."""
    lora: LoRAConfig = msgspec.field(default_factory=LoRAConfig)
    """LoRA adapters instead of full fine-tuning (off unless lora.rank > 0)."""

    def validate(self, prefix: str = "") -> None:
        check(self.nproc >= 1, key_of(prefix, "nproc"), "must be >= 1")
        check(self.nnodes >= 1, key_of(prefix, "nnodes"), "must be >= 1")
        check(
            self.nnodes == 1 or not self.torchrun_args,
            key_of(prefix, "torchrun_args"),
            "give the rendezvous either by hand here or through train.nnodes and train.rdzv, not both",
        )
        self.rdzv.validate(key_of(prefix, "rdzv"))
        check(
            self.rdzv.local_agents is None or self.rdzv.local_agents <= self.nnodes,
            key_of(prefix, "rdzv.local_agents"),
            f"must be <= train.nnodes ({self.nnodes})",
        )
        check(self.ppo_minibatches >= 1, key_of(prefix, "ppo_minibatches"), "must be >= 1")
        check(self.micro_batch_tokens >= 16, key_of(prefix, "micro_batch_tokens"), "must be >= 16")
        check(self.keep_versions >= 1, key_of(prefix, "keep_versions"), "must be >= 1")
        check(self.delta_full_every >= 1, key_of(prefix, "delta_full_every"), "must be >= 1")
        check(self.torch_threads >= 1, key_of(prefix, "torch_threads"), "must be >= 1")
        check(self.temperature > 0, key_of(prefix, "temperature"), "must be > 0")
        check(self.connect_timeout_s > 0, key_of(prefix, "connect_timeout_s"), "must be > 0")
        self.loss.validate(key_of(prefix, "loss"))
        self.advantage.validate(key_of(prefix, "advantage"))
        self.optim.validate(key_of(prefix, "optim"))
        self.lora.validate(key_of(prefix, "lora"))
        check(
            not (self.lora.enabled and self.delta_sync),
            key_of(prefix, "delta_sync"),
            "with train.lora only the adapters travel already; turn delta_sync off",
        )
