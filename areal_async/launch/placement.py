"""Which GPU each launched process gets on this host, decided and checked before anything starts.

GPU numbers here are indices into the GPUs this process sees (its CUDA_VISIBLE_DEVICES, or every GPU of the host),
the numbering `--base-gpu-id` and `cuda:<i>` use in children that inherit the environment:

- server i takes GPUs `server.base_gpu_id + i * server.gpus_per_server` onwards: an SGLang server its
  tensor-parallel size of them (times --dp-size without DP attention; `--base-gpu-id`, `--tp-size`), an embedded
  server one. An embedded server with `server.device` auto (or "cuda") sees only its GPU (CUDA_VISIBLE_DEVICES
  set to it, so "auto" there is that GPU, and still the CPU where torch has no CUDA); "cuda:<k>" is passed as it
  is, for one server only.
- the trainers take `train.cuda_visible_devices` when set (verbatim, as CUDA_VISIBLE_DEVICES entries), else the
  first `train.nproc` GPUs no server takes. With fewer GPUs than that, embedded servers and trainers share (one
  GPU with one server and one trainer is a normal laptop-sized run; the weight broadcast then goes over gloo,
  rollout/broadcast_group.py); SGLang servers never share with trainers when the broadcast is on, and only with
  `--mem-fraction-static` in `server.extra_args` otherwise (SGLang takes ~88% of a GPU's memory by default).
  Several torchrun agents on this host (train.nnodes > 1) get consecutive slices of those GPUs.

Refused before launch, naming the keys: servers whose GPU sets overlap, GPUs past the host's count, trainer ranks
that would share a GPU (NCCL's "Duplicate GPU"), SGLang arguments that break the layout (`--base-gpu-id` for more
than one server, `--tp-size` other than `server.gpus_per_server`, `--dp-size` or `--pp-size` with the broadcast).
On a host where no GPU is found (a CPU box, or no nvidia-smi), nothing is placed and only the argument checks run.
Controller side: no torch (GPUs are counted with nvidia-smi or /proc/driver/nvidia).
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal_async.config import ConfigError

if TYPE_CHECKING:
    from areal_async.config import RunConfig

log = logging.getLogger(__name__)

__all__ = ["Placement", "plan_placement", "visible_gpus", "sglang_flag"]


@dataclass(frozen=True)
class Placement:
    gpus: tuple[str, ...]  # the GPUs this host offers, as CUDA_VISIBLE_DEVICES entries (empty: none found)
    servers: tuple[tuple[int, ...], ...]  # per launched server: the GPU indices it takes
    server_devices: tuple[str, ...]  # embedded servers: the --device each gets
    server_visible: tuple[str | None, ...]  # embedded servers: their CUDA_VISIBLE_DEVICES (None: as is)
    trainer_visible: tuple[str | None, ...]  # per torchrun agent on this host: its CUDA_VISIBLE_DEVICES (None: as is)
    shared: tuple[str, ...] = ()  # GPUs (entries of `gpus`) that a server and a trainer rank both use


def visible_gpus(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The GPUs children of this process can use, as CUDA_VISIBLE_DEVICES entries: that variable when set (up to
    its first invalid entry, as CUDA reads it), else one per GPU nvidia-smi lists."""
    env = os.environ if environ is None else environ
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        out = []
        for entry in (e.strip() for e in cvd.split(",")):
            if not entry or entry.startswith("-"):
                break
            out.append(entry)
        return tuple(out)
    return tuple(str(i) for i in range(_count_gpus()))


@functools.lru_cache(maxsize=1)
def _count_gpus() -> int:
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        if p.returncode == 0:
            return sum(1 for line in p.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def sglang_flag(args: list[str], *names: str) -> str | None:
    """The value of an SGLang command-line option in `args` (`--tp-size 2` or `--tp-size=2`); "" for a flag
    without a value; None when absent."""
    for i, a in enumerate(args):
        for n in names:
            if a == n:
                nxt = args[i + 1] if i + 1 < len(args) else ""
                return "" if nxt.startswith("--") else nxt
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def _int_flag(args: list[str], key: str, *names: str) -> int | None:
    value = sglang_flag(args, *names)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}: {names[0]} needs a whole number, got {value!r}") from None


