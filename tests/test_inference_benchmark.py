"""Smoke test: benchmarks/inference_throughput.py --quick runs end to end and writes its JSON (no speed asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_inference_throughput_quick(tmp_path):
    out = tmp_path / "inference_throughput.json"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "inference_throughput.py"),
            "--quick",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    for key in ("embedded_tokens_per_s", "hf_tokens_per_s", "ratio", "pause_latency_ms"):
        assert data[key] > 0, key
    # batch-64 (here the quick batch) and batch-1 decode rates, and a roofline with the best backend named
    assert data["decode_tokens_per_s"] > 0 and data["batch1_decode_tokens_per_s"] > 0
    assert data["gemm_roofline_gflops"] > 0 and data["gemm_roofline_backend"]
    assert data["llama_cpp"] is None  # never auto-found in --quick
    assert data["tokens"] == data["settings"]["sum_new_tokens"]
    assert data["pause_aborted_requests"] == data["pause_in_flight"] == data["settings"]["requests"]
    assert "ratio" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_prefix_cache_quick(tmp_path):
    out = tmp_path / "prefix_cache.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "prefix_cache.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    on, off = data["prefix_cache_on"], data["prefix_cache_off"]
    assert on["tokens_per_s"] > 0 and off["tokens_per_s"] > 0
    assert off["cached_prompt_frac"] == 0
    assert len(on["rounds"]) == len(off["rounds"]) == 2
