"""train.lora under real torchrun with 2 ranks (FSDP2 shards the frozen base and the adapters alike): the base never
moves, the optimizer holds the adapters alone, every layout (packed, rows, shared prefix), the folded prox pass,
two minibatches, the entropy bonus with the KL reference and activation checkpointing take the same step, the first
step's update is the plainly written policy gradient of the adapters, and what the trainers publish loads as it
should: the adapter directory with peft (peft's key names, the trained values) and the merged checkpoint with
transformers (equal to peft's merge).

The module runs itself as the torchrun job (`python -m torch.distributed.run ... tests/test_lora_train.py MODEL
OUT`): each variant is a fresh engine from the same checkpoint taking two steps on the same batch; rank 0 writes
OUT/results.json and OUT/<variant>_v<k>.npz (the full state dict after step k). AdamW with lr = 1 and eps = 1 makes
the first update -g / (|g| + 1), about the gradient itself, so comparing weights compares gradients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK, ALPHA, SEED = 4, 8.0, 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE_CFG = {
    "device": "cpu",
    "micro_batch_tokens": 64,
    "loss": {"behav_imp_weight_cap": 5.0, "eps_clip": 0.2},
    "optim": {"lr": 1.0, "eps": 1.0, "grad_clip": 0.0, "weight_decay": 0.0},
    "lora": {"rank": RANK, "alpha": ALPHA, "target_modules": TARGETS},
}
VARIANTS = {  # name -> (ppo_minibatches, layout, fold_prox, extra config)
    "packed_separate": (1, "packed", False, {}),  # the plainest path: the reference
    "rows_folded": (1, "rows", True, {}),
    "auto": (1, "auto", True, {}),  # shared prefixes: what a run gets
    "k2_packed": (2, "packed", True, {}),
    "k2_auto": (2, "auto", True, {}),
    "entkl_packed": (1, "packed", False, {"loss": {"entropy_coef": 0.2, "kl_coef": 0.1}}),
    "entkl_auto": (1, "auto", True, {"loss": {"entropy_coef": 0.2, "kl_coef": 0.1}}),
    "checkpointed": (1, "auto", True, {"activation_checkpointing": True}),
}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
    return out


def _job(model: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from train_speedpaths_job import make_trajectories

    from areal_async.config import TrainConfig, from_dict
    from areal_async.train.client import split_by_rank
    from areal_async.train.engine import TrainEngine, init_distributed
    from areal_async.train.lora_publish import AdapterPublisher
    from areal_async.types import pack_trajectories

    torch.set_num_threads(1)
    device = init_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, dict] = {}
    for name, (k, layout, fold, extra) in VARIANTS.items():
        cfg = from_dict(_merge({**BASE_CFG, "ppo_minibatches": k}, extra), TrainConfig)
        engine = TrainEngine(model, cfg, seed=SEED, device=device, layout=layout, fold_prox=fold)
        trajs = make_trajectories(engine.vocab_size)
        shard = split_by_rank(trajs, world)[rank]
        stats = []
        for step in range(2):
            batch = pack_trajectories(shard, step, sum(t.response_len for t in trajs), len(trajs))
            stats.append(engine.train_step(batch)[1])
            sd = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                arrays = {n: t.detach().float().numpy().copy() for n, t in sd.items()}
                np.savez(os.path.join(out_dir, f"{name}_v{step + 1}.npz"), **arrays)
        optimized = [p for g in engine.optimizer.param_groups for p in g["params"]]
        if name == "auto":  # what the trainers publish: the adapters (collective gather), the merged model
            pub = AdapterPublisher().publish(
                engine.model,
                lora=engine.lora,
                rank=RANK,
                alpha=ALPHA,
                dropout=0.0,
                source_dir=model,
                root=os.path.join(out_dir, "adapters"),
                version=2,
                keep=2,
                served="float32",
                skip=engine.tied_names,
            )
            merged = engine.publish(os.path.join(out_dir, "merged"), 2)
            if rank == 0:
                results["published"] = {"adapter": pub.path, "merged": merged.path, "bytes": pub.num_bytes}
        if rank == 0:
            results[name] = {
                "stats": stats,
                "step_layout": engine.last_step_layout,
                "optimized": len(optimized),
                "optimized_numel": sum(p.numel() for p in optimized),
                "optimizer_states": len(engine.optimizer.state),
                "trainable": engine.num_trainable,
                "adapted": sorted(engine.lora),
            }
        del engine
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def lora_steps(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_train")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", __file__]
    proc = subprocess.run([*cmd, tiny_ckpt, str(out)], env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "results.json") as f:
        results = json.load(f)
    weights = {
        (name, v): dict(np.load(out / f"{name}_v{v}.npz")) for name in VARIANTS for v in (1, 2) if name in results
    }
    return results, weights


def _max_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(a[n] - b[n]).max()) for n in a)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_only_the_adapters_train_and_every_path_takes_the_same_step(lora_steps, tiny_ckpt):
    from safetensors.numpy import load_file

    results, weights = lora_steps
    base = load_file(os.path.join(tiny_ckpt, "model.safetensors"))
    ref = results["packed_separate"]
    n_adapted = len(ref["adapted"])
    assert n_adapted == 2 * len(TARGETS)  # the tiny model's 2 layers, every target kind
    for name in VARIANTS:
        r = results[name]
        # the optimizer holds the adapters alone, as its state does
        assert r["optimized"] == r["optimizer_states"] == 2 * n_adapted, (name, r)
        assert r["optimized_numel"] == r["trainable"]
        for v in (1, 2):
            w = weights[(name, v)]
            for n, t in base.items():  # the frozen base, bit for bit
                if n in w:
                    assert np.array_equal(w[n], t.astype(np.float32)), (name, v, n)
            lora = [n for n in w if "lora_" in n]
            assert len(lora) == 2 * n_adapted and set(w) - set(lora) <= set(base) | {"lm_head.weight"}  # tied
    assert results["auto"]["step_layout"] == "prefix"
    assert results["checkpointed"]["step_layout"] != "prefix"  # activation checkpointing: rows
    for a, b in [
        ("packed_separate", "rows_folded"),
        ("packed_separate", "auto"),
        ("packed_separate", "checkpointed"),
        ("k2_packed", "k2_auto"),
        ("entkl_packed", "entkl_auto"),
    ]:
        for v in (1, 2):
            assert _max_diff(weights[(a, v)], weights[(b, v)]) < 1e-6, (a, b, v)
        for key in ("loss", "grad_norm"):
            assert results[b]["stats"][1][key] == pytest.approx(results[a]["stats"][1][key], rel=1e-5, abs=1e-7)
    w1, w2 = weights[("packed_separate", 1)], weights[("packed_separate", 2)]
    a_names = [n for n in w1 if n.endswith("lora_A.weight")]
    b_names = [n for n in w1 if n.endswith("lora_B.weight")]
    assert all(np.abs(w1[n]).max() > 1e-4 for n in b_names)  # B left zero at the first step
    # and A moves once B is not zero (q and k least: the tiny random model's attention is nearly uniform)
    assert all(not np.array_equal(w2[n], w1[n]) for n in a_names)
    assert max(float(np.abs(w2[n] - w1[n]).max()) for n in a_names) > 1e-3
    assert _max_diff(weights[("entkl_auto", 2)], weights[("auto", 2)]) > 1e-5  # the entropy bonus mattered


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_first_update_is_the_plain_policy_gradient_of_the_adapters(lora_steps, tiny_ckpt):
    """A transformers model with the same adapters (train/lora.py, seeded alike), the decoupled-PPO loss written out
    (at the first step ratio = 1, so loss = -sum A_i w_t keep_t logp_t / tokens), autograd: AdamW's first update
    with lr = eps = 1 is -g / (|g| + 1) for every adapter."""
    import torch
    import transformers
    from train_speedpaths_job import make_trajectories

    from areal_async.train.lora import initial_adapters, inject_lora

    results, weights = lora_steps
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_ckpt, dtype=torch.float32, attn_implementation="eager"
    )
    inject_lora(model, rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=TARGETS)
    init = initial_adapters(model, SEED)
    model.load_state_dict(init, strict=False)
    trajs = make_trajectories(model.config.vocab_size)
    rewards = np.array([t.reward for t in trajs])
    gids = np.array([t.group_id for t in trajs])
    adv = np.zeros_like(rewards)
    for g in set(gids.tolist()):
        sel = gids == g
        adv[sel] = (rewards[sel] - rewards[sel].mean()) / (rewards[sel].std() + 1e-6)
    total = sum(t.response_len for t in trajs)
    loss = 0.0
    for t, a in zip(trajs, adv):
        ids = torch.tensor([t.input_ids])
        lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        behav = torch.tensor(t.logprobs[1:])
        w = torch.exp(torch.where(mask, lp.detach() - behav, 0.0))
        keep = mask & (w <= 5.0)
        loss = loss + (-float(a) * w * keep * lp).sum() / total
    loss.backward()
    got = weights[("packed_separate", 1)]
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert p.grad is None or not p.requires_grad
            continue
        g = p.grad.double().numpy()
        want = init[name].numpy().astype(np.float64) - g / (np.abs(g) + 1.0)
        np.testing.assert_allclose(got[name], want, atol=2e-6, rtol=0, err_msg=name)
    assert max(float(p.grad.abs().max()) for n, p in model.named_parameters() if "lora_B" in n) > 1e-4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_published_adapters_load_with_peft_and_the_merged_model_with_transformers(lora_steps, tiny_ckpt):
    import torch
    import transformers

    from areal_async.weights.lora_adapter import peft_key

    peft = pytest.importorskip("peft")
    results, weights = lora_steps
    pub = results["published"]
    with open(os.path.join(pub["adapter"], "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["peft_type"] == "LORA" and cfg["r"] == RANK and cfg["lora_alpha"] == ALPHA
    assert sorted(cfg["target_modules"]) == sorted(TARGETS)
    from safetensors.torch import load_file

    saved = load_file(os.path.join(pub["adapter"], "adapter_model.safetensors"))
    trained = weights[("auto", 2)]
    for name in (n for n in trained if "lora_" in n):
        module, which = name.removesuffix(".weight").rsplit(".lora_", 1)
        assert np.array_equal(saved[peft_key(module, which)].numpy(), trained[name])
    assert len(saved) == len([n for n in trained if "lora_" in n])
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    with_peft = peft.PeftModel.from_pretrained(base, pub["adapter"]).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(pub["merged"], dtype=torch.float32).eval()
    assert not any("lora" in n for n in merged.state_dict())
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]])
    with torch.no_grad():
        want = torch.log_softmax(with_peft(ids).logits.float(), -1)
        got = torch.log_softmax(merged(ids).logits.float(), -1)
        plain = torch.log_softmax(
            transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)(ids).logits.float(), -1
        )
    assert float((got - want).abs().max()) < 1e-4
    assert float((plain - want).abs().max()) > 1e-4  # the trained adapters changed the model


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _job(sys.argv[1], sys.argv[2])
    # as the trainer worker and tests/train_speedpaths_job.py do: skip the interpreter's finalisation. A rank of this
    # job aborted there once in 24 runs ("terminate called without an active exception", SIGABRT): its core shows a
    # gloo thread dropping a finished allgather's tensors, whose Python references need the GIL, during Py_FinalizeEx
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
