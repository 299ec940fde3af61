"""Atomic file replacement: a reader (or a process that starts after a crash) sees either the old file or the new
one, whole, never a partial write.

One durability level for every small state file the package rewrites (a cut-back metrics.jsonl or ledger, a JSON
marker): the new content goes to a unique temporary sibling (`<path>.tmp-<pid>-<random>`, so two writers never share
one), is flushed and fsynced, renamed over `path` with `os.replace`, and the directory is fsynced so the rename
itself survives a power loss (best effort: some filesystems refuse a directory fsync; the rename is still atomic
there). These files are written rarely (a resume, a checkpoint), so the two fsyncs cost nothing that matters, and
a weaker level for some of them would only leave a reader to wonder which guarantee it has. On an error the
temporary file is removed and `path` is untouched.

Directories (cached models, checkpoints, published weights) are made atomic by their owners (cache.py,
train/checkpoint.py, train/publish.py): they are built in a temporary directory and renamed, which is a different
protocol (a marker file, a lock).

Standard library only: the controller side imports this.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from typing import Any

__all__ = ["write_text_atomic", "write_lines_atomic", "write_json_atomic", "fsync_dir"]


def fsync_dir(path: str) -> None:
    """fsync the directory `path` (a rename or a new entry in it survives a crash); best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse directory fsync; the rename is still atomic
        pass
    finally:
        os.close(fd)


def write_lines_atomic(path: str, lines: Iterable[str]) -> None:
    """Replace `path` by the concatenation of `lines` (each carries its own newline), atomically and durably."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(parent)


def write_text_atomic(path: str, text: str) -> None:
    """Replace `path` by `text`, atomically and durably."""
    write_lines_atomic(path, (text,))


def write_json_atomic(path: str, data: Any, **dump_options: Any) -> None:
    """Replace `path` by `json.dumps(data, **dump_options)`, atomically and durably. The text is made before the
    file is opened, so data that cannot be serialised leaves no temporary file."""
    write_text_atomic(path, json.dumps(data, **dump_options))
