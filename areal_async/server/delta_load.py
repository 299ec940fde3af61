"""The embedded server's side of delta sync and of policy identity: what it serves, and loading a delta directory.

Identity (protocol/weight_identity.py): the digests of the parameters as the model holds them, in its own dtype
(the served bits). Computed on demand and cached until the next weight change.

A delta directory (areal_async/weights/delta.py) is loaded in one of two ways, both producing new tensors first and
changing nothing until the engine's swap, so a refused delta leaves the previous weights serving:

- **on top of what the server holds**, when its identity is the delta's base (the usual case: it took the
  previous update);
- **from the chain's snapshot**, otherwise (a restarted server on its launch weights, one that missed updates, or
  one that holds a version of the same number from before a trainer rollback): the full snapshot the manifest
  names, then every delta of the chain in order, each checked against the identity its manifest expects.

Either way the result's identity must be the manifest's, or the load is refused: bit-exactness is checked, not
assumed. Every refusal is a `DeltaError` whose message names the cause.
"""

from __future__ import annotations

import os

import torch

from areal_async.protocol.weight_identity import Identity, combine, probe_names
from areal_async.server.model import ModelSpec
from areal_async.server.weights import load_checkpoint
from areal_async.weights.delta import DeltaError, apply_delta, is_delta_dir, read_delta, read_manifest
from areal_async.weights.digest import dtype_name, identity_of, probe_row, tensor_digest

__all__ = ["served_tensors", "served_identity", "load_delta", "apply_broadcast_delta", "DeltaError", "is_delta_dir"]


def served_tensors(model) -> dict[str, torch.Tensor]:
    """name -> the tensor the model serves (HF names; a tied head is the embedding and not listed)."""
    return dict(model.params)


def served_identity(model, version: int) -> Identity:
    """The identity of the weights `model` serves now (read-only; run it where no swap can interleave)."""
    return identity_of(served_tensors(model).items(), model.dtype, version)


def load_delta(path: str, spec: ModelSpec, model, held: Identity) -> tuple[dict[str, torch.Tensor], Identity, str]:
    """Resolve the delta directory `path` against what `model` serves (`held`: its identity now). Returns the
    tensors to load (name -> tensor, only those that change), the identity the model will then have, and a phrase
    saying how it was loaded. Raises `DeltaError` (nothing changed) when it cannot be."""
    m = read_manifest(path)
    served = dtype_name(model.dtype)
    if m.dtype != served:
        raise DeltaError(f"delta v{m.version} holds {m.dtype} bits; this server serves {served}: a full load is needed")
    current = served_tensors(model)
    if held.combined == m.base_combined:
        _, parts = read_delta(path)
        changed = apply_delta(current, parts, model.dtype)
        digests = {**held.digests, **{n: tensor_digest(t) for n, t in changed.items()}}
        how = f"delta v{m.base_version}->v{m.version} ({m.changed} of {m.total} elements)"
    else:
        root = os.path.dirname(os.path.abspath(path))
        snap = os.path.join(root, f"v{m.snapshot}")
        if not os.path.isdir(snap) or is_delta_dir(snap):
            raise DeltaError(
                f"delta v{m.version} applies to v{m.base_version} (fingerprint {m.base_combined[:12]}), this server "
                f"holds other weights (fingerprint {held.combined[:12]}), and the chain's snapshot {snap} is gone: "
                "a full load is needed"
            )
        try:
            _, loaded = load_checkpoint(snap, spec)
        except Exception as e:
            raise DeltaError(f"the chain's snapshot {snap} cannot be loaded: {e}") from None
        changed = {n: t.to(model.dtype) for n, t in loaded.items() if n in current}
        digests = {n: tensor_digest(changed.get(n, current[n])) for n in current}
        for v in m.chain:
            step = os.path.join(root, f"v{v}")
            sm, parts = read_delta(step) if v != m.version else read_delta(path)
            if combine(digests) != sm.base_combined:
                raise DeltaError(
                    f"the chain to v{m.version} breaks at v{v}: its base is not the weights before it (snapshot "
                    f"v{m.snapshot} republished, or a delta of another lineage)"
                )
            view = {n: changed.get(n, current[n]) for n in current}
            step_out = apply_delta(view, parts, model.dtype)
            changed.update(step_out)
            digests.update({n: tensor_digest(t) for n, t in step_out.items()})
        how = f"snapshot v{m.snapshot} + {len(m.chain)} delta(s)"
    result = combine(digests)
    if result != m.combined:
        bad = ", ".join(sorted(n for n in changed)[:5])
        raise DeltaError(
            f"delta v{m.version}: the weights it gives have fingerprint {result[:12]}, the trainer's are "
            f"{m.combined[:12]} (changed parameters include {bad})"
        )
    final = {n: changed.get(n, current[n]) for n in current}
    probes = {n: probe_row(final[n]) for n in probe_names(list(final))}
    identity = Identity(version=m.version, dtype=served, digests=digests, combined=result, probes=probes)
    return changed, identity, how


def apply_broadcast_delta(
    model, held: Identity, payloads: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], Identity]:
    """A delta that came by broadcast (name -> deflated XOR) applied to what `model` serves, whose identity is
    `held`: the new tensors and the identity the model will have. Raises `DeltaError` (nothing changed)."""
    current = served_tensors(model)
    changed = apply_delta(current, payloads, model.dtype)
    digests = {**held.digests, **{n: tensor_digest(t) for n, t in changed.items()}}
    final = {n: changed.get(n, current[n]) for n in current}
    probes = {n: probe_row(final[n]) for n in probe_names(list(final))}
    identity = Identity(version=-1, dtype=held.dtype, digests=digests, combined=combine(digests), probes=probes)
    return changed, identity
