"""Chat templates rendered as transformers' `apply_chat_template` renders them, without torch or transformers.

The prompt ids the controller sends must be the ids a user gets from transformers for the same conversation
(otherwise RL trains a prompt format the model never sees at deployment), so the rendering follows transformers'
rules exactly:

- a sandboxed Jinja environment (`ImmutableSandboxedEnvironment`) with `trim_blocks` and `lstrip_blocks`, the
  `loopcontrols` extension (`{% break %}`, `{% continue %}`) and the `{% generation %}` block (which marks the
  assistant text to train on; `render(..., track_generation=True)` returns its character spans);
- `tojson` that does not escape HTML and takes `ensure_ascii`, `indent`, `separators`, `sort_keys`;
  `raise_exception(msg)`, `strftime_now(fmt)`, a `dict()` callable and a `namespace()` that refuses
  underscore-prefixed names;
- the variables `messages`, `tools`, `documents`, `add_generation_prompt`, the named special tokens (`bos_token`,
  `eos_token`, ...) and any extra keyword (which overrides a special token of the same name);
- messages copied into plain JSON data with their None-valued keys dropped, and the reasoning fields aliased
  (`reasoning_content`, `thinking`, `reasoning`: templates read different names for the same text);
- `continue_final_message`: the last message left open for the model to continue.

Why not transformers' own renderer (`transformers.utils.chat_template_utils.render_jinja_template`): the
controller never imports torch, and in the transformers versions SGLang pins (4.57.1 for SGLang 0.5.6-0.5.9, 5.3.0
for 0.5.10) `import transformers.utils` imports torch whenever torch is installed, which it always is here
(checked in those versions' environments: `'torch' in sys.modules` after the import). transformers 5.24 no longer
does; once the floor passes the version that stopped, this module can hand rendering to the library and keep only
`render`'s signature. Until then tests/test_tokenizer.py holds the two to the same output, template by template,
against the installed transformers.
Templates are compiled once per source text (cached).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates usually read
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A template cannot be compiled or rendered (including its own `raise_exception`); the message says which."""


def render(
    source: str,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    special_tokens: Mapping[str, str] | None = None,
    track_generation: bool = False,
    origin: str = "chat template",
    **kwargs: Any,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, when `track_generation`, the character spans of its `{% generation %}`
    blocks (else []). `origin` names the template in error messages (a file path)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of message dicts")
    chat = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise TypeError(f"chat messages must be dicts, got {m!r}")
        chat.append({k: v for k, v in m.items() if v is not None})
    chat = _alias_reasoning(_plain(chat))
    if tools is not None:
        bad = next((t for t in tools if not isinstance(t, Mapping)), None)
        if bad is not None:
            raise ValueError(f"tools must be JSON schemas (dicts), got {bad!r}")
    if documents is not None and any(not isinstance(d, Mapping) for d in documents):
        raise TypeError("documents must be a list of dicts with 'title' and 'text' keys")
    final_message = None
    if continue_final_message:
        final_message = _tag_final_message(chat, continue_final_message, source)
    variables = {**{k: v for k, v in (special_tokens or {}).items() if v is not None}, **_plain(kwargs)}
    template = compile_template(source)
    try:
        if track_generation:
            blocks: list[str] = []
            spans: list[tuple[int, int]] = []
            with template.environment.generation_tracking(blocks, spans):
                for block in template.generate(
                    messages=chat,
                    tools=_plain(tools),
                    documents=_plain(documents),
                    add_generation_prompt=add_generation_prompt,
                    **variables,
                ):
                    blocks.append(block)
                text = "".join(blocks)
        else:
            text = template.render(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
            spans = []
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{origin}: {e}") from None
    except Exception as e:  # jinja2 errors and errors raised inside the template (e.g. a missing key)
        raise ChatTemplateError(f"{origin}: rendering failed: {type(e).__name__}: {e}") from None
    if final_message is not None:
        text = _cut_at_tag(text, final_message)
    return text, spans


def _tag_final_message(chat: list[dict], field: bool | str, source: str) -> str:
    """Append the continue tag to the final message's text; returns the text before tagging."""
    field = field if isinstance(field, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue')
    fields = [field]
    if field in REASONING_FIELDS:  # reasoning is copied under several names: tag every copy
        fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in source for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but the chat template does not read it')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return final
        raise ValueError("continue_final_message is set but the final message has no text to continue")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final_message: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_message.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the rendered "
            "chat (the template changes or drops it)"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space, and the tag's with it


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for m in chat:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _plain(value: Any) -> Any:
    """A copy made of plain JSON types only: templates are untrusted code, and rich objects carry methods the
    sandbox does not know to be dangerous. Anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)  # numpy scalars, without importing numpy
    if callable(item) and type(value).__module__ == "numpy":
        return _plain(item())
    return f"<{type(value).__name__}>"


# ---- the environment ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def compile_template(source: str):
    """The compiled template for `source` (cached); a syntax error is a ChatTemplateError with its line."""
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"syntax error at line {e.lineno}: {e.message}") from None


@lru_cache(maxsize=1)
def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body; while tracking, records the body's span."""

        tags = {"generation"}

        def __init__(self, environment) -> None:
            super().__init__(environment)
            self._tracking: ContextVar = ContextVar("generation_tracking", default=None)
            environment.extend(generation_tracking=self.tracking)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

        def _block(self, caller) -> str:
            text = caller()
            state = self._tracking.get()
            if state is not None:
                blocks, spans = state
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

        @contextmanager
        def tracking(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
            token = self._tracking.set((blocks, spans))
            try:
                yield
            finally:
                self._tracking.reset(token)

    class SafeNamespace(jinja2.utils.Namespace):
        """`namespace()` that refuses underscore-prefixed names (a path to interpreter internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's own signature trick)
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
                )

    class DictBuilder:
        """`dict(...)` and `dict.fromkeys(...)`, without handing the template the type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | str | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=DictBuilder(), namespace=SafeNamespace
    )
    return env
