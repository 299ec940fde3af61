"""LoRA in the embedded server: each version merged into the weights (what it does) against the adapters applied at
run time (an extra `x A^T B^T * scale` per adapted projection in every forward). Merging costs once per version,
run-time application costs every step: which is cheaper depends on how many tokens a version serves.

    python benchmarks/lora_apply.py --out benchmarks/out/lora_apply.json [--quick] [--clock cpu] [--threads 1,2]

Rank, alpha and target modules come from configs/smollm2-lora.yaml (`--config`); the adapters are random (their
values do not change the speed of either path). On each model, with a real `AsyncEngine` (not started: this process
drives its scheduler directly, as the engine thread does), at each of `--threads`:

    merge       one version as the server loads it: `read_adapter` + `merge_adapter` (the two calls of
                server/lora_load.py's `load_adapter`) from the kept base, on one torch thread (the server runs it
                in a side thread with one), then `DecoderModel.load_tensors`, the engine's swap; versions alternate
                between two adapter directories. `prepare` is what run-time application would do per version
                instead: build its adapter tensors (below) from the same pairs.
    step        the engine's own decode step, `Scheduler.step` (batch building, the forward with the C kernels,
                sampling at temperature 0.7 with logprobs), at each `--batches` size: rows at contexts of 64-192
                tokens whose prompt KV is taken as written (the cache is filled), so every timed step is a decode
                step; and one `--prefill`-token prefill step (a fresh request each time, prefix cache off)
    run time    the same step with the adapters added in the forward: the model's `_linear` / `_linear_add` are
                wrapped so that after each fused projection `out += (x @ A^T) @ B'^T`, B' = scale * B, as a run-time
                implementation would do it. Three layouts (`runtime_plan`), the fastest counts:
                  fused       A's concatenated where projections share the input (q|k|v, gate|up), B' block-
                              diagonal over the fused output: 4 thin matmul pairs per layer, into the output itself
                  fused_a     the shared A's, each module's B' into its slice of the output (no zero blocks)
                  per_module  one pair per adapted module (7 per layer), each into its slice of the fused output
                `extra` is the adapter ops alone, every layer, the real shapes and tensors, at the same rows
                (`ops_ms`); `in_step_ms` is the step's own difference (paired per repeat; noisier, as a check)
    break even  tokens per version above which run-time application costs more than one merge:
                (merge + swap - prepare) / (extra ms per token at that batch)

Every measurement is interleaved: each repeat runs every variant (order rotated) and one merge, and medians are
taken over `--repeats` repeats, so a shared machine's load drifts into all alike. `typical_version` sizes a version
of the LoRA run (from the config, and the run's figures the flags name) and `conclusion` prices both paths there
(benchmarks/lora_apply_verdict.py). The JSON records the CPU (`lscpu`) and `uptime` before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import torch  # noqa: E402

from areal_async.host.torch_threads import single_torch_thread  # noqa: E402
from areal_async.protocol.engine_api import EngineRequest, EngineSampling  # noqa: E402
from areal_async.server.engine import PAGE_SIZE, AsyncEngine  # noqa: E402
from areal_async.server.lora_load import merge_adapter  # noqa: E402
from areal_async.server.model import DecoderModel, ModelSpec  # noqa: E402
from areal_async.server.scheduler import Request, abort_reason  # noqa: E402
from areal_async.weights.lora_adapter import adapter_config, peft_key, read_adapter, write_adapter  # noqa: E402

Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])
# the model's fused weights and the HF modules stored in them, in storage order
FUSED = (
    ("qkv_w", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("o_w", ("self_attn.o_proj",)),
    ("gate_up_w", ("mlp.gate_proj", "mlp.up_proj")),
    ("down_w", ("mlp.down_proj",)),
)
LAYOUTS = ("fused", "fused_a", "per_module")
# what every figure is timed with (--clock): the wall clock, or this process's CPU time, which on a machine loaded
# above its cores charges a preempted step what it computed, not what it waited (every thread's: at 2 threads it
# includes OpenMP's spinning workers, CPU the step takes from others all the same)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = [time.perf_counter]


def clock() -> float:
    return _clock[0]()


# ---- adapters ------------------------------------------------------------------------------------------------------


def make_pairs(spec: ModelSpec, rank: int, targets: list[str], seed: int) -> Pairs:
    """Random fp32 adapters of rank `rank` on every decoder projection whose last name part is in `targets`: A as
    peft initialises it (uniform, +-1/sqrt(in)), B small and non-zero (a trained B is)."""
    gen = torch.Generator().manual_seed(seed)
    pairs: Pairs = {}
    for name, shape in spec.param_shapes().items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or ".layers." not in name or module.rsplit(".", 1)[-1] not in targets:
            continue
        out, inp = shape
        a = (torch.rand(rank, inp, generator=gen) * 2 - 1) / math.sqrt(inp)  # [r, in]
        b = torch.randn(out, rank, generator=gen) * 0.01  # [out, r]
        pairs[module] = (a, b)
    return pairs


def write_version(path: str, pairs: Pairs, rank: int, alpha: float, targets: list[str]) -> str:
    """A peft adapter directory as the trainer publishes it (fp32 adapters)."""
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[peft_key(module, "A")] = a
        tensors[peft_key(module, "B")] = b
    cfg = adapter_config(rank=rank, alpha=alpha, dropout=0.0, target_modules=targets, base_model="", version=0)
    write_adapter(path, tensors, cfg)
    return path


# ---- run-time application ------------------------------------------------------------------------------------------


@dataclass
class Adapted:
    """The adapters of one fused projection, as parts `(a [in, R], outs)`: `u = x @ a` [N, R], then for each
    `(b [R_j, hi - lo], u_lo, u_hi, lo, hi)` of outs, `out[:, lo:hi] += u[:, u_lo:u_hi] @ b` (scale folded into b).
    A full range adds into the tensor itself, not a view."""

    parts: list[tuple[torch.Tensor, list[tuple[torch.Tensor, int, int, int, int]]]]

    def add(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out [N, out] += the adapters' product of x [N, in], in place."""
        for a, outs in self.parts:
            u = torch.mm(x, a)  # [N, R]
            for b, u_lo, u_hi, lo, hi in outs:
                uu = u if u_hi - u_lo == u.shape[1] else u[:, u_lo:u_hi]  # [N, R_j]
                (out if hi - lo == out.shape[1] else out[:, lo:hi]).addmm_(uu, b)


