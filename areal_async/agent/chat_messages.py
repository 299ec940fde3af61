"""Chat messages as the proxy compares and renders them: flattened for chat templates, and equal as the model sees them.

Apart from openai_proxy.py because it is pure message handling, with no HTTP and no episodes: `template_messages`
gives a chat template what it expects, and `same_message` decides whether a request repeats an earlier call's
conversation (token continuity: the proxy then extends that call's tokens instead of re-rendering the text).
"""

from __future__ import annotations

import json
from typing import Any


def _args_obj(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: no null fields, tool-call arguments as objects (Qwen's template
    applies `tojson` to them, so a JSON string would be encoded twice). Content is already flat text."""
    out = []
    for m in messages:
        msg = {k: v for k, v in m.items() if v is not None}
        msg.setdefault("content", "")
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = dict(tc.get("function") or {})
                fn["arguments"] = _args_obj(fn.get("arguments", {}))
                calls.append({**tc, "function": fn})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def same_message(a: dict, b: dict) -> bool:
    """Equal as far as the model is concerned: role, text, tool call names and arguments, tool_call_id."""

    def key(m: dict) -> tuple:
        calls = tuple(
            (
                tc.get("function", {}).get("name"),
                json.dumps(_args_obj(tc.get("function", {}).get("arguments")), sort_keys=True),
            )
            for tc in (m.get("tool_calls") or [])
        )
        content = m.get("content")
        return (m.get("role"), (content if isinstance(content, str) else "").strip(), calls, m.get("tool_call_id"))

    try:
        return key(a) == key(b)
    except (AttributeError, TypeError):
        return False
