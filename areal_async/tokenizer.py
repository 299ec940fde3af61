"""A torch-free tokenizer for the controller side: an HF checkpoint's tokenizer files read as transformers reads them.

    tokenizer.json                         the fast tokenizer (through the `tokenizers` library)
    tokenizer_config.json                  special tokens, added tokens, `chat_template` (a string or a named list)
    chat_template.jinja                    the template as transformers 5 saves it (wins over tokenizer_config.json)
    additional_chat_templates/NAME.jinja   further named templates (transformers 5)
    special_tokens_map.json                legacy special tokens (read when the config lists no added tokens)
    generation_config.json, config.json    end-of-sequence ids (a model may have several)

Why not transformers' `PreTrainedTokenizerFast`: the controller must not import torch, and in the transformers
versions SGLang pins (4.57.1, 5.3.0) importing it imports torch (areal_async.chat_template says how that was
checked). The library part that does the work, the `tokenizers` fast tokenizer, is used as it is; this module adds
only what transformers layers on top (the config files above, special and added tokens, template choice), and
tests/test_tokenizer.py holds the ids and texts equal to transformers'. Chat templates are rendered by
`areal_async.chat_template`, which follows transformers' rendering rules exactly.

`check_tokenizer(path, need_chat_template)` is the check the controller runs before launching anything: every
problem is a TokenizerError naming the path and what is missing.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from typing import Any

from areal_async.chat_template import SPECIAL_TOKEN_NAMES, ChatTemplateError, compile_template, render

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"


class TokenizerError(ValueError):
    """The tokenizer files of a checkpoint are missing or unusable; the message names the path and the problem."""


class Tokenizer:
    """The tokenizer of the HF directory `path` (see the module docstring for the files read)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _Fast

        if not os.path.isdir(path):
            raise TokenizerError(f"{path}: no such directory (expected an HF checkpoint with tokenizer.json)")
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise TokenizerError(
                f"{path}: no tokenizer.json (only fast tokenizers are supported; transformers "
                "writes one with AutoTokenizer.from_pretrained(path).save_pretrained(path))"
            )
        self.path = path
        try:
            self._tok = _Fast.from_file(tj)
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise TokenizerError(f"{tj}: not a valid tokenizer file ({e})") from None
        self._cfg: dict[str, Any] = _read_json(os.path.join(path, "tokenizer_config.json"))
        self._gen: dict[str, Any] = _read_json(os.path.join(path, "generation_config.json"))
        self._model_cfg: dict[str, Any] = _read_json(os.path.join(path, "config.json"))
        self._special = self._named_special_tokens()
        self._add_config_tokens()
        self._templates, self._template_origin, self._template_is_dict = self._load_templates()

    # ---- tokens -----------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_start|>`) become their ids, as in
        transformers. `add_special_tokens` adds what the tokenizer's post-processor adds (a BOS, for some)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._cfg.get("clean_up_tokenization_spaces") and type(self._tok.model).__name__ != "BPE":
            text = _clean_up_spaces(text)  # as transformers does (never for BPE, where it would corrupt text)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (bos_token, eos_token, unk_token, pad_token, ...), as strings."""
        return dict(self._special)

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of the named special tokens and the config's extra (additional) special tokens, as transformers
        lists them. Decoding with skip_special_tokens skips more: every added token flagged special."""
        extra = self._cfg.get("extra_special_tokens") or self._cfg.get("additional_special_tokens") or []
        names = list(self._special.values()) + [_token_text(t) for t in extra if isinstance(extra, list)]
        return sorted({i for t in names if t and (i := self.token_to_id(t)) is not None})

    @property
    def bos_token(self) -> str | None:
        return self._special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._special.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token) if self.pad_token else None

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """EOS ids from generation_config.json, config.json and the tokenizer's eos_token, deduplicated."""
        ids: list[int] = []
        for src in (self._gen.get("eos_token_id"), self._model_cfg.get("eos_token_id")):
            if isinstance(src, int) and not isinstance(src, bool):
                ids.append(src)
            elif isinstance(src, list):
                ids.extend(int(x) for x in src)
        if self.eos_token is not None and self.token_to_id(self.eos_token) is not None:
            ids.append(self.token_to_id(self.eos_token))  # type: ignore[arg-type]
        return list(dict.fromkeys(ids))

    def _named_special_tokens(self) -> dict[str, str]:
        """Named special tokens from tokenizer_config.json (strings or AddedToken dicts); special_tokens_map.json
        overrides them when the config lists no added tokens (the legacy layout, read that way by transformers)."""
        out = {name: _token_text(self._cfg.get(name)) for name in SPECIAL_TOKEN_NAMES}
        if "added_tokens_decoder" not in self._cfg:
            legacy = _read_json(os.path.join(self.path, "special_tokens_map.json"))
            out.update({name: _token_text(legacy[name]) for name in SPECIAL_TOKEN_NAMES if name in legacy})
        return {k: v for k, v in out.items() if v}

    def _add_config_tokens(self) -> None:
        """Added tokens listed in tokenizer_config.json but absent from tokenizer.json join the vocabulary, as
        transformers adds them when it loads the tokenizer."""
        from tokenizers import AddedToken

        decoder = self._cfg.get("added_tokens_decoder") or {}
        for _, tok in sorted(decoder.items(), key=lambda kv: int(kv[0])):  # in id order: each gets the next id
            if (
                isinstance(tok, dict)
                and isinstance(tok.get("content"), str)
                and self._tok.token_to_id(tok["content"]) is None
            ):
                special = bool(tok.get("special", False))
                added = AddedToken(
                    tok["content"],
                    single_word=bool(tok.get("single_word", False)),
                    lstrip=bool(tok.get("lstrip", False)),
                    rstrip=bool(tok.get("rstrip", False)),
                    normalized=bool(tok.get("normalized", not special)),
                    special=special,
                )
                (self._tok.add_special_tokens if special else self._tok.add_tokens)([added])

    # ---- chat templates ---------------------------------------------------------------------------------------

    def _load_templates(self) -> tuple[dict[str, str], dict[str, str], bool]:
        """(name -> source, name -> where it came from, whether transformers would hold a named dict)."""
        files: dict[str, str] = {}
        origin: dict[str, str] = {}
        main = os.path.join(self.path, TEMPLATE_FILE)
        if os.path.isfile(main):
            files["default"] = _read_text(main)
            origin["default"] = main
        extra_dir = os.path.join(self.path, TEMPLATE_DIR)
        if os.path.isdir(extra_dir):
            for entry in sorted(os.listdir(extra_dir)):
                if entry.endswith(".jinja"):
                    name = entry[: -len(".jinja")]
                    files[name] = _read_text(os.path.join(extra_dir, entry))
                    origin[name] = os.path.join(extra_dir, entry)
        if files:  # template files win over entries in tokenizer_config.json, as in transformers
            return files, origin, not (len(files) == 1 and "default" in files)
        cfg_path = os.path.join(self.path, "tokenizer_config.json")
        src = self._cfg.get("chat_template")
        if src is None or src == "":
            return {}, {}, False
        if isinstance(src, str):
            return {"default": src}, {"default": f"{cfg_path} (chat_template)"}, False
        if isinstance(src, dict):
            src = [{"name": k, "template": v} for k, v in src.items()]
        if isinstance(src, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in src
        ):
            return (
                {t["name"]: t["template"] for t in src},
                {t["name"]: f"{cfg_path} (chat_template {t['name']!r})" for t in src},
                True,
            )
        raise TokenizerError(
            f"{cfg_path}: chat_template must be a string or a list of {{'name': str, 'template': str}} entries"
        )

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def chat_template_names(self) -> list[str]:
        return sorted(self._templates)

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The template source to render, chosen as transformers chooses it: with named templates, `chat_template`
        may name one, else "tool_use" when tools are given and it exists, else "default"; with a single template,
        `chat_template` (when given) is itself the source to use."""
        return self._select(chat_template, tools)[0]

    def _select(self, chat_template: str | None, tools: list[dict] | None) -> tuple[str, str]:
        if self._template_is_dict:
            if chat_template is not None and chat_template in self._templates:
                return self._templates[chat_template], self._template_origin[chat_template]
            if chat_template is None:
                name = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
                if name not in self._templates:
                    raise TokenizerError(
                        f"{self.path}: the tokenizer has several chat templates and none named "
                        f"'default'; name one of {self.chat_template_names}"
                    )
                return self._templates[name], self._template_origin[name]
            return chat_template, "the chat_template argument"
        if chat_template is not None:
            return chat_template, "the chat_template argument"
        if not self._templates:
            raise TokenizerError(
                f"{self.path}: the tokenizer has no chat template (neither {TEMPLATE_FILE} nor "
                "a chat_template entry in tokenizer_config.json)"
            )
        return self._templates["default"], self._template_origin["default"]

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        *,
        documents: list[dict] | None = None,
        continue_final_message: bool | str = False,
        chat_template: str | None = None,
        return_assistant_tokens_mask: bool = False,
        **kwargs: Any,
    ) -> list[int] | str | dict[str, list[int]]:
        """The conversation rendered exactly as transformers' `apply_chat_template` renders it, as ids (`tokenize`)
        or text. Unlike transformers, `add_generation_prompt` defaults to True: prompts for generation are what
        the controller renders. With `return_assistant_tokens_mask` the result is {"input_ids", "assistant_masks"}:
        1 for tokens inside the template's `{% generation %}` blocks (the assistant text to train on)."""
        source, origin = self._select(chat_template, tools)
        text, spans = render(
            source,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            special_tokens=self._special,
            track_generation=return_assistant_tokens_mask,
            origin=origin,
            **kwargs,
        )
        if return_assistant_tokens_mask:
            enc = self._tok.encode(text, add_special_tokens=False)
            return {"input_ids": enc.ids, "assistant_masks": _span_mask(enc.offsets, spans)}
        return self.encode(text) if tokenize else text


