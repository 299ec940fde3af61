"""GGUF file -> HF checkpoint directory, through transformers' own GGUF loader (which needs gguf and accelerate).

The loader de-quantizes every tensor to fp32 and rebuilds the tokenizer (tokenizer.json with its added and special
tokens, the chat template) from the GGUF metadata. What is written is a plain fp32 checkpoint that every loader of
the project (the embedded engine, the FSDP trainers, SGLang, transformers) reads like a downloaded model:

    config.json              without the GGUF quantization_config (the weights are no longer quantized)
    model.safetensors        fp32
    generation_config.json   bos/eos/pad ids from the GGUF metadata
    tokenizer.json, tokenizer_config.json (chat_template inside it too), chat_template.jinja

The chat template is written both ways because loaders differ: transformers 5 reads chat_template.jinja, older
transformers and other tools read tokenizer_config.json. The output is deterministic for a given file and
library versions (de-quantization is element-wise; tensors are saved in name order).

Run by `areal_async.model_store` in a subprocess (the controller never imports torch); as a CLI:
`python -m areal_async.tasks.convert_gguf --gguf FILE --out DIR` prints a JSON summary as its last line.
Writing into DIR is not atomic by itself: model_store gives it a temporary directory and renames it when done.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"


def convert_gguf(gguf_file: str, out_dir: str) -> dict[str, Any]:
    """Convert `gguf_file` into `out_dir` (created if missing); returns a summary (architecture, sizes, versions)."""
    import torch
    import transformers

    t0 = time.perf_counter()
    folder, name = os.path.split(os.path.abspath(gguf_file))
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    t_load = time.perf_counter() - t0

    # A fresh model built from the config without quantization_config and given the loaded tensors: transformers
    # refuses to save a model it loaded through a quantizer, and the saved config must not claim a quantization.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    state = loaded.state_dict()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or [k for k in missing if not _is_tied(model, k)]:
        raise RuntimeError(
            f"{gguf_file}: converted weights do not match the architecture "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.tie_weights()
    if any(p.is_meta for p in model.parameters()):
        raise RuntimeError(f"{gguf_file}: some parameters were not loaded from the file")
    model.generation_config = loaded.generation_config
    if model.generation_config.eos_token_id is None and tok.eos_token_id is not None:
        model.generation_config.eos_token_id = tok.eos_token_id
    del loaded, state

    t1 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    _portable_config(out_dir)
    template = _portable_tokenizer_config(out_dir, tok.chat_template, config.max_position_embeddings)
    for entry in os.listdir(out_dir):  # a shared cache: readable by every user (save_pretrained may write 0600)
        os.chmod(os.path.join(out_dir, entry), 0o644)
    t_save = time.perf_counter() - t1

    import gguf

    return {
        "architecture": (config.architectures or [type(model).__name__])[0],
        "model_type": config.model_type,
        "num_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": int(config.vocab_size),
        "chat_template": template is not None,
        "load_seconds": round(t_load, 2),
        "save_seconds": round(t_save, 2),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
    }


def _is_tied(model, key: str) -> bool:
    return key == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def _portable_config(out_dir: str) -> None:
    """Also write the RoPE base as top-level `rope_theta`: transformers 5 keeps it inside `rope_parameters`, which
    transformers 4 (still used by many SGLang installs) ignores, silently falling back to its default base."""
    path = os.path.join(out_dir, "config.json")
    cfg = _read(path)
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and rope.get("rope_type", "default") == "default" and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
        _write(path, cfg)


def _portable_tokenizer_config(out_dir: str, template: Any, max_length: int | None) -> str | list | None:
    """tokenizer_config.json as every loader reads it: the fast-tokenizer class name that transformers 4 and 5 both
    know, no loading-time keys, the real context length, and the chat template inside it as well as in
    chat_template.jinja (see the module docstring)."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    cfg = _read(path)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only", "gguf_file"):
        cfg.pop(key, None)
    if max_length:
        cfg["model_max_length"] = int(max_length)
    if template:
        cfg["chat_template"] = template
        default = (
            template
            if isinstance(template, str)
            else next((t["template"] for t in template if t.get("name") == "default"), None)
        )
        if default is not None:
            with open(os.path.join(out_dir, TEMPLATE_FILE), "w", encoding="utf-8") as f:
                f.write(default)
    _write(path, cfg)
    return template or None


def _read(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")


def _dist_version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m areal_async.tasks.convert_gguf",
        description="Convert a GGUF file into an fp32 HF checkpoint directory.",
    )
    ap.add_argument("--gguf", required=True, help="the .gguf file")
    ap.add_argument("--out", required=True, help="output directory (created; files in it are overwritten)")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.gguf):
        print(f"error: {args.gguf}: no such file", file=sys.stderr)
        return 2
    stats = convert_gguf(args.gguf, args.out)
    print(json.dumps(stats, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
