"""Policy identity: what a server and the trainer say about the weights, and how the two are compared.

A weight update that is accepted but leaves a server on other weights (a load that silently did nothing, a cache
that kept old state, a server restarted on its launch weights under a stale label) produces plausible metrics and
no error. So after every update each server proves which weights it serves, and the controller compares that with
what the trainer published. Both sides compute the proof from the same tensors, the parameters in the *served*
dtype (the bits the server multiplies with):

- **digests** (the embedded server, `GET /weights_fingerprint`): a SHA-256 of each parameter's bytes. Equal
  digests mean bit-identical weights; a mismatch names the parameters that differ.
- **probes** (SGLang, which has no digest endpoint): the first rows of a few parameters, read with SGLang's own
  `POST /get_weights_by_name {"name", "truncate_size"}` (its answer: the slice `param[:truncate_size]` as nested
  lists of floats, or a list of one such slice per data-parallel replica). The values are the served dtype's values
  widened to fp32, so they agree exactly; `PROBE_RTOL` only absorbs formatting. One bf16 ulp is a relative change
  of at least 2**-8, far above it, so any changed element in a probed row is caught.

Pure functions and one msgspec struct, shared by the embedded server, the trainer ranks, the SGLang fake and the
torch-free client.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgspec

__all__ = [
    "Identity",
    "PROBE_ROWS",
    "PROBE_RTOL",
    "PROBE_ATOL",
    "combine",
    "probe_names",
    "differing",
    "probe_mismatches",
    "weights_by_name_body",
    "read_weights_by_name",
]

PROBE_ROWS = 1  # rows of each probed parameter (SGLang's truncate_size): one row of a matrix, a whole vector
PROBE_COUNT = 6  # parameters probed on a server without digests
PROBE_RTOL = 1e-6  # formatting only: the values are the served dtype's, widened to fp32, on both sides
PROBE_ATOL = 1e-12


class Identity(msgspec.Struct, kw_only=True):
    """What one side holds: `version`, the served `dtype`, a digest per parameter, their combination, and the probe
    rows (`probes`: name -> the first PROBE_ROWS rows, flattened, as floats)."""

    version: int
    dtype: str
    digests: dict[str, str]
    combined: str
    probes: dict[str, list[float]] = {}


def combine(digests: dict[str, str]) -> str:
    """One digest for the whole model (names sorted, so the order tensors came in does not matter)."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(name.encode())
        h.update(b"\0")
        h.update(digests[name].encode())
        h.update(b"\n")
    return h.hexdigest()[:32]


def probe_names(names: list[str]) -> list[str]:
    """Which parameters are probed: PROBE_COUNT spread evenly over the sorted names, so every side picks the same
    ones and the layers probed span the model. The embedding is skipped (its first row is one token's, rarely
    trained)."""
    pool = sorted(n for n in names if "embed_tokens" not in n)
    if len(pool) <= PROBE_COUNT:
        return pool
    step = len(pool) / PROBE_COUNT
    return [pool[int(i * step)] for i in range(PROBE_COUNT)]


def differing(expected: dict[str, str], got: dict[str, str]) -> list[str]:
    """Parameter names whose digests differ, or that one side lacks, sorted."""
    return sorted(n for n in set(expected) | set(got) if expected.get(n) != got.get(n))


def probe_mismatches(expected: dict[str, list[float]], got: dict[str, list[float] | None]) -> list[str]:
    """Probed names whose rows differ beyond PROBE_RTOL (or have another length, or were not answered), sorted."""
    bad = []
    for name, want in expected.items():
        have = got.get(name)
        if have is None or len(have) != len(want):
            bad.append(name)
            continue
        for a, b in zip(have, want):
            if not math.isclose(a, b, rel_tol=PROBE_RTOL, abs_tol=PROBE_ATOL):
                bad.append(name)
                break
    return sorted(bad)


def weights_by_name_body(name: str, truncate_size: int = PROBE_ROWS) -> dict[str, Any]:
    """The body of SGLang's `POST /get_weights_by_name`."""
    return {"name": name, "truncate_size": truncate_size}


def _flatten(value: Any, out: list[float]) -> None:
    if isinstance(value, list):
        for v in value:
            _flatten(v, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out.append(float(value))
    else:
        raise ValueError(f"not a number: {value!r}")


def read_weights_by_name(answer: Any, expected_len: int | None = None) -> list[float]:
    """The probe row of a `/get_weights_by_name` answer, flattened. SGLang answers one nested list, or (data
    parallel) one per replica; replicas must agree, and the first is taken. `expected_len` tells the two apart
    when a one-row answer could read either way."""
    if not isinstance(answer, list):
        raise ValueError(f"expected a JSON list, got {type(answer).__name__}")
    flat: list[float] = []
    _flatten(answer, flat)
    if expected_len is not None and len(flat) != expected_len and len(answer) > 1 and len(flat) % len(answer) == 0:
        replicas = []
        for part in answer:
            one: list[float] = []
            _flatten(part, one)
            replicas.append(one)
        if all(r == replicas[0] for r in replicas) and len(replicas[0]) == expected_len:
            return replicas[0]
    return flat
