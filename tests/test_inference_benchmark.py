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


def test_decode_rounds_alternate_with_llama_cpp(monkeypatch):
    """The engine's decode rounds and llama.cpp's runs go in turns, each side keeps its best round, and the ratios
    report best over best beside the median of the rounds' own ratios."""
    import asyncio
    import types

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import inference_report as rep
    import inference_throughput as it

    calls: list[str] = []
    engine = iter([(600.0, 80.0), (640.0, 70.0), (620.0, 90.0)])  # (batch 64, batch 1) per round
    rival = iter([{1: 75.0, 64: 400.0}, {1: 100.0, 64: 420.0}, {1: 85.0, 64: 410.0}])
    pending: list[float] = []

    async def fake_rate(client, prompts, batch, steps, repeats):
        if batch == 64:
            pending[:] = list(next(engine))
        calls.append(f"engine{batch}")
        rate = pending[0] if batch == 64 else pending[1]
        return {"tokens_per_s": rate, "mean_context": 50.0, "short_wall_s": 0.1, "proportional": False}

    def fake_rival():
        calls.append("llama")
        return next(rival)

    monkeypatch.setattr(it, "decode_rate", fake_rate)
    args = types.SimpleNamespace(decode_rounds=3, decode_batch=64, decode_steps=64)
    out = asyncio.run(it.embedded_decode(None, [[1, 2, 3]], args, fake_rival))
    assert calls == ["engine64", "engine1", "llama"] * 3
    assert out["decode_tokens_per_s"] == 640.0 and out["batch1_decode_tokens_per_s"] == 90.0
    assert out["llama_decode"]["batch1_decode_tokens_per_s"] == 100.0
    assert out["llama_decode"]["decode_tokens_per_s"] == 420.0
    assert [r["llama_batch1"] for r in out["decode_rounds"]] == [75.0, 100.0, 85.0]

    row = {"tokens_per_s": 400.0, **{k: out[k] for k in ("decode_tokens_per_s", "batch1_decode_tokens_per_s")}}
    res = {
        "embedded_tokens_per_s": 400.0,
        "embedded_by_dtype": {"bf16": row | {"decode_rounds": out["decode_rounds"]}},
        "llama_cpp": {"precisions": {"bf16": {"server": {"tokens_per_s": 100.0}, **out["llama_decode"]}}},
    }
    vs = rep.llama_cpp_ratios(res)["vs_llama_cpp"]
    assert vs["decode_batch1"]["bf16"] == pytest.approx(90.0 / 100.0)
    assert vs["decode_batch1_paired"]["bf16"] == pytest.approx(sorted([80 / 75, 70 / 100, 90 / 85])[1])
    assert vs["decode_batch64_paired"]["bf16"] == pytest.approx(sorted([600 / 400, 640 / 420, 620 / 410])[1])
    assert vs["end_to_end"]["bf16"] == pytest.approx(4.0)

    # llama.cpp failing in a round: the engine's rates stand, llama.cpp's are left to be measured apart
    engine = iter([(600.0, 80.0), (640.0, 70.0), (620.0, 90.0)])
    runs = iter([{1: 75.0, 64: 400.0}])

    def failing_rival():
        rates = next(runs, None)
        if rates is None:
            raise RuntimeError("llama-batched-bench failed")
        return rates

    out = asyncio.run(it.embedded_decode(None, [[1, 2, 3]], args, failing_rival))
    assert out["batch1_decode_tokens_per_s"] == 90.0 and "llama_decode" not in out
    assert [sorted(r) for r in out["decode_rounds"]] == [["batch1", "batch64"]] * 3


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_engine_ab_measures_both_servers_in_turns(tmp_path):
    """benchmarks/engine_ab.py with this checkout as its own base: both servers come up, every round has a rate
    from each side, and the report's medians and ratio are what those rates give."""
    out = tmp_path / "ab.json"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "engine_ab.py"),
            *("--base", ROOT, "--model", "tiny", "--threads", "1", "--rounds", "3", "--steps", "8"),
            *("--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    base, new = data["base_tokens_per_s"], data["new_tokens_per_s"]
    assert len(base) == len(new) == 3 and min(base + new) > 0
    ratios = sorted(n / b for b, n in zip(base, new))
    assert data["ratio_median"] == pytest.approx(ratios[1]) and data["new_faster_rounds"] == sum(r > 1 for r in ratios)
