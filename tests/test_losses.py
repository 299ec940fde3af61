"""Decoupled PPO, KL and entropy against hand-computed values and an independent numpy reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from areal_async.config import LossConfig
from areal_async.train.losses import (
    LOSS_STAT_KEYS,
    actor_loss,
    entropy_from_logits,
    kl_penalty,
    loss_normalizer,
    ppo_actor_loss,
    summarize_loss_stats,
)

LN = math.log

# Four trained tokens and one masked one. Log-ratios theta/prox: ln 1.5, ln 0.5, ln 0.5, ln 1.5; A = 1, 1, -2, -2.
# eps 0.2, token by token, loss = max(-A u, -A clip(u, 0.8, 1.2)):
#   t0 u=1.5 A=+1: max(-1.5, -1.2) = -1.2 (clipped)   t1 u=0.5 A=+1: max(-0.5, -0.8) = -0.5
#   t2 u=0.5 A=-2: max( 1.0,  1.6) =  1.6 (clipped)   t3 u=1.5 A=-2: max( 3.0,  2.4) =  3.0
# sum 2.9. The masked token t4 carries absurd values that must not matter.
PROX = torch.tensor([-1.0, -2.0, -0.5, -3.0, 0.0])
LOGP = PROX + torch.tensor([LN(1.5), LN(0.5), LN(0.5), LN(1.5), 50.0])
ADV = torch.tensor([1.0, 1.0, -2.0, -2.0, 1e6])
MASK = torch.tensor([1, 1, 1, 1, 0])


def cfg(**kw) -> LossConfig:
    kw.setdefault("behav_imp_weight_cap", None)
    return LossConfig(**kw)


def test_standard_ppo_hand_values():
    loss, st = ppo_actor_loss(LOGP, PROX, PROX, ADV, MASK, cfg(), normalizer=10.0)
    assert loss.item() == pytest.approx(0.29, abs=1e-6)
    assert st["clipped_count"].item() == 2
    assert st["token_count"].item() == 4 and st["used_token_count"].item() == 4
    assert st["imp_weight_sum"].item() == pytest.approx(4.0) and st["imp_weight_max"].item() == pytest.approx(1.0)
    assert st["ratio_sum"].item() == pytest.approx(4.0, abs=1e-6)
    assert st["pg_loss_sum"].item() == pytest.approx(2.9, abs=1e-5)
    # k3 of KL(prox||theta): r - 1 - ln r for r = 1.5, 0.5, 0.5, 1.5
    k3 = 2 * (0.5 - LN(1.5)) + 2 * (-0.5 - LN(0.5))
    assert st["approx_kl_sum"].item() == pytest.approx(k3, abs=1e-6)
    assert all(v.dtype == torch.float32 and v.dim() == 0 and not v.requires_grad for v in st.values())


def test_asymmetric_clip_hand_values():
    # eps_high 0.28: t0 becomes max(-1.5, -1.28) = -1.28; the rest unchanged -> 2.9 - 0.08 = 2.82
    loss, _ = ppo_actor_loss(LOGP, PROX, PROX, ADV, MASK, cfg(eps_clip_high=0.28), normalizer=1.0)
    assert loss.item() == pytest.approx(2.82, abs=1e-5)


def test_dual_clip_hand_values():
    # c = 1.4 bounds negative-advantage tokens by -c A = 2.8: t3 3.0 -> 2.8; t2 (1.6) untouched -> 2.7
    loss, st = ppo_actor_loss(LOGP, PROX, PROX, ADV, MASK, cfg(dual_clip=1.4), normalizer=10.0)
    assert loss.item() == pytest.approx(0.27, abs=1e-6)
    assert st["dual_clipped_count"].item() == 1
    # positive advantages are never dual-clipped, however large the ratio
    big = PROX + torch.tensor([LN(5.0), 0, 0, 0, 0])
    loss, st = ppo_actor_loss(
        big, PROX, PROX, torch.tensor([1.0, 0, 0, 0, 0]), MASK, cfg(dual_clip=1.4), normalizer=1.0
    )
    assert loss.item() == pytest.approx(-1.2, abs=1e-6) and st["dual_clipped_count"].item() == 0


def test_decoupled_equals_standard_when_prox_is_behav():
    g = torch.Generator().manual_seed(0)
    n = 64
    prox = -torch.rand(n, generator=g) * 3
    logp = prox + torch.randn(n, generator=g) * 0.3
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.3).long()
    dec, st_dec = ppo_actor_loss(logp, prox, prox, adv, mask, cfg(behav_imp_weight_cap=5.0), normalizer=50.0)
    naive, st_naive = ppo_actor_loss(logp, prox, prox, adv, mask, cfg(decoupled=False), normalizer=50.0)
    assert dec.item() == pytest.approx(naive.item(), abs=1e-6)
    assert st_dec["clipped_count"].item() == st_naive["clipped_count"].item()
    # naive PPO ignores prox entirely: the trust region is centred on the behaviour policy
    other_prox = prox + torch.randn(n, generator=g)
    naive2, _ = ppo_actor_loss(logp, other_prox, prox, adv, mask, cfg(decoupled=False), normalizer=50.0)
    assert naive2.item() == pytest.approx(naive.item(), abs=1e-6)


def test_importance_weight_hand_values_and_cap_modes():
    behav = PROX.clone()
    behav[0] = PROX[0] - LN(2.0)  # w0 = prox/behav = 2, the others 1
    loss, st = ppo_actor_loss(LOGP, PROX, behav, ADV, MASK, cfg(), normalizer=1.0)
    assert loss.item() == pytest.approx(2.9 - 1.2, abs=1e-5)  # t0 weighs -1.2 * 2
    assert st["imp_weight_sum"].item() == pytest.approx(5.0, abs=1e-6)
    assert st["imp_weight_max"].item() == pytest.approx(2.0, abs=1e-6)
    assert st["capped_count"].item() == 0

    loss, st = ppo_actor_loss(LOGP, PROX, behav, ADV, MASK, cfg(behav_imp_weight_cap=1.5), normalizer=1.0)
    assert loss.item() == pytest.approx(2.9 + 1.2, abs=1e-5)  # t0 dropped
    assert st["capped_count"].item() == 1 and st["used_token_count"].item() == 3 and st["token_count"].item() == 4
    assert st["clipped_count"].item() == 1  # only t2 remains clipped

    loss, st = ppo_actor_loss(
        LOGP, PROX, behav, ADV, MASK, cfg(behav_imp_weight_cap=1.5, behav_imp_weight_mode="clamp"), normalizer=1.0
    )
    assert loss.item() == pytest.approx(2.9 + 1.2 - 1.2 * 1.5, abs=1e-5)  # w0 clamped to 1.5
    assert st["capped_count"].item() == 1 and st["used_token_count"].item() == 4
    assert st["imp_weight_max"].item() == pytest.approx(2.0, abs=1e-6)  # the raw weight is reported


def test_gspo_sequence_ratio_hand_values():
    # sequences {t0, t1} and {t2, t3}: each mean log-ratio is (ln 1.5 + ln 0.5) / 2, s = sqrt(0.75) = 0.866,
    # inside [0.8, 1.2]. GSPO's sequence mean: seq 0 (A=+1) contributes -s, seq 1 (A=-2) 2 s; normalizer = number
    # of sequences (1 here, to read the sum) -> s. The old token mean gave 2 * -s + 2 * 2 s = 2 s.
    seq_ids = torch.tensor([0, 0, 1, 1, 1])
    loss, st = ppo_actor_loss(LOGP, PROX, PROX, ADV, MASK, cfg(ratio_level="sequence"), normalizer=1.0, seq_ids=seq_ids)
    s = math.sqrt(0.75)
    assert loss.item() == pytest.approx(s, abs=1e-5)
    assert st["clipped_count"].item() == 0 and st["seq_count"].item() == 2
    assert st["ratio_sum"].item() == pytest.approx(4 * s, abs=1e-5)
    # A sequence ratio outside the clip range clips every token of the sequence
    logp = PROX + torch.tensor([LN(1.5), LN(1.5), 0.0, 0.0, 0.0])
    _, st = ppo_actor_loss(logp, PROX, PROX, ADV, MASK, cfg(ratio_level="sequence"), normalizer=1.0, seq_ids=seq_ids)
    assert st["clipped_count"].item() == 2
    # The gradient of a sequence's loss reaches all its tokens equally: d/dlogp_t s = s / |y|
    lp = LOGP.clone().requires_grad_(True)
    loss, _ = ppo_actor_loss(lp, PROX, PROX, ADV, MASK, cfg(ratio_level="sequence"), normalizer=1.0, seq_ids=seq_ids)
    loss.backward()
    # seq 0: loss = -s, d/dlogp_t = -s / 2; seq 1: loss = 2 s -> 2 s / 2 = s; masked token: 0
    assert lp.grad.tolist() == pytest.approx([-s / 2, -s / 2, s, s, 0.0], abs=1e-5)
    with pytest.raises(ValueError, match="seq_ids"):
        ppo_actor_loss(LOGP, PROX, PROX, ADV, MASK, cfg(ratio_level="sequence"), normalizer=1.0)


def test_gspo_weighs_every_sequence_equally_whatever_its_length():
    """The GSPO paper's objective is a mean over sequences: a 1-token and a 9-token answer with the same ratio and
    advantage contribute the same, and the loss equals the plain mean of per-sequence terms."""
    lens = [1, 9]
    seq_ids = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    n = sum(lens)
    prox = torch.full((n,), -1.0)
    logp = prox + LN(1.1)  # s = 1.1 in every sequence, inside the clip range
    adv = torch.tensor([1.0] * lens[0] + [-1.0] * lens[1])
    loss, st = ppo_actor_loss(
        logp, prox, prox, adv, torch.ones(n), cfg(ratio_level="sequence"), normalizer=2.0, seq_ids=seq_ids
    )
    # per sequence: -A s = -1.1 and +1.1; the mean over sequences is 0 (a token mean would give 8 * 1.1 / 10)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    one, _ = ppo_actor_loss(
        logp[:1],
        prox[:1],
        prox[:1],
        adv[:1],
        torch.ones(1),
        cfg(ratio_level="sequence"),
        normalizer=1.0,
        seq_ids=seq_ids[:1],
    )
    nine, _ = ppo_actor_loss(
        logp[1:],
        prox[1:],
        prox[1:],
        adv[1:],
        torch.ones(9),
        cfg(ratio_level="sequence"),
        normalizer=1.0,
        seq_ids=seq_ids[1:] - 1,
    )
    assert one.item() == pytest.approx(-1.1, abs=1e-6) and nine.item() == pytest.approx(1.1, abs=1e-6)
    assert loss_normalizer(cfg(ratio_level="sequence")) == "seqs" and loss_normalizer(cfg()) == "tokens"


def test_kl_penalty_skips_tokens_the_importance_cap_dropped():
    """actor_loss's KL term weighs tokens exactly as the policy term does: a token over the cap (mask mode)
    contributes neither, in "clamp" mode it contributes to both."""
    behav = PROX.clone()
    behav[0] = PROX[0] - LN(10.0)  # w0 = 10 > cap 5: t0 is dropped in mask mode
    ref = LOGP - torch.tensor([LN(3.0), LN(1.2), 0.0, LN(0.5), 7.0])  # log r = ln 3, ln 1.2, 0, ln 0.5; t4 masked
    k1 = torch.tensor([LN(3.0), LN(1.2), 0.0, LN(0.5)])
    c = cfg(behav_imp_weight_cap=5.0, kl_coef=0.5, kl_estimator="k1")
    base, _ = ppo_actor_loss(LOGP, PROX, behav, ADV, MASK, c, normalizer=4.0)
    loss, st = actor_loss(LOGP, PROX, behav, ADV, MASK, c, normalizer=4.0, ref_logp=ref)
    kept_kl = float(k1[1:].sum())  # t0 excluded
    assert st["capped_count"].item() == 1
    assert st["kl_ref_sum"].item() == pytest.approx(kept_kl, abs=1e-6)
    assert loss.item() == pytest.approx(base.item() + 0.5 * kept_kl / 4.0, abs=1e-6)
    # the gradient of the KL term never reaches the dropped token
    lp = LOGP.clone().requires_grad_(True)
    actor_loss(lp, PROX, behav, ADV, MASK, c, normalizer=4.0, ref_logp=ref)[0].backward()
    assert lp.grad[0].item() == 0.0 and lp.grad[4].item() == 0.0
    clamp = cfg(behav_imp_weight_cap=5.0, behav_imp_weight_mode="clamp", kl_coef=0.5, kl_estimator="k1")
    _, st = actor_loss(LOGP, PROX, behav, ADV, MASK, clamp, normalizer=4.0, ref_logp=ref)
    assert st["kl_ref_sum"].item() == pytest.approx(float(k1.sum()), abs=1e-6)


def test_actor_loss_entropy_and_summary():
    ent = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])  # the masked token's entropy never counts
    c = cfg(entropy_coef=0.1)
    base, _ = ppo_actor_loss(LOGP, PROX, PROX, ADV, MASK, c, normalizer=4.0)
    loss, st = actor_loss(LOGP, PROX, PROX, ADV, MASK, c, normalizer=4.0, entropy=ent)
    assert st["entropy_sum"].item() == 10.0
    assert loss.item() == pytest.approx(base.item() - 0.1 * 10.0 / 4.0, abs=1e-6)
    assert set(st) == set(LOSS_STAT_KEYS)
    summary = summarize_loss_stats({k: float(v) for k, v in st.items()}, c, response_tokens=4.0)
    assert summary["pg_loss"] == pytest.approx(2.9 / 4.0, abs=1e-5)
    assert summary["entropy"] == pytest.approx(2.5) and summary["clip_frac"] == pytest.approx(0.5)
    assert "kl_ref" not in summary  # no KL term configured


def test_importance_weight_and_prox_carry_no_gradient():
    logp = LOGP.clone().requires_grad_(True)
    prox = PROX.clone().requires_grad_(True)
    behav = PROX.clone()
    behav[1] = PROX[1] - LN(3.0)  # w1 = 3
    behav.requires_grad_(True)
    loss, _ = ppo_actor_loss(logp, prox, behav, ADV, MASK, cfg(), normalizer=4.0)
    loss.backward()
    assert prox.grad is None and behav.grad is None
    # Unclipped tokens: d loss / d logp = -w A u / normalizer; clipped tokens and the masked one: 0
    expect = [0.0, -3 * 1 * 0.5 / 4, 0.0, -1 * (-2) * 1.5 / 4, 0.0]
    assert logp.grad.tolist() == pytest.approx(expect, abs=1e-6)


def _numpy_reference(logp, prox, behav, adv, mask, eps_low, eps_high, cap, mode, dual, normalizer):
    """Token-by-token loop, written without looking at the torch code."""
    total = 0.0
    for i in range(len(logp)):
        if not mask[i]:
            continue
        w = math.exp(prox[i] - behav[i])
        if cap is not None and w > cap:
            if mode == "mask":
                continue
            w = cap
        u = math.exp(logp[i] - prox[i])
        a = adv[i]
        term = max(-a * u, -a * min(max(u, 1 - eps_low), 1 + eps_high))
        if dual is not None and a < 0:
            term = min(term, -dual * a)
        total += w * term
    return total / normalizer


@pytest.mark.parametrize("mode", ["mask", "clamp"])
@pytest.mark.parametrize("dual", [None, 3.0])
def test_matches_numpy_reference_random(mode, dual):
    rng = np.random.default_rng(1)
    n = 200
    behav = -rng.random(n) * 4
    prox = behav + rng.normal(0, 0.8, n)  # some weights well above the cap
    logp = prox + rng.normal(0, 0.4, n)
    adv = rng.normal(0, 1.5, n)
    mask = rng.random(n) > 0.2
    c = cfg(eps_clip=0.2, eps_clip_high=0.28, behav_imp_weight_cap=2.0, behav_imp_weight_mode=mode, dual_clip=dual)
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    loss, _ = ppo_actor_loss(t(logp), t(prox), t(behav), t(adv), torch.tensor(mask), c, normalizer=123.0)
    ref = _numpy_reference(logp, prox, behav, adv, mask, 0.2, 0.28, 2.0, mode, dual, 123.0)
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)


def test_bf16_inputs_are_computed_in_fp32():
    logp = LOGP.to(torch.bfloat16)
    prox = PROX.to(torch.bfloat16)
    loss, st = ppo_actor_loss(logp, prox, prox, ADV.to(torch.bfloat16), MASK, cfg(), normalizer=10.0)
    ref, _ = ppo_actor_loss(
        logp.float(), prox.float(), prox.float(), ADV.to(torch.bfloat16).float(), MASK, cfg(), normalizer=10.0
    )
    assert loss.dtype == torch.float32 and loss.item() == ref.item()


def test_sum_over_micro_batches_is_global_token_mean():
    g = torch.Generator().manual_seed(3)
    n = 40
    prox = -torch.rand(n, generator=g)
    logp = prox + 0.1 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    mask = torch.ones(n, dtype=torch.long)
    whole, _ = ppo_actor_loss(logp, prox, prox, adv, mask, cfg(), normalizer=float(n))
    parts = sum(
        ppo_actor_loss(logp[s], prox[s], prox[s], adv[s], mask[s], cfg(), normalizer=float(n))[0]
        for s in (slice(0, 13), slice(13, 40))
    )
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="normalizer"):
        ppo_actor_loss(LOGP, PROX, PROX, ADV, MASK, cfg(), normalizer=0.0)
    with pytest.raises(ValueError, match="advantages"):
        ppo_actor_loss(LOGP, PROX, PROX, ADV[:3], MASK, cfg(), normalizer=1.0)
    with pytest.raises(ValueError, match="logp"):
        ppo_actor_loss(LOGP[None], PROX, PROX, ADV, MASK, cfg(), normalizer=1.0)


def test_all_masked_gives_zero_loss_and_finite_stats():
    loss, st = ppo_actor_loss(
        LOGP, PROX, PROX - 100.0, ADV, torch.zeros(5), cfg(behav_imp_weight_cap=5.0), normalizer=1.0
    )
    assert loss.item() == 0.0
    assert all(math.isfinite(v.item()) for v in st.values())


def test_kl_penalty_hand_values():
    logp = torch.tensor([LN(0.4), LN(0.2), -1.0])
    ref = torch.tensor([LN(0.2), LN(0.4), 5.0])
    mask = torch.tensor([1, 1, 0])
    # log r = ln 2, -ln 2; the masked token is 0 whatever its values
    assert kl_penalty(logp, ref, mask, "k1").tolist() == pytest.approx([LN(2), -LN(2), 0.0], abs=1e-6)
    assert kl_penalty(logp, ref, mask, "k2").tolist() == pytest.approx([0.5 * LN(2) ** 2] * 2 + [0.0], abs=1e-6)
    # k3 = 1/r - 1 + ln r: r = 2 -> -0.5 + ln 2; r = 1/2 -> 1 - ln 2
    assert kl_penalty(logp, ref, mask, "k3").tolist() == pytest.approx([LN(2) - 0.5, 1 - LN(2), 0.0], abs=1e-6)
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(logp, ref, mask, "k4")  # type: ignore[arg-type]


def test_entropy_from_logits():
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4
            [1000.0, 0.0, 0.0, 0.0],  # huge logit: ~0, no overflow
            [0.0, float("-inf"), 0.0, float("-inf")],  # banned tokens: ln 2, not nan
            [LN(0.5), LN(0.25), LN(0.25), float("-inf")],
        ]
    )  # 1.5 ln 2
    h = entropy_from_logits(logits)
    assert h.tolist() == pytest.approx([LN(4), 0.0, LN(2), 1.5 * LN(2)], abs=1e-6)
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, (3, 5, 17))
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = -(p * np.log(p)).sum(-1)
    out = entropy_from_logits(torch.tensor(z, dtype=torch.bfloat16))
    assert out.shape == (3, 5) and out.dtype == torch.float32
    np.testing.assert_allclose(entropy_from_logits(torch.tensor(z)).numpy(), ref, atol=1e-5)  # fp32 inside
    np.testing.assert_allclose(out.numpy(), ref, atol=0.1)  # bf16 logits: rounding of the inputs only