def runtime_plan(model: DecoderModel, pairs: Pairs, scale: float, layout: str) -> dict[int, Adapted]:
    """What a run-time implementation would hold per version, keyed by the data pointer of the fused weight it
    follows. Layouts (LAYOUTS): `fused` concatenates the A's of the projections that share an input (q|k|v,
    gate|up) and makes B' block-diagonal over the fused output, so each fused projection takes one pair of thin
    matmuls, 4 per layer (zero blocks cost multiply-adds: 3x B's work on q|k|v); `fused_a` keeps the shared A and
    adds each module's B' into its slice of the output (no zero blocks, 7 B products); `per_module` one (A, B') pair
    per module, 14 matmuls per layer."""
    spec, dt = model.spec, model.dtype
    widths = {
        "qkv_w": (spec.q_size, spec.kv_size, spec.kv_size),
        "o_w": (spec.hidden_size,),
        "gate_up_w": (spec.intermediate_size,) * 2,
        "down_w": (spec.hidden_size,),
    }
    plan: dict[int, Adapted] = {}
    for li, layer in enumerate(model.layers):
        for attr, modules in FUSED:
            w = getattr(layer, attr)
            bounds, lo = [], 0
            for width in widths[attr]:
                bounds.append((lo, lo + width))
                lo += width
            names = [f"model.layers.{li}.{m}" for m in modules]
            held = [(pairs[n], bd) for n, bd in zip(names, bounds) if n in pairs]  # ((A, B), (lo, hi)) each
            if not held:
                continue
            a_t = [a.t().to(dt).contiguous() for (a, _), _ in held]  # [in, r] each
            b_t = [(b * scale).t().to(dt).contiguous() for (_, b), _ in held]  # [r, width] each
            ranks = [x.shape[1] for x in a_t]
            offs = [sum(ranks[:j]) for j in range(len(ranks) + 1)]
            if layout == "per_module":
                parts = [(a, [(b, 0, r, lo, hi)]) for a, b, r, (_, (lo, hi)) in zip(a_t, b_t, ranks, held)]
            elif layout == "fused_a":
                outs = [(b, offs[j], offs[j + 1], lo, hi) for j, (b, (_, (lo, hi))) in enumerate(zip(b_t, held))]
                parts = [(torch.cat(a_t, dim=1), outs)]  # [in, R]
            else:
                b_bd = torch.zeros(offs[-1], w.shape[0], dtype=dt)  # [R, out] block-diagonal
                for j, (b, (_, (lo, hi))) in enumerate(zip(b_t, held)):
                    b_bd[offs[j] : offs[j + 1], lo:hi] = b
                parts = [(torch.cat(a_t, dim=1), [(b_bd, 0, offs[-1], 0, w.shape[0])])]
            plan[w.data_ptr()] = Adapted(parts)
    return plan


