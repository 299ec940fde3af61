"""Config files and overrides as plain nested dicts, before any typing: YAML files with `base:` includes (resolved
relative to the including file; later keys win, mappings merge, lists are replaced) and dotted `key=value` overrides
(the value parsed as YAML). config.py turns the result into a RunConfig. Never torch."""

from __future__ import annotations

import copy
import os
from typing import Any

import yaml

from areal_async.config_base import ConfigError

__all__ = ["ALIASES", "apply_overrides", "lookup", "read_yaml"]

# short override names (command line only; files use the full keys)
ALIASES = {"mode": "schedule.mode", "eta": "schedule.eta", "steps": "schedule.total_steps",
           "total_steps": "schedule.total_steps"}


def _parse_value(text: str) -> Any:
    """Parse the right side of `key=value` as YAML, so `eta=4`, `urls=[a,b]` and `eta=null` do the right thing."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys (`train.optim.lr=1e-5`) in a nested dict (a copy). Short names in `ALIASES` are expanded."""
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
                raise ConfigError(f"{'.'.join(parts[:i + 1])}: is not a section")
            node = nxt
        node[parts[-1]] = _parse_value(value)
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
