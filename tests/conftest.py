"""Shared fixtures: tiny checkpoints made once per session (no downloads)."""

from __future__ import annotations

import os

import pytest

from areal_async.testing.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    """A tiny random Qwen2 checkpoint with the char tokenizer."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "qwen2"), "qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_b(tmp_path_factory) -> str:
    """Same architecture, different weights: for weight-update tests."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "qwen2_b"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_ckpts_all_archs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("archs")
    return {a: make_tiny_checkpoint(str(root / a), a, seed=0) for a in ("qwen2", "qwen3", "llama")}


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            # the marker itself: `"gpu" in item.keywords` also matches a folder named gpu above the tests
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
