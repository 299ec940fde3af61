"""SGLang's command line as every launcher starts it (local, Slurm step, Ray actor). No torch here.

SGLang pins its own torch and transformers, so it runs from an interpreter of its own (`server.python`, a venv per
release: `make sglang` builds one; docs/inference.md). What the command settles, and why:
- `--dtype` is always explicit. SGLang's `auto` serves an fp32 checkpoint as float16 (bfloat16 for a few model
  types), and the identity check after every update compares the served values with the trainer's rounded to the
  served dtype: a guessed dtype quarantines a correct server. model.dtype=auto becomes bfloat16, the dtype the
  trainer publishes on bf16 hardware and 1.8x faster than float16 on a CPU without AVX512-FP16.
- On a machine without a GPU (`server.device` cpu, or auto with none), SGLang's CPU engine: `--device cpu`,
  `--disable-overlap-schedule`, SGLANG_USE_CPU_ENGINE=1, and this package's pure-torch stand-in for the one
  sgl-kernel CPU op SGLang calls without AMX (launch/sglang_cpu_kernels/) first on its PYTHONPATH. The command
  carries the environment through `env`, so a Slurm step or a Ray actor runs exactly the same.
- `--disable-radix-cache` with in-place updates: requests that keep running across an update keep their KV, and
  SGLang's radix cache would hand that old-weight KV to new requests with the same prefix (samples labelled v+1
  computed on v's KV). A flush is refused while requests run, so the cache is not used at all then (measured cost:
  benchmarks/README.md, "SGLang"). With abort-mode updates the cache is flushed at each update and stays on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from areal_async.host.torch_threads import thread_env
from areal_async.launch.placement import sglang_flag
from areal_async.launch.sglang_lora import sglang_lora_args

if TYPE_CHECKING:
    from areal_async.config import RunConfig

# the releases tested against real servers in CI (.ci/sglang_leg.sh); the client's dialect covers 0.5.6 on
# (inference/sglang_dialect.py), but releases before these do not serve on a CPU from PyPI packages
SGLANG_OLDEST = (0, 5, 10)
SGLANG_NEWEST = (0, 5, 23)

__all__ = [
    "SGLANG_NEWEST",
    "SGLANG_OLDEST",
    "installed_release",
    "STAND_IN_DIR",
    "cuda_present",
    "served_dtype",
    "sglang_options",
    "sglang_radix_cache",
    "sglang_server_cmd",
]

# the folder holding the `sgl_kernel` stand-in package (put first on SGLang's PYTHONPATH on CPU)
STAND_IN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_cpu_kernels")


def installed_release(python: str, package: str) -> str | None:
    """The version of `package` installed for the interpreter `python`, read from its metadata (nothing of the
    package is imported); None when it is not installed or the interpreter does not run."""
    probe = (
        "import importlib.metadata as m, sys\n"
        "try:\n    print(m.version(sys.argv[1]))\n"
        "except m.PackageNotFoundError:\n    sys.exit(3)\n"
    )
    try:
        out = subprocess.run([python, "-c", probe, package], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def cuda_present() -> bool:
    """An NVIDIA GPU on this host, told without torch: the driver's device node and nvidia-smi."""
    return os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is not None


def sglang_options(cfg: RunConfig) -> dict[str, Any]:
    """The run's part of `sglang_server_cmd`'s keywords, the same in every launcher (where a server runs: its model,
    host, port and GPUs, is each launcher's)."""
    srv = cfg.server
    return {
        "api_key": srv.api_key,
        "extra_args": list(srv.extra_args),
        "dtype": cfg.model.dtype,
        "lora_args": sglang_lora_args(cfg, list(srv.extra_args)),
        "python": srv.python,
        "device": srv.device,
        "radix_cache": sglang_radix_cache(cfg),
        "threads": srv.torch_threads,
        "max_total_tokens": srv.max_total_tokens,
    }


def sglang_radix_cache(cfg: RunConfig) -> bool:
    """SGLang's radix cache stays on unless the user turned prefix caching off or updates are in place (module
    docstring)."""
    return cfg.server.prefix_cache and cfg.schedule.interrupt_mode != "in_place"


def served_dtype(model_dtype: str) -> str:
    """The --dtype SGLang gets for `model.dtype` (never auto: see the module docstring)."""
    return "bfloat16" if model_dtype in ("auto", "", None) else model_dtype


def sglang_server_cmd(
    model: str,
    *,
    host: str,
    port: str,
    api_key: str | None,
    extra_args: list[str],
    base_gpu_id: int = 0,
    tp_size: int = 1,
    dtype: str = "auto",
    lora_args: list[str] | None = None,
    python: str | None = None,
    device: str = "auto",
    radix_cache: bool = True,
    threads: int = 1,
    max_total_tokens: int | None = None,
) -> list[str]:
    """`python -m sglang.launch_server ...` (through `env` on CPU). `tp_size` (server.gpus_per_server) becomes
    --tp-size: without it SGLang runs tp 1 on the first of the server's GPUs, and the weight broadcast would count
    ranks the server does not have. `dtype` (model.dtype) becomes --dtype unless `extra_args` has one. `lora_args`:
    the LoRA flags of a train.lora run (launch/sglang_lora.py). `threads`: intra-op threads on a CPU.
    `max_total_tokens` (server.max_total_tokens) bounds its KV pool: on a CPU, SGLang otherwise sizes it from the
    host's free memory (a scheduler of SmolLM2-135M was seen at 18 GB). A flag the user put in `extra_args` wins."""
    cpu = device == "cpu" or (device == "auto" and not cuda_present())
    cmd = [
        os.path.expanduser(python) if python else sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--host",
        host,
        "--port",
        port,
        *extra_args,
        *(lora_args or []),
    ]
    if cpu:
        if sglang_flag(extra_args, "--device") is None:
            cmd += ["--device", "cpu"]
        if sglang_flag(extra_args, "--disable-overlap-schedule") is None:
            cmd.append("--disable-overlap-schedule")
    elif sglang_flag(extra_args, "--base-gpu-id") is None:
        cmd += ["--base-gpu-id", str(base_gpu_id)]
    if tp_size > 1 and sglang_flag(extra_args, "--tp-size", "--tp", "--tensor-parallel-size") is None:
        cmd += ["--tp-size", str(tp_size)]
    if sglang_flag(extra_args, "--dtype") is None:
        cmd += ["--dtype", served_dtype(dtype)]
    if max_total_tokens and sglang_flag(extra_args, "--max-total-tokens") is None:
        cmd += ["--max-total-tokens", str(max_total_tokens)]
    if not radix_cache and sglang_flag(extra_args, "--disable-radix-cache") is None:
        cmd.append("--disable-radix-cache")
    if api_key:
        cmd += ["--api-key", api_key]
    if cpu:
        pin = [f"{k}={v}" for k, v in thread_env(threads).items()]  # server.torch_threads, as an embedded server
        cmd = ["env", "SGLANG_USE_CPU_ENGINE=1", f"PYTHONPATH={STAND_IN_DIR}", *pin, *cmd]
    return cmd
