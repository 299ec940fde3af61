"""Training throughput: packed micro-batches under a token budget vs fixed-size padded micro-batches.

Same model, same batch of long-tailed sequence lengths, same loss (decoupled PPO on the recomputed logprobs),
forward + backward (+ an AdamW step with --optim). Only the micro-batching differs:
  packed: `pack_micro_batches(lens, --budget)`, one row per micro-batch, attention kept inside each sequence;
  padded: consecutive groups of --pad-batch sequences, each right-padded to its longest member.
Throughput counts real (unpadded) tokens per second of wall time.

    python benchmarks/train_packing.py --out /tmp/train_packing.json [--quick]
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
import torch

from areal_async.config import LossConfig
from areal_async.testing.tiny import make_tiny_checkpoint
from areal_async.train.logprobs import packed_forward_logprobs, pad_forward_logprobs
from areal_async.train.losses import ppo_actor_loss
from areal_async.train.packing import pack_micro_batches


def sample_lengths(n: int, lo: int, hi: int, median: float, sigma: float, seed: int) -> list[int]:
    """Log-normal lengths clipped to [lo, hi]: most answers short, a few long ones (RL reasoning batches)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(np.log(median), sigma, n), lo, hi).round()]


def train_pass(
    model,
    seqs: list[torch.Tensor],
    adv: list[float],
    micro_batches: list[list[int]],
    padded: bool,
    opt: torch.optim.Optimizer | None,
) -> float:
    """One pass over the batch; returns seconds. The loss normaliser is the batch's token count, as in training."""
    cfg = LossConfig(behav_imp_weight_cap=None)
    total = float(sum(s.numel() - 1 for s in seqs))
    t0 = time.perf_counter()
    for mb in micro_batches:
        parts = [seqs[i] for i in mb]
        lens = [p.numel() for p in parts]
        if padded:
            logp, _ = pad_forward_logprobs(model, parts)
        else:
            logp, _ = packed_forward_logprobs(model, torch.cat(parts), lens)
        mask = torch.ones_like(logp)
        starts = torch.tensor([0] + lens[:-1]).cumsum(0)
        mask[starts] = 0  # first token of each sequence is never trained
        a = torch.repeat_interleave(torch.tensor([adv[i] for i in mb]), torch.tensor(lens)).to(logp.device)
        old = logp.detach()
        loss, _ = ppo_actor_loss(logp, old, old, a, mask, cfg, normalizer=total)
        loss.backward()
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (seconds); figures mean nothing")
    ap.add_argument("--num-seqs", type=int, default=48)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--median-len", type=float, default=160.0)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--budget", type=int, default=2048, help="packed micro-batch token budget")
    ap.add_argument("--pad-batch", type=int, default=8, help="sequences per padded micro-batch")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--optim", action="store_true", help="include an AdamW step per pass")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.num_seqs, args.max_len, args.median_len, args.budget, args.pad_batch = 8, 96, 24.0, 160, 4
        args.min_len, args.hidden, args.layers, args.repeats = 4, 64, 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(
            os.path.join(tmp, "qwen2"),
            "qwen2",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=4 * args.hidden,
            max_position_embeddings=2 * args.max_len,
            seed=args.seed,
        )
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    model.to(args.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5) if args.optim else None

    lens = sample_lengths(args.num_seqs, args.min_len, args.max_len, args.median_len, args.sigma, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    seqs = [torch.randint(2, vocab, (n,), generator=gen) for n in lens]
    adv = torch.randn(len(seqs), generator=gen).tolist()
    packed_mbs = pack_micro_batches(lens, args.budget)
    padded_mbs = [list(range(i, min(i + args.pad_batch, len(lens)))) for i in range(0, len(lens), args.pad_batch)]
    real_tokens = sum(lens)
    padded_slots = sum(len(mb) * max(lens[i] for i in mb) for mb in padded_mbs)

    # Warm-up on a small slice so one-time costs (allocator, kernel selection) land in neither measurement.
    warm = sorted(range(len(lens)), key=lambda i: lens[i])[:2]
    train_pass(model, seqs, adv, [warm], padded=False, opt=None)
    train_pass(model, seqs, adv, [warm], padded=True, opt=None)
    times: dict[str, list[float]] = {"packed": [], "padded": []}
    for _ in range(args.repeats):  # interleaved, so a noisy neighbour hurts both alike
        times["packed"].append(train_pass(model, seqs, adv, packed_mbs, padded=False, opt=opt))
        times["padded"].append(train_pass(model, seqs, adv, padded_mbs, padded=True, opt=opt))
    packed_s, padded_s = statistics.median(times["packed"]), statistics.median(times["padded"])
    result = {
        "packed_tokens_per_s": real_tokens / packed_s,
        "padded_tokens_per_s": real_tokens / padded_s,
        "ratio": padded_s / packed_s,
        "packed_s": times["packed"],
        "padded_s": times["padded"],
        "real_tokens": real_tokens,
        "padded_token_slots": padded_slots,
        "padding_fraction": 1 - real_tokens / padded_slots,
        "packed_micro_batches": len(packed_mbs),
        "padded_micro_batches": len(padded_mbs),
        "max_packed_tokens": max(sum(lens[i] for i in mb) for mb in packed_mbs),
        "lengths": {
            "min": min(lens),
            "median": int(statistics.median(lens)),
            "mean": real_tokens / len(lens),
            "max": max(lens),
        },
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "env": {
            "device": args.device,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'layout':<8} {'micro-batches':>13} {'token slots':>12} {'seconds':>8} {'tokens/s':>10}")
    for name, mbs, slots, secs in (
        ("packed", packed_mbs, real_tokens, packed_s),
        ("padded", padded_mbs, padded_slots, padded_s),
    ):
        print(f"{name:<8} {len(mbs):>13} {slots:>12} {secs:>8.2f} {real_tokens / secs:>10.0f}")
    print(
        f"ratio packed/padded throughput: {result['ratio']:.2f}x  (padding {result['padding_fraction']:.0%}, "
        f"{len(lens)} sequences, lengths {min(lens)}..{max(lens)}, median {result['lengths']['median']})"
    )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
