"""Seconds per trainer step on a realistic RL batch, with a breakdown of where they go.

The same `TrainEngine.train_step` a torchrun rank runs (FSDP2 over a world of one, in this process; the RPC hop of
the worker adds milliseconds on a step of seconds), on the project's default model shape (Qwen2, hidden 128,
4 layers, char vocab, random weights: speed does not depend on what the weights learned) and a synthetic batch
shaped like the default run's: 16 prompt groups x 8 samples, prompts of 26-36 tokens, answers of 15-60 tokens that
differ by up to 6 tokens within a group (`--resp-spread -1` draws every length independently). Answers are random
tokens, so they share nothing beyond the prompt; in the real run the samples of a solved problem also share the
start of their worked solutions, which the shared-prefix layout runs once too.

Breakdown (from `TrainEngine.last_timings` when the engine provides it): prox = the no-grad proximal-logprob pass
(0 when it is folded into the training forward), forward / backward = the training micro-batches, optimizer =
grad-norm clipping + AdamW, other = the rest of the step (decoding, advantages, stats, reductions). All are wall
seconds (medians over the timed steps); `cpu_s_per_step` is the process's CPU time per step, the steadier figure on
a shared machine when the trainer runs one thread.

    python benchmarks/train_step.py --out benchmarks/out/train_step.json [--quick] [--steps 5]
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


def make_batch(num_groups: int, group_size: int, prompt_len: tuple[int, int], resp_len: tuple[int, int],
               vocab: int, policy_version: int, seed: int, resp_spread: int | None = None):
    """A TrainBatch of `num_groups` x `group_size` trajectories: a shared prompt per group, uniform lengths,
    behaviour logprobs around log(1 / vocab) with a few far below (so the importance-weight cap bites), 0/1
    rewards varying within groups. `resp_spread`: answers to one prompt are its group's length (uniform in
    `resp_len`) +- up to this many tokens, as in a real run where the samples of one problem have similar
    lengths; None draws every answer's length independently."""
    from areal_async.types import Trajectory, pack_trajectories

    rng = np.random.default_rng(seed)
    trajs = []
    for g in range(num_groups):
        p_len = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        prompt = rng.integers(2, vocab, p_len).tolist()
        base = int(rng.integers(resp_len[0], resp_len[1] + 1))
        for _ in range(group_size):
            if resp_spread is None:
                r_len = int(rng.integers(resp_len[0], resp_len[1] + 1))
            else:
                r_len = max(1, base + int(rng.integers(-resp_spread, resp_spread + 1)))
            resp = rng.integers(2, vocab, r_len).tolist()
            behav = (np.log(1.0 / vocab) + rng.normal(0.0, 0.3, r_len)
                     - 2.5 * (rng.random(r_len) < 0.05)).tolist()
            trajs.append(Trajectory(input_ids=prompt + resp, loss_mask=[0] * p_len + [1] * r_len,
                                    logprobs=[0.0] * p_len + behav, versions=[-1] * p_len + [policy_version] * r_len,
                                    reward=float(rng.integers(0, 2)), group_id=g, prompt_len=p_len))
    resp_tokens = sum(t.response_len for t in trajs)
    return pack_trajectories(trajs, policy_version, resp_tokens, len(trajs)), trajs


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
    ap.add_argument("--quick", action="store_true", help="smoke run (seconds): 2 groups x 4, 2 layers, 1 step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup untimed ones)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(26, 36),
                    help="shared prompt length range (the default task's prompts are 27-36 tokens)")
    ap.add_argument("--resp-len", type=int, nargs=2, default=(15, 60))
    ap.add_argument("--resp-spread", type=int, default=6,
                    help="answers to one prompt differ by up to this many tokens; -1: every length independent")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the default trainer uses 1)")
    ap.add_argument("--layout", default="auto", choices=["auto", "packed", "rows", "prefix"],
                    help="TrainEngine layout: packed rows with a block mask, padded length-sorted rows, or shared "
                         "prefixes run once")
    ap.add_argument("--no-fold", action="store_true",
                    help="keep the separate prox pass with one minibatch (the path before folding)")
    ap.add_argument("--profile", default=None, help="write a cProfile of the timed steps to this file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="TrainConfig key=value overrides, e.g. train.ppo_minibatches=2")
    args = ap.parse_args(argv)
    if args.quick:
        args.groups, args.group_size, args.layers, args.steps, args.warmup = 2, 4, 2, 1, 0

    import torch

    from areal_async.config import TrainConfig, from_dict
    from areal_async.testing.tiny import make_tiny_checkpoint
    from areal_async.train.engine import TrainEngine, init_distributed

    torch.set_num_threads(args.threads)
    # the default run's trainer settings (configs/default.yaml), then the command line's
    cfg_dict = _apply_overrides({"micro_batch_tokens": 1024, "ppo_minibatches": 1,
                                 "loss": {"eps_clip": 0.2, "behav_imp_weight_cap": 5.0},
                                 "optim": {"lr": 1e-4, "grad_clip": 1.0}}, args.overrides)
    cfg = from_dict(cfg_dict, TrainConfig)
    device = init_distributed(cfg.device)
    steps: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(os.path.join(tmp, "qwen2"), "qwen2", hidden_size=args.hidden,
                                    num_layers=args.layers, num_heads=4, num_kv_heads=2,
                                    intermediate_size=4 * args.hidden, seed=args.seed)
        # only non-default switches are passed, so the script also times an engine from before they existed
        switches = {**({"layout": args.layout} if args.layout != "auto" else {}),
                    **({"fold_prox": False} if args.no_fold else {})}
        engine = TrainEngine(path, cfg, seed=args.seed, device=device, **switches)
        profiler = None
        for i in range(args.warmup + args.steps):
            batch, trajs = make_batch(args.groups, args.group_size, tuple(args.prompt_len), tuple(args.resp_len),
                                      engine.vocab_size, engine.version, args.seed + i,
                                      None if args.resp_spread < 0 else args.resp_spread)
            timed = i >= args.warmup
            if timed and args.profile and profiler is None:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0, c0 = time.perf_counter(), time.process_time()
            _, stats = engine.train_step(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if not timed:
                continue
            parts = dict(getattr(engine, "last_timings", None) or {"prox": stats["prox_seconds"]})
            parts["other"] = max(wall - sum(parts.values()), 0.0)
            steps.append({"wall_s": wall, "cpu_s": cpu, "parts": parts, "tokens": stats["tokens"],
                          "num_seqs": stats["num_seqs"], "loss": stats["loss"], "grad_norm": stats["grad_norm"]})
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
    import torch.distributed as dist

    dist.destroy_process_group()

    wall = statistics.median(s["wall_s"] for s in steps)
    keys = list(steps[0]["parts"])
    parts = {k: statistics.median(s["parts"][k] for s in steps) for k in keys}
    tokens = statistics.mean(s["tokens"] for s in steps)
    result = {
        "s_per_step": wall,
        "cpu_s_per_step": statistics.median(s["cpu_s"] for s in steps),
        "tokens_per_s": tokens / wall,
        "breakdown_s": parts,
        "steps": steps,
        "tokens_per_step": tokens,
        "seqs_per_step": steps[0]["num_seqs"],
        "layout": getattr(engine, "layout", None),
        "fold_prox": getattr(engine, "fold_prox", None),
        "train_config": cfg_dict,
        "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "env": {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
                "python": platform.python_version(), "cpu_count": os.cpu_count(),
                "loadavg_1m": os.getloadavg()[0]},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{len(steps)} steps of {int(result['seqs_per_step'])} seqs / {tokens:.0f} tokens, "
          f"micro_batch_tokens={cfg.micro_batch_tokens}, ppo_minibatches={cfg.ppo_minibatches}, "
          f"layout={result['layout']}, fold_prox={result['fold_prox']}, threads={torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'part':<10} {'s/step':>8} {'share':>6}")
    for k, v in parts.items():
        print(f"{k:<10} {v:>8.3f} {v / wall:>6.0%}")
    print(f"{'total':<10} {wall:>8.3f}   ({tokens / wall:.0f} tokens/s; process CPU {result['cpu_s_per_step']:.3f} "
          f"s/step, which a busy machine inflates less than wall time)")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
