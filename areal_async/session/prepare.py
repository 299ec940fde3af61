"""Before launch: everything about a run that can be checked is checked, and built, here (`prepare`): the config,
the GPU layout, the model directory, the tokenizer and its chat template, the dataset, the reward, the workflow and
the extra metrics loggers (`metrics.loggers`, made here, opened once the run has its directory).
A problem is a ConfigError naming its key, so nothing is started for a run that cannot work. No torch here (the
model is built or converted in a subprocess, areal_async.model_store).
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from areal_async.config import RESERVED_REWARD_ARGS, ConfigError, RunConfig
from areal_async.host.cpu_features import describe, model_hidden_size, resolve_mixed_precision
from areal_async.inference.dialect import parse_release
from areal_async.launch.placement import plan_placement
from areal_async.launch.sglang_server import SGLANG_NEWEST, SGLANG_OLDEST, installed_release
from areal_async.launch.vllm_server import check_vllm_python
from areal_async.metrics_sinks import build_sinks
from areal_async.model_store import ModelPathError, resolve_model_path
from areal_async.rewards.registry import resolve as resolve_reward
from areal_async.rewards.runner import RewardRunner
from areal_async.rollout.chat import ChatTokens
from areal_async.rollout.controller import RunState, load_state
from areal_async.rollout.workflow_api import ScoreFn, Workflow
from areal_async.rollout.workflows import build_workflow
from areal_async.tasks.datasets import load_samples
from areal_async.tokenizer import Tokenizer, check_tokenizer
from areal_async.types import Sample

log = logging.getLogger("areal_async.run")

__all__ = [
    "RunPlan",
    "resolve_model",
    "prepare",
    "make_score",
    "check_devices",
    "check_backend_installed",
    "check_ports",
    "SGLANG_TESTED",
]

SGLANG_TESTED = f"{'.'.join(map(str, SGLANG_OLDEST))} to {'.'.join(map(str, SGLANG_NEWEST))}"


@dataclass
class RunPlan:
    """A checked run, ready to launch."""

    cfg: RunConfig
    model_path: str
    tokenizer: Tokenizer
    train_samples: list[Sample]
    eval_samples: list[Sample]
    rewards: Any  # the RewardRunner behind `score` (closed with the run)
    score: ScoreFn
    workflow: Workflow
    resumed: tuple[RunState, str] | None  # (state, checkpoint directory)
    sinks: list[tuple[str, Any]] = field(default_factory=list)  # metrics.loggers' sinks, made, not opened

    @property
    def trainer_resume(self) -> str | None:
        return os.path.join(self.resumed[1], "trainer") if self.resumed else None


def resolve_model(cfg: RunConfig) -> str:
    """`model.path` as an HF directory: built-in names and GGUF files are built or converted (in a subprocess, so
    this process never imports torch) and cached; see areal_async.model_store."""

    try:
        return resolve_model_path(cfg.model.path)
    except ModelPathError as e:
        raise ConfigError(f"model.path: {e}") from None


def prepare(cfg: RunConfig, workflow: Any = None) -> RunPlan:
    """Validate `cfg` and build what the run needs before launch; every problem is a ConfigError naming its key.

    `workflow` replaces the one `rollout.workflow` names: a Workflow, or a factory `f(cfg, tokenizer, score)`."""
    cfg = msgspec.structs.replace(cfg)  # re-derives the derived fields of a config built in Python
    cfg.validate()

    placement = plan_placement(cfg)  # the GPU layout and SGLang's arguments, checked here (launch/placement.py)
    # what this host offers, before the model is built or loaded and before anything starts
    check_devices(cfg, placement.gpus)
    check_backend_installed(cfg)
    check_ports(cfg)
    sinks = build_sinks(cfg.metrics.loggers, cfg.metrics.wandb)  # imports and makes them: a bad one fails here
    model_path = resolve_model(cfg)
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ConfigError(f"model.path: {model_path} is not an HF checkpoint directory (no config.json)")
    if cfg.train.lora.enabled:
        _check_lora_targets(model_path, cfg.train.lora.target_modules)
    try:  # the tokenizer files, an EOS token, ids within the model's vocabulary (the template: below)
        tokenizer = check_tokenizer(model_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: cannot use the tokenizer of {model_path}: {e}") from None

    try:
        train_samples, eval_samples = load_samples(cfg.data)
    except (OSError, ValueError) as e:  # a DatasetError may name the key to change (data.prompt_key)
        raise ConfigError(f"{getattr(e, 'key', None) or 'data.name'}: {e}") from None
    if not train_samples:
        raise ConfigError(f"data.name: {cfg.data.name} has no training samples")
    _check_chat_template(cfg, tokenizer, train_samples + eval_samples)
    _log_cpu_choices(cfg, model_path, bool(placement.gpus))
    _check_reward(cfg.data.reward)

    rewards = RewardRunner()
    score = make_score(rewards, cfg.data.reward, cfg.rollout.reward_timeout_s, cfg.data.reward_options)
    wf = _build_workflow(cfg, tokenizer, score, workflow)  # the runner starts its workers on first use only
    if cfg.schedule.interrupt_mode == "in_place" and _may_lack_version_spans(cfg):
        log.warning(
            "schedule.interrupt_mode=in_place: SGLang before 0.5.19 stamps a whole response with its last weight "
            "version, so tokens made before an update are labelled newer than they are (the staleness bound "
            "holds; the staleness statistics undercount)"
        )
    resumed = load_state(cfg.run_dir) if cfg.resume else None
    return RunPlan(
        cfg,
        model_path,
        tokenizer,
        train_samples,
        eval_samples[: cfg.eval.num_prompts],
        rewards,
        score,
        wf,
        resumed,
        sinks,
    )


def _no_gpu_reason() -> str:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return f"CUDA_VISIBLE_DEVICES={cvd!r} leaves no GPU visible"
    return "nvidia-smi lists no GPU and /proc/driver/nvidia has none"


def check_devices(cfg: RunConfig, gpus: tuple[str, ...]) -> None:
    """A server or trainer device that asks for CUDA on a host without a visible GPU fails here rather than in a
    child that has already loaded the model. `gpus`: the host's (launch/placement.visible_gpus, no torch). Slurm
    runs are not checked here: their GPUs are the job's nodes', not this host's."""
    if cfg.launcher != "local" or gpus:
        return
    srv, t = cfg.server, cfg.train
    if srv.backend == "embedded" and srv.device.startswith("cuda"):
        raise ConfigError(
            f"server.device: {srv.device} on a host without a visible GPU ({_no_gpu_reason()}); use "
            "server.device=auto (the CPU here) or cpu"
        )
    if t.device.startswith("cuda"):
        ranks = f" for train.nproc={t.nproc} ranks" if t.nproc > 1 else ""
        raise ConfigError(
            f"train.device: {t.device}{ranks} on a host without a visible GPU ({_no_gpu_reason()}); "
            "use train.device=auto (the CPU here) or cpu"
        )


