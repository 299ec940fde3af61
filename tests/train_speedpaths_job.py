"""Run by tests/test_train_speedpaths.py under torchrun: one train step of several TrainEngine variants on the same
batch, written out for comparison.

    torchrun --nproc_per_node 2 tests/train_speedpaths_job.py MODEL_DIR OUT_DIR

Variants: the layout (packed rows with a block mask, padded length-sorted rows, or shared prompts run once) x the
prox pass (separate or folded into the training forward), with one and with two PPO minibatches. Each variant is a
fresh engine from the same checkpoint, so every one takes the same first step. Rank 0 writes OUT_DIR/results.json
(stats, layout) and OUT_DIR/<variant>.npz (the full weights after the step).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

# AdamW with eps=1 and lr=1 makes the first update about the gradient itself (|g| << eps), so comparing weights
# compares gradients; no clipping, so nothing hides a difference. Small micro-batches: several per rank.
# CPU numerics are compared (fp32): pinned to the CPU, also on a GPU host (where "auto" would mean CUDA and bf16, with
# both ranks on one device).
BASE_CFG = {
    "device": "cpu",
    "micro_batch_tokens": 64,
    "loss": {"behav_imp_weight_cap": 5.0, "eps_clip": 0.2},
    "optim": {"lr": 1.0, "eps": 1.0, "grad_clip": 0.0, "weight_decay": 0.0},
}
ENT_KL = {"entropy_coef": 0.2, "kl_coef": 0.1}  # entropy in the loss, and the frozen reference model's pass
VARIANTS = {  # name -> (ppo_minibatches, layout, fold_prox, extra loss settings)
    "k1_packed_separate": (1, "packed", False, {}),  # the path before the speed-ups: the reference
    "k1_packed_folded": (1, "packed", True, {}),
    "k1_rows_separate": (1, "rows", False, {}),
    "k1_rows_folded": (1, "rows", True, {}),
    "k1_prefix_separate": (1, "prefix", False, {}),
    "k1_auto": (1, "auto", True, {}),  # what a run gets (shared prefixes)
    "k2_packed": (2, "packed", True, {}),  # two minibatches: the prox pass always runs
    "k2_auto": (2, "auto", True, {}),
    "k2_rows": (2, "rows", True, {}),
    "k1_packed_separate_entkl": (1, "packed", False, ENT_KL),
    "k1_auto_entkl": (1, "auto", True, ENT_KL),
}


def make_trajectories(vocab: int):
    """5 groups of 4 (2 ranks: 2 groups on one, 3 on the other) with shared prompts of 12-19 tokens, responses of
    2-20 tokens; behaviour logprobs around log(1/V) with a few far below (the importance-weight cap masks them);
    rewards varying within groups."""
    from areal_async.types import Trajectory

    rng = np.random.default_rng(5)
    trajs = []
    for g in range(5):
        p_len = int(rng.integers(12, 20))  # prompts long enough that sharing them pays (train/layouts.py)
        prompt = rng.integers(2, vocab, p_len).tolist()
        for _ in range(4):
            r_len = int(rng.integers(2, 21))
            behav = (np.log(1.0 / vocab) + rng.normal(0.0, 0.3, r_len) - 3.0 * (rng.random(r_len) < 0.1)).tolist()
            trajs.append(
                Trajectory(
                    input_ids=prompt + rng.integers(2, vocab, r_len).tolist(),
                    loss_mask=[0] * p_len + [1] * r_len,
                    logprobs=[0.0] * p_len + behav,
                    versions=[-1] * p_len + [0] * r_len,
                    reward=float(rng.integers(0, 3)),
                    group_id=g,
                    prompt_len=p_len,
                )
            )
    return trajs


def main(model: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from areal_async.config import TrainConfig, from_dict
    from areal_async.train.client import split_by_rank
    from areal_async.train.engine import TrainEngine, init_distributed
    from areal_async.types import pack_trajectories

    torch.set_num_threads(1)
    device = init_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, dict] = {}
    for name, (k, layout, fold, loss) in VARIANTS.items():
        cfg = from_dict({**BASE_CFG, "ppo_minibatches": k, "loss": {**BASE_CFG["loss"], **loss}}, TrainConfig)
        engine = TrainEngine(model, cfg, seed=3, device=device, layout=layout, fold_prox=fold)
        trajs = make_trajectories(engine.vocab_size)
        shard = split_by_rank(trajs, world)[rank]
        batch = pack_trajectories(shard, 0, sum(t.response_len for t in trajs), len(trajs))
        _, stats = engine.train_step(batch)
        weights = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            np.savez(
                os.path.join(out_dir, f"{name}.npz"), **{n: t.detach().float().numpy() for n, t in weights.items()}
            )
            results[name] = {
                "stats": stats,
                "layout": engine.layout,
                "step_layout": engine.last_step_layout,
                "shard_seqs": len(shard),
            }
        del engine, weights
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # as the trainer worker does (areal_async/train/worker.py): skip the interpreter's finalisation, where a gloo
    # thread dropping a finished collective's tensors (their Python references need the GIL) can abort a rank.
    # Rank 1 of this job aborted once in a fresh-clone CI run ("terminate called without an active exception",
    # SIGABRT); a core of the same abort in tests/test_lora_train.py's job showed where
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
