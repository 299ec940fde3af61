"""The CPU RMSNorm, SiLU-gating and greedy-sampling kernels, built for every target this CPU runs (-march=native
and the portable x86-64-v3), against float64 references within their error bounds (error_bounds.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from error_bounds import EXP_POLY_REL, U32, gamma

from areal_async.server.kernels import build as cpu_build
from areal_async.server.kernels import elementwise as cpu_elementwise


@pytest.fixture(params=cpu_build.runnable_marches())
def kernels(request):
    k = cpu_elementwise.load(request.param)
    if k is None:
        pytest.skip(f"the CPU element-wise kernels could not be built for -march={request.param}")
    return k


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_matches_torch_on_strided_rows(kernels, rows):
    g = torch.Generator().manual_seed(rows)
    big = torch.randn(rows * 2, 100, generator=g) * 3
    x = big[::2, 3:91]  # rows with a stride, as a gathered or sliced hidden state can be
    w = torch.randn(88, generator=g)
    want = F.rms_norm(x.double(), (88,), w.double(), 1e-5)
    # sum of 88 squares (all positive): relative gamma(88), halved by the rsqrt; then /n, +eps, sqrt, 1/, two
    # multiplies and the cast: 6 roundings more. Every step is relative, so no atol.
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5).double(), want, atol=0, rtol=gamma(88) / 2 + 7 * U32)


@pytest.mark.parametrize("rows", [1, 9, 64])
def test_silu_mul_matches_torch_including_saturated_inputs(kernels, rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 77, generator=g) * 6
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])  # exp over- and underflow
    gd = gate_up.double()
    want = F.silu(gd[:, :77]) * gd[:, 77:]
    # exp's relative error, then 1 +, /, * u: three roundings. The kernel clamps exp's argument at 88, so a
    # saturated gate (g < -88) gives |g u| / e^88 (< 1e-30 here) where the exact value is ~0: that is the atol.
    torch.testing.assert_close(kernels.silu_mul(gate_up).double(), want, atol=1e-30, rtol=EXP_POLY_REL + 4 * U32)


@pytest.mark.parametrize("rows", [1, 5])
def test_greedy_argmax_and_logsumexp_match_torch(kernels, rows):
    g = torch.Generator().manual_seed(rows)
    n = 49152
    logits = torch.randn(rows, n, generator=g) * 5
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # ties go to the first, as torch.argmax
    idx, lse = kernels.argmax_logsumexp(logits)
    assert torch.equal(idx, logits.argmax(-1)) and idx[0] == 7  # comparisons are exact: no tolerance
    want = torch.logsumexp(logits.double(), -1)
    spread = float((logits.max(-1).values - logits.min(-1).values).max())
    # lse = max + log(s), s = sum exp(x - max) summed in double (its rounding is negligible). Each term errs by the
    # exp polynomial plus the rounding of x - max (u |x - max| <= u * spread, relative after exp), so s is relative
    # EXP_POLY_REL + u * spread, which log turns into an absolute error; log and the final add and cast: u |lse|.
    bound = EXP_POLY_REL + U32 * spread + 3 * U32 * float(want.abs().max())
    assert float((lse.double() - want).abs().max()) <= bound, bound