def _may_lack_version_spans(cfg: RunConfig) -> bool:
    """The servers may answer without exact per-token versions: an SGLang before 0.5.19, or servers of unknown
    engine (external). The embedded server and vLLM always carry them."""
    if cfg.server.backend in ("embedded", "vllm"):
        return False
    if cfg.server.backend == "external":
        return True
    python = os.path.expanduser(cfg.server.python) if cfg.server.python else sys.executable
    version = parse_release(installed_release(python, "sglang"))
    return version is None or version < (0, 5, 19)


def check_backend_installed(cfg: RunConfig) -> None:
    """`server.backend=sglang` needs SGLang in the interpreter that runs it (`server.python`, else this one; in
    Slurm steps and Ray actors the same path). Its release is read from that interpreter's package metadata, without
    importing SGLang (which imports torch and CUDA), and must lie in the tested window."""
    if cfg.server.backend == "vllm":
        why = check_vllm_python(cfg.server.python)
        if why:
            raise ConfigError(f"server.python: {why}")
        return
    if cfg.server.backend != "sglang":
        return
    python = os.path.expanduser(cfg.server.python) if cfg.server.python else sys.executable
    key = "server.python" if cfg.server.python else "server.backend"
    release = installed_release(python, "sglang")
    if release is None:
        raise ConfigError(
            f"{key}: sglang is not installed in {python}; `make sglang` builds a venv of SGLang "
            f"{SGLANG_TESTED} and prints its server.python (docs/inference.md), or use server.backend=embedded"
        )
    version = parse_release(release)
    if version is None or version < SGLANG_OLDEST:
        raise ConfigError(
            f"{key}: SGLang {release} in {python} is older than the oldest release the client supports "
            f"({'.'.join(map(str, SGLANG_OLDEST))}); tested: {SGLANG_TESTED}"
        )
    if version > SGLANG_NEWEST:
        log.warning("SGLang %s is newer than the newest release tested (%s)", release, SGLANG_TESTED)


