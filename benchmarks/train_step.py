"""Seconds per trainer step on a realistic RL batch, where they go, and how close the step runs to this CPU's limit.

The same `TrainEngine.train_step` a torchrun rank runs (FSDP2 over a world of one, in this process; the RPC hop of
the worker adds milliseconds on a step of seconds), on one of two models:

    --model tiny                    the project's default model shape (Qwen2, hidden 128, 4 layers, char vocab,
                                    random weights), on the default run's batch: 16 prompt groups x 8 samples,
                                    prompts of 26-36 tokens, answers of 15-60 tokens within +-6 of their group's
    --model smollm2-135m-instruct   SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, hidden 576, 9/3 heads,
                                    vocab 49152, tied), resolved through areal_async.model_store (or pass the
                                    converted checkpoint directory), on an RL batch shaped for it: 8 prompts x 4
                                    samples, chat-templated word problems of 60-100 tokens, answers of 30-200
                                    tokens drawn independently

Answers are random tokens (speed does not depend on what they say), so samples share exactly their prompt.

Figures, per thread count (`--threads 1,2`: the counts alternate step by step, so a noisy machine hits each alike):
- trained tokens/s: the batch's tokens (every sample's prompt and answer) per second of step
- model FLOPs: 6 x (matmul parameters) per token the model runs (a shared prompt runs once per group) plus causal
  attention (QK^T and AV, 3 x the forward's 4 x layers x heads x head_dim x keys), per step
- roofline: GFLOP/s of plain `torch.mm` on the model's own GEMMs (each projection forward and its two backward
  products, the LM head in the engine's 1024-row chunks) at `--gemm-rows` rows, in the step's dtype, at the same
  thread count, measured right before every timed step: the FLOP-weighted rate of that mix is the best the step's
  matmuls could do
- MFU = model FLOPs / step seconds / roofline; `mfu_cpu` the same in process CPU seconds for the step and for the
  roofline GEMMs (steadier where other processes share the cores: wall time counts the time they held them)
- peak memory: the process's resident-set high-water mark during the step (reset before it through
  /proc/self/clear_refs), and its level before the step

Breakdown (from `TrainEngine.last_timings`): prox = the no-grad proximal pass (0 when folded into the training
forward), forward / backward = the training micro-batches, optimizer = clipping + AdamW, other = decoding,
advantages, stats, reductions.

    python benchmarks/train_step.py --out benchmarks/out/train_step.json [--quick] [--steps 5]
    python benchmarks/train_step.py --model smollm2-135m-instruct --threads 1,2 --out /tmp/ts_smol.json
    python benchmarks/train_step.py --out /tmp/ts.json train.micro_batch_tokens=8192   # TrainConfig overrides
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

WORDS = ("apples", "boxes", "trains", "miles", "coins", "books", "hours", "tickets", "students", "pencils")


def make_batch(
    num_groups: int,
    group_size: int,
    prompt_len: tuple[int, int],
    resp_len: tuple[int, int],
    vocab: int,
    policy_version: int,
    seed: int,
    resp_spread: int | None = None,
    prompts: list[list[int]] | None = None,
):
    """A TrainBatch of `num_groups` x `group_size` trajectories: a shared prompt per group (`prompts[g]` when given,
    else random tokens of a length uniform in `prompt_len`), behaviour logprobs around log(1 / vocab) with a few far
    below (so the importance-weight cap bites), 0/1 rewards varying within groups. `resp_spread`: answers to one
    prompt are its group's length (uniform in `resp_len`) +- up to this many tokens; None draws every answer's
    length independently."""
    from areal_async.types import Trajectory, pack_trajectories

    rng = np.random.default_rng(seed)
    trajs = []
    for g in range(num_groups):
        if prompts is not None:
            prompt = list(prompts[g % len(prompts)])
        else:
            prompt = rng.integers(2, vocab, int(rng.integers(prompt_len[0], prompt_len[1] + 1))).tolist()
        p_len = len(prompt)
        base = int(rng.integers(resp_len[0], resp_len[1] + 1))
        for _ in range(group_size):
            if resp_spread is None:
                r_len = int(rng.integers(resp_len[0], resp_len[1] + 1))
            else:
                r_len = max(1, base + int(rng.integers(-resp_spread, resp_spread + 1)))
            resp = rng.integers(2, vocab, r_len).tolist()
            behav = (np.log(1.0 / vocab) + rng.normal(0.0, 0.3, r_len) - 2.5 * (rng.random(r_len) < 0.05)).tolist()
            trajs.append(
                Trajectory(
                    input_ids=prompt + resp,
                    loss_mask=[0] * p_len + [1] * r_len,
                    logprobs=[0.0] * p_len + behav,
                    versions=[-1] * p_len + [policy_version] * r_len,
                    reward=float(rng.integers(0, 2)),
                    group_id=g,
                    prompt_len=p_len,
                )
            )
    resp_tokens = sum(t.response_len for t in trajs)
    return pack_trajectories(trajs, policy_version, resp_tokens, len(trajs)), trajs


def chat_prompts(model_dir: str, n: int, length: tuple[int, int], seed: int) -> list[list[int]]:
    """`n` chat-templated word problems whose token counts fall in `length` (the template's system turn included)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    rng = np.random.default_rng(seed)
    out: list[list[int]] = []
    while len(out) < n:
        clauses = []
        ids: list[int] = []
        while True:
            a, b = (int(x) for x in rng.integers(2, 999, 2))
            w1, w2 = (str(x) for x in rng.choice(WORDS, 2))
            clauses.append(f"A shop has {a} {w1} and sells {b} {w2} each day.")
            text = " ".join(clauses) + " How many are left after a week? Think step by step."
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            if len(ids) >= length[0]:
                break
        if len(ids) <= length[1]:
            out.append(ids)
    return out


def resolve_model(name: str) -> str:
    """A checkpoint directory as given, or a name through areal_async.model_store when that module exists."""
    if os.path.isdir(name):
        return name
    try:
        from areal_async.model_store import resolve_model_path
    except ImportError:
        raise SystemExit(
            f"--model {name}: not a directory, and areal_async.model_store (which converts named "
            f"models) is not available; pass the converted checkpoint directory"
        ) from None
    return resolve_model_path(name)


def matmul_params(hf_config) -> tuple[int, int, int, int]:
    """(parameters in the model's matmuls, layers, attention width heads x head_dim, vocab) of a decoder config:
    q/k/v/o, gate/up/down per layer, and the LM head (the embedding lookup is not a matmul; a tied head counts
    once, as the head)."""
    c = hf_config.get_text_config()
    h, inter, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    return layers * per_layer + c.vocab_size * h, layers, q, c.vocab_size


def gemm_shapes(hf_config) -> list[tuple[int, int, float]]:
    """(K, N, count per token row) of the model's forward projections: rows x K @ K x N."""
    c = hf_config.get_text_config()
    h, inter, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    return [
        (h, q, layers),
        (h, kv, 2 * layers),
        (q, h, layers),
        (h, inter, 2 * layers),
        (inter, h, layers),
        (h, c.vocab_size, 1),
    ]


def gemm_roofline(hf_config, rows: int, dtype, reps: int = 2) -> dict:
    """FLOP-weighted GFLOP/s of torch.mm over the model's GEMMs, forward (X W^T) and backward (dY W, dY^T X),
    at this thread count. Best of `reps` per shape (the machine is shared: the best is the hardware's rate)."""
    import torch

    flops = secs = cpu_secs = 0.0
    per_shape = {}
    for k, n, count in gemm_shapes(hf_config):
        m = min(rows, 1024) if n == hf_config.get_text_config().vocab_size else rows  # the head runs in chunks
        x = torch.randn(m, k, dtype=dtype)
        w = torch.randn(n, k, dtype=dtype)
        dy = torch.randn(m, n, dtype=dtype)
        for name, fn in (("fwd", lambda: x @ w.t()), ("dx", lambda: dy @ w), ("dw", lambda: dy.t() @ x)):
            fn()  # warm
            best = best_cpu = float("inf")
            for _ in range(reps):
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                best = min(best, time.perf_counter() - t0)
                best_cpu = min(best_cpu, time.process_time() - c0)
            f = 2.0 * m * k * n
            per_shape[f"{name}:{m}x{k}x{n}"] = f / best / 1e9
            flops += f * count * (rows / m)
            secs += best * count * (rows / m)
            cpu_secs += best_cpu * count * (rows / m)
    return {"gflops": flops / secs / 1e9, "gflops_per_cpu_s": flops / cpu_secs / 1e9, "per_shape_gflops": per_shape}


def attention_flops(seq_lens_run: list[tuple[int, int]], layers: int, width: int) -> float:
    """Forward+backward FLOPs of causal attention: for each query, QK^T and AV over its keys (2 x 2 x width per
    key), x 3 for the backward. `seq_lens_run`: (keys before the run, tokens run) per model row."""
    total = 0.0
    for before, n in seq_lens_run:
        keys = n * before + n * (n + 1) / 2  # sum over the run's queries of the keys each attends
        total += 4.0 * width * keys
    return 3.0 * layers * total


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _apply_overrides(cfg_dict: dict, overrides: list[str]) -> dict:
    import yaml

    for ov in overrides:
        key, _, value = ov.partition("=")
        parts = key.split(".")
        if parts[0] == "train":
            parts = parts[1:]
        d = cfg_dict
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = yaml.safe_load(value)
    return cfg_dict


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny", help="tiny, smollm2-135m-instruct, or an HF checkpoint directory")
    ap.add_argument("--quick", action="store_true", help="smoke run (seconds): 2 groups x 4, 2 layers, 1 step")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per thread count (default 5, real model 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per thread count first")
    ap.add_argument("--groups", type=int, default=None, help="prompt groups (default 16, real model 8)")
    ap.add_argument("--group-size", type=int, default=None, help="samples per prompt (default 8, real model 4)")
    ap.add_argument(
        "--prompt-len",
        type=int,
        nargs=2,
        default=None,
        help="prompt length range (default 26-36: the default task; real model 60-100)",
    )
    ap.add_argument("--resp-len", type=int, nargs=2, default=None, help="answer lengths (15-60; real model 30-200)")
    ap.add_argument(
        "--resp-spread",
        type=int,
        default=None,
        help="answers to one prompt differ by up to this many tokens; -1: every length independent "
        "(default 6; real model -1)",
    )
    ap.add_argument("--hidden", type=int, default=128, help="tiny model only")
    ap.add_argument("--layers", type=int, default=4, help="tiny model only")
    ap.add_argument("--threads", default="1", help="torch intra-op threads, comma-separated counts alternate")
    ap.add_argument("--layout", default="auto", choices=["auto", "packed", "rows", "prefix"])
    ap.add_argument("--no-fold", action="store_true", help="keep the separate prox pass with one minibatch")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (inductor, dynamic)")
    ap.add_argument("--gemm-rows", type=int, default=2048, help="rows of the roofline GEMMs")
    ap.add_argument("--profile", default=None, help="write a cProfile of the timed steps to this file")
    ap.add_argument(
        "--op-profile",
        default=None,
        help="write torch.profiler's per-op table (self CPU time, first timed step) to this text file",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="TrainConfig key=value overrides, e.g. train.ppo_minibatches=2")
    args = ap.parse_args(argv)
    real = args.model != "tiny"
    defaults = (
        dict(steps=3, groups=8, group_size=4, prompt_len=(60, 100), resp_len=(30, 200), resp_spread=-1)
        if real
        else dict(steps=5, groups=16, group_size=8, prompt_len=(26, 36), resp_len=(15, 60), resp_spread=6)
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.quick:
        args.groups, args.group_size, args.layers, args.steps, args.warmup = 2, 4, 2, 1, 0
    threads = [int(t) for t in str(args.threads).split(",")]

    import torch

    from areal_async.config import TrainConfig, from_dict
    from areal_async.testing.tiny import make_tiny_checkpoint
    from areal_async.train.engine import TrainEngine, init_distributed

    # the default run's trainer settings (configs/default.yaml), then the command line's
    cfg_dict = _apply_overrides(
        {
            "device": "cpu",
            "micro_batch_tokens": 2048 if real else 1024,
            "ppo_minibatches": 1,
            "loss": {"eps_clip": 0.2, "behav_imp_weight_cap": 5.0},
            "optim": {"lr": 1e-6 if real else 1e-4, "grad_clip": 1.0},
        },
        args.overrides,
    )
    cfg = from_dict(cfg_dict, TrainConfig)
    device = init_distributed(cfg.device)
    per_threads: dict[int, list[dict]] = {t: [] for t in threads}
    with tempfile.TemporaryDirectory() as tmp:
        if real:
            path = resolve_model(args.model)
        else:
            path = make_tiny_checkpoint(
                os.path.join(tmp, "qwen2"),
                "qwen2",
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=4 * args.hidden,
                seed=args.seed,
            )
        switches = {
            **({"layout": args.layout} if args.layout != "auto" else {}),
            **({"fold_prox": False} if args.no_fold else {}),
        }
        engine = TrainEngine(path, cfg, seed=args.seed, device=device, **switches)
        if args.compile:
            for layer in engine.model.model.layers:
                layer.compile(dynamic=True)  # every micro-batch has other shapes: no recompiles
        n_matmul, n_layers, attn_width, vocab = matmul_params(engine.hf_config)
        prompts = chat_prompts(path, 4 * args.groups, tuple(args.prompt_len), args.seed) if real else None
        rss_loaded = _rss_kib("VmRSS")
        profiler = None
        order = [t for _ in range(args.warmup + args.steps) for t in threads]
        for i, nthreads in enumerate(order):
            timed = i >= args.warmup * len(threads)
            torch.set_num_threads(nthreads)
            batch, trajs = make_batch(
                args.groups,
                args.group_size,
                tuple(args.prompt_len),
                tuple(args.resp_len),
                engine.vocab_size,
                engine.version,
                args.seed + i,
                None if args.resp_spread < 0 else args.resp_spread,
                prompts=prompts[i * args.groups % len(prompts) :][: args.groups] if prompts else None,
            )
            roof = gemm_roofline(engine.hf_config, args.gemm_rows, engine.compute_dtype) if timed else None
            if timed and args.profile and profiler is None:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            rss_before = _rss_kib("VmRSS")
            peak_ok = _reset_peak_rss()
            op_prof = None
            if timed and args.op_profile and not os.path.exists(args.op_profile):
                op_prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                op_prof.__enter__()
            t0, c0 = time.perf_counter(), time.process_time()
            _, stats = engine.train_step(batch)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if op_prof is not None:  # profiled steps run slower: their time still counts as measured
                op_prof.__exit__(None, None, None)
                table = op_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
                with open(args.op_profile, "w") as f:
                    f.write(f"{args.model}, {nthreads} thread(s), {engine.compute_dtype}, {wall:.2f} s step\n{table}")
            peak = _rss_kib("VmHWM") if peak_ok else 0
            if not timed:
                continue
            # what the model ran: with the shared-prefix layout each group's prompt once, then every answer
            shared = getattr(engine, "last_step_layout", engine.layout) == "prefix"  # (older engines: no fallback)
            rows = []
            for g in range(args.groups):
                members = [t for t in trajs if t.group_id == g]
                if shared:
                    common = min(t.prompt_len for t in members)
                    rows.append((0, common))
                    rows += [(common, len(t.input_ids) - common) for t in members]
                else:
                    rows += [(0, len(t.input_ids)) for t in members]
            tokens_run = sum(n for _, n in rows)
            flops = 6.0 * n_matmul * tokens_run + attention_flops(rows, n_layers, attn_width)
            parts = dict(engine.last_timings)
            parts["other"] = max(wall - sum(parts.values()), 0.0)
            per_threads[nthreads].append(
                {
                    "wall_s": wall,
                    "cpu_s": cpu,
                    "parts": parts,
                    "tokens": stats["tokens"],
                    "tokens_run": tokens_run,
                    "model_gflop": flops / 1e9,
                    "gflops": flops / wall / 1e9,
                    "roofline_gflops": roof["gflops"],
                    "mfu": flops / wall / 1e9 / roof["gflops"],
                    "roofline_shapes": roof["per_shape_gflops"],
                    # the same ratio in process CPU seconds (step and GEMMs alike): steadier on a shared machine, where
                    # wall time includes the time other processes held the cores
                    "roofline_gflops_per_cpu_s": roof["gflops_per_cpu_s"],
                    "mfu_cpu": flops / cpu / 1e9 / roof["gflops_per_cpu_s"],
                    "rss_before_gb": rss_before / 2**20,
                    "peak_rss_gb": peak / 2**20,
                    "num_seqs": stats["num_seqs"],
                    "loss": stats["loss"],
                    "grad_norm": stats["grad_norm"],
                    "loadavg_1m": os.getloadavg()[0],
                }
            )
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
    import torch.distributed as dist

    dist.destroy_process_group()

    summary = {}
    for t, steps in per_threads.items():
        wall = statistics.median(s["wall_s"] for s in steps)
        summary[str(t)] = {
            "s_per_step": wall,
            "cpu_s_per_step": statistics.median(s["cpu_s"] for s in steps),
            "trained_tokens_per_s": statistics.mean(s["tokens"] for s in steps) / wall,
            "model_gflops": statistics.median(s["gflops"] for s in steps),
            "roofline_gflops": statistics.median(s["roofline_gflops"] for s in steps),
            "mfu": statistics.median(s["mfu"] for s in steps),
            "mfu_each_step": [s["mfu"] for s in steps],
            "mfu_cpu": statistics.median(s["mfu_cpu"] for s in steps),
            "mfu_cpu_each_step": [s["mfu_cpu"] for s in steps],
            "peak_rss_gb": max(s["peak_rss_gb"] for s in steps),
            "breakdown_s": {k: statistics.median(s["parts"][k] for s in steps) for k in steps[0]["parts"]},
            "steps": steps,
        }
    result = {
        "model": args.model,
        "model_path": path if real else "tiny",
        "num_params": engine.num_params,
        "matmul_params": n_matmul,
        "by_threads": summary,
        "tokens_per_step": statistics.mean(s["tokens"] for st in per_threads.values() for s in st),
        "tokens_run_per_step": statistics.mean(s["tokens_run"] for st in per_threads.values() for s in st),
        "seqs_per_step": args.groups * args.group_size,
        "rss_after_load_gb": rss_loaded / 2**20,
        "layout": engine.layout,
        "step_layout": getattr(engine, "last_step_layout", engine.layout),
        "fold_prox": engine.fold_prox,
        "compute_dtype": str(engine.compute_dtype),
        "compile": args.compile,
        "train_config": cfg_dict,
        "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "env": {
            "device": str(device),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "loadavg_1m": os.getloadavg()[0],
        },
    }
    # the tiny model's earlier reports read these at the top level
    first = summary[str(threads[0])]
    result.update(
        {
            "s_per_step": first["s_per_step"],
            "cpu_s_per_step": first["cpu_s_per_step"],
            "tokens_per_s": first["trained_tokens_per_s"],
            "breakdown_s": first["breakdown_s"],
        }
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"{args.model}: {args.groups}x{args.group_size} seqs, {result['tokens_per_step']:.0f} tokens/step "
        f"({result['tokens_run_per_step']:.0f} run), micro_batch_tokens={cfg.micro_batch_tokens}, "
        f"layout={engine.layout} (last step: {result['step_layout']}), dtype={engine.compute_dtype}, "
        f"compile={args.compile}, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'threads':>7} {'s/step':>8} {'tok/s':>8} {'GFLOP/s':>8} {'roof':>8} {'MFU':>6} {'MFU cpu':>7} "
        f"{'peak GB':>8}   breakdown s"
    )
    for t, s in summary.items():
        parts = " ".join(f"{k}={v:.2f}" for k, v in s["breakdown_s"].items())
        print(
            f"{t:>7} {s['s_per_step']:>8.2f} {s['trained_tokens_per_s']:>8.0f} {s['model_gflops']:>8.1f} "
            f"{s['roofline_gflops']:>8.1f} {s['mfu']:>6.1%} {s['mfu_cpu']:>7.1%} {s['peak_rss_gb']:>8.2f}   {parts}"
        )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
