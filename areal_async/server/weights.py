"""Reading and validating Hugging Face checkpoints for the embedded engine.

A weight update must never leave a server half-updated, so loading is two-phase: `load_checkpoint` reads every
tensor of a directory into host memory and checks it (architecture, names, shapes, float dtypes, finite values);
only a fully valid set is handed to `DecoderModel.load_tensors`. Any problem is a `WeightError` whose message says
what is wrong and where. Safetensors only: it cannot execute code, unlike pickled `.bin` files, which are refused.
"""

from __future__ import annotations

import json
import os

import torch

from areal_async.net.custom_group import bind_cuda, connect_store, new_custom_group
from areal_async.server.model import ModelSpec, UnsupportedModelError

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Tensors some checkpoints carry that hold nothing to load (recomputed buffers).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "uint8": torch.uint8,  # a delta's payloads (deflated XOR of the served bits); never a weight
}


class WeightError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


def read_config(path: str) -> dict:
    """config.json of a checkpoint directory."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise WeightError(f"checkpoint directory not found: {path}")
    if not os.path.exists(cfg_path):
        raise WeightError(f"no config.json in {path}")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise WeightError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise WeightError(f"{cfg_path}: expected a JSON object")
    return cfg


def read_spec(path: str) -> ModelSpec:
    try:
        return ModelSpec.from_hf_config(read_config(path))
    except UnsupportedModelError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise WeightError(f"{path}/config.json: bad or missing field: {e}") from None


def safetensors_files(path: str) -> list[str]:
    """The weight files of a checkpoint: from model.safetensors.index.json when sharded, else every *.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightError(f"cannot read {index}: {e}") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        has_bin = any(f.endswith(".bin") or f.endswith(".pt") for f in os.listdir(path))
        hint = " (pickled .bin/.pt weights are not loaded: convert to safetensors)" if has_bin else ""
        raise WeightError(f"no *.safetensors files in {path}{hint}")
    missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise WeightError(f"{path}: weight files listed in the index are missing: {missing}")
    return [os.path.join(path, f) for f in files]


def load_checkpoint(path: str, spec: ModelSpec | None = None) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Read and validate every tensor of the checkpoint at `path` into host memory.

    With `spec`, the checkpoint must have exactly that architecture (what a weight update requires). Returns the
    checkpoint's spec and `{hf_name: tensor}` holding every name of `spec.param_shapes()`.
    """
    from safetensors import safe_open

    new_spec = read_spec(path)
    if spec is not None and new_spec != spec:
        diffs = [
            f"{k}: {getattr(spec, k)!r} -> {getattr(new_spec, k)!r}"
            for k in spec.__dataclass_fields__
            if getattr(spec, k) != getattr(new_spec, k)
        ]
        raise WeightError(f"{path} has a different architecture than the loaded model ({'; '.join(diffs)})")
    expected = new_spec.param_shapes()
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name not in expected:
                        if name == "lm_head.weight" and new_spec.tie_word_embeddings:
                            continue  # some tied checkpoints store the head too; it is the embedding
                        raise WeightError(f"{file}: unexpected tensor {name!r} for {new_spec.architecture}")
                    tensors[name] = f.get_tensor(name)
        except WeightError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise WeightError(f"cannot read {file}: {type(e).__name__}: {e}") from None
    check_tensors(tensors, expected, where=path)
    return new_spec, tensors


def check_tensors(
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], where: str, require_all: bool = True
) -> None:
    """Names, shapes, float dtypes and finiteness; raises `WeightError` naming the first few problems."""
    if require_all:
        missing = [n for n in expected if n not in tensors]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise WeightError(f"{where}: missing tensors {missing[:5]}{more}")
    for name, t in tensors.items():
        if name not in expected:
            raise WeightError(f"{where}: unknown tensor {name!r}")
        if tuple(t.shape) != expected[name]:
            raise WeightError(f"{where}: {name} has shape {list(t.shape)}, expected {list(expected[name])}")
        if t.dtype not in _FLOAT_DTYPES:
            raise WeightError(f"{where}: {name} has dtype {t.dtype}, expected a float type")
        if not bool(torch.isfinite(t).all()):
            raise WeightError(f"{where}: {name} contains NaN or Inf")


# ---- receiving weights by broadcast (the server side of SGLang's distributed weight update) -------------------


def init_custom_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    device: torch.device | str,
    timeout_s: float = 600.0,
):
    """Join the trainer's weight-update group as `rank` (> 0), the way SGLang's `init_custom_process_group` does,
    so a trainer written for SGLang talks to us unchanged (areal_async/net/custom_group.py holds the shared c10d setup).

    The trainer (rank 0) hosts a TCPStore at `init_method` (`tcp://host:port`). `device` may lack an index ("cuda"
    from an "auto" device): it is taken as the current CUDA device."""
    if not 0 < rank < world_size:
        raise ValueError(f"rank {rank} is not a receiving rank of a group of {world_size} (rank 0 is the trainer)")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unsupported backend {backend!r}; use gloo (CPU) or nccl (CUDA)")
    store = connect_store(init_method, rank, world_size, timeout_s)
    return new_custom_group(
        backend, store, world_size=world_size, rank=rank, group_name=group_name, device=device, timeout_s=timeout_s
    )


def receive_tensors(
    group, names: list[str], dtypes: list[str], shapes: list[list[int]], device: torch.device
) -> dict[str, torch.Tensor]:
    """Receive each tensor with broadcast(src=0) in the listed order. gloo moves host tensors, nccl device ones."""
    import torch.distributed as dist

    on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    bind_cuda(on)  # this runs in a worker thread, whose current CUDA device is not the engine's
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        t = torch.empty(shape, dtype=DTYPES[dtype], device=on)
        dist.broadcast(t, src=0, group=group)
        out[name] = t
    return out


def destroy_group(group) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)
