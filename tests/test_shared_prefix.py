"""The shared-prefix layout (train/shared_prefix.py): which sequences share, the exactness of running each shared
prompt once (logprobs, entropy and gradients against each sequence alone), and its packer's contract. Whole engine
steps with this layout under torchrun are in tests/test_train_speedpaths.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areal_async.testing.reference import load_model, reference_logprobs
from areal_async.train.logprobs import rows_forward_logprobs
from areal_async.train.packing import family_slots, pack_family_micro_batches
from areal_async.train.shared_prefix import (
    plan_families,
    shared_prefix_forward_logprobs,
    shared_prefix_savings,
    supports_shared_prefix,
)


def _batch(vocab: int, seed: int = 0) -> tuple[list[torch.Tensor], list[int]]:
    """Groups with shared prompts of different lengths and answers of 1-9 tokens; one group whose members
    differ from the first token (nothing to share) and one group of a single sequence."""
    rng = np.random.default_rng(seed)
    seqs: list[list[int]] = []
    groups: list[int] = []
    for g, (p_len, n) in enumerate([(5, 4), (1, 3), (9, 2), (3, 1), (7, 5)]):
        prompt = rng.integers(2, vocab, p_len).tolist()
        for _ in range(n):
            seqs.append(prompt + rng.integers(2, vocab, int(rng.integers(1, 10))).tolist())
            groups.append(g)
    for i, g in enumerate(groups):  # group 1: every member starts differently
        if g == 1:
            seqs[i][0] = 2 + i
    return [torch.tensor(s) for s in seqs], groups


def test_plan_families_shares_within_groups_only():
    ids = [
        [5, 6, 7, 8],
        [5, 6, 7, 9, 9],
        [5, 6, 3],  # group 0: common prefix [5, 6]
        [4, 4, 4],
        [4, 4],  # group 1: the short member caps the prefix at its length - 1
        [5, 6, 7, 8],  # group 2: same tokens as group 0's first, but another group: alone
        [2, 3],
        [3, 3],
    ]  # group 3: nothing in common: each alone
    groups = [0, 0, 0, 1, 1, 2, 3, 3]
    lens = [len(s) for s in ids]
    fam, pre = plan_families(np.array([t for s in ids for t in s]), lens, groups)
    assert fam == [0, 0, 0, 1, 1, 2, 3, 4]
    assert pre == [2, 2, 2, 1, 1, 3, 1, 1]
    assert shared_prefix_savings(fam, pre) == 2 + 2 + 1
    with pytest.raises(ValueError, match="at least 2 tokens"):
        plan_families(np.array([1, 2, 3]), [2, 1], [0, 0])
    with pytest.raises(ValueError, match="group_ids"):
        plan_families(np.array([1, 2]), [2], [0, 0])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_shared_prefix_equals_each_sequence_alone(tiny_ckpts_all_archs, arch):
    torch.set_num_threads(1)
    model = load_model(tiny_ckpts_all_archs[arch])
    assert supports_shared_prefix(model)
    seqs, groups = _batch(model.config.vocab_size)
    lens = [len(s) for s in seqs]
    ids = torch.cat(seqs)
    fam, pre = plan_families(ids.numpy(), lens, groups)
    assert shared_prefix_savings(fam, pre) > 0 and len(set(fam)) < len(lens)
    temp = 0.7
    with torch.no_grad():
        logp, ent = shared_prefix_forward_logprobs(
            model, ids, lens, fam, pre, temperature=temp, compute_entropy=True, chunk_tokens=5
        )
        ref_lp, ref_ent = reference_logprobs(model, seqs, temp)
    assert logp.dtype == torch.float32 and logp.shape == (sum(lens),)
    torch.testing.assert_close(logp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    starts = np.cumsum([0] + lens[:-1])
    assert logp[torch.as_tensor(starts)].abs().max() == 0  # first tokens are 0 by convention


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_gradients_equal_rows_gradients(tiny_ckpt, attn):
    """The shared prompt's activations feed every member: their gradients must add up to exactly what separate
    copies give (the members also appear out of order, with their families interleaved)."""
    torch.set_num_threads(1)
    model = load_model(tiny_ckpt, attn)
    seqs, groups = _batch(model.config.vocab_size, seed=1)
    order = [0, 9, 4, 1, 13, 5, 2, 10, 14, 3, 6, 7, 8, 11, 12]
    seqs, groups = [seqs[i] for i in order], [groups[i] for i in order]
    lens = [len(s) for s in seqs]
    ids = torch.cat(seqs)
    fam, pre = plan_families(ids.numpy(), lens, groups)
    weights = torch.randn(sum(lens), generator=torch.Generator().manual_seed(3))
    grads = []
    for shared in (False, True):
        model.zero_grad()
        if shared:
            lp, ent = shared_prefix_forward_logprobs(model, ids, lens, fam, pre, compute_entropy=True)
        else:
            lp, ent = rows_forward_logprobs(model, ids, lens, compute_entropy=True)
        ((lp + 0.1 * ent) * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=2e-6, rtol=1e-5, msg=n)


def test_shared_prefix_rejects_bad_input(tiny_ckpt):
    model = load_model(tiny_ckpt)
    ids = torch.tensor([3, 4, 5, 3, 9, 6])
    with pytest.raises(ValueError, match="share their first"):
        shared_prefix_forward_logprobs(model, ids, [3, 3], [0, 0], [2, 2])  # [3, 4] vs [3, 9]
    with pytest.raises(ValueError, match="shorter than its sequence"):
        shared_prefix_forward_logprobs(model, ids, [3, 3], [0, 0], [3, 3])
    with pytest.raises(ValueError, match="different prefix lengths"):
        shared_prefix_forward_logprobs(model, ids, [3, 3], [0, 0], [1, 2])
    with pytest.raises(ValueError, match="sum"):
        shared_prefix_forward_logprobs(model, ids, [3, 2], [0, 1], [1, 1])
    with pytest.raises(ValueError, match="one family"):
        shared_prefix_forward_logprobs(model, ids, [3, 3], [0], [1, 1])
    lp, _ = shared_prefix_forward_logprobs(model, ids, [3, 3], [0, 0], [1, 1])  # a one-token prefix is fine
    assert lp.shape == (6,)


def test_supports_shared_prefix_refuses_what_it_cannot_mask(tiny_ckpt):
    model = load_model(tiny_ckpt)
    assert supports_shared_prefix(model)
    model.config.layer_types = ["sliding_attention"] + list(model.config.layer_types[1:])
    assert not supports_shared_prefix(model)
    model = load_model(tiny_ckpt)
    model.config._attn_implementation = "flash_attention_2"
    assert not supports_shared_prefix(model)


# ---- the family packer --------------------------------------------------------------------------------------------


def _families(sizes_prefix_suffixes: list[tuple[int, list[int]]]) -> tuple[list[int], list[int], list[int]]:
    lens, fam, pre = [], [], []
    for f, (p, suffixes) in enumerate(sizes_prefix_suffixes):
        for r in suffixes:
            lens.append(p + r)
            fam.append(f)
            pre.append(p)
    return lens, fam, pre


def _check_partition(n: int, mbs: list[list[int]]) -> None:
    assert sorted(i for mb in mbs for i in mb) == list(range(n))
    assert all(mb == sorted(mb) and mb for mb in mbs)


def test_family_packer_keeps_families_whole_under_the_budget():
    lens, fam, pre = _families([(20, [10, 11, 9, 10]), (25, [30, 31, 29]), (20, [10, 12]), (22, [30, 28])])
    mbs = pack_family_micro_batches(lens, fam, pre, 220)
    _check_partition(len(lens), mbs)
    for mb in mbs:
        assert family_slots(lens, fam, pre, mb) <= 220
    # long answers together, short answers together, no family split
    assert mbs == [[4, 5, 6, 9, 10], [0, 1, 2, 3, 7, 8]]
    assert family_slots(lens, fam, pre, mbs[0]) == 2 * 25 + 5 * 31


def test_family_packer_splits_a_family_where_padding_costs_more_than_a_prefix():
    # one prompt of 4 tokens, answers of 60 and 5 tokens: padding the short ones to 60 costs 3 x 55 slots, a
    # second prefix row 4
    lens, fam, pre = _families([(4, [60, 5, 5, 5])])
    mbs = pack_family_micro_batches(lens, fam, pre, 1000)
    assert mbs == [[0, 1, 2, 3]]  # still one micro-batch: both runs fit
    assert family_slots(lens, fam, pre, mbs[0]) == 4 + 4 * 60  # the micro-batch itself pads to its longest
    mbs = pack_family_micro_batches(lens, fam, pre, 70)  # the runs land in different micro-batches
    assert mbs == [[0], [1, 2, 3]]
    # a long prompt makes the split not worth it: whole family, and a budget too small for it cuts member-wise
    lens, fam, pre = _families([(200, [60, 50, 55])])
    assert pack_family_micro_batches(lens, fam, pre, 1000) == [[0, 1, 2]]
    mbs = pack_family_micro_batches(lens, fam, pre, 320)
    _check_partition(3, mbs)
    assert mbs == [[0, 2], [1]]


def test_family_packer_min_micro_batches_and_bad_input():
    lens, fam, pre = _families([(5, [3, 3, 3, 3]), (5, [2, 2])])
    assert len(pack_family_micro_batches(lens, fam, pre, 1000)) == 1
    mbs = pack_family_micro_batches(lens, fam, pre, 1000, min_micro_batches=3)
    _check_partition(len(lens), mbs)
    assert len(mbs) == 3
    assert len(pack_family_micro_batches([4, 4], [0, 0], [1, 1], 100, min_micro_batches=5)) == 2
    assert pack_family_micro_batches([], [], [], 100) == []
    with pytest.raises(ValueError, match="one entry per sequence"):
        pack_family_micro_batches([4, 4], [0], [1, 1], 100)
    with pytest.raises(ValueError, match="max_tokens"):
        pack_family_micro_batches([4], [0], [1], 0)


def test_auto_layout_shares_prompts_only_where_it_pays(tiny_ckpt):
    """Per step, the prefix layout is taken when its padded slots are at most PREFIX_SLOT_RATIO of padded rows':
    long shared prompts with answers of similar length share; short prompts whose answers differ a lot in length
    (every family padded to its longest answer) run as sorted rows; prompts that share nothing run as rows."""
    import transformers

    from areal_async.train.layouts import PREFIX_SLOT_RATIO, select_layout
    from areal_async.train.shard import decode_shard
    from areal_async.types import Trajectory, pack_trajectories

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    choice = select_layout(model, "auto")
    assert choice.name == "prefix" and choice.plain.name == "rows"
    rng = np.random.default_rng(0)

    def shard(prompt_len, answer_lens, shared=True):
        trajs = []
        for g, lens in enumerate(answer_lens):
            prompt = rng.integers(2, 90, prompt_len).tolist()
            for r in lens:
                p = prompt if shared else rng.integers(2, 90, prompt_len).tolist()
                n = prompt_len + r
                trajs.append(
                    Trajectory(
                        input_ids=p + rng.integers(2, 90, r).tolist(),
                        loss_mask=[0] * prompt_len + [1] * r,
                        logprobs=[0.0] * n,
                        versions=[0] * n,
                        reward=0.0,
                        group_id=g,
                        prompt_len=prompt_len,
                    )
                )
        batch = pack_trajectories(trajs, 0, sum(t.response_len for t in trajs), len(trajs))
        return decode_shard(batch, 100, torch.device("cpu"))

    def chosen(s):
        candidate, costs = choice.plan(s, 256)
        return choice.for_step(candidate, costs).name, costs

    name, (saved, pre, rows) = chosen(shard(40, [[20, 22, 21, 19]] * 4))
    assert name == "prefix" and saved == 4 * 3 * 40 and pre <= PREFIX_SLOT_RATIO * rows
    name, (saved, pre, rows) = chosen(shard(4, [[2, 60, 3, 58]] * 4))
    assert name == "rows" and saved > 0 and pre > PREFIX_SLOT_RATIO * rows
    name, (saved, _, _) = chosen(shard(20, [[20, 22, 21, 19]] * 2, shared=False))
    assert name == "rows" and saved == 0
    # a configured "prefix" shares whenever something is shared, paying or not
    forced = select_layout(model, "prefix")
    costly = shard(4, [[2, 60, 3, 58]] * 4)
    assert forced.for_step(*forced.plan(costly, 256)).name == "prefix"
