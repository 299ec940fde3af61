"""LoRA adapter directories as peft writes and loads them, and the one merge both the trainer and the servers use.

An adapter version on disk is a directory with two files, exactly what `peft.PeftModel.save_pretrained` writes:

- `adapter_config.json`: `peft_type: "LORA"`, `r`, `lora_alpha`, `lora_dropout`, `target_modules`, ...;
- `adapter_model.safetensors`: for each adapted linear layer `<module>` (a transformers name such as
  `model.layers.0.self_attn.q_proj`), `base_model.model.<module>.lora_A.weight` [r, in] and
  `base_model.model.<module>.lora_B.weight` [out, r] (fp32 here).

So `PeftModel.from_pretrained(base, path)` loads any version the trainer published, and a server loads the same
directory. The servers serve `W = W0 + (alpha / r) * B @ A`, merged from a copy of the base weights W0 that they keep
(so version after version never drifts: every merge starts from W0, never from the previous merge).

**The merge is bit-reproducible** (`merge_weight`): policy identity compares SHA-256 digests of the served bits, so
the trainer (which computes the identity of what the servers must hold) and every server must get the same bits,
on any device and any thread count. A float64 matmul does not promise that (its summation order is the library's).
Here the r rank-one terms are summed in a fixed order, in float64, as elementwise ops: each product of two fp32
values is exact in float64 (24 + 24 significant bits < 53), so a fused multiply-add or a separate multiply gives
the same result, and every addition is one IEEE rounding in the order the loop fixes. The scale is applied once,
then W0 is added, then the result is rounded to the served dtype: the same four steps everywhere. Torch is imported
here (the controller never imports this module).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AdapterError",
    "is_adapter_dir",
    "peft_key",
    "module_of_key",
    "adapter_config",
    "write_adapter",
    "read_adapter",
    "merge_weight",
    "pair_modules",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_ROWS = 128  # output rows merged at a time: the float64 accumulator of one block stays in cache (~1.5 MB)


class AdapterError(ValueError):
    """An adapter directory that cannot be loaded; the message names the file or tensor."""


def is_adapter_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, ADAPTER_CONFIG))


def peft_key(module: str, which: str) -> str:
    """peft's saved name of `module`'s A or B matrix (`which` in "A", "B")."""
    return f"{_PREFIX}{module}.lora_{which}.weight"


def module_of_key(key: str) -> tuple[str, str]:
    """(module, "A" | "B") of a peft key; AdapterError for any other name."""
    if not key.startswith(_PREFIX):
        raise AdapterError(f"unexpected tensor {key!r} (peft names start with {_PREFIX!r})")
    rest = key[len(_PREFIX) :]
    for which in ("A", "B"):
        suffix = f".lora_{which}.weight"
        if rest.endswith(suffix):
            return rest[: -len(suffix)], which
    raise AdapterError(f"unexpected tensor {key!r} (expected <module>.lora_A.weight or <module>.lora_B.weight)")


def adapter_config(
    *, rank: int, alpha: float, dropout: float, target_modules: list[str], base_model: str, version: int
) -> dict:
    """adapter_config.json as peft writes it for a LoRA of a causal LM (the fields peft reads, with its defaults
    for the ones this project does not use; an unknown key would make peft warn, so the version is not in it)."""
    del version
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def write_adapter(directory: str, tensors: dict[str, torch.Tensor], config: dict) -> int:
    """Write the two files into `directory` (created; the caller renames it into place). `tensors`: peft keys ->
    CPU tensors. Returns the bytes of the weights file."""
    from safetensors.torch import save_file

    from areal_async.cache import follow_umask

    os.makedirs(directory, exist_ok=True)
    weights = os.path.join(directory, ADAPTER_WEIGHTS)
    save_file({k: t.contiguous() for k, t in tensors.items()}, weights, metadata={"format": "pt"})
    follow_umask(weights)
    cfg_path = os.path.join(directory, ADAPTER_CONFIG)
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return os.path.getsize(weights)


def read_adapter(path: str) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(config, module -> (A [r, in], B [out, r])) of an adapter directory, checked: a LoRA config with a positive
    rank and alpha, every module with both matrices of rank r, finite float values. AdapterError names the cause."""
    from safetensors import safe_open

    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{cfg_path}: not a LoRA adapter (peft_type {cfg.get('peft_type')!r})")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise AdapterError(f"{cfg_path}: r and lora_alpha must be positive numbers, got {r!r} and {alpha!r}")
    if cfg.get("use_dora") or cfg.get("use_rslora") or cfg.get("fan_in_fan_out"):
        raise AdapterError(f"{cfg_path}: DoRA, rsLoRA and fan_in_fan_out adapters are not supported")
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.exists(weights):
        raise AdapterError(f"no {ADAPTER_WEIGHTS} in {path}")
    raw: dict[str, torch.Tensor] = {}
    try:
        with safe_open(weights, framework="pt", device="cpu") as f:
            for key in f.keys():
                raw[key] = f.get_tensor(key)
    except Exception as e:  # safetensors raises its own types for truncated or corrupt files
        raise AdapterError(f"cannot read {weights}: {type(e).__name__}: {e}") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        module, which = module_of_key(key)
        if not t.is_floating_point() or t.dim() != 2:
            raise AdapterError(f"{weights}: {key} must be a 2-d float tensor, got {t.dtype} {list(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{weights}: {key} contains NaN or Inf")
        halves.setdefault(module, {})[which] = t
    pairs = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights}: {module} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != r or b.shape[1] != r:
            raise AdapterError(f"{weights}: {module}: A {list(a.shape)} and B {list(b.shape)} are not of rank r={r}")
        pairs[module] = (a, b)
    if not pairs:
        raise AdapterError(f"{weights}: no adapter tensors")
    return cfg, pairs


def merge_weight(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """W0 + scale * B @ A, rounded to `dtype`, bit-reproducibly (module docstring). w0 [out, in] (any float dtype),
    a [r, in], b [out, r] (fp32 or narrower: their products must be exact in float64). Returns [out, in] `dtype`
    on w0's device."""
    if a.dtype == torch.float64 or b.dtype == torch.float64:
        raise ValueError("adapter matrices must be fp32 or narrower (their products must be exact in float64)")
    out, rank = b.shape
    a64 = a.to(w0.device, torch.float64)  # [r, in]
    b64 = b.to(w0.device, torch.float64)  # [out, r]
    merged = torch.empty(w0.shape, dtype=dtype, device=w0.device)
    for lo in range(0, out, _ROWS):
        hi = min(out, lo + _ROWS)
        acc = torch.zeros((hi - lo, a.shape[1]), dtype=torch.float64, device=w0.device)  # [rows, in]
        for k in range(rank):  # fixed order; each product exact
            acc.addcmul_(b64[lo:hi, k : k + 1], a64[k : k + 1, :])
        acc.mul_(scale)
        acc.add_(w0[lo:hi].to(torch.float64))
        merged[lo:hi] = acc.to(dtype)
    return merged


def pair_modules(names: Iterable[str]) -> list[str]:
    """Adapted module names of state-dict names such as `<module>.lora_A.weight` (sorted, each once)."""
    out = set()
    for n in names:
        for which in ("A", "B"):
            suffix = f".lora_{which}.weight"
            if n.endswith(suffix):
                out.add(n[: -len(suffix)])
    return sorted(out)