def _check_sglang_args(cfg: RunConfig) -> int:
    """The argument checks; returns how many GPUs one SGLang server takes."""
    srv = cfg.server
    args = list(srv.extra_args)
    if srv.num_servers > 1 and sglang_flag(args, "--base-gpu-id") is not None:
        raise ConfigError(
            "server.extra_args: --base-gpu-id would put all server.num_servers="
            f"{srv.num_servers} servers on the same GPUs; set server.base_gpu_id instead (server i "
            "starts at base_gpu_id + i * gpus_per_server)"
        )
    tp = _int_flag(args, "server.extra_args", "--tp-size", "--tp", "--tensor-parallel-size")
    if tp is not None and tp != srv.gpus_per_server:
        raise ConfigError(
            f"server.extra_args: --tp-size {tp} differs from server.gpus_per_server="
            f"{srv.gpus_per_server}; set server.gpus_per_server (the launcher passes --tp-size)"
        )
    dp = _int_flag(args, "server.extra_args", "--dp-size", "--dp", "--data-parallel-size") or 1
    pp = _int_flag(args, "server.extra_args", "--pp-size", "--pp", "--pipeline-parallel-size") or 1
    dp_attention = sglang_flag(args, "--enable-dp-attention") is not None
    if cfg.train.weight_sync == "broadcast":
        if dp > 1 and not dp_attention:
            raise ConfigError(
                f"server.extra_args: --dp-size {dp} with train.weight_sync=broadcast: SGLang refuses "
                "distributed weight updates with data parallelism unless --enable-dp-attention; "
                "use train.weight_sync=disk, or server.num_servers replicas of --dp-size 1"
            )
        if pp > 1:
            raise ConfigError(
                f"server.extra_args: --pp-size {pp} with train.weight_sync=broadcast: every pipeline "
                "stage would join the weight-update group as the same ranks; use "
                "train.weight_sync=disk"
            )
    return srv.gpus_per_server * (dp if dp > 1 and not dp_attention else 1) * pp


def plan_placement(cfg: RunConfig, gpus: tuple[str, ...] | None = None) -> Placement:
    """The GPUs of every server and trainer agent this host starts (`gpus`: the host's, default `visible_gpus()`).
    Raises ConfigError naming the keys when the layout cannot work."""
    srv, t = cfg.server, cfg.train
    per_server = _check_sglang_args(cfg) if srv.backend == "sglang" else 1
    here = (t.rdzv.local_agents or t.nnodes) if t.nnodes > 1 else 1
    if cfg.launcher != "local":  # Slurm gives each step its GPUs
        return Placement(gpus=(), servers=(), server_devices=(), server_visible=(), trainer_visible=(None,) * here)
    gpus = visible_gpus() if gpus is None else tuple(gpus)
    servers, devices, server_visible, seen = _place_servers(cfg, gpus, per_server)
    visible, trainer_gpus = _place_trainers(cfg, gpus, here, seen)
    shared = _check_shared(cfg, gpus, seen, trainer_gpus)
    return Placement(
        gpus=gpus,
        servers=tuple(servers),
        server_devices=tuple(devices),
        server_visible=tuple(server_visible),
        trainer_visible=tuple(visible),
        shared=shared,
    )


def _place_servers(
    cfg: RunConfig, gpus: tuple[str, ...], per_server: int
) -> tuple[list[tuple[int, ...]], list[str], list[str | None], dict[int, int]]:
    """Per launched server: its GPU indices, its --device and its CUDA_VISIBLE_DEVICES (embedded servers); and which
    server takes each GPU index. Refuses overlapping servers and GPUs past the host's count."""
    srv = cfg.server
    n = len(gpus)
    launched = srv.backend in ("embedded", "sglang", "vllm")
    servers: list[tuple[int, ...]] = []
    devices: list[str] = []
    server_visible: list[str | None] = []
    dev = srv.device
    if launched and srv.backend == "embedded" and dev.startswith("cuda:") and srv.num_servers > 1:
        raise ConfigError(
            f"server.device: {dev} would put all server.num_servers={srv.num_servers} servers on one "
            "GPU; use auto or cuda (server i on cuda:<base_gpu_id + i * gpus_per_server>)"
        )
    on_gpu = srv.backend in ("sglang", "vllm") or dev in ("auto", "cuda") or dev.startswith("cuda:")
    for i in range(srv.num_servers if launched else 0):
        first = srv.base_gpu_id + i * srv.gpus_per_server
        if srv.backend == "embedded" and dev.startswith("cuda:"):
            try:
                first = int(dev.split(":", 1)[1])
            except ValueError:
                raise ConfigError(f"server.device: {dev!r} is not a device (cuda:<index>)") from None
        take = tuple(range(first, first + per_server)) if on_gpu and n else ()
        servers.append(take)
        if srv.backend == "embedded":
            pinned = bool(take) and not dev.startswith("cuda:")
            devices.append(dev)
            server_visible.append(gpus[first] if pinned and first < n else None)
    used = [g for s in servers for g in s]
    if n and used and max(used) >= n:
        raise ConfigError(
            f"server.base_gpu_id: servers need GPUs {min(used)}..{max(used)} "
            f"(server.num_servers={srv.num_servers}, server.gpus_per_server={srv.gpus_per_server}"
            f"{', server.device=' + dev if dev.startswith('cuda:') else ''}), this host has {n} "
            f"visible ({', '.join(gpus)})"
        )
    seen: dict[int, int] = {}
    for i, s in enumerate(servers):
        for g in s:
            if g in seen:
                raise ConfigError(f"server.gpus_per_server: servers {seen[g]} and {i} would share GPU {g}")
            seen[g] = i
    return servers, devices, server_visible, seen


