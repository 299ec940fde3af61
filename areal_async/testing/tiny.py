"""Tiny random HF checkpoints of the supported architectures, for tests and benchmarks.

They are real `save_pretrained` directories (config.json, model.safetensors, tokenizer files with a chat template),
so every loader in the project is exercised exactly as with a downloaded model.
"""

from __future__ import annotations

import os
from typing import Literal

from areal_async.tasks.char_tokenizer import save_char_tokenizer

Arch = Literal["qwen2", "qwen3", "llama"]


def make_tiny_checkpoint(
    path: str,
    arch: Arch = "qwen2",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    rope_theta: float = 10000.0,
    init_std: float = 0.02,
) -> str:
    """Write a randomly initialised model of `arch` with the char tokenizer into `path` and return `path`.

    `init_std` larger than the HF default makes the random model's next-token distribution far from uniform, so
    greedy decoding and logprob comparisons are meaningful.
    """
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    vocab_size = save_char_tokenizer(path)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta,
        initializer_range=init_std,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, use_sliding_window=False)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=hidden_size // num_heads, use_sliding_window=False)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path, safe_serialization=True)
    return path
