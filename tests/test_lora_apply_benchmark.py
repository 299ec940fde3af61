"""Smoke test: benchmarks/lora_apply.py --quick runs end to end and writes its JSON (no speed asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_lora_apply_quick(tmp_path):
    out = tmp_path / "lora_apply.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "lora_apply.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["adapter"]["rank"] == 8 and data["adapter"]["alpha"] == 16
    assert len(data["adapter"]["target_modules"]) == 7
    assert data["machine"]["lscpu_model_name"] and "load average" in data["machine"]["uptime"]
    version = data["typical_version"]
    assert version["trained"]["decode_tokens"] == 8 * 8 * version["mean_response_tokens"]
    assert version["served"]["decode_tokens"] > version["trained"]["decode_tokens"]
    m = data["models"]["tiny"]
    spec = m["shape"]
    assert m["adapted_modules"] == 7 * spec["layers"]
    # the run-time forward computes what the merged weights compute
    assert max(m["max_logit_diff_runtime_vs_merged"].values()) < 1e-3
    merge = m["merge"]
    assert merge["versions"] >= 5 and merge["merge_s"] > 0 and merge["swap_s"] > 0
    assert merge["version_s"] == pytest.approx(merge["merge_s"] + merge["swap_s"])
    res = m["by_threads"]["1"]
    assert set(res["decode"]) == {"1", "4"} and res["prefill"]["tokens_per_step"] == 32
    for block in [*res["decode"].values(), res["prefill"]]:
        assert block["step_ms"] > 0 and block["extra_ms"] > 0
        assert block["best_layout"] in block["ops_ms"]
        assert block["extra_ms"] == min(block["ops_ms"].values())
        assert all(len(s) == 5 for s in block["samples_ms"].values())
    conc = m["conclusion"]
    assert set(conc["faster"]) == {"trained", "served", "busy_s"}
    assert all(v in ("merged", "run time", "depends on the batch") for v in conc["faster"].values())
    for row in conc["by_threads"]["1"].values():
        assert row["break_even_tokens"] > 0 and row["tokens_busy_s"] > 0
        for kind in ("trained", "served", "busy_s"):
            assert row[f"runtime_over_merged_{kind}"] > 0
    assert "break-even" in proc.stdout
