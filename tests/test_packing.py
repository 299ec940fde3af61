"""Dynamic micro-batching (hand-traced cases and invariants) and packed forward logprobs on real tiny models."""

from __future__ import annotations

import importlib.util
import json
import os
import random

import pytest
import torch

from areal_async.testing.reference import load_model, random_sequences, reference_logprobs
from areal_async.train.logprobs import (
    block_causal_mask,
    broadcast_to_tokens,
    packed_forward_logprobs,
    pad_forward_logprobs,
    position_ids_from_lens,
    seq_ids_from_lens,
)
from areal_async.train.packing import balance_across_ranks, pack_micro_batches, split_minibatches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- pack_micro_batches ----------------------------------------------------------------------------------------


def test_pack_hand_traced():
    # longest first: 8 -> new B0; 6 -> new B1 (8+6 > 10); 5 -> new B2; 3 -> B1 or B2 (1 seq each), lighter B2 (5);
    # 2 (idx 3) -> B0 or B1 (1 seq each), lighter B1 (6); 2 (idx 4) -> the only one-sequence batch B0
    assert pack_micro_batches([5, 3, 8, 2, 2, 6], 10) == [[2, 4], [3, 5], [0, 1]]


def test_pack_min_micro_batches_hand_traced():
    # the first four sequences open four batches; 2 (idx 3) -> all hold one, lightest B3 (3); 2 (idx 4) -> B0..B2
    # hold one, lightest B2 (5)
    assert pack_micro_batches([5, 3, 8, 2, 2, 6], 10, min_micro_batches=4) == [[2], [5], [0, 4], [1, 3]]
    # a floor above the number of sequences cannot be met: one sequence per batch
    assert pack_micro_batches([1, 2], 100, min_micro_batches=5) == [[1], [0]]


def test_pack_oversized_sequence_gets_its_own_batch():
    assert pack_micro_batches([20, 3, 4], 10) == [[0], [1, 2]]
    assert pack_micro_batches([3, 30, 25, 2], 10) == [[1], [2], [0, 3]]
    assert pack_micro_batches([], 10) == []


@pytest.mark.parametrize("seed", range(5))
def test_pack_invariants_random(seed):
    rng = random.Random(seed)
    lens = [rng.choice([rng.randint(1, 50), rng.randint(50, 400)]) for _ in range(rng.randint(1, 80))]
    budget, floor = rng.randint(64, 512), rng.randint(1, 6)
    mbs = pack_micro_batches(lens, budget, floor)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lens)))  # each index exactly once
    for mb in mbs:
        assert mb == sorted(mb) and mb
        load = sum(lens[i] for i in mb)
        assert load <= budget or len(mb) == 1  # only a lone oversized sequence may exceed the budget
    assert len(mbs) >= min(floor, len(lens))


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="max_tokens"):
        pack_micro_batches([1], 0)
    with pytest.raises(ValueError, match="min_micro_batches"):
        pack_micro_batches([1], 5, 0)
    with pytest.raises(ValueError, match=r"seq_lens\[1\]"):
        pack_micro_batches([1, -2], 5)
    with pytest.raises(TypeError, match=r"seq_lens\[0\]"):
        pack_micro_batches([1.5], 5)  # type: ignore[list-item]


# ---- balance_across_ranks / split_minibatches --------------------------------------------------------------------


def test_balance_hand_traced():
    # 10 -> r0; 7 -> r1; 3 (g3) -> r1 (7 < 10); 3 (g4) -> tie at 10, r0 has fewer groups; 2 -> r1 (10 < 13);
    # 1 -> r1 (12 < 13). Loads 13 / 13.
    assert balance_across_ranks([10, 1, 7, 3, 3, 2], 2) == [[0, 4], [1, 2, 3, 5]]
    assert balance_across_ranks([5], 3) == [[0], [], []]
    assert balance_across_ranks([0, 0, 0], 3) == [[0], [1], [2]]  # empty groups still spread one per rank
    with pytest.raises(ValueError, match="world_size"):
        balance_across_ranks([1], 0)


def test_balance_is_near_even_and_complete():
    rng = random.Random(0)
    counts = [rng.randint(10, 2000) for _ in range(37)]
    ranks = balance_across_ranks(counts, 4)
    assert sorted(g for r in ranks for g in r) == list(range(37)) and all(ranks)
    loads = [sum(counts[g] for g in r) for r in ranks]
    assert max(loads) - min(loads) <= max(counts)  # LPT's bound: within one group of each other


