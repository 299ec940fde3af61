"""The trainer's one-pass RMSNorm (train/rms_norm.py) against transformers' LlamaRMSNorm in bf16, values and
gradients, on every target this CPU runs, within bounds from the roundings both sides make."""

from __future__ import annotations

import pytest
import torch
from error_bounds import gamma

from areal_async.server.kernels import build as cpu_build
from areal_async.train import rms_norm

ULP16 = 2.0**-7  # one bf16 ulp, relative: two correct roundings of nearby fp32 values can land one ulp apart


@pytest.fixture(params=cpu_build.runnable_marches())
def kernels(request):
    k = rms_norm.load(request.param)
    if k is None:
        pytest.skip(f"the RMSNorm kernel could not be built for -march={request.param}")
    return k


def _torch_norm(x, w, eps):
    """transformers' LlamaRMSNorm.forward, verbatim in ops."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("shape", [(3, 37, 576), (5, 64), (1, 1, 1000)])
def test_values_and_gradients_match_transformers(kernels, shape):
    g = torch.Generator().manual_seed(sum(shape))
    n, eps = shape[-1], 1e-5
    x = (torch.randn(shape, generator=g) * 3).bfloat16().requires_grad_()
    w = (torch.randn(n, generator=g) * 0.3 + 1).bfloat16().requires_grad_()
    gy = torch.randn(shape, generator=g).bfloat16()
    y = rms_norm.rms_norm(x, w, eps, kernels)
    dx, dw = torch.autograd.grad(y, (x, w), gy)
    y_t = _torch_norm(x, w, eps)
    dx_t, dw_t = torch.autograd.grad(y_t, (x, w), gy)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16 and y.shape == x.shape
    x64, w64, g64 = x.detach().double(), w.detach().double(), gy.double()
    r = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
    xhat = (x64 * r).abs()
    # x_hat in fp32 on each side within gamma(n + 3) (a sum of n squares, the mean, sqrt, product), then rounded
    # to bf16 (one ulp apart at most), times w, rounded again (one ulp apart at most)
    bound_y = w64.abs() * xhat * (2 * gamma(n + 3) + ULP16) + ULP16 * y_t.double().abs()
    assert bool(((y.double() - y_t.double()).abs() <= bound_y).all())
    # dx = r (gn - x_hat mean(gn x_hat)), gn = bf16(g w) the same on both sides: fp32 sums of n terms in any order
    # (gamma(n + 4) of the magnitudes), then one rounding to bf16 each
    gn = (g64 * w64).abs()
    mag = r * (gn + xhat * (gn * xhat).mean(-1, keepdim=True))
    bound_dx = 2 * gamma(n + 4) * mag + ULP16 * dx_t.double().abs() + ULP16 * mag * 2.0**-8
    assert bool(((dx.double() - dx_t.double()).abs() <= bound_dx).all())
    # dw = sum over rows of bf16(g bf16(x_hat)): bf16(x_hat) may sit one ulp apart (above), the rows' sum in fp32
    # in another order (gamma(rows)), one rounding each
    rows = x.numel() // n
    terms = (g64 * xhat).reshape(rows, n).abs().sum(0)
    bound_dw = (gamma(rows) * 2 + 2 * ULP16 + 4 * gamma(n + 3)) * terms + ULP16 * dw_t.double().abs()
    assert bool(((dw.double() - dw_t.double()).abs() <= bound_dw).all())


def test_install_takes_bf16_cpu_llama_norms_only(tiny_llama_config):
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config, dtype=torch.float32)
    assert rms_norm.install(model, torch.device("cpu"), torch.float32) == 0
    if rms_norm.load() is None:
        pytest.skip("the RMSNorm kernel could not be built here")
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert rms_norm.install(model, torch.device("cpu"), torch.bfloat16) == len(norms) > 0
    model = model.bfloat16()
    x = torch.randn(2, 5, tiny_llama_config.hidden_size).bfloat16()
    norm = norms[0]
    assert torch.equal(norm(x), rms_norm.rms_norm(x, norm.weight, norm.variance_epsilon))


@pytest.fixture
def tiny_llama_config():
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100,
    )  # fmt: skip
