"""One decode step of the embedded engine's model, attention path against attention path, and against the time the
step's own matmuls take alone: where a decode step's time goes, without HTTP or scheduling in the way.

    python benchmarks/decode_step.py --model DIR_OR_NAME --batch 64 --threads 1 --out benchmarks/out/decode_step.json

A `DecoderModel` with the checkpoint's weights, a KV cache filled with random values (so reads cost what they cost
in serving), `--batch` rows with lognormal context lengths (median `--context`), one new token each. Timed, best of
`--rounds`, alternating so that load drifting on a shared machine hits every variant alike:
- `paged`: decode attention straight from the pages (the CPU kernel, kernels/attention.py), as the engine runs on CPU;
- `gather_sdpa`: every row's pages gathered into a padded batch, SDPA with an additive mask (the portable path);
- `paged_torch_mm`: as `paged`, with every matmul through torch (the few-rows kernel, kernels/gemm.py, off);
- `gemm_only`: the step's matmuls alone (the model's own weight tensors, same rows, same threads): the roofline.
`--cpu-time` times with the process's CPU time instead of the wall clock: on a shared machine (load above the core
count) a preempted step then costs what it computed, not what it waited; meaningful at `--threads 1`.
MFU = gemm_only / step time: the share of the matmul-only speed the whole step reaches (attention FLOPs, ~2% here,
are not credited).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny", help="tiny | smollm2-135m-instruct | a checkpoint directory")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=150, help="median context length of the rows")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-time", action="store_true", help="time with process CPU time (shared machines)")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inference_throughput import resolve_model

    from areal_async.server.model import DecoderModel, KVCache, build_step_batch
    from areal_async.server.weights import load_checkpoint

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
        spec, tensors = load_checkpoint(resolve_model(args.model, tmp, args.seed, quick=False))
    model = DecoderModel(spec)
    model.load_tensors(tensors)
    del tensors
    kernel, gemm = model._kernel, model._gemm
    cpu, ps, b = torch.device("cpu"), 16, args.batch
    rng = random.Random(args.seed)
    cap = spec.max_position_embeddings - 2
    ctxs = [max(1, min(cap, int(rng.lognormvariate(math.log(args.context), 0.5)))) for _ in range(b)]
    max_pages = -(-(max(ctxs) + 1) // ps)
    cache = KVCache(spec, b * max_pages * ps, ps, cpu, torch.float32)
    cache.kv.normal_().mul_(0.5)
    table = torch.zeros(b, max_pages, dtype=torch.long)
    order = torch.randperm(b * max_pages, generator=torch.Generator().manual_seed(args.seed)) + 1  # scattered pages
    seqs = []
    for i, c in enumerate(ctxs):
        pages = order[i * max_pages : (i + 1) * max_pages].tolist()
        table[i] = torch.tensor(pages)
        seqs.append(([rng.randrange(spec.vocab_size)], c, pages, i))

    def step(paged: bool, own_mm: bool = True) -> torch.Tensor:
        model.paged_decode, model._kernel = paged, kernel if paged else None
        model._gemm = gemm if own_mm else None
        batch = build_step_batch(seqs, table, ps, cpu, [[0]] * b, paged_decode=paged)
        return model.forward(batch, cache)

    x = torch.randn(b, spec.hidden_size)
    xi = torch.randn(b, spec.intermediate_size)
    xq = torch.randn(b, spec.q_size)

    def gemm_only() -> None:
        for layer in model.layers:
            F.linear(x, layer.qkv_w, layer.qkv_b)
            torch.addmm(x, xq, layer.o_w.t())
            F.linear(x, layer.gate_up_w, layer.gate_up_b)
            torch.addmm(x, xi, layer.down_w.t())
        F.linear(x, model.lm_head)

    variants = {"gather_sdpa": lambda: step(False), "gemm_only": gemm_only}
    if kernel is not None:
        variants = {"paged": lambda: step(True), "paged_torch_mm": lambda: step(True, False), **variants}
        diff = float((step(True) - step(False)).abs().max())
    else:
        print("the CPU attention kernel is not available here; timing the portable path only", file=sys.stderr)
        diff = float("nan")
    best = {k: math.inf for k in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            t0 = clock()
            fn()
            best[name] = min(best[name], clock() - t0)
    res = {f"{k}_ms": v * 1000 for k, v in best.items()}
    for k in ("paged", "paged_torch_mm", "gather_sdpa"):
        if k in best:
            res[f"{k}_tokens_per_s"] = b / best[k]
            res[f"{k}_mfu"] = best["gemm_only"] / best[k]
    res.update(
        {
            "roofline_tokens_per_s": b / best["gemm_only"],
            "max_logit_diff_paged_vs_gather": diff,
            "settings": {
                "model": args.model,
                "batch": b,
                "mean_context": sum(ctxs) / b,
                "threads": args.threads,
                "rounds": args.rounds,
                "clock": "process_time" if args.cpu_time else "wall",
                "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "kernel_march": os.environ.get("AREAL_KERNEL_MARCH", "native"),
                "load_average": os.getloadavg(),
            },
        }
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"batch {b}, mean context {sum(ctxs) / b:.0f}, {args.threads} thread(s); best of {args.rounds}")
    for k in variants:
        extra = f"  MFU {res[k + '_mfu']:.2f}" if k + "_mfu" in res else ""
        print(f"  {k:<12} {res[k + '_ms']:8.1f} ms{extra}")


if __name__ == "__main__":
    main()
