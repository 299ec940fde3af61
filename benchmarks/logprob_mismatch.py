"""Train/inference logprob mismatch on a real model: the trainer's logprobs of exactly the tokens the embedded server
sampled, against the server's own (behaviour) logprobs of them.

    python benchmarks/logprob_mismatch.py --config configs/smollm2.yaml --out benchmarks/out/logprob_mismatch.json
    python benchmarks/logprob_mismatch.py --config configs/smollm2.yaml --device cuda --dtype bfloat16 \\
        --out benchmarks/out/logprob_mismatch_cuda_bf16.json

Why it matters: decoupled PPO weighs every trained token by the importance weight pi_prox / pi_behav. With fresh
weights (sync mode, or a token made by the current version) the two policies are the same weights, so any weight
other than 1 is numerics alone: a different kernel, batch shape, reduction order or precision on the server than in
the trainer. Tokens whose weight exceeds the cap (`train.loss.behav_imp_weight_cap`, 5.0 by default) get no
gradient, and a systematic gap biases the gradient of the rest.

What it does, as a run does it:
- prompts: the config's dataset (`data.*`, training split, chat template as configured), rendered with the model's
  tokenizer the way rollouts are (areal_async.rollout.prompts);
- sampling: `python -m areal_async.serve` on the config's model, driven by the real InferenceClient with every request
  in flight at once, at the config's `rollout.temperature` / top_p / top_k / max_new_tokens, `--samples` per prompt;
- the trainer side: a `TrainEngine` in this process (a world of one, FSDP2 as in a run), built from the config's
  `train` section with the same temperature, `TrainEngine.logprobs` on the packed batch: the step's own layout
  (shared prefixes / rows / packing), micro-batches and precision, as a train step's proximal logprobs;
- the figures, over every sampled token: max and mean |trainer - server|, the k3 estimate of KL(server || trainer)
  (E[r - 1 - log r], r = pi_trainer / pi_server, on tokens drawn from the server's policy), the fraction of tokens
  whose importance weight pi_trainer / pi_server is past the cap (the tokens a train step would mask), and below
  1 / cap, quantiles of |diff|, and the same by position in the response.

`--device` / `--dtype` set both sides (server weights and trainer compute): auto resolves as a run's defaults do
(`model.dtype`, `train.mixed_precision`: one rule, bf16 on CUDA and on a CPU with AVX512-BF16 or AMX for a model
with hidden size >= 512, fp32 elsewhere); `--server-dtype` / `--train-dtype` set one side
only, to split a mismatch into its two causes. The script is device-agnostic; a CUDA run needs nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPE_NAMES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def start_server(
    model_dir: str, device: str, dtype: str, threads: int, max_total_tokens: int, max_running: int
) -> tuple[subprocess.Popen, str]:
    """The embedded server in its own process, as a run launches it; returns (process, base URL)."""
    from areal_async.server.cli import READY_PREFIX

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [
        sys.executable,
        "-m",
        "areal_async.serve",
        "--model",
        model_dir,
        "--port",
        "0",
        "--device",
        device,
        "--dtype",
        dtype,
        "--max-total-tokens",
        str(max_total_tokens),
        "--max-running-requests",
        str(max_running),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(READY_PREFIX):
            return proc, line[len(READY_PREFIX) :].strip()
    proc.wait()
    raise SystemExit(f"the server for {model_dir} did not start (exit status {proc.returncode})")


async def sample_all(url: str, prompts: list[list[int]], samples: int, sampling: Any) -> list[Any]:
    """`samples` completions of every prompt, all in flight at once, through the client a run uses."""
    from areal_async.inference.client import InferenceClient

    async with InferenceClient([url]) as client:
        tasks = [
            client.agenerate(ids, sampling, session_key=f"p{i}")
            for i, ids in enumerate(prompts)
            for _ in range(samples)
        ]
        return await asyncio.gather(*tasks)


def mismatch_stats(
    train_logp: np.ndarray, server_logp: np.ndarray, positions: np.ndarray, cap: float
) -> dict[str, Any]:
    """The figures over response tokens: train_logp, server_logp [T] (the same sampled tokens), positions [T]
    (each token's index in its response)."""
    diff = train_logp - server_logp  # [T] log r, r = pi_trainer / pi_server
    absd = np.abs(diff)
    log_r = np.clip(diff, -20.0, 20.0)
    k3 = np.exp(log_r) - 1.0 - log_r  # >= 0; unbiased for KL(server || trainer) on tokens drawn from the server
    w = np.exp(log_r)  # the importance weight a train step would see with fresh weights
    out: dict[str, Any] = {
        "tokens": int(diff.size),
        "max_abs_diff": float(absd.max()),
        "mean_abs_diff": float(absd.mean()),
        "mean_diff": float(diff.mean()),  # sign: > 0 where the trainer puts more mass on the sampled tokens
        "abs_diff_quantiles": {q: float(np.quantile(absd, float(q))) for q in ("0.5", "0.9", "0.99", "0.999")},
        "kl_k3_mean": float(k3.mean()),
        "kl_k1_mean": float(-diff.mean()),  # E[log pi_server - log pi_trainer]: the plain estimate, for comparison
        "cap": cap,
        "frac_over_cap": float((w > cap).mean()),
        "frac_under_inv_cap": float((w < 1.0 / cap).mean()),
        "imp_weight_max": float(w.max()),
        "imp_weight_min": float(w.min()),
        "frac_abs_diff_over": {t: float((absd > float(t)).mean()) for t in ("1e-4", "1e-3", "1e-2", "1e-1")},
    }
    by_pos = []
    for lo, hi in ((0, 8), (8, 32), (32, 128), (128, 1 << 30)):
        sel = (positions >= lo) & (positions < hi)
        if sel.any():
            by_pos.append(
                {
                    "positions": f"{lo}-{hi - 1}" if hi < 1 << 30 else f"{lo}+",
                    "tokens": int(sel.sum()),
                    "mean_abs_diff": float(absd[sel].mean()),
                    "max_abs_diff": float(absd[sel].max()),
                    "kl_k3_mean": float(k3[sel].mean()),
                }
            )
    out["by_position"] = by_pos
    return out


def trainer_logprobs(model_dir: str, train_cfg: Any, trajs: list[Any]) -> np.ndarray:
    """The trainer's logprobs of every token of `trajs`, packed as a train step receives them. [N] fp32."""
    import torch

    from areal_async.train.engine import TrainEngine, init_distributed
    from areal_async.types import pack_trajectories

    init_distributed(train_cfg.device)
    engine = TrainEngine(model_dir, train_cfg)
    resp = sum(sum(t.loss_mask) for t in trajs)
    batch = pack_trajectories(trajs, policy_version=0, global_response_tokens=resp, global_num_seqs=len(trajs))
    out = engine.logprobs(batch)  # [N]
    if out.device.type == "cuda":
        torch.cuda.synchronize()
    return out.float().cpu().numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "smollm2.yaml"))
    ap.add_argument("--out", default="benchmarks/out/logprob_mismatch.json")
    ap.add_argument("--prompts", type=int, default=32, help="training prompts of the config's dataset")
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1: both sides")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=sorted(DTYPE_NAMES),
        help="both sides; auto: as a run resolves it (bf16 on CUDA and on bf16-capable CPUs)",
    )
    ap.add_argument("--server-dtype", default=None, choices=sorted(DTYPE_NAMES), help="the server's only")
    ap.add_argument(
        "--train-dtype",
        default=None,
        choices=("auto", "fp32", "bf16", "float32", "bfloat16"),
        help="the trainer's compute precision only (train.mixed_precision)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the server and of the trainer; default: the config's",
    )
    ap.add_argument(
        "--cap",
        type=float,
        default=None,
        help="importance-weight cap; default: the config's train.loss.behav_imp_weight_cap",
    )
    ap.add_argument("--quick", action="store_true", help="4 prompts x 2 samples, 16 new tokens: a smoke test")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the config (as for areal_async.run)")
    args = ap.parse_args()

    import msgspec
    import torch

    from areal_async.config import load_config
    from areal_async.host.cpu_features import model_hidden_size, resolve_mixed_precision
    from areal_async.model_store import resolve_model_path
    from areal_async.rollout.prompts import prompt_ids
    from areal_async.rollout.workflow_api import trajectory_from_generation
    from areal_async.server.device import resolve_dtype
    from areal_async.tasks.datasets import load_samples
    from areal_async.tokenizer import Tokenizer
    from areal_async.types import SamplingParams

    cfg = load_config(args.config, args.overrides)
    if args.quick:
        args.prompts, args.samples = min(args.prompts, 4), min(args.samples, 2)
        cfg.rollout.max_new_tokens = min(cfg.rollout.max_new_tokens, 16)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    both = DTYPE_NAMES[args.dtype]
    model_dir = resolve_model_path(cfg.model.path)
    # auto as a run resolves it on each side: the server's --dtype auto and the trainer's mixed_precision=auto
    # follow one rule (host/cpu_features.py: bf16 on CUDA, and on a CPU with a bf16 dot product for a model with
    # hidden size >= 512)
    server_dtype = DTYPE_NAMES[args.server_dtype] if args.server_dtype else both
    if server_dtype == "auto":
        server_dtype = str(resolve_dtype("auto", torch.device(device), model_dir)).removeprefix("torch.")
    train_dtype = DTYPE_NAMES[args.train_dtype] if args.train_dtype else both
    if train_dtype == "auto":
        mp, _ = resolve_mixed_precision("auto", torch.device(device).type, model_hidden_size(model_dir))
        train_dtype = "bfloat16" if mp == "bf16" else "float32"
    threads = args.threads
    cap = args.cap if args.cap is not None else cfg.train.loss.behav_imp_weight_cap
    cap = float(cap) if cap is not None else 5.0

    tok = Tokenizer(model_dir)
    data = msgspec.structs.replace(cfg.data, num_train=max(args.prompts, 1), num_eval=1)
    train, _ = load_samples(data)
    items = train[: args.prompts]
    prompts = [prompt_ids(tok, s, cfg.data.apply_chat_template) for s in items]
    r = cfg.rollout
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)

    server_threads = threads or cfg.server.torch_threads
    proc, url = start_server(
        model_dir, device, server_dtype, server_threads, cfg.server.max_total_tokens, cfg.server.max_running_requests
    )
    try:
        t0 = time.perf_counter()
        gens = asyncio.run(sample_all(url, prompts, args.samples, sampling))
        sample_s = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)  # its memory is free before the trainer loads the model

    trajs = []
    for i, g in enumerate(gens):
        if not g.output_ids:
            continue
        t = trajectory_from_generation(prompts[i // args.samples], g, 0.0)
        t.group_id = i // args.samples
        trajs.append(t)
    if not trajs:
        raise SystemExit("the server returned no tokens")
    torch.set_num_threads(threads or cfg.train.torch_threads)
    mp = {"float32": "fp32", "bfloat16": "bf16"}[train_dtype]
    train_cfg = msgspec.structs.replace(cfg.train, device=device, mixed_precision=mp, nproc=1)
    t0 = time.perf_counter()
    logp = trainer_logprobs(model_dir, train_cfg, trajs)  # [N]
    score_s = time.perf_counter() - t0

    mask = np.concatenate([np.asarray(t.loss_mask, dtype=bool) for t in trajs])  # [N]
    server = np.concatenate([np.asarray(t.logprobs, dtype=np.float64) for t in trajs])[mask]  # [T]
    positions = np.concatenate([np.arange(len(t.loss_mask)) - t.prompt_len for t in trajs])[mask]  # [T]
    stats = mismatch_stats(logp.astype(np.float64)[mask], server, positions, cap)
    report = {
        "config": os.path.relpath(args.config, ROOT) if os.path.isabs(args.config) else args.config,
        "overrides": args.overrides,
        "model": cfg.model.path,
        "model_dir": model_dir,
        "device": device,
        "server_dtype": server_dtype,
        "train_dtype": train_dtype,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "max_new_tokens": r.max_new_tokens,
        "prompts": len(items),
        "samples_per_prompt": args.samples,
        "sequences": len(trajs),
        "train_layout": train_cfg.layout,
        "micro_batch_tokens": train_cfg.micro_batch_tokens,
        "threads": {"server": server_threads, "train": threads or cfg.train.torch_threads},
        "finish_reasons": {k: sum(g.finish_reason == k for g in gens) for k in ("stop", "length", "abort")},
        "sample_s": round(sample_s, 2),
        "score_s": round(score_s, 2),
        **stats,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(
        f"model {cfg.model.path} on {device}: server {server_dtype}, trainer {train_dtype}; temperature "
        f"{r.temperature}; {len(trajs)} sequences ({len(items)} prompts x {args.samples}), {stats['tokens']} "
        "sampled tokens"
    )
    print(
        "| device | server | trainer | tokens | max abs diff | mean abs diff | p99 abs diff | KL k3 | "
        f"past cap {cap:g} | below 1/cap |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {device} | {server_dtype} | {train_dtype} | {stats['tokens']} | {stats['max_abs_diff']:.3g} | "
        f"{stats['mean_abs_diff']:.3g} | {stats['abs_diff_quantiles']['0.99']:.3g} | {stats['kl_k3_mean']:.3g} | "
        f"{stats['frac_over_cap']:.4f} | {stats['frac_under_inv_cap']:.4f} |"
    )
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
