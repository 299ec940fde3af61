"""Smoke test: the controller-capacity benchmark runs end to end on tiny settings (no speed assertion)."""

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "controller_overhead.py")


def test_controller_overhead_quick(tmp_path):
    out = tmp_path / "co.json"
    subprocess.run([sys.executable, BENCH, "--out", str(out), "--quick", "--seconds", "1"], check=True, timeout=120)
    data = json.loads(out.read_text())
    run = data["runs"][0]
    assert run["inflight"] == 50 and run["requests_per_s"] > 0 and run["failed"] == 0
    assert {"p99_loop_lag_ms", "cpu_ms_per_sample"} <= run.keys()
