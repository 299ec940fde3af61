"""Delta weight files: only the elements whose served-dtype bits changed since a base version, bit-exact.

After one small optimizer step most bf16 values do not change (an Adam step of ~lr is far below one bf16 ulp of
most weights), so the bits that did change are sparse. A delta holds, per parameter that changed, the XOR of its
old and new bits, compressed (mostly zeros, so it packs tight); applied to the exact base it was computed against,
it gives the new version bit for bit. "Exact base" is checked, not assumed: the manifest carries the base's
identity and the result's (the combined digests of protocol/weight_identity.py), and a receiver applies a delta
only to weights whose identity is the base's, then checks the result's. A label ("version 4") is not enough:
after a trainer rollback version 4 is trained again and has other bits.

On disk a delta is a directory `v<k>` with two files:

    delta.json          the manifest: format, version, base_version, dtype, base / result identity, the
                        snapshot and chain it extends (see `Manifest`), and the SHA-256 of delta.safetensors
    delta.safetensors   per parameter with any change, `<name>:xor`: the XOR of the old and new bits (integers
                        of the element's size, row-major), zlib-compressed, as a uint8 tensor

Why XOR and compression rather than a list of indices: a changed bf16 value usually moves by one or two ulps, so
its XOR has only low mantissa bits set, and the unchanged ones are zero; deflate (level 1, fast) packs that far
tighter than 4 bytes of index per change. On SmolLM2-135M under Adam at lr 2e-5 (3-9% of the bf16 values changing
per step), XOR + deflate is 10-19x smaller than the bf16 model, int32 indices + values 4-7x (benchmarks/README.md,
"Delta sync and policy identity").

Everything a reader can get wrong is a `DeltaError` naming the cause: a missing or truncated file, a checksum that
does not match, a manifest of another format, indices out of range, a delta in another dtype than the weights it
would change, or a base that is not what the receiver holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib

import msgspec
import torch

from areal_async.weights.digest import as_bits, dtype_name

__all__ = [
    "DeltaError",
    "Manifest",
    "MANIFEST",
    "DATA",
    "FORMAT",
    "is_delta_dir",
    "diff_tensor",
    "write_delta",
    "read_manifest",
    "read_delta",
    "apply_delta",
]

MANIFEST = "delta.json"
DATA = "delta.safetensors"
FORMAT = "areal-delta/1"
_LEVEL = 1  # deflate's fastest level: on XORs of one-ulp changes it is within a few percent of the best


class DeltaError(ValueError):
    """A delta that cannot be applied; the message names the cause (and the receiver keeps its weights)."""


class Manifest(msgspec.Struct, kw_only=True):
    """delta.json. `snapshot` is the version of the full checkpoint the chain starts from and `chain` the delta
    versions after it up to this one (ascending, this one last): a receiver that does not hold the base loads the
    snapshot and applies the chain."""

    format: str
    version: int
    base_version: int
    dtype: str  # the served dtype whose bits the delta holds
    base_combined: str  # identity of the base (protocol/weight_identity.combine)
    combined: str  # identity of the result
    snapshot: int
    chain: list[int]
    sha256: str  # of delta.safetensors
    num_bytes: int  # size of delta.safetensors
    changed: int  # elements changed
    total: int  # elements in the model


def is_delta_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def diff_tensor(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(the compressed XOR of the bits as uint8 [B], how many elements changed), or None when none did. Both tensors
    in the same dtype and shape, on the CPU."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise DeltaError(f"cannot diff {list(old.shape)} {old.dtype} against {list(new.shape)} {new.dtype}")
    x = torch.bitwise_xor(as_bits(old), as_bits(new)).view(-1)  # [N] integers, 0 where unchanged
    changed = int(torch.count_nonzero(x))
    if changed == 0:
        return None
    packed = zlib.compress(x.numpy().tobytes(), _LEVEL)
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8), changed


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_delta(directory: str, parts: dict[str, torch.Tensor], manifest: Manifest) -> int:
    """Write delta.safetensors (from `parts`: name -> compressed XOR, as `diff_tensor` makes it) and delta.json
    into `directory`; the manifest's checksum and size are filled in here. Returns the data file's size."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, packed in parts.items():
        tensors[f"{name}:xor"] = packed.contiguous()
    data = os.path.join(directory, DATA)
    if tensors:
        save_file(tensors, data, metadata={"format": FORMAT})
    else:  # nothing changed: an empty file still has a header (safetensors refuses to write none)
        save_file({"_empty": torch.zeros(0, dtype=torch.uint8)}, data, metadata={"format": FORMAT})
    manifest.sha256 = _sha256_file(data)
    manifest.num_bytes = os.path.getsize(data)
    with open(os.path.join(directory, MANIFEST), "wb") as f:
        f.write(msgspec.json.encode(manifest))
    return manifest.num_bytes


