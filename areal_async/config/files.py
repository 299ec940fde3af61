"""Config files and overrides as plain nested dicts, before any typing: YAML files with `base:` includes (resolved
relative to the including file; later keys win, mappings merge, lists are replaced) and dotted `key=value` overrides
(the value parsed as YAML, except where the field is text: see `apply_overrides`). run_config.py turns the result into a
RunConfig. Never torch."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any, Literal

import yaml

from areal_async.config.base import ConfigError

__all__ = ["ALIASES", "TextKind", "apply_overrides", "lookup", "read_yaml"]

# short override names (command line only; files use the full keys)
ALIASES = {
    "mode": "schedule.mode",
    "eta": "schedule.eta",
    "steps": "schedule.total_steps",
    "total_steps": "schedule.total_steps",
}


# How a field takes override text: "str" keeps the text as typed, "str?" too except for null / ~ / nothing (None),
# "list[str]" keeps each item of a flow list as typed; None (any other field): the value is YAML.
TextKind = Literal["str", "str?", "list[str]"] | None

_NULL_TAG = "tag:yaml.org,2002:null"


def _parse_value(text: str, kind: TextKind = None) -> Any:
    """The right side of `key=value`. As YAML (`eta=4`, `urls=[a,b]`, `eta=null`), except for text fields, where
    YAML's own typing would turn `0`, `123456`, `no` or `1e-5` into a number or a boolean that a str field then
    refuses: there the scalar's text is kept as typed (its quotes, if any, removed)."""
    if kind is not None:
        try:
            node = yaml.compose(text)
        except yaml.YAMLError:
            return text
        if node is None:  # `key=` or `key=   `
            return None if kind == "str?" else text
        if kind in ("str", "str?"):
            if not isinstance(node, yaml.ScalarNode):  # `a: b`, `[x]`: text too, for a text field
                return text
            if kind == "str?" and node.tag == _NULL_TAG and not node.style:
                return None
            return node.value
        if (
            kind == "list[str]"
            and isinstance(node, yaml.SequenceNode)
            and all(isinstance(item, yaml.ScalarNode) for item in node.value)
        ):
            return [item.value for item in node.value]
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(
    raw: dict[str, Any], overrides: list[str], text_kind: Callable[[str], TextKind] | None = None
) -> dict[str, Any]:
    """Set dotted keys (`train.optim.lr=1e-5`) in a nested dict (a copy). Short names in `ALIASES` are expanded.

    `text_kind(key)` says which keys are text fields (run_config.py knows the types); their values are kept as typed
    rather than read as YAML, so `server.api_key=123456` is the string "123456"."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item}: overrides are key=value")
        key, _, value = item.partition("=")
        key = ALIASES.get(key.strip(), key.strip())
        node = raw
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a section")
            node = nxt
        node[parts[-1]] = _parse_value(value, text_kind(key) if text_kind is not None else None)
    return raw


def lookup(raw: dict[str, Any], key: str) -> tuple[bool, Any]:
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A config file as a nested dict, with its `base:` chain merged in (the base first, this file on top)."""
    real = os.path.realpath(path)
    if real in _seen:
        raise ConfigError(f"{path}: base: includes form a cycle ({' -> '.join(_seen + (real,))})")
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        try:
            loaded = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    base = loaded.pop("base", None)
    if base is None:
        return loaded
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: must be a file name")
    base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
    return _deep_merge(read_yaml(base_path, _seen + (real,)), loaded)