def test_balance_is_torch_free():
    # the controller imports this module and must not pull in torch
    import subprocess
    import sys

    code = "import sys, areal_async.train.packing; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_split_minibatches():
    assert split_minibatches(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_minibatches(6, 2) == [[0, 1, 2], [3, 4, 5]]
    assert split_minibatches(2, 3) == [[0], [1], []]  # always exactly k
    assert split_minibatches(0, 1) == [[]]
    with pytest.raises(ValueError):
        split_minibatches(3, 0)


# ---- packed layout helpers -----------------------------------------------------------------------------------------


def test_layout_helpers():
    assert seq_ids_from_lens([3, 1, 2]).tolist() == [0, 0, 0, 1, 2, 2]
    assert position_ids_from_lens([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]
    assert broadcast_to_tokens(torch.tensor([0.5, -1.0]), [2, 3]).tolist() == [0.5, 0.5, -1.0, -1.0, -1.0]
    expect = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert block_causal_mask([2, 2])[0, 0].int().tolist() == expect
    with pytest.raises(ValueError, match="at least one token"):
        seq_ids_from_lens([2, 0])


# ---- packed forward on real tiny models ----------------------------------------------------------------------------


LENS = [6, 1, 19, 9, 2]  # includes a one-token sequence and two neighbours of very different length


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_packed_equals_each_sequence_alone(tiny_ckpts_all_archs, arch):
    torch.set_num_threads(1)
    model = load_model(tiny_ckpts_all_archs[arch])
    seqs = random_sequences(model.config.vocab_size, LENS)
    temp = 0.7
    with torch.no_grad():
        logp, ent = packed_forward_logprobs(
            model, torch.cat(seqs), LENS, temperature=temp, compute_entropy=True, chunk_tokens=5
        )
        explicit, _ = packed_forward_logprobs(model, torch.cat(seqs), LENS, temperature=temp, explicit_mask=True)
        # Reference straight from the model, one sequence at a time, with plain log_softmax
        ref_lp, ref_ent = reference_logprobs(model, seqs, temp)
    assert logp.dtype == torch.float32 and logp.shape == (sum(LENS),)
    torch.testing.assert_close(logp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(explicit, ref_lp, atol=1e-5, rtol=0)
    assert logp[position_ids_from_lens(LENS) == 0].abs().max() == 0  # first tokens are 0 by convention
    # Sanity: packing without the restarts would let sequences see each other, and that must be visible
    with torch.no_grad():
        leaky, _ = packed_forward_logprobs(model, torch.cat(seqs), [sum(LENS)], temperature=temp)
    assert (leaky[LENS[0] + 1 :] - logp[LENS[0] + 1 :]).abs().max() > 1e-3


def test_padded_equals_packed(tiny_ckpt):
    torch.set_num_threads(1)
    model = load_model(tiny_ckpt)
    seqs = random_sequences(model.config.vocab_size, LENS, seed=1)
    with torch.no_grad():
        lp, ent = packed_forward_logprobs(model, torch.cat(seqs), LENS, compute_entropy=True)
        lp_pad, ent_pad = pad_forward_logprobs(model, seqs, compute_entropy=True, chunk_tokens=7)
    torch.testing.assert_close(lp_pad, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_pad, ent, atol=1e-5, rtol=0)


def test_packed_gradients_equal_sum_of_single_sequence_gradients(tiny_ckpt):
    torch.set_num_threads(1)
    model = load_model(tiny_ckpt)
    seqs = random_sequences(model.config.vocab_size, LENS, seed=2)
    weights = torch.randn(sum(LENS), generator=torch.Generator().manual_seed(3))

    model.zero_grad()
    lp, ent = packed_forward_logprobs(model, torch.cat(seqs), LENS, compute_entropy=True, chunk_tokens=4)
    ((lp + 0.1 * ent) * weights).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    off = 0
    for s in seqs:
        lp, ent = packed_forward_logprobs(model, s, [s.numel()], compute_entropy=True)
        ((lp + 0.1 * ent) * weights[off : off + s.numel()]).sum().backward()
        off += s.numel()
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_packed_forward_rejects_bad_input(tiny_ckpt):
    model = load_model(tiny_ckpt)
    with pytest.raises(ValueError, match="sum"):
        packed_forward_logprobs(model, torch.tensor([3, 4, 5]), [2, 2])
    with pytest.raises(ValueError, match="flat"):
        packed_forward_logprobs(model, torch.tensor([[3, 4]]), [2])
    with pytest.raises(ValueError, match="temperature"):
        packed_forward_logprobs(model, torch.tensor([3, 4]), [2], temperature=0.0)


# ---- benchmark smoke -------------------------------------------------------------------------------------------


def test_benchmark_quick(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "train_packing_bench", os.path.join(ROOT, "benchmarks", "train_packing.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--out", str(out), "--threads", "1"])
    data = json.loads(out.read_text())
    for key in ("packed_tokens_per_s", "padded_tokens_per_s", "ratio"):
        assert data[key] > 0
    # the packed micro-batches respect the token budget (unless one sequence alone is longer)
    assert data["max_packed_tokens"] <= max(data["config"]["budget"], data["lengths"]["max"])
    assert data["packed_micro_batches"] >= -(-data["real_tokens"] // data["config"]["budget"])
