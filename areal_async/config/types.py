"""What the config's types say about a dotted key: the field's msgspec type info, whether it holds text (so an
override keeps its text as typed), an enum's choices, and msgspec's conversion errors turned into messages that name
the key (with a "did you mean" for an unknown one). Generic over the root Struct, so run_config.py's sections and the
trainer's `TrainConfig` alike use it. Never torch."""

from __future__ import annotations

import difflib
from typing import Any

import msgspec

from areal_async.config.base import ConfigError, key_of
from areal_async.config.files import ALIASES, TextKind

__all__ = ["field_info", "text_kind_of", "choices", "format_validation_error"]


def field_info(cls: type[msgspec.Struct], key: str) -> Any:
    """The msgspec type info of the field at dotted `key` of `cls` (None when there is no such field): what an
    error message or an override's parsing needs to know about it."""
    info: Any = msgspec.inspect.type_info(cls)
    for part in key.split(".") if key else []:
        if not isinstance(info, msgspec.inspect.StructType):
            return None
        info = next((f.type for f in info.fields if f.name == part), None)
        if info is None:
            return None
    return info


def text_kind_of(info: Any) -> TextKind:
    """Whether a field of type `info` holds text: "str", "str?" (optional), "list[str]", or None (not text)."""
    ins = msgspec.inspect
    if isinstance(info, ins.StrType):
        return "str"
    if isinstance(info, ins.UnionType):
        kinds = {type(t) for t in info.types}
        if kinds == {ins.StrType, ins.NoneType}:
            return "str?"
    if isinstance(info, ins.ListType) and isinstance(info.item_type, ins.StrType):
        return "list[str]"
    return None


def choices(info: Any) -> str:
    """An enum field's allowed values, for an error message ("a, b, null")."""
    if isinstance(info, msgspec.inspect.UnionType):  # Literal[...] | None
        values = [v for t in info.types if isinstance(t, msgspec.inspect.LiteralType) for v in t.values]
        if any(isinstance(t, msgspec.inspect.NoneType) for t in info.types):
            values.append(None)
    else:
        values = list(getattr(info, "values", ()))
    return ", ".join("null" if v is None else str(v) for v in values)


def format_validation_error(e: msgspec.ValidationError, root: type[msgspec.Struct]) -> ConfigError:
    """msgspec's conversion error for a config of type `root` as a ConfigError that names the dotted key, with a
    "did you mean" for an unknown key, the choices of an enum, and how to quote a text field."""
    # msgspec says "... - at `$.train.optim.lr`" or "Object contains unknown field `x` - at `$.train`"
    msg = str(e)
    where = ""
    if " - at `$" in msg:
        msg, _, where = msg.partition(" - at `$")
        where = where.rstrip("`").lstrip(".")
    if msg.startswith("Object contains unknown field"):
        field = msg.split("`")[1]
        section = field_info(root, where)
        names = [f.name for f in section.fields] if isinstance(section, msgspec.inspect.StructType) else []
        if not where:
            names += list(ALIASES)
        close = difflib.get_close_matches(field, names, n=1)
        if close:  # a short override name (top level only) is suggested as itself
            suggestion = close[0] if not where and close[0] in ALIASES else key_of(where, close[0])
            if suggestion == field:  # a short override name used as a file key: files spell the key out
                suggestion = ALIASES[field]
            hint = f"; did you mean {suggestion}?"
        else:
            hint = ""
        return ConfigError(f"{key_of(where, field)}: unknown key{hint}")
    info = field_info(root, where) if where else None
    if msg.startswith("Invalid enum value") and info is not None:
        return ConfigError(
            f"{where}: {msg.replace('Invalid enum value', 'invalid value', 1)}; choose one of {choices(info)}"
        )
    if text_kind_of(info) in ("str", "str?") and msg.startswith("Expected `str"):
        msg += (
            ' (a text field: quote the value in a YAML file, e.g. "123456"; a key=value override keeps '
            "its text as typed)"
        )
    return ConfigError(f"{where or '<root>'}: {msg}")
