"""Every config key with its default and documentation (`python -m areal_async.run --help`).

The documentation of a field is the string literal under it in config/run_config.py, config/trainer.py,
config/server.py or config/cluster.py (an attribute docstring, as Sphinx reads them); it is read from the modules'
source, so it works from an installed copy too. tests/test_config.py checks that no field goes without one. No
torch here.
"""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import msgspec
import yaml

from areal_async.config import cluster as config_cluster
from areal_async.config import run_config
from areal_async.config import server as config_server
from areal_async.config import trainer as config_trainer


@functools.lru_cache(maxsize=1)
def _field_docs() -> dict[tuple[str, str], str]:
    """(class name, field) -> the string literal under the field in the modules that define sections."""
    docs: dict[tuple[str, str], str] = {}
    modules = (run_config, config_trainer, config_cluster, config_server)
    nodes = [n for m in modules for n in ast.parse(inspect.getsource(m)).body]
    for node in nodes:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt, nxt in zip(node.body, node.body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[(node.name, stmt.target.id)] = inspect.cleandoc(nxt.value.value)
    return docs


def field_doc(cls: type[msgspec.Struct], name: str) -> str | None:
    return _field_docs().get((cls.__name__, name))


def iter_fields(
    cls: type[msgspec.Struct] = run_config.RunConfig, prefix: str = ""
) -> Iterator[tuple[str, Any, str | None]]:
    """(dotted key, default, doc) for every leaf field, depth first in declaration order."""
    default = cls()
    for name in cls.__struct_fields__:
        value = getattr(default, name)
        key = f"{prefix}.{name}" if prefix else name
        if isinstance(value, msgspec.Struct):
            yield from iter_fields(type(value), key)
        else:
            yield key, value, field_doc(cls, name)


VALUES = (
    "Values are YAML (eta=null, server.urls=[http://a:1, http://b:2], train.optim.lr=1e-5), except for "
    "text fields,\nwhich keep the text as typed (server.api_key=123456, slurm.account=no, "
    "train.cuda_visible_devices=0); an\noptional text field takes null for null and '\"null\"' (quoted, "
    "inside the shell's quotes) for the word."
)


def describe(cls: type[msgspec.Struct] = run_config.RunConfig) -> str:
    """Every key with its default and documentation, section after section, after how override values are read
    (the one thing about them a user cannot guess from the types)."""
    lines: list[str] = [VALUES]
    section = None
    for key, default, doc in iter_fields(cls):
        head = key.split(".")[0] if "." in key else ""
        if head != section:
            section = head
            title = (
                (type(getattr(cls(), head)).__doc__ or "").strip().split("\n")[0]
                if head
                else (cls.__doc__ or "").strip().split("\n")[0]
            )
            lines.append(f"\n{head or 'top level'}: {title}")
        shown = yaml.safe_dump(msgspec.to_builtins(default), default_flow_style=True).strip()
        lines.append(f"  {key} = {shown.removesuffix('...').strip()}")
        lines.extend(f"      {chunk}" for chunk in (doc or "").split("\n"))
    return "\n".join(lines)
