"""The embedded server's side of adapter sync (train.lora): loading a peft adapter directory by merging it.

A server serves one adapter version at a time, merged into its weights: `W = W0 + (alpha / r) * B @ A` for every
adapted linear layer (areal_async/lora_adapter.py's bit-reproducible `merge_weight`), computed from a copy of the
base weights W0 that the engine keeps from its first adapter load on (`base`). Every version merges from W0, never
from the previous merge, so a thousand versions do not drift; a layer the new adapter no longer adapts gets W0
back. A full (or delta) load replaces the base: the engine drops its copy, and the next adapter merges into
those weights.

Why merged rather than applied at run time (an extra x A^T B^T per adapted layer in every forward): merging costs
one pass over the adapted weights per version, off the decode path; the run-time product costs every decoded
token two thin matmuls per adapted layer and keeps the fused kernels from running as they are. The requests of an
update pause then see the new merge as a weight swap like any other, so per-token versions stay exact with no
extra bookkeeping (docs/weights.md, "LoRA").

The load is two-phase like every other: the merged tensors are computed first, and nothing changes until the
engine's swap; a bad adapter (unreadable, wrong shapes, a module the model lacks) is an `AdapterError` naming the
cause, and the old weights keep serving.
"""

from __future__ import annotations

import torch

from areal_async.lora_adapter import AdapterError, is_adapter_dir, merge_weight, read_adapter
from areal_async.server.delta_load import served_tensors
from areal_async.server.model import ModelSpec

__all__ = ["load_adapter", "drop_base", "AdapterError", "is_adapter_dir"]


def load_adapter(
    path: str, spec: ModelSpec, model, base: dict[str, torch.Tensor] | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], str]:
    """Merge the adapter directory `path` into the base the server keeps (`base`; None: its weights now are the
    base). Returns (name -> merged tensor to load, including W0 for layers no longer adapted; the base to keep
    from now on; a phrase saying what was loaded). Raises AdapterError (nothing changed)."""
    cfg, pairs = read_adapter(path)
    scale = float(cfg["lora_alpha"]) / int(cfg["r"])
    expected = spec.param_shapes()
    current = served_tensors(model)
    kept = dict(base or {})
    out: dict[str, torch.Tensor] = {}
    for module, (a, b) in sorted(pairs.items()):
        name = f"{module}.weight"
        shape = expected.get(name)
        if shape is None or name not in current:
            raise AdapterError(f"{path}: the adapter targets {module}, which {spec.architecture} does not have")
        if len(shape) != 2 or (b.shape[0], a.shape[1]) != tuple(shape):
            raise AdapterError(
                f"{path}: {module}: B @ A is [{b.shape[0]}, {a.shape[1]}], the layer's weight is {list(shape)}"
            )
        if name not in kept:  # never adapted before: its weights now are its base
            kept[name] = current[name].detach().clone()
        out[name] = merge_weight(kept[name], a.float(), b.float(), scale, model.dtype)
    for name, w0 in kept.items():  # adapted by an earlier version, not by this one: back to the base
        if name not in out:
            out[name] = w0
    how = f"adapter r={cfg['r']} alpha={cfg['lora_alpha']} merged into {len(pairs)} layers"
    return out, kept, how


def drop_base(engine) -> None:
    """A full or delta load replaces the base: forget the kept copy (the engine calls it inside its swap)."""
    engine._lora_base = None
