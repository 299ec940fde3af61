"""The CPU RMSNorm and SiLU-gating kernels against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areal_async.inference import cpu_elementwise

kernels = cpu_elementwise.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU element-wise kernels could not be built here")


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_matches_torch_on_strided_rows(rows):
    g = torch.Generator().manual_seed(rows)
    big = torch.randn(rows * 2, 100, generator=g) * 3
    x = big[::2, 3:91]  # rows with a stride, as a gathered or sliced hidden state can be
    w = torch.randn(88, generator=g)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (88,), w, 1e-5), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 9, 64])
def test_silu_mul_matches_torch_including_saturated_inputs(rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 77, generator=g) * 6
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])  # exp over- and underflow
    want = F.silu(gate_up[:, :77]) * gate_up[:, 77:]
    torch.testing.assert_close(kernels.silu_mul(gate_up), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5])
def test_greedy_argmax_and_logsumexp_match_torch(rows):
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 49152, generator=g) * 5
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # ties go to the first, as torch.argmax
    idx, lse = kernels.argmax_logsumexp(logits)
    assert torch.equal(idx, logits.argmax(-1)) and idx[0] == 7
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-6)
