"""A torch-free tokenizer for the controller side: tokenizer.json through the `tokenizers` library, chat templates
through a sandboxed Jinja2 environment.

Why not transformers.AutoTokenizer: the controller must not import torch, and workflows need token-in/token-out
exactness (the ids trained are the ids generated), which only needs the fast tokenizer itself.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from typing import Any


class Tokenizer:
    """Loads `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` from an HF directory."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _Fast

        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise FileNotFoundError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        self.path = path
        self._tok = _Fast.from_file(tj)
        self._cfg: dict[str, Any] = _read_json(os.path.join(path, "tokenizer_config.json"))
        self._gen: dict[str, Any] = _read_json(os.path.join(path, "generation_config.json"))
        self._model_cfg: dict[str, Any] = _read_json(os.path.join(path, "config.json"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _special(self, name: str) -> str | None:
        v = self._cfg.get(name)
        if isinstance(v, dict):  # older configs store AddedToken dicts
            v = v.get("content")
        return v

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """EOS ids from generation_config.json, config.json and the tokenizer's eos_token, deduplicated."""
        ids: list[int] = []
        for src in (self._gen.get("eos_token_id"), self._model_cfg.get("eos_token_id")):
            if isinstance(src, int):
                ids.append(src)
            elif isinstance(src, list):
                ids.extend(int(x) for x in src)
        tok = self._special("eos_token")
        if tok is not None and self.token_to_id(tok) is not None:
            ids.append(self.token_to_id(tok))  # type: ignore[arg-type]
        return list(dict.fromkeys(ids))

    @property
    def pad_token_id(self) -> int | None:
        tok = self._special("pad_token")
        return self.token_to_id(tok) if tok else None

    @cached_property
    def _template(self):
        src = self._cfg.get("chat_template")
        if isinstance(src, list):  # named templates: take "default"
            src = next((t["template"] for t in src if t.get("name") == "default"), src[0]["template"])
        if not src:
            raise ValueError(f"{self.path}: the tokenizer has no chat_template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)

        def raise_exception(msg: str) -> None:
            raise ValueError(msg)

        env.globals["raise_exception"] = raise_exception
        return env.from_string(src)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = True) -> list[int] | str:
        text = self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     bos_token=self._special("bos_token") or "",
                                     eos_token=self._special("eos_token") or "")
        return self.encode(text) if tokenize else text


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)
