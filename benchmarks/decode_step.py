"""One decode step of the embedded engine's model, taken apart: where a decode step's time goes, without HTTP or
scheduling in the way.

    python benchmarks/decode_step.py --model smollm2-135m-instruct --batch 64 --threads 1 --cpu-time \
        --dtype bfloat16 --out benchmarks/out/decode_step.json

A `DecoderModel` with the checkpoint's weights in `--dtype` (the served dtype: weights and KV cache; on CPU the
activations are fp32 either way), a KV cache filled with random values (so reads cost what they cost in serving),
`--batch` rows with lognormal context lengths (median `--context`), one new token each. Timed, best of `--rounds`,
alternating so that load drifting on a shared machine hits every variant alike:
- `paged`: the step as the engine runs it on CPU (decode attention straight from the pages, kernels/attention.py;
  every matmul routed by server/cpu_matmul.py; each layer one C call, kernels/decode_layer.py), greedy sampling
  included;
- `paged_op_by_op`: as `paged`, the layers op by op from Python (the same kernels, the same results);
- `gather_sdpa`: every row's pages gathered into a padded batch, SDPA with an additive mask (the portable path);
- `paged_torch_mm`: as `paged`, with every matmul through torch (the packed and few-rows kernels off);
- `gemm_only`: torch's product of the step's matmuls alone (the model's own weights, same rows, same threads).
Then the parts of a `paged_op_by_op` step, each timed alone over all layers with the step's own tensors (`parts`):
each matmul shape through the engine's route (qkv, o, gate_up, down, lm_head), attention over the paged KV, the
norms, SiLU-gating, RoPE + KV store, the embedding, building the step's tensors on the host, and sampling (greedy,
and temperature 0.7 as the training runs sample). `other` = the op-by-op step minus its parts: the Python and
dispatch cost of the forward's ~20 ops per layer, which the one-call layers of `paged` take out.
`--cpu-time` times with the process's CPU time instead of the wall clock: on a shared machine (load above the core
count) a preempted step then costs what it computed, not what it waited; meaningful at `--threads 1`.
MFU = gemm_only / step time: the share of torch's matmul-only speed the whole step reaches.
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
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="served dtype")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=150, help="median context length of the rows")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-time", action="store_true", help="time with process CPU time (shared machines)")
    ap.add_argument("--no-parts", action="store_true", help="time the whole-step variants only")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inference_throughput import resolve_model

    from areal_async.host.cpu_features import describe
    from areal_async.server.model import DecoderModel, KVCache, build_step_batch
    from areal_async.server.sampling import RowParams, sample
    from areal_async.server.weights import load_checkpoint

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
        spec, tensors = load_checkpoint(resolve_model(args.model, tmp, args.seed, quick=False))
    model = DecoderModel(spec, dtype=dtype)
    model.load_tensors(tensors)
    del tensors
    kernel, mm = model._kernel, model.mm
    few_rows = (mm.packed, mm.gemm, mm.gemm_bf16)
    cpu, ps, b = torch.device("cpu"), 16, args.batch
    rng = random.Random(args.seed)
    cap = spec.max_position_embeddings - 2
    ctxs = [max(1, min(cap, int(rng.lognormvariate(math.log(args.context), 0.5)))) for _ in range(b)]
    need = [-(-(c + 1) // ps) for c in ctxs]  # pages per row, the new token's included
    max_pages = max(need)
    # as many pages as the rows use (sized b * max_pages, long contexts would not fit in memory); KVCache adds page 0
    cache = KVCache(spec, sum(need) * ps, ps, cpu, dtype)
    cache.kv.normal_(generator=torch.Generator().manual_seed(args.seed)).mul_(0.5)  # the same cache every run
    table = torch.zeros(b, max_pages, dtype=torch.long)
    order = (torch.randperm(sum(need), generator=torch.Generator().manual_seed(args.seed)) + 1).tolist()  # scattered
    seqs = []
    for i, c in enumerate(ctxs):
        pages = order[sum(need[:i]) : sum(need[: i + 1])]
        table[i, : len(pages)] = torch.tensor(pages)
        seqs.append(([rng.randrange(spec.vocab_size)], c, pages, i))
    greedy_rows = [RowParams(temperature=0.0) for _ in range(b)]
    temp_rows = [RowParams(temperature=0.7) for _ in range(b)]
    gen = torch.Generator().manual_seed(args.seed)

    fused = model._fused

    def step(paged: bool, own_mm: bool = True, whole_layers: bool = True) -> torch.Tensor:
        model.paged_decode, model._kernel = paged, kernel if paged else None
        mm.packed, mm.gemm, mm.gemm_bf16 = few_rows if own_mm else (None, None, None)
        model._fused = fused if whole_layers else None
        batch = build_step_batch(seqs, table, ps, cpu, [[0]] * b, dtype, paged_decode=paged)
        logits = model.forward(batch, cache)
        sample(logits, greedy_rows, gen, 0, model.elementwise)
        return logits

    h, hkv, d, hid = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    x = torch.randn(b, hid)  # [B, hidden] fp32 activations
    xi = torch.randn(b, spec.intermediate_size)
    xq = torch.randn(b, spec.q_size)
    xw = {t: v.to(dtype) for t, v in (("x", x), ("xi", xi), ("xq", xq))}  # torch's operands in the weights' dtype

    def gemm_only() -> None:
        for layer in model.layers:
            F.linear(xw["x"], layer.qkv_w, layer.qkv_b)
            F.linear(xw["xq"], layer.o_w, layer.o_b)
            F.linear(xw["x"], layer.gate_up_w, layer.gate_up_b)
            F.linear(xw["xi"], layer.down_w, layer.down_b)
        F.linear(xw["x"], model.lm_head)

    variants = {"gather_sdpa": lambda: step(False), "gemm_only": gemm_only}
    if kernel is not None:
        variants = {
            "paged": lambda: step(True),
            "paged_op_by_op": lambda: step(True, True, False),
            "paged_torch_mm": lambda: step(True, False),
            **variants,
        }
        diff = float((step(True) - step(False)).abs().max())
    else:
        print("the CPU attention kernel is not available here; timing the portable path only", file=sys.stderr)
        diff = float("nan")

    # the parts of a paged step, each over every layer, with the step's own shapes
    step(kernel is not None)
    batch = build_step_batch(seqs, table, ps, cpu, [[0]] * b, dtype, paged_decode=kernel is not None)
    qkv = torch.randn(b, h + 2 * hkv, d)  # [B, H + 2Hkv, D]
    cos = torch.addcmul(model._cos_add, model.cos[batch.positions][:, None, :], model._rope_mul)
    sin = model.sin[batch.positions][:, None, :] * model._rope_mul
    gate_up = torch.randn(b, 2 * spec.intermediate_size)
    logits = torch.randn(b, spec.vocab_size)
    eps, L = spec.rms_norm_eps, model.layers

    def kv_store() -> None:
        for li in range(len(L)):
            r = torch.addcmul(qkv * cos, qkv.roll(d // 2, dims=-1), sin)
            cache.kv[li].view(-1, 2 * hkv, d).index_copy_(0, batch.write_slots, r[:, h:].to(cache.kv.dtype))

    parts = {
        "qkv": lambda: [model._linear(x, la.qkv_w, la.qkv_b) for la in L],
        "o": lambda: [model._linear_add(x.clone(), xq, la.o_w, la.o_b) for la in L],
        "gate_up": lambda: [model._linear(x, la.gate_up_w, la.gate_up_b) for la in L],
        "down": lambda: [model._linear_add(x.clone(), xi, la.down_w, la.down_b) for la in L],
        "lm_head": lambda: mm.head(x, model.lm_head),
        "attention": lambda: [model._attention(qkv[:, :h], cache.kv[li], batch.groups) for li in range(len(L))],
        "rms_norms": lambda: [model._rms_norm(x, la.ln1, eps) for la in [*L, *L, L[0]]],
        "silu_mul": lambda: [
            model.elementwise.silu_mul(gate_up)
            if model.elementwise is not None
            else F.silu(gate_up[:, : spec.intermediate_size]) * gate_up[:, spec.intermediate_size :]
            for _ in L
        ],
        "rope_kv_store": kv_store,
        "embedding": lambda: F.embedding(batch.input_ids, model.embed).to(model.act_dtype),
        "build_batch": lambda: build_step_batch(seqs, table, ps, cpu, [[0]] * b, dtype, paged_decode=True),
        "sampling_greedy": lambda: sample(logits, greedy_rows, gen, 0, model.elementwise),
        "sampling_t0.7": lambda: sample(logits, temp_rows, gen, 0, model.elementwise),
    }
    if args.no_parts or kernel is None:
        parts = {}
    timed = {**variants, **{f"part.{k}": v for k, v in parts.items()}}
    best = {k: math.inf for k in timed}
    for _ in range(args.rounds):
        for name, fn in timed.items():
            if name.startswith("part."):  # the engine's own state, as a `paged` step leaves it
                model.paged_decode, model._kernel = True, kernel
                mm.packed, mm.gemm, mm.gemm_bf16 = few_rows
                model._fused = fused
            t0 = clock()
            fn()
            best[name] = min(best[name], clock() - t0)
    res: dict = {f"{k}_ms": v * 1000 for k, v in best.items() if not k.startswith("part.")}
    for k in ("paged", "paged_op_by_op", "paged_torch_mm", "gather_sdpa"):
        if k in best:
            res[f"{k}_tokens_per_s"] = b / best[k]
            res[f"{k}_mfu"] = best["gemm_only"] / best[k]
    if parts:
        part_ms = {k: best[f"part.{k}"] * 1000 for k in parts if k != "sampling_t0.7"}
        # the parts are op-by-op calls: `other` is the op-by-op step minus them (Python and dispatch between them)
        part_ms["other"] = res["paged_op_by_op_ms"] - sum(part_ms.values())
        res["parts_ms"] = part_ms
        res["sampling_t0.7_ms"] = best["part.sampling_t0.7"] * 1000
    res.update(
        {
            "roofline_tokens_per_s": b / best["gemm_only"],
            "max_logit_diff_paged_vs_gather": diff,
            "settings": {
                "model": args.model,
                "dtype": args.dtype,
                "batch": b,
                "mean_context": sum(ctxs) / b,
                "threads": args.threads,
                "rounds": args.rounds,
                "clock": "process_time" if args.cpu_time else "wall",
                "cpu": describe(),
                "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "kernel_march": os.environ.get("AREAL_KERNEL_MARCH", "native"),
                "few_rows_kernel": {"fp32": mm.gemm is not None, "bf16": mm.gemm_bf16 is not None},
                "packed_kernel": mm.packed is not None,
                "load_average": os.getloadavg(),
            },
        }
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"{args.dtype}, batch {b}, mean context {sum(ctxs) / b:.0f}, {args.threads} thread(s); best of {args.rounds}")
    for k in variants:
        extra = f"  MFU {res[k + '_mfu']:.2f}" if k + "_mfu" in res else ""
        print(f"  {k:<15} {res[k + '_ms']:8.2f} ms{extra}")
    for k, v in res.get("parts_ms", {}).items():
        print(f"    {k:<15} {v:8.2f} ms  {100 * v / res['paged_op_by_op_ms']:5.1f}%")
    if parts:
        print(f"    (sampling at temperature 0.7: {res['sampling_t0.7_ms']:.2f} ms)")


if __name__ == "__main__":
    main()
