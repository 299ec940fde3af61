"""The inference benchmark's roofline: the best rate this machine reaches on the model's own matmul shapes, across
torch, oneDNN, MKL and ggml, per dtype and ISA.

Why several libraries: MFU against torch alone overstates how close the engine is to the limit when another library
runs the same shapes faster (llama.cpp's F32 decode reached more GFLOP/s than torch's GEMM loop on Zen 5). So each
candidate times exactly the same work, the model's matmuls ([rows, in] x [in, out], each as often as the model has
it) at the engine's thread count, and the roofline is the best of them:
- `torch_mm`: `torch.mm(x, w.t())`, what a plain PyTorch model does (MKL sgemm for fp32, oneDNN for bf16);
- `onednn_packed`: oneDNN's linear on a weight reordered once for this batch (`torch.ops.mkldnn._linear_pointwise`,
  the path torch.compile's CPU backend takes);
- `mkl_packed`: MKL's packed sgemm (`torch.ops.mkl._mkl_linear`), fp32 only;
- `engine_packed`: the engine's own packed-weight kernel (areal_async/server/kernels/gemm_packed.py: fp32 rows against
  fp32 or bf16 weights), built for the same ISA (x86-64-v3 under `avx2`);
- `ggml`: ggml_mul_mat through benchmarks/ggml_gemm_bench.c, built against llama.cpp for the same ISA;
- `llama_decode`: llama.cpp's whole batch-64 decode step (model FLOPs / step time). A lower bound of ggml's GEMM rate
  (the step does more than matmuls), counted because it has been the best figure on this CPU.
ISA: `native` is whatever the CPU has; `avx2` holds torch to AVX2 (`ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`, read when a process starts, so torch's side runs in a child
process) and uses the x86-64-v3 llama.cpp build.

    python benchmarks/roofline.py --rows 64 --threads 2 --shapes '[[[576, 960], 30], ...]' --dtypes fp32,bf16
prints {dtype: {backend: GFLOP/s}} as one JSON line (the torch side; the benchmark adds ggml).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
Shapes = list[tuple[tuple[int, int], int]]


def model_flops(cfg: dict) -> dict[str, Any]:
    """Matmul shapes of one token through the model ([in, out] and count), and FLOPs per token (2 x the parameters
    in matmuls, LM head included; attention's q.k and p.v counted per token of context)."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    shapes = [
        ((h, (heads + 2 * kv) * d), layers),
        ((heads * d, h), layers),
        ((h, 2 * i), layers),
        ((i, h), layers),
        ((h, cfg["vocab_size"]), 1),
    ]
    per_token = sum(2 * a * b * n for (a, b), n in shapes)
    return {"shapes": shapes, "matmul_flops_per_token": per_token, "attn_flops_per_ctx_token": 4 * layers * heads * d}


def _best_rate(once: Callable[[], None], flops: float, seconds: float) -> float:
    """FLOP/s of the fastest call of `once` within `seconds`, after a warm-up call. A call slower than the whole
    budget (bf16 emulated on AVX2) is timed once, so a slow path cannot stall the run."""
    t0 = time.perf_counter()
    once()
    first = time.perf_counter() - t0
    if first > seconds:
        return flops / first
    best, t_end = math.inf, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
    return flops / best


