"""`ast.parse` that is safe to call from several threads on CPython 3.11.

CPython 3.11 keeps the AST constructor's recursion counter in per-interpreter state, not per thread, so two
threads that turn source into `ast` objects at the same time can corrupt each other's count, and a parse fails with a
spurious `SystemError: AST constructor recursion depth mismatch` (python/cpython gh-106905; seen in the test suite
on the cache fingerprint). The code reward's test analysis and the cache fingerprint parse source, and a library
thread may parse too. Our own parses are serialised by one lock, and a parse that still hits the spurious error
(from a thread outside the lock) is repeated: parsing is deterministic, so a repeat succeeds or fails for a real
reason.
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()
_ATTEMPTS = 5
_SPURIOUS = "AST constructor recursion depth mismatch"


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse(source, filename)`, serialised with this process's other callers and retried on the spurious
    3.11 error; a real `SyntaxError`, `RecursionError` or `ValueError` propagates unchanged."""
    for attempt in range(_ATTEMPTS):
        try:
            with _LOCK:
                return ast.parse(source, filename)
        except SystemError as e:
            if _SPURIOUS not in str(e) or attempt == _ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")
