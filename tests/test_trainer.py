"""Trainer ranks under real torchrun, driven over RPC by `TrainerGroup`: the step against an independent reference,
1 rank == 2 ranks (uneven and empty shards), resume == uninterrupted, skipped non-finite steps, rejected batches,
authentication, and the ways a rank exits.

Three torchrun jobs, all started at once since each start costs seconds: A (1 rank) and B (2 ranks) train the
same batches side by side; C (1 rank, activation checkpointing on) loads A's checkpoint in a fresh process.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import secrets
import signal
import sys
import time

import msgspec
import numpy as np
import pytest
import pytest_asyncio

from areal_async.launch import Processes
from areal_async.net.rpc import RpcAuthError, RpcClient, RpcError
from areal_async.train.client import TrainerError, TrainerGroup, split_by_rank
from areal_async.train.errors import BatchError, PeerBatchError, kind_of
from areal_async.train.packing import pack_micro_batches
from areal_async.types import Array, TrainStepRequest, TrainStepResult, Trajectory, pack_trajectories

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

# k=2 minibatches, several micro-batches per minibatch, global batch norm, the importance-weight cap in play, an lr
# large enough that one step moves the weights far beyond the comparison tolerances, and a warmup, so that a
# resumed run must restore the schedule too (lr x0.5 at step 1, x1 at step 2).
# Pinned to the CPU (fp32 numerics are compared against transformers), also on a GPU host.
CFG = {
    "device": "cpu",
    "ppo_minibatches": 2,
    "micro_batch_tokens": 40,
    "advantage": {"batch_norm": True},
    "loss": {"behav_imp_weight_cap": 5.0, "eps_clip": 0.2},
    "optim": {
        "lr": 1e-3,
        "grad_clip": 0.05,
        "eps": 1e-8,
        "schedule": "cosine",
        "warmup_steps": 2,
        "total_steps": 6,
        "min_lr_ratio": 0.1,
    },
}
STEP1_LR = 0.5e-3  # warmup: (0 + 1) / 2 of the peak


# ---- torchrun jobs ------------------------------------------------------------------------------------------------


class Job:
    """One torchrun trainer job, started the way a run starts it (areal_async.launch), plus its TrainerGroup."""

    def __init__(self, name: str, nproc: int, model: str, root, secret: bytes, cfg: dict):
        self.name, self.nproc, self.secret = name, nproc, secret
        self.launcher = Processes(str(root / name))
        self.run_dir = self.launcher.run_dir
        self.child = self.launcher.start_trainers(
            model=model, nproc=nproc, config_json=json.dumps(cfg), seed=3, secret_hex=secret.hex(), torch_threads=1
        )
        self.proc = self.child.proc  # torchrun's agent
        self.group: TrainerGroup | None = None

    async def connect(self) -> TrainerGroup:
        """TrainerGroup.connect, failing fast (with the log tail) if the job dies while we wait."""
        watch = asyncio.ensure_future(self.launcher.watch())
        connect = asyncio.ensure_future(TrainerGroup.connect(self.run_dir, self.nproc, self.secret, timeout=180))
        await asyncio.wait([watch, connect], return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if not connect.done():
            connect.cancel()
            watch.result()  # raises ChildFailed
        self.group = connect.result()
        return self.group

    def worker_pids(self) -> list[int]:
        pids = []
        for r in range(self.nproc):
            with open(os.path.join(self.run_dir, "trainer", f"rank{r}.json")) as f:
                pids.append(json.load(f)["pid"])
        return pids

    def kill(self) -> None:
        self.launcher.shutdown(grace_s=5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by a dead parent's successor) is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


async def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        await asyncio.sleep(0.1)
    return False


# ---- batches ------------------------------------------------------------------------------------------------------


def _hf_model(path: str):
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def _seq_logp(model, ids: list[int]):
    """Unpacked, one sequence at a time: the plainest way to get logp[t] = log p(ids[t] | ids[:t]), 0 at t=0."""
    import torch

    logits = model(torch.tensor([ids])).logits[0].float()  # [T, V]
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([lp.new_zeros(1), lp])  # [T]


def make_batch(
    model, rng: random.Random, group_lens: list[list[tuple[int, int]]], policy_version: int
) -> list[Trajectory]:
    """Trajectories whose behaviour logprobs sit near the model's own (importance weights around 1), with a few
    tokens far below (weights beyond the cap of 5: masked), rewards varying within groups."""
    import torch

    trajs = []
    for g, members in enumerate(group_lens):
        for prompt_len, resp_len in members:
            ids = [rng.randrange(2, 100) for _ in range(prompt_len + resp_len)]
            with torch.no_grad():
                lp = _seq_logp(model, ids).tolist()
            behav = [0.0] * prompt_len
            for t in range(prompt_len, len(ids)):
                off = -2.5 if rng.random() < 0.1 else rng.gauss(0.0, 0.2)
                behav.append(lp[t] + off)
            versions = [-1] * prompt_len + [max(policy_version - rng.randrange(0, 2), 0)] * resp_len
            trajs.append(
                Trajectory(
                    input_ids=ids,
                    loss_mask=[0] * prompt_len + [1] * resp_len,
                    logprobs=behav,
                    versions=versions,
                    reward=float(rng.randrange(0, 3)),
                    group_id=100 + g,
                    prompt_len=prompt_len,
                )
            )
    return trajs


# Group token totals 60 > 40 > 38 > 20: balance_across_ranks gives rank 0 groups {0, 3} and rank 1 {1, 2}, so each
# rank's two minibatch halves are whole groups and the global minibatches ({0, 1}, {2, 3}) are the same as with one
# rank; the shards are uneven (80 vs 78 tokens, different micro-batch counts).
STEP1_GROUPS = [[(5, 30), (5, 20)], [(4, 18), (4, 14)], [(6, 14), (6, 12)], [(3, 7), (3, 7)]]
STEP2_GROUPS = [[(7, 25), (7, 30)], [(5, 20), (5, 12)], [(4, 16), (4, 16)], [(2, 9), (2, 5)]]
STEP3_GROUPS = [[(5, 12), (5, 17), (5, 9), (5, 22)]]  # one group: trainer rank 1 gets an empty shard


def reference_step(model, trajs: list[Trajectory], num_minibatches: int) -> dict:
    """The train step written out plainly on a transformers model (no FSDP, no packing, no engine code): GRPO
    advantages with global batch norm, decoupled PPO with the capped importance weight, one AdamW step per
    minibatch normalised by the minibatch's response tokens, grad-norm clipping."""
    import torch

    loss_cfg, opt_cfg = CFG["loss"], CFG["optim"]
    opt = torch.optim.AdamW(model.parameters(), lr=STEP1_LR, betas=(0.9, 0.999), eps=opt_cfg["eps"], weight_decay=0.0)
    with torch.no_grad():
        prox = [_seq_logp(model, t.input_ids) for t in trajs]
    rewards = np.array([t.reward for t in trajs], dtype=np.float64)
    gids = np.array([t.group_id for t in trajs])
    adv = np.zeros_like(rewards)
    for g in set(gids.tolist()):
        sel = gids == g
        adv[sel] = (rewards[sel] - rewards[sel].mean()) / (rewards[sel].std() + 1e-6)
    adv = (adv - adv.mean()) / (adv.std() + 1e-6)
    n = len(trajs)
    bounds = np.linspace(0, n, num_minibatches + 1).astype(int)
    losses, norms = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        idx = range(lo, hi)
        total_tokens = sum(trajs[i].response_len for i in idx)
        loss = 0.0
        for i in idx:
            t = trajs[i]
            mask = torch.tensor(t.loss_mask, dtype=torch.bool)
            logp = _seq_logp(model, t.input_ids)
            behav = torch.tensor(t.logprobs)
            w = torch.exp(torch.where(mask, prox[i] - behav, 0.0))
            keep = mask & (w <= loss_cfg["behav_imp_weight_cap"])
            ratio = torch.exp(torch.where(keep, logp - prox[i], 0.0))
            a = float(adv[i])
            pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - loss_cfg["eps_clip"], 1 + loss_cfg["eps_clip"]))
            loss = loss + (pg * w * keep).sum() / total_tokens
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        coef = min(1.0, opt_cfg["grad_clip"] / (norm + 1e-6))
        for g in grads:
            g.mul_(coef)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        norms.append(norm)
    return {
        "loss": float(np.mean(losses)),
        "grad_norm": float(np.mean(norms)),
        "grad_norms": norms,
        "weights": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
    }


