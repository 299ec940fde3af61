"""Who runs the real-vLLM tests, shared by their modules (test_vllm_real, test_vllm_broadcast, test_vllm_run): a real
vLLM takes ~5 GB and both cores of a small host for minutes, so the tests are opt-in (AREAL_VLLM_TESTS=1), and the
CI leg (.ci/vllm_leg.sh, AREAL_REQUIRE_VLLM=1) turns every skip into a failure. AREAL_VLLM_PYTHON names another
engine interpreter than scripts/install_vllm.sh's."""

from __future__ import annotations

import os

import pytest

from areal_async.launch.vllm_server import check_vllm_python, default_vllm_python

PYTHON = os.environ.get("AREAL_VLLM_PYTHON") or default_vllm_python()
REQUIRED = os.environ.get("AREAL_REQUIRE_VLLM") == "1"
WANTED = REQUIRED or os.environ.get("AREAL_VLLM_TESTS") == "1"


def need_vllm() -> None:
    """Skip (or, under AREAL_REQUIRE_VLLM=1, fail) with the reason unless a real vLLM can run here."""
    if not WANTED:
        pytest.skip("real-vLLM tests are opt-in: AREAL_VLLM_TESTS=1, or .ci/vllm_leg.sh (AREAL_REQUIRE_VLLM=1)")
    why = check_vllm_python(PYTHON)
    if why:
        if REQUIRED:
            pytest.fail(f"AREAL_REQUIRE_VLLM=1 but vLLM cannot run: {why}")
        pytest.skip(f"no vLLM engine venv ({why}); scripts/install_vllm.sh builds it")