def _place_trainers(
    cfg: RunConfig, gpus: tuple[str, ...], here: int, seen: dict[int, int]
) -> tuple[list[str | None], list[str]]:
    """Per torchrun agent on this host: its CUDA_VISIBLE_DEVICES (None: as is); and the GPUs (entries of `gpus`)
    the trainer ranks take. `seen`: the GPU indices servers take. Refuses two ranks on one GPU."""
    srv, t = cfg.server, cfg.train
    n = len(gpus)
    need = t.nproc * here
    visible: list[str | None] = [t.cuda_visible_devices] * here
    trainer_gpus: list[str] = []
    if t.cuda_visible_devices is not None:
        entries = [e.strip() for e in t.cuda_visible_devices.split(",") if e.strip()]
        if len(set(entries)) != len(entries):
            raise ConfigError(f"train.cuda_visible_devices: {t.cuda_visible_devices!r} names a GPU twice")
        if t.device != "cpu" and len(entries) < t.nproc:
            raise ConfigError(
                f"train.cuda_visible_devices: {len(entries)} GPU(s) for train.nproc={t.nproc} ranks "
                "(two ranks on one GPU fail NCCL's setup)"
            )
        if here > 1 and n:  # several agents on this host: each takes its slice
            if len(entries) < need:
                raise ConfigError(
                    f"train.cuda_visible_devices: {here} torchrun agents of train.nproc={t.nproc} "
                    f"on this host need {need} GPUs, {len(entries)} given"
                )
            visible = [",".join(entries[k * t.nproc : (k + 1) * t.nproc]) for k in range(here)]
        trainer_gpus = entries
    elif t.device != "cpu" and n:
        if need > n:
            raise ConfigError(
                f"train.nproc: {need} trainer rank(s) on this host need {need} GPUs, it has {n} "
                f"visible ({', '.join(gpus)}); two ranks on one GPU fail NCCL's setup"
            )
        free = [i for i in range(n) if i not in seen]
        if len(free) >= need:
            pick = free[:need]
        elif srv.backend == "sglang" and seen:
            raise ConfigError(
                f"train.nproc: the SGLang servers take GPUs {sorted(seen)} of {n}; {need} trainer "
                f"rank(s) need {need} more (lower server.num_servers or server.gpus_per_server, or "
                "set train.cuda_visible_devices)"
            )
        else:
            pick = list(range(need))
        trainer_gpus = [gpus[i] for i in pick]
        visible = [",".join(trainer_gpus[k * t.nproc : (k + 1) * t.nproc]) for k in range(here)]
    return visible, trainer_gpus


def _check_shared(
    cfg: RunConfig, gpus: tuple[str, ...], seen: dict[int, int], trainer_gpus: list[str]
) -> tuple[str, ...]:
    """The GPUs a server and a trainer rank both use; refused for SGLang servers with the broadcast or without
    --mem-fraction-static, a warning otherwise."""
    srv = cfg.server
    server_entries = {gpus[g] for g in seen} if gpus else set()
    shared = tuple(sorted(server_entries & set(trainer_gpus)))
    if shared and srv.backend == "sglang":
        if cfg.train.weight_sync == "broadcast":
            raise ConfigError(
                f"train.cuda_visible_devices: the trainers would share GPU(s) {', '.join(shared)} "
                "with SGLang servers, and an nccl weight broadcast cannot join two processes on one "
                "GPU; give them other GPUs (server.base_gpu_id, train.cuda_visible_devices) or use "
                "train.weight_sync=disk"
            )
        if sglang_flag(list(srv.extra_args), "--mem-fraction-static") is None:
            raise ConfigError(
                f"server.extra_args: SGLang servers would share GPU(s) {', '.join(shared)} with the "
                "trainers while taking ~88% of their memory; pass --mem-fraction-static (e.g. 0.4) "
                "or give the trainers other GPUs (train.cuda_visible_devices)"
            )
    if shared:
        log.warning(
            "GPU(s) %s hold both a server and a trainer rank%s",
            ", ".join(shared),
            " (the weight broadcast goes over gloo)" if cfg.train.weight_sync == "broadcast" else "",
        )
    return shared
