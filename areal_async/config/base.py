"""The pieces every config section is built from: the error that names a key, the section base class and its
checks. Leaf module: imports nothing of the package and never torch."""

from __future__ import annotations

import msgspec

__all__ = ["ConfigError", "Section", "key_of", "check", "is_host_port"]


class ConfigError(ValueError):
    """A config problem; the message starts with the offending key."""


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    def validate(self, prefix: str = "") -> None:  # overridden where there is something to check
        del prefix


def key_of(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def is_host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
