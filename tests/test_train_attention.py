"""The trainer's CPU attention kernel (train/attention_kernel.py) and its transformers entry (train/attention.py):
values and gradients against float64 attention within an error bound, for every target this CPU runs, on the
shapes the layouts produce (causal rows, the shared-prefix pass's boolean mask, GQA), and the fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from error_bounds import EXP_POLY_REL, U32, gamma

from areal_async.server.kernels import build as cpu_build
from areal_async.train import attention as train_attention
from areal_async.train import attention_kernel

U16 = 2.0**-8  # bf16 unit roundoff: each output is rounded once to the input dtype


@pytest.fixture(params=cpu_build.runnable_marches())
def kernel(request):
    k = attention_kernel.load(request.param)
    if k is None:
        pytest.skip(f"the trainer attention kernel could not be built for -march={request.param}")
    return k


def _inputs(b, h, hkv, length, lk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, length, h, d, generator=g).transpose(1, 2).to(dtype)  # [B, H, L, D], strided as the model's
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    dout = torch.randn(b, length, h, d, generator=g).to(dtype)  # [B, L, H, D]
    return q, k, v, dout


def _prefix_mask(b, length, prefix_max, seed):
    """The shared-prefix layout's second-pass mask: each row sees its first pre[s] prefix keys and its own
    suffix causally. [B, 1, L, P + L] bool"""
    g = torch.Generator().manual_seed(seed)
    pre = torch.randint(1, prefix_max + 1, (b,), generator=g)
    kp, qp = torch.arange(prefix_max + length), torch.arange(length)
    see_prefix = kp[None, None, :] < pre[:, None, None]
    see_suffix = (kp[None, :] >= prefix_max) & (kp[None, :] - prefix_max <= qp[:, None])
    return (see_prefix | see_suffix[None]).unsqueeze(1)


def _reference(q, k, v, dout, mask, causal, scale):
    """float64 attention of the same (rounded) inputs and its gradients, with the intermediate magnitudes the
    error bound needs. Returns out [B, L, H, D], dq [B, H, L, D], dk, dv, and the bounds of each."""
    groups = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kk, vv = k64.repeat_interleave(groups, 1), v64.repeat_interleave(groups, 1)  # [B, H, Lk, D]
    s = scale * q64 @ kk.transpose(-1, -2)  # [B, H, L, Lk]
    allowed = torch.ones_like(s, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if mask is not None:
        allowed = allowed & mask
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)  # [B, H, L, Lk]
    out = (p @ vv).transpose(1, 2)  # [B, L, H, D]
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    # Error bound (first order, Higham's gamma for each fp32 dot product and sum; see error_bounds.py):
    # a score errs by gamma(D) sum_d |q k| (scale included), each exp by EXP_POLY_REL, the row sum by gamma(Lk):
    # relative error of each probability eps_p. out = sum_j p v: gamma(Lk) sum |p v| plus eps_p sum p |v|.
    d, lk = q.shape[-1], k.shape[2]
    with torch.no_grad():
        sabs = scale * q64.abs() @ kk.abs().transpose(-1, -2)  # [B, H, L, Lk]
        eps_p = 2 * gamma(d) * sabs.amax(-1, keepdim=True) + EXP_POLY_REL + gamma(lk + 2)  # [B, H, L, 1]
        pv = p @ vv.abs()  # [B, H, L, D]
        out_b = ((gamma(lk) + eps_p) * pv).transpose(1, 2)
        # backward: dP = dout v^T errs by gamma(D) |dout| |v|, the row term sum dout * out by gamma(D) |dout| |out|
        # plus the error of out; dS = p (dP - row) then errs by eps_p |dS| + p (those two); dq = scale dS k,
        # dk = scale dS^T q, dv = p^T dout add gamma(Lk) (or gamma(L G)) of their own sums of magnitudes.
        g64 = dout.double().transpose(1, 2)  # [B, H, L, D]
        dp = g64 @ vv.transpose(-1, -2)
        row = (g64 * out.detach().transpose(1, 2)).sum(-1, keepdim=True)
        err_dp = gamma(d) * g64.abs() @ vv.abs().transpose(-1, -2)
        # the kernel (as torch's) takes the row term from the stored output, rounded to the dtype (u_out |out|)
        u_out = U16 if q.dtype == torch.bfloat16 else U32
        out_err = out_b.transpose(1, 2) + u_out * out.detach().abs().transpose(1, 2)  # [B, H, L, D]
        err_row = gamma(d) * (g64.abs() * pv).sum(-1, keepdim=True) + (g64.abs() * out_err).sum(-1, keepdim=True)
        ds_abs = p * (dp - row).abs()
        err_ds = eps_p * ds_abs + p * (err_dp + err_row)  # [B, H, L, Lk]
        length = q.shape[2]
        dq_b = scale * (err_ds + gamma(lk) * ds_abs) @ kk.abs()
        dk_b = scale * (err_ds + gamma(length * groups) * ds_abs).transpose(-1, -2) @ q64.abs()
        dv_b = (eps_p * p + gamma(length * groups) * p).transpose(-1, -2) @ g64.abs()

        def per_kv(t):  # [B, H, Lk, D] -> [B, Hkv, Lk, D]: the query heads of a kv head add up
            return t.reshape(t.shape[0], -1, groups, *t.shape[2:]).sum(2)

    return out, dq, dk, dv, (out_b, dq_b, per_kv(dk_b), per_kv(dv_b))


def _check(got, want, bound, dtype, what):
    # fp32: the bound as derived; bf16: plus the one rounding of each output to bf16 (u16 |value|) and of the
    # inputs' own rounding, which the reference shares (it is computed from the same rounded inputs)
    total = bound + (U16 * want.abs() if dtype == torch.bfloat16 else U32 * want.abs())
    err = (got.double() - want).abs()
    assert bool((err <= total + 1e-300).all()), (what, float((err - total).max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "b,h,hkv,length,d,case",
    [(3, 9, 3, 37, 64, "causal"), (2, 4, 4, 5, 64, "causal"), (2, 9, 3, 29, 64, "prefix"), (2, 4, 2, 1, 128, "full")],
)
def test_kernel_matches_float64_attention_and_gradients(kernel, dtype, b, h, hkv, length, d, case):
    prefix = 23 if case == "prefix" else 0
    lk = length + prefix
    q, k, v, dout = _inputs(b, h, hkv, length, lk, d, dtype, seed=length * 10 + d)
    mask = _prefix_mask(b, length, prefix, seed=length) if case == "prefix" else None
    causal = case == "causal"
    scale = d**-0.5
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = train_attention.short_attention(kernel, q, k, v, mask, causal, scale)  # [B, L, H, D]
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    want_out, want_dq, want_dk, want_dv, bounds = _reference(q, k, v, dout, mask, causal, scale)
    for got, want, bound, what in zip((out, dq, dk, dv), (want_out, want_dq, want_dk, want_dv), bounds, "o q k v"):
        assert got.shape == want.shape and got.dtype == dtype
        _check(got, want, bound, dtype, what)


def test_rows_that_see_no_key_give_zeros_not_nans(kernel):
    q, k, v, dout = _inputs(1, 2, 1, 4, 6, 64, torch.float32, seed=1)
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    mask[0, 0, 2] = False  # row 2 sees nothing
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = train_attention.short_attention(kernel, q, k, v, mask, False, 0.125)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert bool(torch.isfinite(out).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all())
    assert bool((out[0, 2] == 0).all()) and bool((dq[0, :, 2] == 0).all())


class _Module(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def test_entry_takes_the_kernel_only_for_cpu_bf16_and_otherwise_is_sdpa():
    """fp32 calls (and anything the kernel does not cover) go to transformers' SDPA unchanged: bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, _ = _inputs(2, 9, 3, 11, 11, 64, torch.float32, seed=3)
    got, _ = train_attention.attention(_Module(), q, k, v, None, scaling=0.125)
    want, _ = sdpa_attention_forward(_Module(), q, k, v, None, scaling=0.125)
    assert torch.equal(got, want)
    kern = attention_kernel.load()
    qb, kb = q.bfloat16(), k.bfloat16()
    assert train_attention.kernel_applies(kern, qb, kb, None, True) == (kern is not None)
    assert not train_attention.kernel_applies(kern, q, k, None, True)  # fp32 stays on torch
    assert not train_attention.kernel_applies(kern, qb, kb[:, :, :5], None, True)  # causal with fewer keys
    long_k = torch.zeros(1, 3, attention_kernel.MAX_KEYS + 1, 64, dtype=torch.bfloat16)
    assert not train_attention.kernel_applies(kern, qb[:1], long_k, torch.ones(1, 1, 11, long_k.shape[2]) > 0, False)
    float_mask = torch.zeros(2, 1, 11, 11, dtype=torch.bfloat16)
    assert not train_attention.kernel_applies(kern, qb, kb, float_mask, False)


