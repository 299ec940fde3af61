"""What this CPU can do fast, read from /proc/cpuinfo and the environment, so defaults follow the machine.

Why it matters: a bf16 matmul is 4x faster than fp32 on a CPU with AMX or AVX512-BF16 (measured: 170 vs 41
GFLOP/s on one thread of an AMD EPYC with avx512_bf16), and about 40x slower on one without, where oneDNN converts
every element (1.2 vs 51.6 GFLOP/s on an AVX2-only EPYC). So `train.mixed_precision=auto` picks bf16 on a CPU only
where the hardware has a bf16 dot product that torch is allowed to use: a cap set through `ONEDNN_MAX_CPU_ISA`
(oneDNN runs torch's CPU matmuls) or `ATEN_CPU_CAPABILITY` holds torch below it, and the cap wins.

Torch-free: the controller prints the choice before anything starts, the trainer makes the same one on its host.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CpuInfo", "read_cpu_info", "cpu_bf16_choice", "resolve_mixed_precision", "model_hidden_size", "describe"]

# oneDNN's ISA names from weakest to strongest (its dnnl_cpu_isa_t); a cap admits every ISA up to its own
_ONEDNN_ISAS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
)
_ONEDNN_BF16_AVX512 = _ONEDNN_ISAS.index("AVX512_CORE_BF16")
_ONEDNN_BF16_AMX = _ONEDNN_ISAS.index("AVX10_1_512_AMX")


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's model name, architecture and feature flags (lower case, as the kernel prints them)."""

    model: str
    arch: str
    flags: frozenset[str]

    @property
    def isa(self) -> str:
        """The widest vector ISA in short: amx, avx512, avx2, or the architecture's name."""
        if "amx_bf16" in self.flags:
            return "amx"
        if "avx512f" in self.flags:
            return "avx512"
        if "avx2" in self.flags and "fma" in self.flags:
            return "avx2"
        return self.arch


def read_cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's CPU; an unreadable cpuinfo (not Linux) gives no flags, so every choice falls back to fp32."""
    model, flags = platform.processor() or "unknown", frozenset()
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key == "model name" and model in ("unknown", "", platform.machine()):
                    model = value.strip()
                elif key in ("flags", "features") and not flags:  # x86 "flags", aarch64 "Features"
                    flags = frozenset(value.split())
    except OSError:
        pass
    return CpuInfo(model=model, arch=platform.machine(), flags=flags)


def _onednn_cap(env: Mapping[str, str]) -> int | None:
    """The index in `_ONEDNN_ISAS` that ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA) caps at, or None."""
    raw = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if not raw or raw in ("ALL", "DEFAULT"):
        return None
    return _ONEDNN_ISAS.index(raw) if raw in _ONEDNN_ISAS else None


def cpu_bf16_choice(info: CpuInfo | None = None, env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """(bf16 is the faster compute dtype on this CPU, why) for `mixed_precision=auto` on a CPU device."""
    info = info if info is not None else read_cpu_info()
    env = os.environ if env is None else env
    if info.arch not in ("x86_64", "AMD64", "amd64"):
        return False, f"{info.arch}: bf16 matmul speed not established on this architecture, fp32"
    if "amx_bf16" in info.flags:
        hw, need = "amx_bf16", _ONEDNN_BF16_AMX
    elif "avx512_bf16" in info.flags:
        hw, need = "avx512_bf16", _ONEDNN_BF16_AVX512
    else:
        return False, "no amx_bf16 or avx512_bf16 in the CPU flags: bf16 matmuls are emulated there, fp32"
    cap = _onednn_cap(env)
    if cap is not None and cap < need:
        name = "ONEDNN_MAX_CPU_ISA" if env.get("ONEDNN_MAX_CPU_ISA") else "DNNL_MAX_CPU_ISA"
        return False, f"CPU has {hw} but {name}={env[name]} holds torch below it, fp32"
    aten = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten in ("default", "avx2", "zvector", "vsx"):
        return False, f"CPU has {hw} but ATEN_CPU_CAPABILITY={aten} holds torch below it, fp32"
    return True, f"CPU has {hw} (a bf16 dot product), bf16"


# Below this hidden size a CPU train step is bound by per-op overhead, not by its GEMMs: bf16 saves nothing there
# (the default tiny model, hidden 128: 2.70 vs 3.02 s per step on the AVX-512 EPYC, within that run's noise) and
# adds rounding noise to the importance ratios, so such models stay in fp32.
BF16_MIN_HIDDEN = 512


def resolve_mixed_precision(
    setting: str,
    device_type: str,
    hidden_size: int | None = None,
    info: CpuInfo | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[str, str]:
    """`train.mixed_precision` as "bf16" or "fp32" for a trainer on `device_type` training a model of
    `hidden_size` (None: unknown), and why (for the logs)."""
    if setting != "auto":
        return setting, "set in the config"
    if device_type == "cuda":
        return "bf16", "CUDA device"
    if device_type != "cpu":
        return "fp32", f"{device_type} device"
    if hidden_size is not None and hidden_size < BF16_MIN_HIDDEN:
        return "fp32", f"hidden size {hidden_size} < {BF16_MIN_HIDDEN}: a CPU step this small is not GEMM-bound"
    fast, why = cpu_bf16_choice(info, env)
    return ("bf16" if fast else "fp32"), why


def model_hidden_size(model_dir: str) -> int | None:
    """The text model's hidden size from `model_dir`/config.json (None where it cannot be read)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    size = cfg.get("hidden_size")
    return size if isinstance(size, int) else None


def describe(info: CpuInfo | None = None) -> str:
    """One line for logs and benchmark records: model, ISA and the caps set in the environment."""
    info = info if info is not None else read_cpu_info()
    caps = [
        f"{k}={os.environ[k]}"
        for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "AREAL_KERNEL_MARCH")
        if os.environ.get(k)
    ]
    return f"{info.model} ({info.isa}{', ' + ' '.join(caps) if caps else ''})"
