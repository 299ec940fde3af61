"""The CPU few-rows matmul kernel, built for every target this CPU runs (-march=native and the portable x86-64-v3),
against a float64 product within its error bound, and the model's forward with and without it."""

from __future__ import annotations

import pytest
import torch
from error_bounds import U32, gamma, spec_logit_bound

from areal_async.server.kernels import build as cpu_build
from areal_async.server.kernels import gemm as cpu_gemm

kernel = cpu_gemm.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the CPU matmul kernel could not be built here")


@pytest.fixture(params=cpu_build.runnable_marches())
def target_kernel(request):
    fn = cpu_gemm.load(request.param)
    if fn is None:
        pytest.skip(f"the CPU matmul kernel could not be built for -march={request.param}")
    return fn


def _within_dot_bound(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, terms: int) -> None:
    """Each element a sum of `terms` products and addends whose |values| add up to `magnitude` [M, N]: any order
    errs by at most gamma(terms) * magnitude, plus the output's own rounding (u |want|)."""
    bound = gamma(terms) * magnitude + U32 * want.abs()
    excess = (got.double() - want).abs() - bound
    assert float(excess.max()) <= 0, float(excess.max())


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16, 24, 32])
@pytest.mark.parametrize("n,k", [(960, 576), (13, 40), (8, 16), (37, 1539)])  # model shapes; ragged blocks, tails
def test_kernel_matches_torch(target_kernel, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b, c = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    assert target_kernel.applies(x, w) == (target_kernel.min_rows <= m <= target_kernel.max_rows)
    xd, wd, bd, cd = x.double(), w.double(), b.double(), c.double()
    mag = x.abs().double() @ w.abs().double().T  # [M, N]: sum_k |x_mk w_nk|
    _within_dot_bound(cpu_gemm.linear(target_kernel, x, w), xd @ wd.T, mag, k)
    _within_dot_bound(cpu_gemm.linear(target_kernel, x, w, b), xd @ wd.T + bd, mag + bd.abs(), k + 1)
    want = cd + xd @ wd.T + bd
    out = cpu_gemm.linear(target_kernel, x, w, b, add_to=c)
    assert out is c  # added in place
    _within_dot_bound(out, want, mag + bd.abs() + cd.abs(), k + 2)


def test_applies_only_where_it_pays_and_can_run(target_kernel):
    w = torch.randn(8, 16)
    lo, hi = cpu_gemm.row_range(target_kernel.vector_width)  # the range measured for this build and CPU kind
    assert (target_kernel.min_rows, target_kernel.max_rows) == (lo, hi)
    assert lo == 1 or not target_kernel.applies(torch.randn(lo - 1, 16), w)
    assert not target_kernel.applies(torch.randn(hi + 1, 16), w)
    assert target_kernel.applies(torch.randn(lo, 16), w) and target_kernel.applies(torch.randn(hi, 16), w)
    assert not target_kernel.applies(torch.randn(4, 16, dtype=torch.float64), w.double())
    assert not target_kernel.applies(torch.randn(16, 4).T, w)  # not contiguous


@needs_kernel
def test_model_logits_are_the_same_with_and_without_the_kernel(tiny_ckpt):
    from areal_async.server.model import DecoderModel
    from areal_async.server.weights import load_checkpoint

    spec, tensors = load_checkpoint(tiny_ckpt)
    model = DecoderModel(spec)
    model.load_tensors(tensors)
    model.mm.packed = None  # this file's kernel on unpacked weights (tests/test_cpu_gemm_packed.py: the packed one)
    model._gemm = kernel
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, spec.vocab_size, (int(n),), generator=g).tolist() for n in (5, 9, 3)]
    assert model._gemm.applies(torch.zeros(17, 4), torch.zeros(4, 4))
    with_kernel = model.score(seqs)  # one pass of 17 rows: every projection and the head go through the kernel
    model._gemm = None
    without = model.score(seqs)
    for a, b in zip(with_kernel, without):
        # two fp32 forwards that sum in different orders: the decoder bound at these logits' magnitude
        tol = spec_logit_bound(spec, a.shape[0], float(b.abs().max()))
        torch.testing.assert_close(a, b, atol=tol, rtol=0)