def check_tokenizer(path: str, need_chat_template: bool = False) -> Tokenizer:
    """Load the tokenizer of `path` and check what a run needs, before anything is launched: the tokenizer files,
    an end-of-sequence token, ids within the model's vocabulary, and (when `need_chat_template`) a chat template
    that compiles and renders a one-message conversation. Returns the tokenizer; raises TokenizerError."""
    tok = Tokenizer(path)
    if not tok.eos_token_ids:
        raise TokenizerError(
            f"{path}: no end-of-sequence token (none of generation_config.json eos_token_id, "
            "config.json eos_token_id, tokenizer_config.json eos_token); generation could not stop"
        )
    model_vocab = tok._model_cfg.get("vocab_size")
    if isinstance(model_vocab, int) and tok.vocab_size > model_vocab:
        raise TokenizerError(
            f"{path}: the tokenizer has {tok.vocab_size} tokens but config.json vocab_size is "
            f"{model_vocab}: some ids have no embedding"
        )
    if need_chat_template:
        if not tok.has_chat_template:
            raise TokenizerError(
                f"{path}: the tokenizer has no chat template (neither {TEMPLATE_FILE} nor a "
                "chat_template entry in tokenizer_config.json), which data.apply_chat_template "
                "needs"
            )
        for name in tok.chat_template_names:
            try:
                compile_template(tok._templates[name])
            except ChatTemplateError as e:
                raise TokenizerError(f"{tok._template_origin[name]}: {e}") from None
        try:
            ids = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 1?"}])
        except (ChatTemplateError, TokenizerError) as e:
            raise TokenizerError(f"{path}: the chat template cannot render a one-message conversation: {e}") from None
        if not ids:
            raise TokenizerError(f"{path}: the chat template renders a conversation as empty text")
    return tok


def _span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token that overlaps a character span (spans and offsets are both in order)."""
    mask = [0] * len(offsets)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # older configs store AddedToken dicts
        v = v.get("content")
    return v if isinstance(v, str) else None


def _clean_up_spaces(text: str) -> str:
    for a, b in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(a, b)
    return text


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data