def attach(model: DecoderModel, plan: dict[int, Adapted]) -> None:
    """Run the model's forward with the adapters: wrap its projection calls (instance attributes shadow the class's
    methods; `detach` removes them). The lm head has no entry in the plan and passes through."""
    linear, linear_add = model._linear, model._linear_add

    def lora_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = linear(x, w, b)  # [N, out]
        adapted = plan.get(w.data_ptr())
        if adapted is not None:
            adapted.add(out, x)
        return out

    def lora_linear_add(x: torch.Tensor, inp: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out = linear_add(x, inp, w, b)  # [N, hidden]: the residual stream with the projection added
        adapted = plan.get(w.data_ptr())
        if adapted is not None:
            adapted.add(out, inp)
        return out

    model._linear, model._linear_add = lora_linear, lora_linear_add


def detach(model: DecoderModel) -> None:
    model.__dict__.pop("_linear", None)
    model.__dict__.pop("_linear_add", None)


def adapter_ops(model: DecoderModel, plan: dict[int, Adapted], rows: int) -> Callable[[], None]:
    """The adapter ops of one forward alone, every layer, with `rows` rows of random inputs of the real widths."""
    spec = model.spec
    inputs = {
        "qkv_w": torch.randn(rows, spec.hidden_size, dtype=model.dtype),  # [rows, hidden]: the normed stream
        "o_w": torch.randn(rows, spec.q_size, dtype=model.dtype),  # [rows, H * D]: attention output
        "gate_up_w": torch.randn(rows, spec.hidden_size, dtype=model.dtype),
        "down_w": torch.randn(rows, spec.intermediate_size, dtype=model.dtype),  # [rows, I]: gated activation
    }
    work = []
    for layer in model.layers:
        for attr, _ in FUSED:
            w = getattr(layer, attr)
            if w.data_ptr() in plan:
                work.append((plan[w.data_ptr()], torch.zeros(rows, w.shape[0], dtype=model.dtype), inputs[attr]))

    def run() -> None:
        for adapted, out, x in work:
            adapted.add(out, x)

    return run


# ---- the engine's steps --------------------------------------------------------------------------------------------


def decoding_rows(engine: AsyncEngine, batch: int, max_new: int, rng: random.Random) -> list[Request]:
    """`batch` requests admitted with their prompt KV taken as written, so the next steps are decode steps."""
    sched = engine._sched
    lo, hi = min(8, engine.vocab_size - 1), engine.vocab_size
    reqs = []
    for i in range(batch):
        ids = [rng.randrange(lo, hi) for _ in range(rng.randint(64, 192))]
        sampling = EngineSampling(max_new_tokens=max_new, temperature=0.7, ignore_eos=True)
        r = Request(
            EngineRequest(rid=f"d{batch}-{i}", input_ids=ids, sampling=sampling, return_logprob=True),
            None,
            engine.eos_token_ids,
            engine.device,
            PAGE_SIZE,
        )
        sched.add(r)
        reqs.append(r)
    sched._admit()
    if len(sched.running) != batch:
        raise SystemExit(f"only {len(sched.running)} of {batch} rows were admitted: raise the KV budget")
    for r in reqs:
        r.num_cached = r.prompt_len - 1
    return reqs


def end_rows(engine: AsyncEngine) -> None:
    sched = engine._sched
    for r in list(sched.running) + list(sched.waiting):
        sched.finish(r, abort_reason("benchmark block done"), emit=False)
    sched.dirty.clear()


def prefill_step(engine: AsyncEngine, tokens: int, rng: random.Random) -> None:
    """One engine step that prefills a fresh `tokens`-token prompt (and samples its one token)."""
    sched = engine._sched
    ids = [rng.randrange(min(8, engine.vocab_size - 1), engine.vocab_size) for _ in range(tokens)]
    sampling = EngineSampling(max_new_tokens=1, temperature=0.7, ignore_eos=True)
    req = EngineRequest(rid="p", input_ids=ids, sampling=sampling, return_logprob=True)
    sched.add(Request(req, None, engine.eos_token_ids, engine.device, PAGE_SIZE))
    sched.step()
    sched.dirty.clear()
    if sched.running:
        raise SystemExit("the prefill step did not take the whole prompt (chunked_prefill_size too small)")


def timed(fn: Callable[[], object], n: int) -> float:
    """Milliseconds per call of fn, over n calls."""
    t0 = clock()
    for _ in range(n):
        fn()
    return (clock() - t0) / n * 1000


def calls_for(fn: Callable[[], object], target_s: float, cap: int) -> int:
    """How many calls of fn make about target_s (one warm-up call timed)."""
    t0 = clock()
    fn()
    return max(1, min(cap, round(target_s / max(clock() - t0, 1e-6))))


# ---- one model -----------------------------------------------------------------------------------------------------


class Merges:
    """One adapter version at a time as the server loads it, alternating between two directories (module
    docstring, `merge`); every call is one more sample."""

    def __init__(self, engine: AsyncEngine, dirs: list[str], rank: int, alpha: float, base: dict[str, torch.Tensor]):
        self.engine, self.dirs, self.rank, self.alpha, self.base = engine, dirs, rank, alpha, base
        self.samples: list[dict[str, float]] = []

    def __call__(self) -> None:
        path = self.dirs[len(self.samples) % len(self.dirs)]
        model, spec = self.engine.model, self.engine.spec
        with single_torch_thread():  # the server's side thread runs the load with one torch thread
            t0 = clock()
            _, pairs = read_adapter(path)
            t1 = clock()
            tensors, _, _ = merge_adapter(pairs, self.rank, self.alpha, spec, model, self.base, where=path)
            t2 = clock()
            model.load_tensors(tensors)
            t3 = clock()
            runtime_plan(model, pairs, self.alpha / self.rank, "fused")
            t4 = clock()
        self.samples.append({"read_s": t1 - t0, "merge_s": t2 - t1, "swap_s": t3 - t2, "prepare_s": t4 - t3})

    def summary(self) -> dict:
        keys = ("read_s", "merge_s", "swap_s", "prepare_s")
        out = {k: statistics.median(s[k] for s in self.samples) for k in keys}
        out["version_s"] = out["merge_s"] + out["swap_s"]  # what merging costs per version beyond reading it
        out["versions"] = len(self.samples)
        return out


def block(engine: AsyncEngine, rows: int | None, plans: dict[str, dict[int, Adapted]], merges: Merges, args) -> dict:
    """Interleaved repeats at one decode batch (`rows`), or of the prefill step (`rows` None)."""
    model, rng = engine.model, random.Random(args.seed)
    if rows is None:
        tokens = args.prefill
        step: Callable[[], object] = lambda: prefill_step(engine, tokens, rng)
        n = 1
    else:
        tokens = rows
        cap = max(1, min(16, 128 // rows))
        decoding_rows(engine, rows, 8 + args.repeats * (1 + len(LAYOUTS)) * cap, rng)
        step = engine._sched.step
    for layout in LAYOUTS:  # warm-up: every path once
        attach(model, plans[layout])
        step()
        detach(model)
    if rows is not None:
        n = calls_for(step, args.sample_s, cap)
    ops = {layout: adapter_ops(model, plans[layout], tokens) for layout in LAYOUTS}
    n_ops = {layout: calls_for(ops[layout], args.sample_s / 4, 2000) for layout in LAYOUTS}
    variants = ["merged", *LAYOUTS]
    samples: dict[str, list[float]] = {v: [] for v in variants + [f"ops_{x}" for x in LAYOUTS]}
    for rep in range(args.repeats):
        for v in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
            if v != "merged":
                attach(model, plans[v])
            try:
                samples[v].append(timed(step, n))
            finally:
                detach(model)
        for layout in LAYOUTS:
            samples[f"ops_{layout}"].append(timed(ops[layout], n_ops[layout]))
        merges()
    if rows is not None:
        end_rows(engine)
    med = {k: statistics.median(v) for k, v in samples.items()}
    best = min(LAYOUTS, key=lambda x: med[f"ops_{x}"])
    return {
        "tokens_per_step": tokens,
        "steps_per_sample": n,
        "step_ms": med["merged"],
        "runtime_step_ms": {x: med[x] for x in LAYOUTS},
        "in_step_ms": {x: statistics.median(a - b for a, b in zip(samples[x], samples["merged"])) for x in LAYOUTS},
        "ops_ms": {x: med[f"ops_{x}"] for x in LAYOUTS},
        "best_layout": best,
        "extra_ms": med[f"ops_{best}"],
        "extra_frac": med[f"ops_{best}"] / med["merged"],
        "extra_ms_per_token": med[f"ops_{best}"] / tokens,
        "samples_ms": samples,
    }


def measure_model(path: str, args, lora: tuple[int, float, list[str]]) -> dict:
    """Everything of the module docstring on one checkpoint."""
    rank, alpha, targets = lora
    caps = {b: max(1, min(16, 128 // b)) for b in args.batches}
    budget = max(b * (192 + 8 + args.repeats * (1 + len(LAYOUTS)) * caps[b] + PAGE_SIZE) for b in args.batches)
    engine = AsyncEngine(
        path,
        device="cpu",
        dtype=args.dtype,
        max_total_tokens=budget + args.prefill + PAGE_SIZE,
        max_running_requests=max(args.batches) + 1,
        prefix_cache=False,
        chunked_prefill_size=max(256, args.prefill),
        seed=args.seed,
    )
    engine.cache.kv.fill_(0.01)  # touch every page: reads then cost what they cost in serving
    spec, model = engine.spec, engine.model
    with tempfile.TemporaryDirectory(prefix="lora_apply_") as tmp:
        dirs = [
            write_version(
                os.path.join(tmp, f"v{i}"), make_pairs(spec, rank, targets, args.seed + i), rank, alpha, targets
            )
            for i in range(2)
        ]
        with single_torch_thread():  # the first load keeps a copy of the base: once per server, not per version
            t0 = clock()
            _, pairs = read_adapter(dirs[0])
            tensors, base, _ = merge_adapter(pairs, rank, alpha, spec, model, None, where=dirs[0])
            model.load_tensors(tensors)
            first_s = clock() - t0
        # the run-time forward must compute what the merged weights do
        seq = [random.Random(args.seed).randrange(min(8, spec.vocab_size - 1), spec.vocab_size) for _ in range(48)]
        merged_logits = model.score([seq])[0]  # [T, V]
        model.load_tensors(base)
        plans = {layout: runtime_plan(model, pairs, alpha / rank, layout) for layout in LAYOUTS}
        diffs = {}
        for layout in LAYOUTS:
            attach(model, plans[layout])
            diffs[layout] = float((model.score([seq])[0] - merged_logits).abs().max())
            detach(model)
        merges = Merges(engine, dirs, rank, alpha, base)
        by_threads = {}
        for threads in args.threads:
            torch.set_num_threads(threads)
            res: dict = {"decode": {}}
            for b in args.batches:
                res["decode"][str(b)] = block(engine, b, plans, merges, args)
            if args.prefill:
                res["prefill"] = block(engine, None, plans, merges, args)
            by_threads[str(threads)] = res
    return {
        "path": path,
        "dtype": str(model.dtype).removeprefix("torch."),
        "shape": {
            "layers": spec.num_layers,
            "hidden": spec.hidden_size,
            "intermediate": spec.intermediate_size,
            "q": spec.q_size,
            "kv": spec.kv_size,
        },
        "adapted_modules": len(pairs),
        "adapter_params": sum(a.numel() + b.numel() for a, b in pairs.values()),
        "adapted_weight_elements": sum(b.shape[0] * a.shape[1] for a, b in pairs.values()),
        "max_logit_diff_runtime_vs_merged": diffs,
        "first_load_s": first_s,
        "merge": merges.summary(),
        "merge_samples": merges.samples,
        "by_threads": by_threads,
    }


def machine() -> dict:
    """The CPU (`lscpu`'s model name, the ISA torch uses) and `uptime`."""
    from inference_throughput import machine_info

    info = machine_info(torch, os.getloadavg())
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info["lscpu_model_name"] = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), ""
    )
    info["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return info


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="smoke run: the smallest tiny model, 1 thread, 2 batches")
    ap.add_argument("--models", default="tiny,smollm2-135m-instruct", help="tiny | smollm2-135m-instruct | a dir")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "smollm2-lora.yaml"))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,8,32,64,256", help="decode rows per step")
    ap.add_argument("--prefill", type=int, default=256, help="tokens of the prefill step timed (0: none)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", help="the server's dtype (the LoRA config's auto: fp32 on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="wall, or process CPU time (CLOCKS)")
    ap.add_argument(
        "--mean-response",
        type=float,
        default=45.0,
        help="tokens per response: the config's note, greedy answers average ~45 (sampled run longer; the full "
        "fine-tuning run learned to answer in 22.8, benchmarks/README.md)",
    )
    ap.add_argument(
        "--generated-per-trained",
        type=float,
        default=608 / 240,
        help="groups generated per group trained (filter_uniform_reward): 608 for 240 in the configs/smollm2.yaml "
        "run (benchmarks/README.md)",
    )
    ap.add_argument(
        "--prompt-tokens",
        type=float,
        default=66.0,
        help="prompt tokens per sample: that run's 5,701 tokens per step less 64 x 22.8 response tokens, over 64",
    )
    ap.add_argument(
        "--server-busy-s",
        type=float,
        default=0.96 * 61.4,
        help="the server's CPU seconds per train step: 0.96 of a core over 61.4 s steps in the LoRA run (lr 5e-4, "
        "benchmarks/README.md)",
    )
    args = ap.parse_args(argv)
    args.sample_s = 0.2  # seconds per timed sample of steps (the adapter ops alone: a quarter of it)
    if args.quick:
        args.models, args.threads, args.batches, args.prefill, args.sample_s = "tiny", "1", "1,4", 32, 0.01
    _clock[0] = CLOCKS[args.clock]
    args.threads = [int(x) for x in args.threads.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    import transformers
    import yaml
    from inference_throughput import resolve_model
    from lora_apply_verdict import conclude, report, typical_version

    transformers.utils.logging.disable_progress_bar()

    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    lcfg = cfg["train"]["lora"]
    lora = (int(lcfg["rank"]), float(lcfg["alpha"]), list(lcfg["target_modules"]))
    start = machine()
    result: dict = {
        "settings": {
            k: getattr(args, k)
            for k in ("models", "threads", "batches", "prefill", "repeats", "dtype", "clock", "quick")
        },
        "adapter": {"rank": lora[0], "alpha": lora[1], "target_modules": lora[2], "config": args.config},
        "models": {},
    }
    version = typical_version(cfg, args)
    result["typical_version"] = version
    with tempfile.TemporaryDirectory(prefix="lora_apply_models_") as tmp:
        for name in args.models.split(","):
            path = resolve_model(name, tmp, args.seed, quick=args.quick)
            res = measure_model(path, args, lora)
            res["conclusion"] = conclude(res, version)
            result["models"][name] = res
    result["machine"] = {**start, "uptime_end": machine()["uptime"], "load_average_end": os.getloadavg()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    report(result)
    return result


if __name__ == "__main__":
    main()
