"""Loading a transformers causal LM into FSDP2 shards, and the pieces of a step that touch the sharded parameters.

Rank 0 alone reads the HF directory; every rank builds the model on the meta device, shards it (one FSDP unit per
decoder layer, plus the root), and receives its shards from rank 0 (`set_model_state_dict(broadcast_from_rank0)`),
so a node never holds one full copy per GPU; rank 0 reads it in the checkpoint's dtype. Master weights are fp32
whatever the checkpoint stores; the compute dtype is FSDP's `param_dtype`. Dropout is zeroed: RL's prox and theta
policies must agree at the same weights.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from areal_async.train.attention import trainer_attention
from areal_async.train.rms_norm import install as install_rms_norm

__all__ = ["LoadedModel", "load_sharded", "clip_grad_norm", "rng_state", "set_rng_state"]


@dataclass
class LoadedModel:
    model: nn.Module
    config: object  # transformers PretrainedConfig (dropout zeroed, use_cache off)
    checkpoint_dtype: torch.dtype  # the dtype the HF directory stores: what publish and broadcast send
    tied_names: set[str]  # state-dict names that alias another parameter (a tied lm_head): never written twice
    lora: dict[str, float] = field(default_factory=dict)  # train.lora: adapted module -> scale (train/lora.py)


def load_sharded(
    model_path: str,
    device: torch.device,
    compute_dtype: torch.dtype,
    activation_checkpointing: bool,
    *,
    trainable: bool,
    lora=None,
    seed: int = 1,
) -> LoadedModel:
    """Build the model on the meta device on every rank, shard it with FSDP2, then fill the shards from the full
    weights that only rank 0 reads from disk (fp32 master weights whatever the checkpoint's dtype).

    `lora` (a config's `LoRAConfig` with rank > 0): adapters go on the target layers before sharding, the base is
    frozen, and rank 0 draws the initial adapters (from `seed`) into the state dict it broadcasts (train/lora.py)."""
    import transformers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    transformers.utils.logging.disable_progress_bar()
    config = transformers.AutoConfig.from_pretrained(model_path)
    # transformers >= 4.56 names it `dtype`; config.json files written before say `torch_dtype`
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    checkpoint_dtype = stored if isinstance(stored, torch.dtype) and stored.is_floating_point else torch.float32
    for key, value in list(vars(config).items()):  # RL trains without dropout: prox and theta must agree at u = 1
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    config.use_cache = False
    rank = dist.get_rank()
    full_sd: dict[str, Tensor] = {}
    loaded = None
    if rank == 0:
        # in the checkpoint's dtype (bf16: 2 B/param of host memory, not 4): the shards are fp32 and
        # set_model_state_dict casts each tensor as it copies it in; on CUDA with every host core (the trainer
        # runs one torch thread per rank on the host, which leaves a 30B load single-threaded for minutes)
        with _load_threads(device):
            loaded = transformers.AutoModelForCausalLM.from_pretrained(
                model_path, config=config, dtype=checkpoint_dtype, attn_implementation="sdpa"
            )
        full_sd = loaded.state_dict()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=trainer_attention(device, compute_dtype)
        )
    install_rms_norm(model, device, compute_dtype)  # bf16 on CPU: one-pass RMSNorm (train/rms_norm.py)
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    tied = {n for names in aliases.values() for n in names[1:]}
    persistent = set(model.state_dict())
    transient = [n for n, _ in model.named_buffers() if n not in persistent]  # rotary inv_freq and the like
    adapted: dict[str, float] = {}
    if lora is not None and lora.rank > 0:
        from areal_async.train.lora import initial_adapters, inject_lora, lora_modules

        inject_lora(
            model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=list(lora.target_modules)
        )
        adapted = {n: m.lora_scale for n, m in lora_modules(model).items()}
        if rank == 0:
            full_sd.update(initial_adapters(model, seed))
    if activation_checkpointing and trainable:  # non-reentrant: the variant that composes with FSDP2
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"{model_path}: cannot find the decoder layers to shard ({type(model).__name__} lists no _no_split_modules)"
        )
    # A world of one has nothing to free by resharding: keep each layer's parameters gathered between its forward
    # and backward instead of copying them again for the backward.
    reshard = dist.get_world_size() > 1
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    # the root keeps its default (stay gathered after forward): train/lm_head.py reads the head's gathered weight
    # after the forward
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    with _load_threads(device):
        set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full_sd
    # Buffers outside the state dict were left uninitialised by to_empty: take rank 0's freshly computed ones.
    real = dict(loaded.named_buffers()) if loaded is not None else {}
    for name in transient:
        buf = model.get_buffer(name)
        value = real[name].to(device=device, dtype=buf.dtype) if rank == 0 else torch.empty_like(buf)
        if dist.get_world_size() > 1:
            dist.broadcast(value, src=0)
        buf.copy_(value)
    del loaded, real
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    return LoadedModel(model, config, checkpoint_dtype, tied, adapted)


@contextlib.contextmanager
def _load_threads(device: torch.device) -> Iterator[None]:
    """Every CPU this process may use, for the duration, when the model trains on CUDA (the host only loads
    then); unchanged on CPU, where the ranks share the cores and the count is set per compute thread."""
    if device.type != "cuda":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """Total L2 norm of the (sharded) gradients across all ranks, then clip to `max_norm` when it is finite and
    `max_norm` > 0. Returns the norm before clipping as a plain tensor."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0 and torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm.detach().float().cpu()


def rng_state(device: torch.device) -> dict[str, bytes]:
    state = {"cpu": torch.get_rng_state().numpy().tobytes()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes()
    return state


def set_rng_state(state: dict[str, bytes], device: torch.device) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["cpu"]), dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8), device)