def load_weights(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert set(a) <= set(b), set(a) ^ set(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


# ---- fixtures -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secret() -> bytes:
    return secrets.token_bytes(32)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def jobs(tiny_ckpt, tmp_path_factory, secret):
    root = tmp_path_factory.mktemp("trainers")
    a = Job("A", 1, tiny_ckpt, root, secret, CFG)
    b = Job("B", 2, tiny_ckpt, root, secret, CFG)
    # C resumes A's checkpoint later; activation checkpointing must not change a single number
    c = Job("C", 1, tiny_ckpt, root, secret, {**CFG, "activation_checkpointing": True})
    started = [a, b, c]
    try:
        await asyncio.gather(a.connect(), b.connect(), c.connect())
        yield {"A": a, "B": b, "C": c, "root": root, "started": started}
    finally:
        for job in started:
            if job.group is not None and job.proc.poll() is None:
                try:
                    await asyncio.wait_for(job.group.shutdown(), 60)
                    job.proc.wait(60)
                except Exception:
                    pass
            job.kill()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trained(jobs, tiny_ckpt, secret):
    """Steps 1-3 on A and B side by side (A checkpoints after step 1), each step's stats and published weights;
    plus the batches."""
    a, b, root = jobs["A"], jobs["B"], jobs["root"]
    model = _hf_model(tiny_ckpt)
    rng = random.Random(7)
    batches = [make_batch(model, rng, STEP1_GROUPS, 0)]
    out = {"batches": batches, "A": [], "B": [], "pub": {"A": [], "B": []}}
    ck1 = str(root / "ck1")
    for step, groups in enumerate([STEP1_GROUPS, STEP2_GROUPS, STEP3_GROUPS]):
        if step > 0:  # later batches are made from the step-1 weights only to look realistic; any batch would do
            batches.append(make_batch(model, rng, groups, step))
        ra, rb = await asyncio.gather(a.group.train_step(batches[step], step), b.group.train_step(batches[step], step))
        out["A"].append(ra)
        out["B"].append(rb)
        pa, pb = await asyncio.gather(
            a.group.publish(step + 1, str(root / "pubA")), b.group.publish(step + 1, str(root / "pubB"), keep=5)
        )
        out["pub"]["A"].append(load_weights(pa.path))
        out["pub"]["B"].append(load_weights(pb.path))
        if step == 0:
            res = await a.group.save_checkpoint(ck1)
            assert res.version == 1
    out["ck1"] = ck1
    return out


# ---- tests --------------------------------------------------------------------------------------------------------


async def test_first_step_matches_plain_reference(trained, tiny_ckpt):
    """Prox recompute, GRPO + global batch norm, the per-minibatch normaliser, the capped decoupled loss, clipping
    and AdamW, against the same step written out on an unsharded, unpacked transformers model."""
    ref = reference_step(_hf_model(tiny_ckpt), trained["batches"][0], CFG["ppo_minibatches"])
    stats = trained["A"][0].stats
    assert trained["A"][0].version == 1
    assert stats["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert stats["optimizer_steps"] == 2 and stats["skipped_steps"] == 0
    assert stats["lr"] == pytest.approx(STEP1_LR)
    base = load_weights(tiny_ckpt)
    got = trained["pub"]["A"][0]
    assert max_diff(got, base) > 5e-4  # the step moved the weights well beyond the tolerance below
    assert max_diff(got, ref["weights"]) < 1e-5
    # stats that do not depend on the update, computed from the batch
    batch = trained["batches"][0]
    resp = sum(t.response_len for t in batch)
    assert stats["response_tokens"] == resp
    assert stats["response_len_mean"] == pytest.approx(resp / len(batch))
    assert stats["reward_mean"] == pytest.approx(np.mean([t.reward for t in batch]))
    assert stats["imp_weight_masked_frac"] > 0  # the tokens placed 2.5 nats below are over the cap
    assert stats["staleness_max"] == 0 and stats["tokens"] == sum(len(t.input_ids) for t in batch)


async def test_two_ranks_match_one_rank(trained):
    """Same loss, grad norm and weights on 1 and 2 ranks, for uneven shards (different micro-batch counts) and
    for a batch of one group, where rank 1 has nothing and only keeps the collectives company."""
    batch1 = trained["batches"][0]
    shards = split_by_rank(batch1, 2)
    lens = [[len(t.input_ids) for t in s] for s in shards]
    assert sum(lens[0]) != sum(lens[1])
    assert len(pack_micro_batches(lens[0], CFG["micro_batch_tokens"])) != len(
        pack_micro_batches(lens[1], CFG["micro_batch_tokens"])
    )
    assert [len(s) for s in split_by_rank(trained["batches"][2], 2)] == [4, 0]
    for step in range(3):
        sa, sb = trained["A"][step].stats, trained["B"][step].stats
        assert trained["B"][step].version == step + 1
        for key in (
            "loss",
            "grad_norm",
            "clip_frac",
            "imp_weight_mean",
            "imp_weight_max",
            "entropy",
            "staleness_mean",
            "adv_abs_mean",
            "response_tokens",
            "num_seqs",
        ):
            assert sb[key] == pytest.approx(sa[key], rel=1e-5, abs=1e-6), (step, key)
        assert max_diff(trained["pub"]["A"][step], trained["pub"]["B"][step]) < 1e-5, step
    # step 2 mixes tokens of versions 0 and 1 at policy version 1
    assert 0 < trained["A"][1].stats["staleness_mean"] <= trained["A"][1].stats["staleness_max"] == 1


async def test_resume_in_new_torchrun_equals_uninterrupted(trained, jobs):
    """Job C, a torchrun of its own that never trained, loads A's checkpoint from after step 1; its step 2 equals
    A's uninterrupted one (model, AdamW state, LR schedule, version all restored; C also runs with activation
    checkpointing, which must not change the numbers). Then C's torchrun agent is killed outright: the orphaned
    rank notices and exits by itself."""
    c: Job = jobs["C"]
    group = c.group
    assert (await group.load_checkpoint(trained["ck1"])).version == 1
    res = await group.train_step(trained["batches"][1], 1)
    assert res.stats["loss"] == pytest.approx(trained["A"][1].stats["loss"], abs=1e-6)
    assert res.stats["lr"] == pytest.approx(CFG["optim"]["lr"])  # the schedule resumed past its warmup
    pub = await group.publish(2, os.path.join(c.run_dir, "pub"))
    assert max_diff(load_weights(pub.path), trained["pub"]["A"][1]) < 1e-6

    (pid,) = c.worker_pids()
    await group.close()
    os.kill(c.proc.pid, signal.SIGKILL)  # torchrun's agent dies without a word to its workers
    c.proc.wait(10)
    assert await _wait_gone(pid, 20), "an orphaned trainer rank kept running"


async def test_load_checkpoint_rpc_restores_step_state(trained, jobs):
    group = jobs["A"].group
    # 3 right after `trained`, other tests on A (any order) leave it at 2 or more: never the checkpoint's 1, so the
    # load below has a version and a state to restore
    assert group.version >= 2
    res = await group.load_checkpoint(trained["ck1"])
    assert res.version == 1 and (await group.info())[0].version == 1
    again = await group.train_step(trained["batches"][1], 1)
    assert again.stats["loss"] == pytest.approx(trained["A"][1].stats["loss"], abs=1e-6)
    assert again.stats["lr"] == trained["A"][1].stats["lr"] == pytest.approx(CFG["optim"]["lr"])
    pub = await group.publish(2, str(jobs["root"] / "pubA_again"))
    assert max_diff(load_weights(pub.path), trained["pub"]["A"][1]) < 1e-6
    with pytest.raises(TrainerError, match="not a trainer checkpoint|not found"):
        await group.load_checkpoint(str(jobs["root"]))
    assert (await group.info())[0].version == 2  # a failed load changes nothing


async def test_nonfinite_gradient_step_is_skipped(trained, jobs):
    """A NaN reward makes every advantage NaN (global batch norm), hence NaN gradients: both optimizer steps are
    skipped on both ranks, the weights stay as they were, and the next clean step trains normally."""
    group = jobs["B"].group
    v = group.version
    before = load_weights((await group.publish(v, str(jobs["root"] / "pubB"), keep=10)).path)
    batch = [msgspec.structs.replace(t) for t in trained["batches"][1]]
    batch[3] = msgspec.structs.replace(batch[3], reward=float("nan"))
    res = await group.train_step(batch, v)
    assert res.version == v + 1
    assert res.stats["skipped_steps"] == 2 and res.stats["optimizer_steps"] == 0
    assert res.stats["nonfinite_inputs"] == 1
    assert not math.isfinite(res.stats["grad_norm"])
    after = load_weights((await group.publish(v + 1, str(jobs["root"] / "pubB"), keep=10)).path)
    assert max_diff(after, before) == 0.0
    clean = await group.train_step(trained["batches"][0], v + 1)
    assert clean.stats["optimizer_steps"] == 2 and math.isfinite(clean.stats["loss"])
    final = load_weights((await group.publish(v + 2, str(jobs["root"] / "pubB"), keep=10)).path)
    assert 0 < max_diff(final, after) and all(np.isfinite(x).all() for x in final.values())


async def test_bad_batches_are_rejected_on_every_rank(trained, jobs):
    group = jobs["B"].group
    v = group.version
    good = trained["batches"][0]
    with pytest.raises(ValueError, match="trajectory 0: len\\(logprobs\\)"):
        await group.train_step([msgspec.structs.replace(good[0], logprobs=[0.0])] + good[1:], v)
    with pytest.raises(ValueError, match="loss_mask\\[0\\]"):
        await group.train_step([msgspec.structs.replace(good[0], loss_mask=[1] * len(good[0].input_ids))], v)

    # only rank 1's shard is broken (a token id outside the vocabulary): both ranks refuse, neither hangs
    shards = split_by_rank(good, 2)
    total = sum(t.response_len for t in good)
    reqs = [TrainStepRequest(batch=pack_trajectories(s, v, total, len(good))) for s in shards]
    ids = reqs[1].batch.input_ids.to_numpy().copy()
    ids[3] = 10_000
    reqs[1] = TrainStepRequest(batch=msgspec.structs.replace(reqs[1].batch, input_ids=Array.from_numpy(ids)))
    results = await asyncio.gather(
        *(cl.call("train_step", r, TrainStepResult, timeout=60) for cl, r in zip(group.clients, reqs)),
        return_exceptions=True,
    )
    assert all(isinstance(r, RpcError) and r.remote_type.endswith("BatchError") for r in results), results
    assert "token ids must be in [0, 100)" in results[1].remote_message
    assert "another trainer rank" in results[0].remote_message
    # the kinds travel as types: rank 1 found the problem, rank 0 only heard of it
    assert kind_of(results[1].remote_type) is BatchError
    assert kind_of(results[0].remote_type) is PeerBatchError

    # a wrong dtype on the wire (rank 0 only), and a batch for another policy version
    n0 = len(reqs[0].batch.input_ids.to_numpy())
    reqs[1] = TrainStepRequest(batch=pack_trajectories(shards[1], v, total, len(good)))
    reqs[0] = TrainStepRequest(
        batch=msgspec.structs.replace(reqs[0].batch, logprobs=Array.from_numpy(np.zeros(n0, dtype=np.float64)))
    )
    results = await asyncio.gather(
        *(cl.call("train_step", r, TrainStepResult, timeout=60) for cl, r in zip(group.clients, reqs)),
        return_exceptions=True,
    )
    assert "batch.logprobs: dtype must be float32" in results[0].remote_message
    assert isinstance(results[1], RpcError)
    with pytest.raises(TrainerError, match="policy_version") as info:
        await group.train_step(good, v + 5)
    assert info.value.bad_input and info.value.kind is BatchError  # both ranks found it: a first-hand error
    assert [i.version for i in await group.info()] == [v, v]
    ok = await group.train_step(good, v)  # still in step after all that
    assert ok.version == v + 1


def _weighted_advantages(rewards, groups, weights, eps: float = 1e-6) -> np.ndarray:
    """CFG's advantages written out: per group the weighted mean and weighted population std, then the batch
    normalised by its weighted mean and std."""
    r, g, w = (np.asarray(x, dtype=np.float64) for x in (rewards, groups, weights))
    a = np.zeros_like(r)
    for k in set(g.tolist()):
        sel = g == k
        m = (w[sel] * r[sel]).sum() / w[sel].sum()
        a[sel] = (r[sel] - m) / (np.sqrt((w[sel] * (r[sel] - m) ** 2).sum() / w[sel].sum()) + eps)
    m = (w * a).sum() / w.sum()
    return (a - m) / (np.sqrt((w * (a - m) ** 2).sum() / w.sum()) + eps)


async def test_episode_weights_in_a_real_step(trained, jobs, tiny_ckpt):
    """Agent per_call episodes in a real step on two ranks: group 0 is an episode of 1 call (reward 1) and one of 3
    calls (reward 0), group 1 an episode of 2 calls (reward 2) and two of 1 call (0 and 1), group 2 an ordinary pair.
    The advantages the step trained on (adv_abs_mean, grpo + global batch norm) are the hand-computed weighted ones,
    every episode counted once, across ranks; bad weights are refused by the controller and by the trainers."""
    group = jobs["B"].group
    v = group.version
    rng = random.Random(5)
    trajs = make_batch(_hf_model(tiny_ckpt), rng, [[(4, 6)] * 4, [(5, 5)] * 4, [(3, 8)] * 2], v)
    rewards = [1, 0, 0, 0, 2, 2, 0, 1, 0, 2]
    weights = [1, 1 / 3, 1 / 3, 1 / 3, 1 / 2, 1 / 2, 1, 1, None, None]  # None: no key (an ordinary workflow)
    trajs = [
        msgspec.structs.replace(t, reward=float(r), info={} if w is None else {"episode_weight": w})
        for t, r, w in zip(trajs, rewards, weights)
    ]
    shards = split_by_rank(trajs, 2)
    assert all(any("episode_weight" in t.info for t in s) for s in shards)  # both ranks hold weighted groups
    gids = [t.group_id for t in trajs]
    want = np.abs(_weighted_advantages(rewards, gids, [1.0 if w is None else w for w in weights])).mean()
    plain = np.abs(_weighted_advantages(rewards, gids, [1.0] * len(trajs))).mean()
    assert abs(want - plain) > 0.05  # the check below tells the two apart
    res = await group.train_step(trajs, v)
    assert res.version == v + 1 and res.stats["optimizer_steps"] == 2
    assert res.stats["adv_abs_mean"] == pytest.approx(want, rel=1e-5)

    v += 1
    bad = [msgspec.structs.replace(trajs[0], info={"episode_weight": float("nan")})] + trajs[1:]
    with pytest.raises(ValueError, match="trajectory 0: info\\['episode_weight'\\] must be finite and > 0"):
        await group.train_step(bad, v)
    # past the controller's check (a hand-built request): a zero weight on rank 1's shard, refused on both ranks
    total = sum(t.response_len for t in trajs)
    reqs = [TrainStepRequest(batch=pack_trajectories(s, v, total, len(trajs))) for s in shards]
    w1 = np.ones(len(shards[1]), dtype=np.float32)
    w1[-1] = 0.0
    reqs[1] = TrainStepRequest(batch=msgspec.structs.replace(reqs[1].batch, baseline_weights=Array.from_numpy(w1)))
    results = await asyncio.gather(
        *(cl.call("train_step", r, TrainStepResult, timeout=60) for cl, r in zip(group.clients, reqs)),
        return_exceptions=True,
    )
    assert kind_of(results[1].remote_type) is BatchError and kind_of(results[0].remote_type) is PeerBatchError
    assert "batch.baseline_weights: every weight must be finite and > 0" in results[1].remote_message
    assert [i.version for i in await group.info()] == [v, v]


async def test_all_weights_one_is_bit_identical(trained, jobs):
    """From the same checkpoint, one step without weights and one with baseline_weights sent explicitly as all
    1.0 (what pack_trajectories never sends, so the weighted path itself runs): the same loss, grad norm and
    advantages, bit for bit, and the same published weights."""
    a = jobs["A"]
    group, batch = a.group, trained["batches"][1]
    outs = []
    for explicit in (False, True):
        assert (await group.load_checkpoint(trained["ck1"])).version == 1
        req = pack_trajectories(batch, 1, sum(t.response_len for t in batch), len(batch))
        assert req.baseline_weights is None
        if explicit:
            req = msgspec.structs.replace(req, baseline_weights=Array.from_numpy(np.ones(len(batch), np.float32)))
        res = await group.clients[0].call("train_step", TrainStepRequest(batch=req), TrainStepResult, timeout=120)
        pub = await group.publish(2, str(jobs["root"] / f"pub_ones_{explicit}"))
        outs.append((res.stats, load_weights(pub.path)))
    (s0, w0), (s1, w1) = outs
    for key in ("loss", "grad_norm", "adv_abs_mean", "clip_frac", "imp_weight_mean"):
        assert s1[key] == s0[key], key
    assert max_diff(w1, w0) == 0.0
    assert s0["loss"] == pytest.approx(trained["A"][1].stats["loss"], abs=1e-6)  # the ordinary step 2
    await group.info()


async def test_wrong_secret_is_refused(jobs):
    a = jobs["A"]
    with open(os.path.join(a.run_dir, "trainer", "rank0.json")) as f:
        address = json.load(f)["address"]
    with pytest.raises(RpcAuthError):
        await RpcClient.connect(address, b"not-the-secret-" * 3, timeout=10)
    with pytest.raises(RpcAuthError):
        await TrainerGroup.connect(a.run_dir, 1, secrets.token_bytes(32), timeout=10)
    assert (await a.group.info())[0].rank == 0  # the real controller is unaffected


async def test_shutdown_and_sigterm_exit_cleanly(tiny_ckpt, tmp_path, secret):
    """A two-rank job leaves on the shutdown RPC (exit code 0, rank files removed); a one-rank job's rank leaves on
    SIGTERM. Jobs of its own: ending the module's jobs would break whichever tests run after it."""
    b = Job("shutdown", 2, tiny_ckpt, tmp_path, secret, CFG)
    a = Job("sigterm", 1, tiny_ckpt, tmp_path, secret, CFG)
    try:
        await asyncio.gather(b.connect(), a.connect())
        await b.group.shutdown()
        assert b.proc.wait(60) == 0
        assert not os.listdir(os.path.join(b.run_dir, "trainer"))

        (pid,) = a.worker_pids()
        await a.group.close()
        os.kill(pid, signal.SIGTERM)
        assert await _wait_gone(pid, 60)
        assert a.proc.wait(60) == 0  # torchrun saw its worker finish cleanly
    finally:
        for job in (a, b):
            if job.group is not None:
                await job.group.close()
            job.kill()


async def test_controller_side_is_torch_free():
    code = "import sys, areal_async.train.client; assert 'torch' not in sys.modules, 'train/client.py pulled in torch'"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
    assert await proc.wait() == 0
