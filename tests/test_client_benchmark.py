"""Smoke test: benchmarks/client_streaming.py --quick runs end to end and writes its JSON (no speed asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_client_streaming_quick(tmp_path):
    out = tmp_path / "client_streaming.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "client_streaming.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    for name in ("mixed", "long"):
        w = data["workloads"][name]
        assert w["json_tokens_per_s"] > 0 and w["stream_tokens_per_s"] > 0 and w["ratio_median"] > 0
        assert all(r["tokens"] == w["tokens"] for runs in w["runs"].values() for r in runs)
    assert "stream / json" in proc.stdout
