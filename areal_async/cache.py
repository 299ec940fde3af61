"""The on-disk cache of built and converted models: its root, its lock, atomic directories, build-code fingerprints,
and file modes that follow the umask (`follow_umask`).

Every cached model is a directory that appears under its final name only when complete: it is written into a
temporary sibling (`<final>.tmp-<pid>-<random>`), a marker file is written into it last, and the temporary
directory is renamed into place while holding `<final>.lock`. A crash at any point leaves at most a temporary
directory (removed by the next builder, which holds the lock, so no live builder owns it) and never a directory
under the final name without its marker.

The fingerprint of the build code enters cache keys, so a changed build never reuses a model built by the old code.
It hashes the modules' syntax trees without docstrings, so comments, docstrings and formatting do not force a
rebuild while every change of what the code does does.

No torch here: the controller resolves cached models through this module.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import os
import shutil
import stat
import uuid
from collections.abc import Iterator

from areal_async.host import safe_ast

ENV_VAR = "AREAL_CACHE"


def default_cache_dir() -> str:
    """`$AREAL_CACHE`, else `~/.cache/areal_async`."""
    return os.environ.get(ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "areal_async")


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """An exclusive advisory lock on `path` (created if missing), released when the block ends or the process dies."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename alone keeps the cache consistent
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def is_complete(path: str, marker: str) -> bool:
    return os.path.isfile(os.path.join(path, marker))


def fresh_tmp_dir(final: str) -> str:
    """A new, empty temporary sibling of `final`, after removing the leftovers of dead builders and an incomplete
    `final`. Call only while holding `final`'s lock."""
    parent, name = os.path.split(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    for entry in os.listdir(parent):
        if entry.startswith(name + ".tmp-"):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    if os.path.exists(final):  # no marker (the caller checked), so a partial directory of an older layout
        shutil.rmtree(final)
    tmp = os.path.join(parent, f"{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    return tmp


def code_fingerprint(modules: list[str]) -> str:
    """sha256 (hex, 16 digits) of the named modules' code: their syntax trees with docstrings removed."""
    h = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise RuntimeError(f"cannot find the source of module {name}")
        with open(spec.origin, encoding="utf-8") as f:
            tree = safe_ast.parse(f.read(), spec.origin)
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (
                isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
        h.update(name.encode() + b"\0" + ast.dump(tree).encode() + b"\0")
    return h.hexdigest()[:16]


def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def current_umask() -> int:
    """This process's umask, read without changing it where Linux tells (/proc/self/status): `os.umask` can only
    be read by setting it, which would race with other threads creating files."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str) -> None:
    """Give `path` (a file, or a directory and everything below it) the mode a plain `open()` or `mkdir` would
    have given it: safetensors writes its files 0600 whatever the umask (through a private temporary file), so a
    checkpoint or published model on a shared filesystem would be unreadable to the teammates the umask lets in.
    Executable bits are kept where set; links are not followed."""
    mask = current_umask()

    def fix(p: str) -> None:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            return
        full = 0o777 if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o111 else 0o666
        want = full & ~mask
        if stat.S_IMODE(st.st_mode) != want:
            with contextlib.suppress(PermissionError):  # another user's file (a shared directory): theirs to set
                os.chmod(p, want)

    fix(path)
    if os.path.isdir(path) and not os.path.islink(path):
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                fix(os.path.join(root, name))