def _port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound now ("in use", or a reason the host is unusable), None when it can. With
    SO_REUSEADDR, as the servers bind: a port left in TIME_WAIT by an earlier run is free."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot resolve {host!r} ({e})"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "in use"
            if e.errno == errno.EADDRNOTAVAIL:
                return "not an address of this host"
            return f"{type(e).__name__}: {e.strerror or e}"
    return None


def check_ports(cfg: RunConfig) -> None:
    """Fixed ports this host will bind are tried now, so a port already in use is a config error before the model
    loads and before the trainers start: `server.port` onwards (one per launched server) and a rendezvous
    endpoint on this host (`train.rdzv.endpoint`, where the first torchrun agent serves the store). Port 0 and
    Slurm runs (their ports are on the job's nodes) are not checked."""
    if cfg.launcher != "local":
        return
    srv, t = cfg.server, cfg.train
    if srv.backend in ("embedded", "sglang", "vllm") and srv.port:
        last = srv.port + srv.num_servers - 1
        if last > 65535:
            raise ConfigError(f"server.port: {srv.num_servers} servers from port {srv.port} run past 65535")
        for port in range(srv.port, last + 1):
            why = _port_taken(srv.host, port)
            if why == "in use":
                which = f"server {port - srv.port} of server.num_servers={srv.num_servers}: " if last > srv.port else ""
                raise ConfigError(
                    f"server.port: {which}{srv.host}:{port} is already in use; pick free ports or "
                    "server.port=0 (each server picks a free one)"
                )
            if why is not None:
                raise ConfigError(f"server.host: cannot serve on {srv.host}:{port}: {why}")
    if t.nnodes > 1 and t.rdzv.endpoint:
        host, _, port_text = t.rdzv.endpoint.rpartition(":")
        if _port_taken(host.strip("[]"), int(port_text)) == "in use":  # elsewhere (not bindable here): not ours
            raise ConfigError(
                f"train.rdzv.endpoint: {t.rdzv.endpoint} is already in use on this host; pick another "
                "port or leave it null (the launcher picks one)"
            )


def _log_cpu_choices(cfg: RunConfig, model_path: str, has_gpus: bool) -> None:
    """Say what `auto` settings pick on this CPU and why; the trainer ranks decide the same on their own host."""
    if cfg.train.device == "cpu" or (cfg.train.device == "auto" and not has_gpus):
        mp, why = resolve_mixed_precision(cfg.train.mixed_precision, "cpu", model_hidden_size(model_path))
        log.info("CPU %s: train.mixed_precision=%s -> %s (%s)", describe(), cfg.train.mixed_precision, mp, why)


