"""The packed-weight matmul kernels (server/kernels/gemm_packed.py), built for every target this CPU runs
(-march=native, with AVX512-BF16's dot product where the CPU has it, and the portable x86-64-v3), against a float64
product of the same operands within its error bound, at every row-block remainder and panel tail; and the engine's
model on them: logits against the unpacked and torch routes, and repacking after weight writes."""

from __future__ import annotations

import pytest
import torch
from error_bounds import U32, gamma, spec_logit_bound

from areal_async.server.kernels import build as cpu_build
from areal_async.server.kernels import gemm as cpu_gemm
from areal_async.server.kernels import gemm_packed
from areal_async.server.model import DecoderModel
from areal_async.server.weights import load_checkpoint

kernel = gemm_packed.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the packed matmul kernels could not be built here")


@pytest.fixture(params=cpu_build.runnable_marches())
def target_kernel(request):
    k = gemm_packed.load(request.param)
    if k is None:
        pytest.skip(f"the packed matmul kernels could not be built for -march={request.param}")
    return k


# rows: 1 (the two-chain path) and every remainder of the row blocks (AVX-512: 6, AVX2: 2); N: whole panels and
# tails; K: odd (a zero-padded last pair in bf16), below one vector, the model's sizes
SHAPES = [(1, 37, 50), (1, 960, 576), (2, 64, 1), (3, 33, 5), (4, 96, 31), (5, 17, 64), (6, 576, 1536), (7, 130, 100),
          (13, 40, 77), (64, 200, 96)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_matches_a_float64_product(target_kernel, dtype, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)  # [M, K] fp32 (rounded to bf16 by the kernel for bf16 weights)
    w = torch.randn(n, k, generator=g).to(dtype)  # [N, K]
    b = torch.randn(n, generator=g)
    xd = (x if dtype == torch.float32 else x.bfloat16()).double()
    want = xd @ w.double().T + b.double()
    mag = xd.abs() @ w.double().abs().T + b.double().abs()
    panels = target_kernel.pack(w)
    assert panels.data_ptr() % 64 == 0 and panels.shape[0] == -(-n // gemm_packed.PANEL)
    got = target_kernel.linear(x, panels, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # fp32: K products and K + 1 additions, each rounding once; bf16: the products are exact
    terms = 2 * k + 1 if dtype == torch.float32 else k + 1
    assert float(((got.double() - want).abs() - gamma(terms) * mag - U32 * want.abs()).max()) <= 0
    c = torch.randn(m, n, generator=g)
    into = c.clone()
    out = target_kernel.linear(x, panels, w, b, add_to=into)
    assert out.data_ptr() == into.data_ptr()  # in place: the residual stream
    want_c = want + c.double()
    bound = gamma(terms + 1) * (mag + c.double().abs()) + U32 * want_c.abs()
    assert float(((out.double() - want_c).abs() - bound).max()) <= 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_threads_share_the_panels_from_both_ends(target_kernel, dtype):
    """Two threads and at most one register block of rows take panels from both ends until they meet: every panel
    computed exactly once, the same bits as one thread, from 1 panel to the LM head's 1,536 (even and odd counts)."""
    saved = torch.get_num_threads()
    g = torch.Generator().manual_seed(3)
    try:
        for m in (1, 2, 7):
            for n in (5, 32, 33, 96, 575, 49152):
                k = 64 if n == 49152 else 96
                x = torch.randn(m, k, generator=g)  # [M, K]
                w = torch.randn(n, k, generator=g).to(dtype)  # [N, K]
                panels = target_kernel.pack(w)
                c = torch.randn(m, n, generator=g)
                outs = []
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    outs.append(
                        (target_kernel.linear(x, panels, w), target_kernel.linear(x, panels, w, add_to=c.clone()))
                    )
                assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), (m, n)
    finally:
        torch.set_num_threads(saved)


def test_pack_takes_a_row_strided_view(target_kernel):
    """A weight that is a row slice of a wider tensor (row stride > K) packs as its contiguous copy would."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        wide = torch.randn(48, 80, generator=g).to(dtype)
        view = wide[:, 8:72]  # [48, 64], row stride 80
        assert torch.equal(target_kernel.pack(view), target_kernel.pack(view.contiguous()))


def test_kernel_takes_its_rows_only(target_kernel):
    x1 = torch.zeros(1, 16)
    for dtype, hi in ((torch.float32, target_kernel.max_rows_f32), (torch.bfloat16, target_kernel.max_rows_bf16)):
        w = torch.zeros(8, 16, dtype=dtype)
        assert target_kernel.applies(x1, w) and target_kernel.applies(torch.zeros(hi, 16), w)
        assert not target_kernel.applies(torch.zeros(hi + 1, 16), w)
        assert not target_kernel.applies(torch.zeros(0, 16), w)
    assert not target_kernel.applies(x1, torch.zeros(8, 16, dtype=torch.float16))
    assert not target_kernel.applies(x1.bfloat16(), torch.zeros(8, 16, dtype=torch.bfloat16))  # rows are fp32
    assert not target_kernel.applies(torch.zeros(16, 2).T, torch.zeros(8, 16))  # not contiguous


def _model(ckpt: str, dtype: torch.dtype) -> DecoderModel:
    spec, tensors = load_checkpoint(ckpt)
    m = DecoderModel(spec, dtype=dtype)
    m.load_tensors(tensors)
    return m


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_logits_on_packed_weights_equal_the_other_routes(tiny_ckpt, dtype):
    """Decode-sized (3 rows) and prefill-sized (17, 63 rows) passes on packed weights against the unpacked kernels
    and torch: fp32 within the decoder's summation bound; bf16 within a few bf16 roundings of the activations."""
    model = _model(tiny_ckpt, dtype)
    assert model.mm.packed is not None
    g = torch.Generator().manual_seed(0)
    vocab = model.spec.vocab_size
    for lengths in ((3,), (5, 9, 3), (40, 23)):
        seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
        packed = model.score(seqs)
        saved = model.mm.packed
        model.mm.packed = None
        if dtype == torch.float32:
            model.mm.gemm = cpu_gemm.load()
        others = model.score(seqs)
        model.mm.packed, model.mm.gemm = saved, None
        for a, b in zip(packed, others):
            if dtype == torch.float32:
                tol = spec_logit_bound(model.spec, a.shape[0], float(b.abs().max()))
            else:
                # sums in another order can round an activation to the neighbouring bf16 value (2^-8 relative)
                # on its way into the next matmul: a few of those, not a different model
                tol = 1e-2 * float(b.abs().max()) + 1e-4
            torch.testing.assert_close(a, b, atol=tol, rtol=0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_follow_every_write(tiny_ckpt, tiny_ckpt_b, dtype):
    """A load into the model's tensors repacks at its end, and an in-place write outside any load (here: one
    layer's MLP weight scaled) is seen by the next product through the tensor's version counter: the model's logits
    then equal a fresh model's with the same weights."""
    model = _model(tiny_ckpt, dtype)
    held = model.mm.prepack([])
    assert held >= sum(w.numel() * w.element_size() for la in model.layers for w in (la.qkv_w, la.down_w))
    seqs = [list(range(3, 9)), [7]]  # 7 rows: the packed route
    before = model.score(seqs)
    model.load_tensors(load_checkpoint(tiny_ckpt_b)[1])
    fresh = _model(tiny_ckpt_b, dtype)
    after = model.score(seqs)
    for a, w, b in zip(after, fresh.score(seqs), before):
        assert torch.equal(a, w) and not torch.equal(a, b)
    with torch.inference_mode():  # as the engine writes
        model.layers[0].down_w.mul_(2)
        fresh.layers[0].down_w.mul_(2)
    for a, w, b in zip(model.score(seqs), fresh.score(seqs), after):
        assert torch.equal(a, w) and not torch.equal(a, b)