def test_entry_with_the_kernel_matches_sdpa_within_bf16_rounding():
    """The transformers entry on bf16 (kernel) against SDPA on the same inputs in float64: the bound of the kernel
    test applies (both calls see the same rounded inputs)."""
    kern = attention_kernel.load()
    if kern is None:
        pytest.skip("the trainer attention kernel could not be built here")
    q, k, v, dout = _inputs(2, 9, 3, 17, 17 + 9, 64, torch.bfloat16, seed=5)
    mask = _prefix_mask(2, 17, 9, seed=5)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, _ = train_attention.attention(_Module(), q, k, v, mask, scaling=0.125)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    want_out, want_dq, want_dk, want_dv, bounds = _reference(q, k, v, dout, mask, False, 0.125)
    for got, want, bound, what in zip((out, dq, dk, dv), (want_out, want_dq, want_dk, want_dv), bounds, "o q k v"):
        _check(got, want, bound, torch.bfloat16, what)
    # and SDPA itself (float64) agrees with the reference: the reference is attention
    ref = F.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1), attn_mask=mask, scale=0.125
    )
    assert torch.allclose(ref.transpose(1, 2), want_out, rtol=0, atol=1e-12)


def test_trainer_model_uses_it_only_on_cpu_bf16():
    kern = attention_kernel.load()
    assert train_attention.trainer_attention(torch.device("cpu"), torch.float32) == "sdpa"
    want = train_attention.NAME if kern is not None else "sdpa"
    assert train_attention.trainer_attention(torch.device("cpu"), torch.bfloat16) == want
    assert train_attention.sdpa_like(train_attention.NAME) and train_attention.sdpa_like("sdpa")
    assert not train_attention.sdpa_like("eager")
