"""The LM head's bf16 -> fp32 product kernel (server/kernels/head.py): the same fp32 logits as torch's fp32 product
of the upcast operands, within the fp32 error bound of a K-term dot product, and the same log-probabilities and
gradients through train/lm_head.py with and without it."""

from __future__ import annotations

import pytest
import torch
from error_bounds import EXP_POLY_REL, U32, gamma, logsumexp_bound

from areal_async.server.kernels import build as cpu_build
from areal_async.server.kernels import head as head_kernel
from areal_async.train import lm_head

kernel = head_kernel.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the head kernels could not be built here")
needs_product = pytest.mark.skipif(
    kernel is None or kernel.forward_fn is None, reason="no AVX512-BF16 build of the head's product here"
)


@needs_product
@pytest.mark.parametrize("m,n,k", [(1, 33, 8), (13, 100, 576), (24, 64, 577), (250, 1000, 64)])
def test_product_matches_float64_within_the_fp32_bound(m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    h = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    z = kernel.forward(h, kernel.pack(w), n, bias)  # [M, N] fp32
    assert z.dtype == torch.float32 and z.shape == (m, n)
    exact = h.double() @ w.double().T + bias.double()
    # products of bf16 values are exact in fp32; k + 1 terms (the bias) summed in fp32 in some order
    bound = gamma(k + 1) * (h.double().abs() @ w.double().abs().T + bias.double().abs())
    assert bool(((z.double() - exact).abs() <= bound).all())


@needs_product
def test_applies_to_cpu_bf16_only():
    h, w = torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16)
    assert kernel.applies(h, w)
    assert not kernel.applies(h.float(), w.float())
    assert not kernel.applies(h, w[:, :8])


@needs_kernel
@pytest.mark.parametrize("keep_bytes", [0, lm_head.DEFAULT_KEEP_BYTES])
@pytest.mark.parametrize("entropy", [False, True])
def test_head_logprobs_and_gradients_match_the_torch_path(monkeypatch, entropy, keep_bytes):
    """The kernels' path (product, fused log-softmax passes; forward keeping the logits or backward recomputing
    them) against torch's fp32 product and ops, with the entropy's gradient where it is computed."""
    g = torch.Generator().manual_seed(7)
    m, hdim, v, temp = 70, 64, 500, 0.8
    hidden = (torch.randn(m, hdim, generator=g) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(v, hdim, generator=g) * 0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (m,), generator=g)
    head = lm_head.LMHead(weight, None)

    def run():
        lp, ent = lm_head.logprobs_from_hidden(
            hidden, head, targets, temperature=temp, compute_entropy=entropy, chunk_tokens=32, keep_bytes=keep_bytes
        )
        loss = lp.sum() + (0.3 * ent.sum() if ent is not None else 0.0)
        gh, gw = torch.autograd.grad(loss, (hidden, weight))
        return lp.detach(), ent, gh, gw

    lp_k, ent_k, gh_k, gw_k = run()
    monkeypatch.setitem(lm_head._kernel_state, "kernel", None)  # the torch fp32 product
    lp_t, ent_t, gh_t, gw_t = run()
    h64, w64 = hidden.detach().double(), weight.detach().double()
    # Both sides compute the same fp32 logits up to summation order: each within gamma(hdim) sum |h w| / T of the
    # exact; a logprob then moves by at most twice that (its logit and the logsumexp's shift), plus each side's
    # logsumexp error.
    zabs = (h64.abs() @ w64.abs().T) / temp  # [M, V]
    dz = 2 * gamma(hdim) * float(zabs.amax())
    lse_err = logsumexp_bound(v, float(2 * zabs.amax()), float(lp_t.abs().max()))
    assert float((lp_k - lp_t).abs().max()) <= 2 * dz + 2 * lse_err
    if entropy:  # H = -sum p log p: p moves by at most p (2 dz + lse_err) relative, log p by as much absolute
        hbound = (2 * dz + 2 * lse_err) * (1 + float(lp_t.abs().max()) + float(ent_t.max()))
        assert float((ent_k - ent_t).abs().max()) <= hbound
    # Gradients of sum(lp) (+ 0.3 sum(H)): dz = (onehot - p) / T per logit (plus the entropy's term), rounded to
    # bf16 on each side (2^-8 relative each, and p itself differs by ~p (2 dz + lse_err)), then bf16 products with
    # fp32 sums (gamma(V) or gamma(M) each side) rounded to bf16 (2^-8 |grad| each side).
    z = (h64 @ w64.T) / temp
    p = torch.softmax(z, -1)  # [M, V]
    dzabs = (torch.nn.functional.one_hot(targets, v).double() + p) / temp
    if entropy:  # the entropy's term: 0.3 p (log p + H) per logit
        logp = torch.log_softmax(z, -1)
        dzabs = dzabs + 0.3 * p * (logp.abs() + (-(p * logp).sum(-1, keepdim=True))) / temp
    rel = 2 * 2.0**-8 + (2 * dz + 2 * lse_err)
    for got, want, prod, n in (
        (gh_k, gh_t, dzabs @ w64.abs(), v),  # [M, H]
        (gw_k, gw_t, dzabs.T @ h64.abs(), m),  # [V, H]
    ):
        bound = (rel + 2 * gamma(n)) * prod + 2 * 2.0**-8 * want.double().abs() + U32
        assert bool(((got.double() - want.double()).abs() <= bound).all())


