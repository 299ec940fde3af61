"""Shared fixtures: tiny checkpoints made once per session (no downloads)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

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


_prebuild: subprocess.Popen | None = None


def pytest_sessionstart(session):
    """On a machine without the default base model (a fresh clone in CI), start building it now, in the
    background, on the core the first tests leave idle: whichever test needs it first (model.path=tiny) waits on
    the cache's lock instead of building it from scratch. Only for a whole-suite run; a run that selects
    tests (files, -k, -m, node ids) builds it when, and if, a test needs it."""
    global _prebuild
    root = str(session.config.rootpath)
    whole = {os.path.realpath(root), os.path.realpath(os.path.join(root, "tests"))}
    if session.config.getoption("keyword") or session.config.getoption("markexpr") or any(
            os.path.realpath(a) not in whole for a in session.config.args):
        return
    from areal_async.tasks.base_model import cached_path, is_built

    if is_built(cached_path()):
        return
    log = open(os.path.join(session.config.rootpath, ".pytest_base_model.log"), "w")
    _prebuild = subprocess.Popen([sys.executable, "-m", "areal_async.tasks.base_model"], stdout=log,
                                 stderr=subprocess.STDOUT)


def pytest_sessionfinish(session, exitstatus):
    if _prebuild is not None and _prebuild.poll() is None:  # no test needed it after all: stop it (SIGINT, so
        _prebuild.send_signal(signal.SIGINT)               # that it removes its temporary directory)
        try:
            _prebuild.wait(30)
        except subprocess.TimeoutExpired:
            _prebuild.kill()


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            # the marker itself: `"gpu" in item.keywords` also matches a folder named gpu above the tests
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