def _check_chat_template(cfg: RunConfig, tokenizer: Tokenizer, samples: list[Sample]) -> None:
    key = None
    if cfg.data.apply_chat_template:
        key = "data.apply_chat_template"
    elif any(s.messages is not None for s in samples):
        key = f"data.name ({cfg.data.name} has chat-message prompts)"
    elif cfg.rollout.workflow == "multi_turn" and cfg.rollout.multi_turn.chat:
        key = "rollout.multi_turn.chat"
    if key is None:
        return

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True)
        if cfg.rollout.workflow == "multi_turn":  # feedback turns are appended as rendered deltas
            ChatTokens(tokenizer).delta_ids([{"role": "user", "content": "again"}])
    except Exception as e:  # a missing template, or one that fails to render (raise_exception, syntax)
        raise ConfigError(
            f"{key}: the chat template of {tokenizer.path} does not render: {type(e).__name__}: {e}"
        ) from None


def _check_lora_targets(model_path: str, targets: list[str]) -> None:
    """Every train.lora target names a linear layer of the decoder layers (a 2-d
    `model.layers.<i>.<...>.<target>.weight`), read from the safetensors headers (no torch): a typo fails here, not
    in every trainer rank after launch."""
    import json
    import struct

    matrices: set[str] = set()  # names of 2-d weights (a linear layer's; norms are 1-d)
    for fname in sorted(os.listdir(model_path)):
        if not fname.endswith(".safetensors"):
            continue
        try:
            with open(os.path.join(model_path, fname), "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return  # unreadable here: the trainer's own check (train/lora.py) names the problem
        matrices.update(n for n, v in header.items() if isinstance(v, dict) and len(v.get("shape", ())) == 2)
    if not matrices:
        return
    layer_parts = {n.split(".")[-2] for n in matrices if ".layers." in n and n.endswith(".weight")}
    missing = [t for t in targets if t not in layer_parts]
    if missing:
        raise ConfigError(
            f"train.lora.target_modules: {missing} match no linear layer of the decoder layers of {model_path} "
            f"(they have {sorted(layer_parts)})"
        )


def _check_reward(spec: str) -> None:
    try:
        target = resolve_reward(spec).target
    except (KeyError, ValueError) as e:
        raise ConfigError(f"data.reward: {e.args[0] if e.args else e}") from None
    module = target.partition(":")[0]
    try:  # find, do not import: rewards run in worker processes and may pull heavy packages
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"data.reward: module {module!r} of {target!r} is not importable")
    for needs, dist, extra in _REWARD_EXTRAS.get(module, ()):
        if importlib.util.find_spec(needs) is None:  # the reward would score every answer 0.0, silently
            raise ConfigError(f"data.reward: {spec} needs the package {dist}; pip install 'areal_async[{extra}]'")


# rewards whose module imports an optional package only when scoring: (module, distribution, extra)
_REWARD_EXTRAS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "areal_async.rewards.math": (("math_verify", "math-verify", "math"),),
}


def make_score(rewards: Any, reward: str, timeout_s: float, options: Mapping[str, Any] | None = None) -> ScoreFn:
    """The configured reward as a ScoreFn, run off the loop by the reward runner. `options` (data.reward_options)
    and then the sample's meta are passed on as keywords, except keys that would collide with the runner's own
    arguments (such as a record's extra "prompt")."""
    base = dict(options or {})

    async def score(
        completion: str, answer: str, prompt: str = "", meta: Mapping[str, Any] | None = None
    ) -> tuple[float, str | None]:
        extra = {k: v for k, v in {**base, **(meta or {})}.items() if k not in RESERVED_REWARD_ARGS}
        return await rewards.score(reward, completion, answer, prompt=prompt, timeout_s=timeout_s, **extra)

    return score


def _build_workflow(cfg: RunConfig, tokenizer: Tokenizer, score: ScoreFn, given: Any) -> Workflow:
    if given is None:
        return build_workflow(cfg, tokenizer, score)
    wf = given if hasattr(given, "run") else given(cfg, tokenizer, score)
    if not hasattr(wf, "run"):
        raise ConfigError(f"workflow: the factory returned {type(wf).__name__}, not a workflow")
    return wf
