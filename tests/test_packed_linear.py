"""oneDNN on reordered weights (server/packed_linear.py): the product torch computes, remade after every in-place
write to the weight, within its memory budget, and the engine's matmul routing takes it for many rows only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from error_bounds import U32, gamma

from areal_async.server import packed_linear
from areal_async.server.cpu_matmul import Matmuls

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this torch has no oneDNN linear")


def _within(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, terms: int) -> None:
    excess = (got.double() - want).abs() - (gamma(terms) * mag + U32 * want.abs())
    assert float(excess.max()) <= 0, float(excess.max())


@pytest.mark.parametrize("m", [4, 25, 64, 300])
def test_fp32_product_and_fused_add_match_float64(m):
    g = torch.Generator().manual_seed(m)
    x, w, b, c = (
        torch.randn(m, 96, generator=g),
        torch.randn(200, 96, generator=g),
        torch.randn(200),
        torch.randn(m, 200),
    )
    packs = packed_linear.PackedLinear()
    assert packs.applies(x, w)
    p = packs.packed(w)
    mag = x.abs().double() @ w.abs().double().T
    want = x.double() @ w.double().T + b.double()
    _within(packed_linear.linear(p, x, b), want, mag + b.abs().double(), 97)
    out = packed_linear.linear_add(p, c, x, b)
    _within(out, want + c.double(), mag + b.abs().double() + c.abs().double(), 98)


def test_bf16_product_equals_torchs_or_is_refused():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(40, 128, generator=g).bfloat16(), torch.randn(64, 128, generator=g).bfloat16()
    packs = packed_linear.PackedLinear()
    p = packs.packed(w)
    if p is None:  # oneDNN's bf16 linear needs AVX512-BW/VL/DQ (e.g. torch held to AVX2): torch's path instead
        assert packs.refused == {torch.bfloat16} and packs.used == 0
        assert packs.packed(torch.randn(8, 8)) is not None  # fp32 still packs
        return
    got = packed_linear.linear(p, x, None)
    assert got.dtype == torch.bfloat16
    want = (x.double() @ w.double().T).bfloat16()  # fp32 accumulation then one rounding: within one bf16 ulp
    assert float((got.float() - want.float()).abs().max()) <= float(want.float().abs().max()) * 2**-7


def test_a_write_to_the_weight_repacks_it():
    w = torch.randn(64, 32)
    x = torch.randn(8, 32)
    packs = packed_linear.PackedLinear()
    p1 = packs.packed(w)
    assert packs.packed(w) is p1  # unchanged: the same copy
    w[3].mul_(-2)  # an in-place write through a view, as a weight load or update makes
    p2 = packs.packed(w)
    assert p2 is not p1
    assert torch.allclose(packed_linear.linear(p2, x, None), F.linear(x, w), atol=1e-5)
    assert packs.used == w.numel() * 4  # the repack did not count twice


def test_the_budget_leaves_the_rest_to_torch():
    packs = packed_linear.PackedLinear(budget_bytes=64 * 32 * 4)
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    assert packs.packed(a) is not None and packs.packed(b) is None


def test_routing_takes_it_for_many_rows_only():
    mm = Matmuls(torch.device("cpu"), torch.float32)
    assert mm.packs is not None
    w = torch.randn(256, 64)
    few, many = torch.randn(2, 64), torch.randn(48, 64)
    mm.linear(few, w)
    assert mm.packs.used == 0  # the few-row kernel (or torch's matrix-vector product) took it
    got = mm.linear(many, w)
    assert mm.packs.used == w.numel() * 4
    assert torch.allclose(got, F.linear(many, w), atol=1e-4)
    res = torch.randn(48, 256)
    assert torch.allclose(mm.linear_add(res.clone(), many, w, None), res + F.linear(many, w), atol=1e-4)
    mmb = Matmuls(torch.device("cpu"), torch.bfloat16)
    wb = w.bfloat16()
    rows = torch.randn(300, 64)  # above the bf16 kernel's rows on every build (256 where it has no bf16 dot product)
    got_b = mmb.linear(rows, wb)
    assert got_b.dtype == torch.float32
    assert mmb.packs.used == (0 if mmb.packs.refused else wb.numel() * 2)
    assert torch.equal(got_b, F.linear(rows.bfloat16(), wb).float())  # the same bf16 operands and rounding
