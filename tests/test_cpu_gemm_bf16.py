"""bf16 serving on CPU: the few-rows bf16-weight matmul kernel, built for every target this CPU runs (-march=native,
with AVX512-BF16's dot product where the CPU has it, and the portable x86-64-v3 with widened weights and FMA),
against a float64 product of the same bf16-rounded operands within its error bound; the model's bf16 forward
(kernel, torch and the packed head) against its own fp32 forward; the packed head following weight updates; and
`--dtype auto` deciding by the trainer's rule."""

from __future__ import annotations

import json
import os

import pytest
import torch
from error_bounds import U32, gamma

from areal_async.host.cpu_features import cpu_bf16_choice
from areal_async.server.device import resolve_dtype
from areal_async.server.kernels import build as cpu_build
from areal_async.server.kernels import gemm_bf16
from areal_async.server.model import DecoderModel
from areal_async.server.weights import load_checkpoint

kernel = gemm_bf16.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the bf16 matmul kernel could not be built here")


@pytest.fixture(params=cpu_build.runnable_marches())
def target_kernel(request):
    k = gemm_bf16.load(request.param)
    if k is None:
        pytest.skip(f"the bf16 matmul kernel could not be built for -march={request.param}")
    return k


@pytest.mark.parametrize("m,n,k", [(1, 37, 50), (2, 960, 576), (3, 64, 1536), (5, 9, 33), (16, 130, 100)])
def test_kernel_matches_the_product_of_bf16_operands(target_kernel, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)  # [M, K] fp32: the kernel rounds it to bf16
    w = torch.randn(n, k, generator=g).bfloat16()  # [N, K]
    b = torch.randn(n, generator=g)
    xd, wd = x.bfloat16().double(), w.double()  # the exact operands
    want = xd @ wd.T + b.double()
    mag = xd.abs() @ wd.abs().T + b.double().abs()
    got = gemm_bf16.linear(target_kernel, x, w, b)
    # every product of two bf16 values is exact in fp32: only the K + 1 additions round
    assert float(((got.double() - want).abs() - gamma(k + 1) * mag - U32 * want.abs()).max()) <= 0
    c = torch.randn(m, n, generator=g)
    into = c.clone()
    out = gemm_bf16.linear(target_kernel, x, w, b, add_to=into)
    assert out.data_ptr() == into.data_ptr()
    want_c = want + c.double()
    bound = gamma(k + 2) * (mag + c.double().abs()) + U32 * want_c.abs()
    assert float(((out.double() - want_c).abs() - bound).max()) <= 0


def test_kernel_takes_its_rows_only(target_kernel):
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    hi = target_kernel.max_rows
    assert target_kernel.applies(torch.zeros(1, 16), w) and target_kernel.applies(torch.zeros(hi, 16), w)
    assert not target_kernel.applies(torch.zeros(hi + 1, 16), w)
    assert not target_kernel.applies(torch.zeros(2, 16), w.float())  # fp32 weights: kernels/gemm.py's
    assert not target_kernel.applies(torch.zeros(2, 16, dtype=torch.bfloat16), w)  # the rows are fp32
    assert not target_kernel.applies(torch.zeros(16, 2).T, w[:, :2])  # not contiguous


def _models(ckpt: str) -> tuple[DecoderModel, DecoderModel]:
    spec, tensors = load_checkpoint(ckpt)
    m32, m16 = DecoderModel(spec), DecoderModel(spec, dtype=torch.bfloat16)
    m32.load_tensors(tensors)
    m16.load_tensors(tensors)
    return m32, m16


def test_bf16_forward_stays_near_fp32_on_every_route(tiny_ckpt):
    """The same prompts scored with fp32 weights and with bf16 weights and KV, on each route: packed weights
    (kernels/gemm_packed.py), the unpacked few-rows kernel (decode-sized passes) with torch's bf16 matmul and the
    head kernel above it, and torch alone. bf16 rounds
    every matmul input (relative 2^-9), so the logits move by a few times that of their scale, not more."""
    m32, m16 = _models(tiny_ckpt)
    assert m16.act_dtype == torch.float32 and m16.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    vocab = m32.spec.vocab_size
    for lengths in ((3,), (5, 4, 2), (40, 23)):  # 3, 11 and 63 rows in one pass
        seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
        ref = m32.score(seqs)
        for route in ("packed", "unpacked", "torch"):
            saved = m16.mm.packed, m16.mm.gemm_bf16
            if route != "packed":
                m16.mm.packed = None
                m16.mm.gemm_bf16 = gemm_bf16.load() if route == "unpacked" else None
            got = m16.score(seqs)
            m16.mm.packed, m16.mm.gemm_bf16 = saved
            for a, b in zip(got, ref):
                assert a.dtype == torch.float32
                scale = float(b.abs().max())
                assert float((a - b).abs().max()) <= 0.05 * scale + 1e-3, (lengths, route)


def test_packed_head_follows_weight_updates(tiny_ckpt, tiny_ckpt_b):
    """The bf16 head is packed once per weight version: a load into the model's tensors must repack it, so the
    updated model's logits equal those of a model built with the new weights."""
    _, m16 = _models(tiny_ckpt)
    _, fresh = _models(tiny_ckpt_b)
    seqs = [list(range(3, 40)), list(range(5, 30))]  # 62 rows: torch's matmuls and the packed head where built
    before = m16.score(seqs)
    m16.load_tensors(load_checkpoint(tiny_ckpt_b)[1])
    after, want = m16.score(seqs), fresh.score(seqs)
    for a, w, b in zip(after, want, before):
        assert torch.equal(a, w)
        assert not torch.equal(a, b)


def _config_dir(tmp_path, hidden: int) -> str:
    d = tmp_path / f"h{hidden}"
    os.makedirs(d, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    return str(d)


def test_dtype_auto_follows_the_trainers_rule(tmp_path):
    """bf16 on a CPU with a bf16 dot product for a model big enough to be matmul-bound, fp32 otherwise; explicit
    dtypes are taken as they are."""
    cpu = torch.device("cpu")
    fast, _ = cpu_bf16_choice()
    assert resolve_dtype("auto", cpu, _config_dir(tmp_path, 576)) == (torch.bfloat16 if fast else torch.float32)
    assert resolve_dtype("auto", cpu, _config_dir(tmp_path, 128)) == torch.float32  # too small to gain
    assert resolve_dtype("float32", cpu, _config_dir(tmp_path, 576)) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError):
        resolve_dtype("int8", cpu)


def test_dtype_auto_is_fp32_where_torch_is_held_below_bf16(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert resolve_dtype("auto", torch.device("cpu"), _config_dir(tmp_path, 576)) == torch.float32
