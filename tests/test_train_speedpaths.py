"""The trainer's fast paths compute what the plain ones do: padded length-sorted rows == packed == each sequence
alone (logprobs, entropy, gradients), the sorted packer's contract, and, under real torchrun with 2 ranks, whole
train steps of the engine with the prox pass folded into the training forward and/or the rows or shared-prefix
layout against the previous path (separate prox pass, packed rows): same loss, stats and updated weights. The
shared-prefix layout's own forward and packer are tested in tests/test_shared_prefix.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from areal_async.testing.reference import load_model, random_sequences, reference_logprobs
from areal_async.train.logprobs import needs_dense_packing_mask, packed_forward_logprobs, rows_forward_logprobs
from areal_async.train.packing import pack_sorted_micro_batches, padded_slots

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the sorted packer ------------------------------------------------------------------------------------------


def _check_partition(lens: list[int], mbs: list[list[int]]) -> None:
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lens)))
    assert all(mb == sorted(mb) and mb for mb in mbs)


def test_sorted_packer_groups_similar_lengths_under_the_budget():
    lens = [5, 40, 7, 38, 6, 39, 100, 8, 37, 5]
    mbs = pack_sorted_micro_batches(lens, 80)
    _check_partition(lens, mbs)
    # longest first; the 100-token sequence exceeds the budget and runs alone
    assert mbs == [[6], [1, 5], [3, 8], [0, 2, 4, 7, 9]]
    for mb in mbs:
        assert padded_slots(lens, mb) <= 80 or len(mb) == 1
    # consecutive runs of the length-sorted order: no length in one micro-batch lies inside another's range
    ranges = [(min(lens[i] for i in mb), max(lens[i] for i in mb)) for mb in mbs]
    assert all(lo_a >= hi_b for (lo_a, _), (_, hi_b) in zip(ranges, ranges[1:]))


def test_sorted_packer_min_micro_batches_splits_the_biggest_run():
    lens = [10] * 6 + [3] * 4
    assert len(pack_sorted_micro_batches(lens, 1000)) == 1
    mbs = pack_sorted_micro_batches(lens, 1000, min_micro_batches=3)
    _check_partition(lens, mbs)
    assert len(mbs) == 3
    # the one run halved, then its bigger-padded first half (ties: the earlier) halved again
    assert mbs == [[0, 1, 2], [3, 4], [5, 6, 7, 8, 9]]
    # never more runs than sequences: the floor is only met where there are enough of them
    assert len(pack_sorted_micro_batches([4, 4], 100, min_micro_batches=5)) == 2
    assert pack_sorted_micro_batches([], 100, min_micro_batches=2) == []


def test_sorted_packer_rejects_bad_input():
    with pytest.raises(ValueError, match="max_tokens"):
        pack_sorted_micro_batches([3], 0)
    with pytest.raises(ValueError, match="min_micro_batches"):
        pack_sorted_micro_batches([3], 10, min_micro_batches=0)
    with pytest.raises(ValueError, match=">= 0"):
        pack_sorted_micro_batches([3, -1], 10)
    with pytest.raises(TypeError, match="int"):
        pack_sorted_micro_batches([3.5], 10)


# ---- rows forward on real tiny models ----------------------------------------------------------------------------


LENS = [6, 1, 19, 9, 2, 19]  # a one-token sequence, very different neighbours, a tie for the longest


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_rows_equal_each_sequence_alone(tiny_ckpts_all_archs, arch):
    torch.set_num_threads(1)
    model = load_model(tiny_ckpts_all_archs[arch])
    assert needs_dense_packing_mask(model)
    seqs = random_sequences(model.config.vocab_size, LENS)
    temp = 0.7
    with torch.no_grad():
        logp, ent = rows_forward_logprobs(
            model, torch.cat(seqs), LENS, temperature=temp, compute_entropy=True, chunk_tokens=5
        )
        packed, packed_ent = packed_forward_logprobs(
            model, torch.cat(seqs), LENS, temperature=temp, compute_entropy=True
        )
        ref_lp, ref_ent = reference_logprobs(model, seqs, temp)
    assert logp.dtype == torch.float32 and logp.shape == (sum(LENS),)
    torch.testing.assert_close(logp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(logp, packed, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, packed_ent, atol=1e-5, rtol=0)
    starts = np.cumsum([0] + LENS[:-1])
    assert logp[torch.as_tensor(starts)].abs().max() == 0  # first tokens are 0 by convention


def test_rows_gradients_equal_packed_gradients(tiny_ckpt):
    torch.set_num_threads(1)
    model = load_model(tiny_ckpt)
    seqs = random_sequences(model.config.vocab_size, LENS, seed=2)
    weights = torch.randn(sum(LENS), generator=torch.Generator().manual_seed(3))
    grads = []
    for fwd in (packed_forward_logprobs, rows_forward_logprobs):
        model.zero_grad()
        lp, ent = fwd(model, torch.cat(seqs), LENS, compute_entropy=True, chunk_tokens=4)
        ((lp + 0.1 * ent) * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-6, rtol=1e-5, msg=n)
    # entropy as a statistic only: same values, no graph, and logp's gradient unchanged
    model.zero_grad()
    lp, ent_stat = rows_forward_logprobs(model, torch.cat(seqs), LENS, compute_entropy=True, entropy_grad=False)
    assert not ent_stat.requires_grad
    (lp * weights).sum().backward()
    only_lp = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lp, ent = rows_forward_logprobs(model, torch.cat(seqs), LENS, compute_entropy=True)
    (lp * weights).sum().backward()
    torch.testing.assert_close(ent_stat, ent.detach(), atol=0, rtol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(only_lp[n], p.grad, atol=0, rtol=0, msg=n)


def test_rows_forward_edge_cases(tiny_ckpt):
    model = load_model(tiny_ckpt)
    lp, ent = rows_forward_logprobs(model, torch.zeros(0, dtype=torch.long), [], compute_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    lp, _ = rows_forward_logprobs(model, torch.tensor([5]), [1])  # one token: nothing to predict
    assert lp.tolist() == [0.0]
    with pytest.raises(ValueError, match="sum"):
        rows_forward_logprobs(model, torch.tensor([3, 4, 5]), [2, 2])
    with pytest.raises(ValueError, match="flat"):
        rows_forward_logprobs(model, torch.tensor([[3, 4]]), [2])
    with pytest.raises(ValueError, match="at least one token"):
        rows_forward_logprobs(model, torch.tensor([3, 4]), [2, 0])
    with pytest.raises(ValueError, match="temperature"):
        rows_forward_logprobs(model, torch.tensor([3, 4]), [2], temperature=0.0)


# ---- whole engine steps under torchrun ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_steps(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("speedpaths")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--standalone",
        os.path.join(ROOT, "tests", "train_speedpaths_job.py"),
        tiny_ckpt,
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "results.json") as f:
        results = json.load(f)
    weights = {name: dict(np.load(out / f"{name}.npz")) for name in results}
    return results, weights


TIMING_KEYS = {"step_seconds", "prox_seconds", "tokens_per_s"}


def _assert_same_step(results, weights, a: str, b: str) -> None:
    sa, sb = results[a]["stats"], results[b]["stats"]
    assert set(sa) == set(sb)
    for key in sorted(set(sa) - TIMING_KEYS - {"shared_prefix_tokens"}):
        assert sb[key] == pytest.approx(sa[key], rel=1e-5, abs=1e-6), (a, b, key)
    for name in weights[a]:
        diff = float(np.abs(weights[a][name] - weights[b][name]).max())
        assert diff < 1e-6, (a, b, name, diff)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_fast_paths_take_the_same_step(engine_steps, tiny_ckpt):
    """2 ranks, uneven shards, several micro-batches each. The folded prox pass (one minibatch) and the rows layout,
    alone and together, give the loss, every stat and the updated weights of the previous path; with two
    minibatches (prox pass kept) the layouts agree too."""
    from safetensors.numpy import load_file

    results, weights = engine_steps
    assert results["k1_auto"]["layout"] == "prefix"  # sdpa, shared prompts: a run gets the shared-prefix layout
    assert results["k1_auto"]["step_layout"] == "prefix"
    assert results["k1_auto"]["stats"]["shared_prefix_tokens"] > 0
    assert results["k1_packed_separate"]["layout"] == "packed"
    assert results["k1_rows_folded"]["stats"]["shared_prefix_tokens"] == 0
    ref = "k1_packed_separate"
    for other in ("k1_packed_folded", "k1_rows_separate", "k1_rows_folded", "k1_prefix_separate", "k1_auto"):
        _assert_same_step(results, weights, ref, other)
    _assert_same_step(results, weights, "k2_packed", "k2_auto")
    _assert_same_step(results, weights, "k2_packed", "k2_rows")
    _assert_same_step(results, weights, "k1_packed_separate_entkl", "k1_auto_entkl")
    # (the reference model's pass ran: at the first step it equals the policy, so the KL itself is 0)
    assert results["k1_auto_entkl"]["stats"]["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert (
        max(float(np.abs(weights["k1_auto_entkl"][n] - weights["k1_auto"][n]).max()) for n in weights["k1_auto"]) > 1e-4
    )  # the entropy bonus changed the step
    # the step did something these comparisons could miss
    base = load_file(os.path.join(tiny_ckpt, "model.safetensors"))
    moved = max(float(np.abs(weights[ref][n] - base[n]).max()) for n in base)
    assert moved > 1e-3
    s1, s2 = results[ref]["stats"], results["k2_auto"]["stats"]
    assert s1["imp_weight_masked_frac"] > 0  # the cap is in play
    assert s2["optimizer_steps"] == 2 and s2["clip_frac"] > 0  # the second minibatch runs on moved weights
    assert abs(s2["loss"] - s1["loss"]) > 1e-4
    assert results[ref]["shard_seqs"] in (8, 12)  # rank 0's shard: 2 or 3 of the 5 groups, so the shards differ


@pytest.mark.slow
def test_benchmark_quick(tmp_path):
    out = tmp_path / "ts.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--quick", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["s_per_step"] > 0 and result["layout"] == "prefix" and result["fold_prox"] is True
    assert set(result["breakdown_s"]) == {"prox", "forward", "backward", "optimizer", "other"}