def torch_rates(shapes: Shapes, rows: int, threads: int, dtypes: list[str], seconds: float) -> dict[str, dict]:
    """{dtype: {backend: GFLOP/s}} for the torch-side backends of this process's ISA (see the module docstring).
    Every layer gets weights of its own, as in the model, so the rate includes streaming them from memory."""
    import torch

    torch.set_num_threads(threads)
    flops = sum(2 * rows * a * b * n for (a, b), n in shapes)
    out: dict[str, dict] = {}
    for name in dtypes:
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        x = {a: torch.randn(rows, a).to(dt) for (a, _), _ in shapes}  # [rows, in]
        ws = [(a, torch.randn(b, a).to(dt)) for (a, b), n in shapes for _ in range(n)]  # [out, in]
        rates: dict[str, float] = {}

        def mm(ws=ws, x=x) -> None:
            for a, w in ws:
                torch.mm(x[a], w.t())

        rates["torch_mm"] = _best_rate(mm, flops, seconds)
        try:
            packed = [(a, torch.ops.mkldnn._reorder_linear_weight(w, rows)) for a, w in ws]

            def onednn(packed=packed, x=x) -> None:
                for a, w in packed:
                    torch.ops.mkldnn._linear_pointwise(x[a], w, None, "none", [], "")

            rates["onednn_packed"] = _best_rate(onednn, flops, seconds)
        except (RuntimeError, AttributeError) as e:  # a torch without oneDNN
            print(f"roofline: oneDNN packed linear unavailable: {e}", file=sys.stderr)
        if name == "fp32" and torch.backends.mkl.is_available():
            mkl = [(a, torch.ops.mkl._mkl_reorder_linear_weight(w, rows), w) for a, w in ws]

            def mkl_linear(mkl=mkl, x=x) -> None:
                for a, p, w in mkl:
                    torch.ops.mkl._mkl_linear(x[a], p, w, None, rows)

            rates["mkl_packed"] = _best_rate(mkl_linear, flops, seconds)
        eng = _engine_packed()
        if eng is not None:
            xf = {a: v.float() for a, v in x.items()}  # the engine's rows are fp32 whatever the weights
            panels = [(a, eng.pack(w), w) for a, w in ws]

            def engine(panels=panels, xf=xf) -> None:
                for a, p, w in panels:
                    eng.linear(xf[a], p, w)

            rates["engine_packed"] = _best_rate(engine, flops, seconds)
        out[name] = {k: v / 1e9 for k, v in rates.items()}
    return out


def _engine_packed():
    """The engine's packed matmul kernel for this process's target, or None where it cannot be built."""
    try:
        from areal_async.server.kernels import gemm_packed
    except ImportError:
        return None
    return gemm_packed.load()


def torch_rates_in_child(
    isa: str, shapes: Shapes, rows: int, threads: int, dtypes: list[str], seconds: float
) -> dict[str, dict]:
    """torch_rates in a fresh interpreter, held to AVX2 when `isa` is "avx2" (the ISA variables are read at start)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for k in [*AVX2_ENV, "AREAL_KERNEL_MARCH"]:
        env.pop(k, None)
    if isa == "avx2":
        env.update(AVX2_ENV)
        env["AREAL_KERNEL_MARCH"] = "x86-64-v3"
    cmd = [
        sys.executable, os.path.abspath(__file__), "--rows", str(rows), "--threads", str(threads),
        "--shapes", json.dumps(shapes), "--dtypes", ",".join(dtypes), "--seconds", str(seconds),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ggml_rate(bench: str, dtype: str, shapes: Shapes, rows: int, threads: int, seconds: float) -> float:
    """GFLOP/s of ggml_mul_mat on `shapes` with weights of `dtype` (fp32, bf16, q8_0), from ggml-gemm-bench."""
    gtype = {"fp32": "f32", "bf16": "bf16", "q8_0": "q8_0"}[dtype]
    args = [f"{a}:{b}:{n}" for (a, b), n in shapes]
    out = subprocess.run(
        [bench, gtype, str(rows), str(threads), str(seconds), *args], capture_output=True, text=True, timeout=900,
        check=True,
    )  # fmt: skip
    return float(json.loads(out.stdout.strip().splitlines()[-1])["gflops"])


def combine(rates: dict[str, float]) -> dict[str, Any]:
    """The candidates of one (ISA, dtype), with the best one named: the roofline MFU is taken against."""
    got = {k: v for k, v in rates.items() if v and v > 0}
    if not got:
        return {"best_gflops": None, "best_backend": None, "candidates": {}}
    best = max(got, key=lambda k: got[k])
    return {"best_gflops": got[best], "best_backend": best, "candidates": got}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--shapes", required=True, help="JSON [[[in, out], count], ...]")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    shapes = [((int(a), int(b)), int(n)) for (a, b), n in json.loads(args.shapes)]
    print(json.dumps(torch_rates(shapes, args.rows, args.threads, args.dtypes.split(","), args.seconds)))


if __name__ == "__main__":
    main()
