"""LoRA on the trainer: adapters on the decoder layers' linear layers, the frozen base sharded by FSDP2 as before.

`train.lora.rank > 0` turns each target `nn.Linear` (matched by the last part of its name, as peft matches
`target_modules`) into a `LoRALinear`: the same module, with its frozen `weight` and `bias` under the same names, and
two new children, `lora_A` [r, in] and `lora_B` [out, r], so that

    y = x W0^T + b + (alpha / r) * B (A dropout(x))          (shapes: x [..., in], y [..., out])

The class swap keeps every base name where transformers and the checkpoint put it, so rank 0's full state dict fills
the base as before (train/fsdp.py), and the adapters' names are peft's (`<module>.lora_A.weight`) once peft's
`base_model.model.` prefix is added (areal_async/weights/lora_adapter.py). Own wrapper, not peft's: peft wraps the base
layer in a child (`base_layer`), which renames every base parameter and would break rank 0's load into the
FSDP2 shards and every tensor name that leaves the trainer; the few lines here keep the names.

A starts as peft starts it (Kaiming-uniform, a = sqrt(5), as `nn.Linear`), B at zero, so the first version serves
the base model exactly. The draws come from a generator seeded by the run's seed on rank 0 only and reach the
other ranks with the base weights (broadcast_from_rank0), so every rank trains the same adapters.

Everything that reads the model's state dict sees the adapters too; `merged_tensors` is the view with them merged
into the base weights (a full HF checkpoint: the final model, pinned-eval snapshots, a full load after a refused
adapter), and `adapter_tensors` the adapters alone (what adapter sync publishes).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from areal_async.weights.lora_adapter import merge_weight, peft_key

__all__ = [
    "LoRALinear",
    "inject_lora",
    "lora_modules",
    "lora_param_names",
    "initial_adapters",
    "merged_tensors",
    "adapter_tensors",
]


class LoRALinear(nn.Linear):
    """An `nn.Linear` with a low-rank update (made by `inject_lora` swapping the class of an existing layer, never
    constructed directly). `lora_scale` = alpha / r."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    lora_scale: float

    def forward(self, x: Tensor) -> Tensor:  # x [..., in] -> [..., out]
        base = F.linear(x, self.weight, self.bias)
        update = self.lora_B(self.lora_A(self.lora_dropout(x)))  # [..., out]
        return base + update * self.lora_scale


def inject_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float, target_modules: list[str]) -> list[str]:
    """Give every target linear layer inside the decoder layers its adapters (in place, on whatever device the
    model is: the meta device in train/fsdp.py), freeze everything else, and return the adapted module names.
    ValueError names a target that matches no linear layer."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    inside = set()
    for name, m in model.named_modules():
        if type(m).__name__ in layer_classes:
            inside.update(f"{name}.{sub}" if sub else name for sub, _ in m.named_modules())
    targets = set(target_modules)
    found: dict[str, int] = dict.fromkeys(target_modules, 0)
    chosen = []
    for name, m in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short in targets and name in inside and type(m) is nn.Linear:
            chosen.append((name, m))
            found[short] += 1
    missing = [t for t, n in found.items() if n == 0]
    if missing:
        raise ValueError(
            f"train.lora.target_modules: {missing} match no linear layer of the decoder layers of "
            f"{type(model).__name__}"
        )
    model.requires_grad_(False)
    for _, m in chosen:
        device, dtype = m.weight.device, m.weight.dtype
        m.__class__ = LoRALinear
        m.lora_A = nn.Linear(m.in_features, rank, bias=False, device=device, dtype=dtype)
        m.lora_B = nn.Linear(rank, m.out_features, bias=False, device=device, dtype=dtype)
        m.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        m.lora_scale = alpha / rank
        m.lora_A.weight.requires_grad_(True)
        m.lora_B.weight.requires_grad_(True)
    return [name for name, _ in chosen]


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """name -> adapted layer (FSDP2 keeps the module tree, so this works before and after sharding)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_param_names(modules: list[str]) -> list[str]:
    """State-dict names of the adapters of `modules`, A before B."""
    return [f"{m}.lora_{w}.weight" for m in modules for w in ("A", "B")]


def initial_adapters(model: nn.Module, seed: int) -> dict[str, Tensor]:
    """Rank 0's initial adapters (state-dict name -> fp32 CPU tensor): A Kaiming-uniform as nn.Linear's default
    (bound 1 / sqrt(in)), B zero. Drawn in module order from one seeded generator (a rerun draws the same)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Tensor] = {}
    for name, m in lora_modules(model).items():
        bound = 1.0 / math.sqrt(m.in_features)  # kaiming_uniform_(a=sqrt(5)) on [r, in]
        a = torch.empty(m.lora_A.out_features, m.in_features).uniform_(-bound, bound, generator=gen)  # [r, in]
        out[f"{name}.lora_A.weight"] = a
        out[f"{name}.lora_B.weight"] = torch.zeros(m.out_features, m.lora_A.out_features)  # [out, r]
    return out


def merged_tensors(
    full: Iterator[tuple[str, Tensor | None]], modules: dict[str, float], dtype: torch.dtype
) -> Iterator[tuple[str, Tensor | None]]:
    """The state-dict stream `full` (train/publish.py's `iter_full_tensors` in fp32, base weights before their
    adapters, as a module's own parameters come before its children's) with each adapted weight replaced by its
    merge W0 + scale * B @ A under the base name, no adapter names, every float tensor in `dtype`. `modules`:
    adapted module -> scale. Ranks other than 0 get (name, None) for every base name, as from `full`. The merge is
    weights/lora_adapter.py's."""
    held: dict[str, dict[str, Tensor | None]] = {}
    for name, tensor in full:
        module, _, leaf = name.rpartition(".")
        owner, _, which = module.rpartition(".")
        if which in ("lora_A", "lora_B") and owner in modules and leaf == "weight":
            parts = held[owner]
            parts[which] = tensor
            if "lora_A" in parts and "lora_B" in parts:
                del held[owner]
                w0, a, b = parts["weight"], parts["lora_A"], parts["lora_B"]
                if w0 is None or a is None or b is None:
                    yield f"{owner}.weight", None
                else:
                    yield f"{owner}.weight", merge_weight(w0, a.float(), b.float(), modules[owner], dtype)
            continue
        if leaf == "weight" and module in modules:
            held[module] = {"weight": tensor}
            continue
        yield name, tensor.to(dtype) if tensor is not None and tensor.is_floating_point() else tensor
    if held:
        raise RuntimeError(f"adapted weights without their adapters in the state dict: {sorted(held)[:3]}")


def adapter_tensors(full: Iterator[tuple[str, Tensor | None]]) -> dict[str, Tensor]:
    """peft key -> fp32 tensor for every adapter in the stream `full` (rank 0; empty elsewhere)."""
    out: dict[str, Tensor] = {}
    for name, tensor in full:
        if tensor is None:
            continue
        module, _, which = name.removesuffix(".weight").rpartition(".")
        out[peft_key(module, which.removeprefix("lora_"))] = tensor.float()
    return out
