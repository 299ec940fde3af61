"""The engine's matmuls of a decode step, per row count, through each code that could take them: the packed
kernels (server/kernels/gemm_packed.py), the unpacked few-rows kernels (kernels/gemm.py, kernels/gemm_bf16.py) and
torch's product (MKL for fp32; oneDNN for bf16, with the rows rounded to bf16 as the engine does). It sets the row
limits in gemm_packed.py: where the packed kernel stops beating torch.

    python benchmarks/gemm_packed.py --threads 2 --out benchmarks/results/gemm_packed_zen5.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 AREAL_KERNEL_MARCH=x86-64-v3 \
        python benchmarks/gemm_packed.py --threads 2 --out benchmarks/results/gemm_packed_zen5_avx2.json

One "step" is SmolLM2-135M's 30 layers of four products (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536)
plus its 49,152-row LM head, on weights of those shapes, each layer its own (random values; the time does not depend
on them), so that a step streams them from memory as the model's does. Every variant runs the same step in turn,
`--rounds` times, so that load drifting on a shared machine hits all alike; the median is reported, wall clock at
`--threads`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from areal_async.host.torch_threads import one_thread_until_set

    one_thread_until_set()
    import torch
    import torch.nn.functional as F

    from areal_async.host.cpu_features import describe
    from areal_async.server.kernels import gemm as gemm_f32
    from areal_async.server.kernels import gemm_bf16, gemm_packed

    torch.set_num_threads(args.threads)
    packed_k, f32_k, bf16_k = gemm_packed.load(), gemm_f32.load(), gemm_bf16.load()
    if packed_k is None:
        sys.exit("the packed kernels could not be built here")
    results: dict = {}
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        ws = {
            s: [torch.randn(n, k).to(dtype) for _ in range(1 if s == "lm_head" else LAYERS)]
            for s, (n, k) in SHAPES.items()
        }
        packs = {s: [packed_k.pack(w) for w in v] for s, v in ws.items()}
        for rows in map(int, args.rows.split(",")):
            xs = {s: torch.randn(rows, k) for s, (n, k) in SHAPES.items()}  # [rows, K] fp32 activations

            def step(one) -> None:
                for i in range(LAYERS):
                    for s in ("qkv", "o", "gate_up", "down"):
                        one(s, i)
                one("lm_head", 0)

            def torch_one(s: str, i: int) -> None:
                x = xs[s] if dtype == torch.float32 else xs[s].to(dtype)
                F.linear(x, ws[s][i])

            variants = {
                "packed": lambda: step(lambda s, i: packed_k.linear(xs[s], packs[s][i], ws[s][i])),
                "torch": lambda: step(torch_one),
            }
            few = f32_k if dtype == torch.float32 else bf16_k
            if few is not None and few.applies(xs["qkv"], ws["qkv"][0]):
                mod = gemm_f32 if dtype == torch.float32 else gemm_bf16
                variants["unpacked"] = lambda mod=mod, few=few: step(lambda s, i: mod.linear(few, xs[s], ws[s][i]))
            for fn in variants.values():
                fn()  # warm-up
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            med = {v: statistics.median(t) * 1000 for v, t in times.items()}
            results.setdefault(dname, {})[rows] = {
                "ms": med,
                "packed_over_torch": med["torch"] / med["packed"],
                **({"packed_over_unpacked": med["unpacked"] / med["packed"]} if "unpacked" in med else {}),
            }
            line = "  ".join(f"{v} {t:8.2f} ms" for v, t in med.items())
            print(f"{dname:8s} rows {rows:4d}  {line}  torch/packed {med['torch'] / med['packed']:.2f}", flush=True)
    out = {
        "results": results,
        "settings": {
            "threads": args.threads,
            "rounds": args.rounds,
            "shapes": SHAPES,
            "layers": LAYERS,
            "cpu": describe(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "kernel_march": os.environ.get("AREAL_KERNEL_MARCH", "native"),
            "packed": {"has_dp": packed_k.has_dp, "vector_width": packed_k.vector_width},
            "load_average": os.getloadavg(),
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
