"""The CPU few-rows matmul kernel against torch, and the model's forward with and without it."""

from __future__ import annotations

import pytest
import torch

from areal_async.inference import cpu_gemm

kernel = cpu_gemm.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the CPU matmul kernel could not be built here")


@needs_kernel
@pytest.mark.parametrize("m", [3, 4, 7, 16, 24])
@pytest.mark.parametrize("n,k", [(960, 576), (13, 40), (8, 16), (37, 1539)])  # model shapes; ragged blocks, tails
def test_kernel_matches_torch(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b, c = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    tol = dict(atol=1e-5 * k ** 0.5, rtol=1e-5)
    assert cpu_gemm.applies(x, w)
    torch.testing.assert_close(cpu_gemm.linear(kernel, x, w), x @ w.T, **tol)
    torch.testing.assert_close(cpu_gemm.linear(kernel, x, w, b), x @ w.T + b, **tol)
    want = c + x @ w.T + b
    out = cpu_gemm.linear(kernel, x, w, b, add_to=c)
    assert out is c  # added in place
    torch.testing.assert_close(out, want, **tol)


def test_applies_only_where_it_pays_and_can_run():
    w = torch.randn(8, 16)
    assert not cpu_gemm.applies(torch.randn(2, 16), w)  # torch's matrix-vector path is at the bandwidth there
    assert not cpu_gemm.applies(torch.randn(cpu_gemm.MAX_ROWS + 1, 16), w)
    assert not cpu_gemm.applies(torch.randn(4, 16, dtype=torch.float64), w.double())
    assert not cpu_gemm.applies(torch.randn(16, 4).T, w)  # not contiguous


@needs_kernel
def test_model_logits_are_the_same_with_and_without_the_kernel(tiny_ckpt):
    from areal_async.inference.model import DecoderModel
    from areal_async.inference.weights import load_checkpoint

    spec, tensors = load_checkpoint(tiny_ckpt)
    model = DecoderModel(spec)
    model.load_tensors(tensors)
    assert model._gemm is not None
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, spec.vocab_size, (int(n),), generator=g).tolist() for n in (5, 9, 3)]
    with_kernel = model.score(seqs)  # one pass of 17 rows: every projection and the head go through the kernel
    model._gemm = None
    without = model.score(seqs)
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