def read_manifest(directory: str) -> Manifest:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DeltaError(f"cannot read the delta manifest {path}: {e}") from None
    try:
        m = msgspec.json.decode(raw, type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DeltaError(f"corrupt delta manifest {path}: {e}") from None
    if m.format != FORMAT:
        raise DeltaError(f"{path}: delta format {m.format!r}, this reader knows {FORMAT!r}")
    if not m.chain or m.chain[-1] != m.version or m.base_version >= m.version:
        raise DeltaError(f"{path}: inconsistent manifest (version {m.version}, base {m.base_version}, chain {m.chain})")
    return m


def read_delta(directory: str) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """The manifest and name -> compressed XOR of a delta directory, after checking the data file's size and
    checksum against the manifest (a truncated or corrupt file is refused before any tensor is read)."""
    from safetensors import safe_open

    m = read_manifest(directory)
    data = os.path.join(directory, DATA)
    try:
        size = os.path.getsize(data)
    except OSError as e:
        raise DeltaError(f"delta {m.version}: cannot read {data}: {e}") from None
    if size != m.num_bytes:
        raise DeltaError(
            f"delta {m.version}: {data} is truncated or padded ({size} bytes, the manifest says {m.num_bytes})"
        )
    if _sha256_file(data) != m.sha256:
        raise DeltaError(f"delta {m.version}: checksum mismatch on {data} (corrupt file)")
    parts: dict[str, torch.Tensor] = {}
    try:
        with safe_open(data, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(":xor"):
                    parts[key[: -len(":xor")]] = f.get_tensor(key)
                elif key != "_empty":
                    raise DeltaError(f"delta {m.version}: unexpected entry {key!r} in {data}")
    except DeltaError:
        raise
    except Exception as e:  # safetensors' own error types for a malformed file
        raise DeltaError(f"delta {m.version}: cannot read {data}: {type(e).__name__}: {e}") from None
    return m, parts


def apply_delta(
    held: dict[str, torch.Tensor], parts: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """New tensors (copies: `held` is left as it is, so a refused delta changes nothing) for every parameter the
    delta changes. `held`: name -> the receiver's current tensor in `dtype`."""
    out: dict[str, torch.Tensor] = {}
    for name, packed in parts.items():
        base = held.get(name)
        if base is None:
            raise DeltaError(f"the delta changes {name!r}, which this model does not have")
        if base.dtype != dtype:
            raise DeltaError(
                f"{name}: the delta holds {dtype_name(dtype)} bits, the model holds {dtype_name(base.dtype)}"
            )
        if packed.dtype != torch.uint8 or packed.dim() != 1:
            raise DeltaError(f"{name}: malformed delta entry ({packed.dtype} {list(packed.shape)})")
        want = base.numel() * base.element_size()
        try:
            raw = zlib.decompress(packed.numpy().tobytes(), bufsize=want)
        except zlib.error as e:
            raise DeltaError(f"{name}: corrupt delta data ({e})") from None
        if len(raw) != want:
            raise DeltaError(f"{name}: the delta holds {len(raw)} bytes of XOR, the parameter has {want}")
        new = base.detach().to("cpu", copy=True).contiguous()
        flat = as_bits(new).view(-1)  # [N] integers sharing `new`'s memory
        flat ^= torch.frombuffer(bytearray(raw), dtype=flat.dtype)  # [N]
        out[name] = new
    return out


def load_json(path: str) -> dict:
    """A small JSON file (a fingerprint beside a snapshot); {} when absent or unreadable."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}