@pytest.fixture(params=cpu_build.runnable_marches())
def any_target(request):
    k = head_kernel.load(request.param)
    if k is None:
        pytest.skip(f"the head kernels could not be built for -march={request.param}")
    return k


@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_softmax_passes_match_float64_on_every_target(any_target, temp):
    g = torch.Generator().manual_seed(11)
    c, v = 6, 3000
    z = torch.randn(c, v, generator=g) * 4  # [C, V] fp32
    targets = torch.randint(0, v, (c,), generator=g)
    g_lp, g_ent = torch.randn(c, generator=g), torch.randn(c, generator=g)
    zs = z.clone()
    lp, lse, ent = any_target.softmax_forward(zs, targets, temp, True)
    z64 = z.double() / temp
    want_lse = torch.logsumexp(z64, -1)
    logp = z64 - want_lse[:, None]
    p = logp.exp()
    want_ent = -(p * logp).sum(-1)
    spread = float((z64.amax(-1) - z64.amin(-1)).max())
    lse_b = logsumexp_bound(v, spread, float(want_lse.abs().max()))
    assert float((lse.double() - want_lse).abs().max()) <= lse_b
    assert float((lp.double() - logp.gather(1, targets[:, None])[:, 0]).abs().max()) <= lse_b + U32 * spread
    # H = log s - sum e d / s: each term's relative error EXP_POLY_REL plus a rounding of d, summed in double
    ent_b = lse_b + (EXP_POLY_REL + 2 * U32) * float((p * logp.abs()).sum(-1).max() + spread)
    assert float((ent.double() - want_ent).abs().max()) <= ent_b
    assert torch.allclose(zs.double(), z64, rtol=2 * U32, atol=0)  # scaled in place (one rounding)
    for out_dtype in (torch.float32, torch.bfloat16):
        dz = any_target.softmax_backward(zs, lse, targets, g_lp, temp, out_dtype, ent, g_ent)
        coef = g_lp.double()[:, None] + g_ent.double()[:, None] * (logp + want_ent[:, None])
        want = (torch.nn.functional.one_hot(targets, v).double() * g_lp.double()[:, None] - p * coef) / temp
        # p errs relatively by the exp (EXP_POLY_REL) of an argument off by lse_b + U32 |z - lse|; the coefficient
        # by |g_ent| (lse_b + ent_b); a few fp32 roundings of the product; then one rounding to the output dtype
        rel = EXP_POLY_REL + lse_b + U32 * (spread + float(want_lse.abs().max())) + 6 * U32
        bound = (p * (rel * coef.abs() + g_ent.double().abs()[:, None] * (lse_b + ent_b))) / temp
        u_out = 2.0**-8 if out_dtype == torch.bfloat16 else U32
        bound = bound * (1 + u_out) + u_out * want.abs() + 1e-45
        assert bool(((dz.double() - want).abs() <= bound).all()), out_dtype


def test_scratch_buffers_are_recycled_by_capacity_and_never_shared():
    pool = lm_head._Scratch(keep=1)
    a = pool.take(3, 5, 4, torch.float32)  # [3, 5] view of a 4 x 5 buffer
    b = pool.take(4, 5, 4, torch.float32)
    assert a.shape == (3, 5) and a.is_contiguous() and a.data_ptr() != b.data_ptr()
    pool.give(a)
    c = pool.take(2, 5, 4, torch.float32)  # the same capacity: a's buffer again
    assert c.data_ptr() == a.data_ptr()
    pool.give(b)
    pool.give(c)  # the pool keeps one free buffer per key; the other is left to the garbage collector
    assert len(pool._free[(torch.float32, 20)]) == 1
    assert pool.take(9, 5, 4, torch.float32).shape == (9, 5)  # more rows than the capacity: a buffer of its own
