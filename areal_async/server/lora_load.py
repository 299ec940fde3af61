"""The embedded server's side of adapter sync (train.lora): loading a peft adapter directory by merging it.

A server serves one adapter version at a time, merged into its weights: `W = W0 + (alpha / r) * B @ A` for every
adapted linear layer (weights/lora_adapter.py's bit-reproducible `merge_weight`), computed from a copy of the
base weights W0 that the engine keeps from its first adapter load on (`base`). Every version merges from W0, never
from the previous merge, so a thousand versions do not drift; a layer the new adapter no longer adapts gets W0
back. A full (or delta) load replaces the base: the engine drops its copy, and the next adapter merges into
those weights.

Why merged rather than applied at run time (an extra (alpha / r) x A^T B^T per adapted layer in every forward):
measured, and merging costs 3.6-4.3x less per version in the LoRA run at 32-256 decode rows (`python
benchmarks/lora_apply.py --clock cpu`, AMD EPYC Zen 5 with 2 cores, load average 3-8 from other jobs, process CPU
time, medians of 5 interleaved repeats; docs/weights.md, "LoRA", has the figures). On SmolLM2-135M in fp32 with one
engine thread, as configs/smollm2-lora.yaml serves it, a version's merge and swap cost 0.44 s of CPU (off the decode
path), while the adapters at run time, in the fastest layout tried (A's concatenated where projections share their
input), add 3-4% to every decode step: 0.15-0.26 ms per token at 8-256 rows, so they cost more than the merge past
about 1,700-2,900 tokens per version. A version of that run serves about 11k (its 64 trained samples, the groups
generated and dropped as uniform, its share of the evals, the prompts). The requests of an update pause then see the
new merge as a weight swap like any other, so per-token versions stay exact with no extra bookkeeping
(docs/weights.md, "LoRA").

The load is two-phase like every other: the merged tensors are computed first, and nothing changes until the
engine's swap; a bad adapter (unreadable, wrong shapes, a module the model lacks) is an `AdapterError` naming the
cause, and the old weights keep serving.
"""

from __future__ import annotations

import torch

from areal_async.server.delta_load import served_tensors
from areal_async.server.model import ModelSpec
from areal_async.weights.lora_adapter import AdapterError, is_adapter_dir, merge_weight, module_of_key, read_adapter

__all__ = ["load_adapter", "adapter_pairs", "merge_adapter", "AdapterError", "is_adapter_dir"]


def load_adapter(
    path: str, spec: ModelSpec, model, base: dict[str, torch.Tensor] | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], str]:
    """Merge the adapter directory `path` into the base the server keeps (`base`; None: its weights now are the
    base). Returns (name -> merged tensor to load, including W0 for layers no longer adapted; the base to keep
    from now on; a phrase saying what was loaded). Raises AdapterError (nothing changed)."""
    cfg, pairs = read_adapter(path)
    return merge_adapter(pairs, int(cfg["r"]), float(cfg["lora_alpha"]), spec, model, base, where=path)


def adapter_pairs(tensors: dict[str, torch.Tensor], r: int, where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A, B) of adapters received by name (peft keys, as a broadcast sends them), checked as
    `read_adapter` checks a directory's. Raises AdapterError."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, which = module_of_key(key)
        if t.dim() != 2 or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{where}: {key} must be a finite 2-d float tensor")
        halves.setdefault(module, {})[which] = t.cpu()
    pairs = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != r or ab["B"].shape[1] != r:
            raise AdapterError(f"{where}: {module} needs lora_A [r={r}, in] and lora_B [out, r={r}]")
        pairs[module] = (ab["A"], ab["B"])
    if not pairs:
        raise AdapterError(f"{where}: no adapter tensors")
    return pairs


def merge_adapter(
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    r: int,
    alpha: float,
    spec: ModelSpec,
    model,
    base: dict[str, torch.Tensor] | None,
    *,
    where: str,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], str]:
    """`load_adapter`'s merge, for adapters from a directory or a broadcast."""
    scale = alpha / r
    expected = spec.param_shapes()
    current = served_tensors(model)
    kept = dict(base or {})
    out: dict[str, torch.Tensor] = {}
    for module, (a, b) in sorted(pairs.items()):
        name = f"{module}.weight"
        shape = expected.get(name)
        if shape is None or name not in current:
            raise AdapterError(f"{where}: the adapter targets {module}, which {spec.architecture} does not have")
        if len(shape) != 2 or (b.shape[0], a.shape[1]) != tuple(shape):
            raise AdapterError(
                f"{where}: {module}: B @ A is [{b.shape[0]}, {a.shape[1]}], the layer's weight is {list(shape)}"
            )
        if name not in kept:  # never adapted before: its weights now are its base
            kept[name] = current[name].detach().clone()
        out[name] = merge_weight(kept[name], a.float(), b.float(), scale, model.dtype)
    for name, w0 in kept.items():  # adapted by an earlier version, not by this one: back to the base
        if name not in out:
            out[name] = w0
    how = f"adapter r={r} alpha={alpha:g} merged into {len(pairs)} layers"
    return out, kept, how
