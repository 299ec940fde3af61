"""Digests of weights in the served dtype: the torch half of policy identity (protocol/weight_identity.py says why).

Shared by the trainer ranks (the identity of what they publish) and the embedded server (the identity of what it
serves), so both compute it the same way from the same bits. A digest is SHA-256 (hardware-accelerated where the CPU
has SHA extensions) of a parameter's bytes, contiguous, in row-major order. Torch is imported here: the controller
side never imports this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from areal_async.protocol.weight_identity import PROBE_ROWS, Identity, combine, probe_names

__all__ = ["tensor_digest", "probe_row", "identity_of", "IdentityBuilder", "as_bits", "dtype_name", "served_dtype"]

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # float element size -> the integer type of its bits


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16 (SGLang's spelling)."""
    return str(dtype).removeprefix("torch.")


def served_dtype(name: str) -> torch.dtype:
    """torch dtype for a served-dtype name; raises ValueError for one that is not a float type."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"not a float dtype: {name!r}")
    return dtype


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory seen as integers of the element's size (equal bits <=> equal integers; NaN payloads and
    -0.0 included, which a float comparison would not tell apart). Contiguous. [same shape]"""
    t = t.contiguous()
    return t.view(_BITS[t.element_size()])


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of the tensor's bytes (host copy when on a device), 32 hex digits."""
    data = t.detach().contiguous()
    if data.device.type != "cpu":
        data = data.cpu()
    return hashlib.sha256(data.view(torch.uint8).numpy().data).hexdigest()[:32]


def probe_row(t: torch.Tensor) -> list[float]:
    """What SGLang's /get_weights_by_name answers with truncate_size=PROBE_ROWS, flattened: `t[:PROBE_ROWS]` widened
    to fp32."""
    return t[:PROBE_ROWS].detach().to("cpu", torch.float32).flatten().tolist()


class IdentityBuilder:
    """Builds an `Identity` from tensors that arrive one at a time (the trainer gathers them one by one and holds
    none of them for long): a digest and a probe row per tensor, the probes kept chosen at the end."""

    def __init__(self, dtype: torch.dtype, version: int) -> None:
        self.dtype = dtype
        self.version = version
        self.digests: dict[str, str] = {}
        self.rows: dict[str, list[float]] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        """`t` in any float dtype: cast to the served one first, exactly as a server loading it does."""
        if t.dtype != self.dtype:
            t = t.to(self.dtype)
        self.digests[name] = tensor_digest(t)
        self.rows[name] = probe_row(t)

    def finish(self) -> Identity:
        probes = {n: self.rows[n] for n in probe_names(list(self.digests))}
        return Identity(
            version=self.version,
            dtype=dtype_name(self.dtype),
            digests=dict(self.digests),
            combined=combine(self.digests),
            probes=probes,
        )


def identity_of(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, version: int) -> Identity:
    """The identity of `named` as served in `dtype`."""
    builder = IdentityBuilder(dtype, version)
    for name, t in named:
        builder.add(name, t)
    return builder.finish()
