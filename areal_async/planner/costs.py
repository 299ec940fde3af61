"""Cost terms from specifications: a GPU preset and a model's shapes -> `ServerCosts` and `TrainerCosts`.

Why a separate step: the simulator takes seconds per token and per step, which is what a profile measures
(calibrate.py) and what a user overrides; turning data-sheet figures into those numbers needs efficiencies nobody
publishes for a given cluster. Those are the `Efficiency` fields below, each an assumption, stated as one and
listed in docs/planner.md ("Measured, specified, assumed"); they were set once, before any comparison with a
measured or published speedup, and are never fitted to one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from areal_async.planner.presets import GPUSpec, ModelSpec
from areal_async.planner.server_model import ServerCosts
from areal_async.planner.trainer_model import TrainerCosts


@dataclass(frozen=True)
class Efficiency:
    """Assumed fractions of peak and fixed overheads (none is a measurement; override any)."""

    decode_bw: float = 0.7  # share of HBM bandwidth a decode step's weight and KV reads reach
    decode_mfu: float = 0.5  # share of peak FLOP/s for decode GEMMs once compute-bound (large batches)
    prefill_mfu: float = 0.5  # share of peak FLOP/s in prefill
    train_mfu: float = 0.35  # share of peak FLOP/s in training (dense and attention FLOPs)
    step_overhead_s: float = 0.004  # per decode step: scheduler, sampling, launches (CUDA graphs assumed)
    tp_allreduce_s: float = 10e-6  # per all-reduce of a tensor-parallel decode step (2 per layer)
    kv_mem_frac: float = 0.85  # share of GPU memory given to weights + KV (SGLang's mem_fraction_static)
    max_running: int = 1024  # cap on running sequences per server (SGLang max_running_requests)
    train_forwards: int = 1  # extra forward passes per step (the proximal policy's logprobs)
    fsdp_overlap: float = 0.5  # share of FSDP communication hidden behind compute
    disk_write_bw: float = 2e9  # bytes/s the trainer writes a checkpoint at (shared file system)
    disk_read_bw: float = 2e9  # bytes/s each server reads a checkpoint at
    sync_latency_s: float = 1.0  # fixed cost of one weight update on a server (allocation, cache reset)
    broadcast_eff: float = 0.7  # share of the network bandwidth a weight broadcast reaches
    pause_s: float = 0.05  # one pause or continue round trip to every server
    train_step_overhead_s: float = 0.5  # per train step: optimizer update, batch transfer, launches


def server_costs(
    gpu: GPUSpec, model: ModelSpec, tp: int = 1, eff: Efficiency | None = None, *, weight_sync: str = "disk"
) -> ServerCosts:
    """One server of `tp` GPUs serving `model`."""
    e = eff or Efficiency()
    bw = gpu.memory_bw * tp * e.decode_bw
    flops_decode = gpu.peak_flops * tp * e.decode_mfu
    flops_prefill = gpu.peak_flops * tp * e.prefill_mfu
    attn_per_ctx = 4.0 * model.layers * model.heads * model.head_dim  # FLOPs per token per context token
    kv_room = gpu.memory_bytes * tp * e.kv_mem_frac - model.weight_bytes
    if kv_room <= 0:
        raise ValueError(f"{model.name} does not fit on {tp} x {gpu.name}: raise tp")
    overhead = e.step_overhead_s + (2 * model.layers * e.tp_allreduce_s if tp > 1 else 0.0)
    if weight_sync == "broadcast":
        load = model.weight_bytes / (gpu.network_bw * e.broadcast_eff) + e.sync_latency_s
    else:
        load = model.weight_bytes / e.disk_read_bw + e.sync_latency_s
    return ServerCosts(
        step_overhead_s=overhead,
        weights_s=model.weight_bytes / bw,
        kv_s=model.kv_bytes_per_token / bw,
        seq_s=2.0 * model.params / flops_decode,
        attn_s=attn_per_ctx / flops_decode,
        additive=False,
        prefill_token_s=2.0 * model.params / flops_prefill,
        prefill_attn_s=attn_per_ctx / flops_prefill,
        kv_capacity_tokens=int(kv_room / model.kv_bytes_per_token),
        max_running=e.max_running,
        prefix_sharing=True,
        pause_s=e.pause_s,
        load_s=load,
    )


def trainer_costs(
    gpu: GPUSpec,
    model: ModelSpec,
    gpus: int,
    eff: Efficiency | None = None,
    *,
    minibatches: int = 4,
    weight_sync: str = "disk",
) -> TrainerCosts:
    """A trainer of `gpus` GPUs (FSDP over all of them) updating `model` in `minibatches` optimizer steps."""
    e = eff or Efficiency()
    flops = gpu.peak_flops * gpus * e.train_mfu
    dense = (6.0 + 2.0 * e.train_forwards) * model.params  # FLOPs per token
    # causal attention: forward 2 L H d s^2 per sequence (half of 4 L H d s^2), x3 for the update, x1 per extra forward
    attn = (3.0 + e.train_forwards) * 2.0 * model.layers * model.heads * model.head_dim
    # FSDP per optimizer step: all-gather for forward and backward, reduce-scatter of gradients (bf16, 2 bytes);
    # one more all-gather per extra forward; over NVLink inside a node, over the network across nodes
    link = gpu.nvlink_bw if gpus <= gpu.gpus_per_node else gpu.network_bw
    frac = (gpus - 1) / gpus if gpus > 1 else 0.0
    comm_bytes = (3 * minibatches + e.train_forwards) * model.weight_bytes * frac
    comm = comm_bytes / link * (1.0 - e.fsdp_overlap)
    publish = model.weight_bytes / e.disk_write_bw if weight_sync == "disk" else 0.0
    return TrainerCosts(
        token_s=dense / flops, attn_s=attn / flops, overhead_s=e.train_step_overhead_s, comm_s=comm, publish_s=publish
    )


def override(obj: Any, values: dict[str, Any]) -> Any:
    """A copy of a cost dataclass with `values` (name -> number) replaced; unknown names raise."""
    names = {f.name: f.type for f in fields(obj)}
    bad = sorted(set(values) - set(names))
    if bad:
        raise KeyError(f"unknown {type(obj).__name__} field(s) {bad}; known: {sorted(names)}")
    cast = {
        k: (type(getattr(obj, k))(v) if not isinstance(getattr(obj, k), bool) else _bool(v)) for k, v in values.items()
    }
    return replace(obj, **cast)


def _bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.lower() in ("1", "true", "yes", "on")
    return bool(v)
