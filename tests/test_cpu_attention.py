"""The CPU paged decode-attention kernel, built for every target this CPU runs (-march=native and the portable
x86-64-v3), against float64 attention within its error bound, and the model's two attention paths (kernel and
gather + SDPA) against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from error_bounds import attention_bound, spec_logit_bound

from areal_async.server.kernels import attention as cpu_attention
from areal_async.server.kernels import build as cpu_build
from areal_async.server.model import DecoderModel
from areal_async.server.weights import load_checkpoint

kernel = cpu_attention.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the CPU attention kernel could not be built here")


def reference(q, kv_pages, table, lens, hkv):
    """Attention of each row over its first lens[b] keys, gathered token by token, in float64, and the error bound
    of each row [B] (error_bounds.attention_bound over its heads)."""
    b, h, d = q.shape
    ps = kv_pages.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    bounds = torch.empty(b, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        slots = [int(table[i, s // ps]) * ps + s % ps for s in range(n)]
        kv = kv_pages.reshape(-1, 2 * hkv, d)[slots].double()  # [n, 2Hkv, D]
        k = kv[:, :hkv].repeat_interleave(h // hkv, dim=1).transpose(0, 1)  # [H, n, D]
        v = kv[:, hkv:].repeat_interleave(h // hkv, dim=1).transpose(0, 1)
        out[i] = F.scaled_dot_product_attention(q[i].double()[:, None], k, v, scale=1.0)[:, 0]
        bounds[i] = max(attention_bound(q[i, j], k[j], v[j]) for j in range(h))
    return out, bounds


def _assert_within(got, want_and_bounds):
    want, bounds = want_and_bounds
    err = (got.double() - want).abs().amax(dim=(1, 2))  # [B]
    assert bool((err <= bounds).all()), (err, bounds)


@pytest.fixture(params=cpu_build.runnable_marches())
def target_kernel(request):
    fn = cpu_attention.load(request.param)
    if fn is None:
        pytest.skip(f"the CPU attention kernel could not be built for -march={request.param}")
    return fn


@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 4, 16), (8, 1, 32), (14, 2, 128)])
def test_kernel_matches_attention_over_scattered_pages(target_kernel, h, hkv, d):
    kernel = target_kernel
    g = torch.Generator().manual_seed(h * 100 + d)
    ps, num_pages, b = 16, 60, 7
    kv_pages = torch.randn(num_pages, ps, 2 * hkv, d, generator=g)
    lens = torch.tensor([1, 15, 16, 17, 40, 100, 3])  # inside a page, page edges, several pages
    p = int(max(-(-lens // ps)))
    perm = torch.randperm(num_pages - 1, generator=g)[: b * p] + 1  # pages in no particular order, never page 0
    table = perm.view(b, p).clone()
    q = torch.randn(b, h, d, generator=g) * d**-0.5
    got = cpu_attention.paged_decode_attention(kernel, q, kv_pages, table, lens, hkv)
    _assert_within(got, reference(q, kv_pages, table, lens, hkv))
    # a row's result depends on its own keys only: scrambling what lies past its length changes nothing
    kv2 = kv_pages.clone()
    last = table[0, 0]
    kv2[last, 1:] = torch.randn(ps - 1, 2 * hkv, d)
    kv2[0] = 1e6  # page 0 is never read
    again = cpu_attention.paged_decode_attention(kernel, q, kv2, table, lens, hkv)
    assert torch.equal(again[0], got[0])
    # peaked softmaxes (scores tens apart, the max moving within and across pages) stay exact: the kernel's exp
    # is its own polynomial, and a page's update rescales what earlier pages accumulated
    sharp = q * 40
    got = cpu_attention.paged_decode_attention(kernel, sharp, kv_pages, table, lens, hkv)
    _assert_within(got, reference(sharp, kv_pages, table, lens, hkv))


@pytest.mark.parametrize("path", ["kernel", "gather_sdpa"])
def test_both_attention_paths_match_transformers(tiny_ckpts_all_archs, path):
    """Two requests of different lengths prefilled, then decoded together one token per step: every step's logits
    against transformers' logits at the same positions."""
    import transformers

    from areal_async.server.model import KVCache, build_step_batch

    if path == "kernel" and kernel is None:
        pytest.skip("the CPU attention kernel could not be built here")
    ckpt = tiny_ckpts_all_archs["llama"]
    spec, tensors = load_checkpoint(ckpt)
    model = DecoderModel(spec)
    model.load_tensors(tensors)
    if path == "gather_sdpa":
        model._kernel, model.paged_decode = None, False
    assert model.paged_decode == (path == "kernel")
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, spec.vocab_size, (n,), generator=g).tolist() for n in (40, 23)]
    with torch.no_grad():
        want = [hf(torch.tensor([s])).logits[0].float() for s in seqs]  # [T, V] each
    cpu = torch.device("cpu")
    cache = KVCache(spec, 8 * 16, 16, cpu, torch.float32)
    pages = [[1, 2, 3], [4, 5]]
    table = torch.tensor([[1, 2, 3], [4, 5, 0]])
    decode_from = [s.__len__() - 6 for s in seqs]
    prefill = [(s[:n], 0, p, i) for i, (s, n, p) in enumerate(zip(seqs, decode_from, pages))]
    model.forward(build_step_batch(prefill, table, 16, cpu, [[], []], paged_decode=model.paged_decode), cache)
    for step in range(6):
        chunks = [([s[n + step]], n + step, p, i) for i, (s, n, p) in enumerate(zip(seqs, decode_from, pages))]
        batch = build_step_batch(chunks, table, 16, cpu, [[0], [0]], paged_decode=model.paged_decode)
        assert all((grp.table is not None) == model.paged_decode for grp in batch.groups)
        logits = model.forward(batch, cache)  # [2, V]
        for i, (_s, n) in enumerate(zip(seqs, decode_from)):
            ref = want[i][n + step]
            tol = spec_logit_bound(spec, n + step + 1, float(ref.abs().max()))  # two fp32 forwards, any order
            assert torch.allclose(logits[i], ref, atol=tol, rtol=0), (path, i, step, tol)


@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (8, 1, 32)])
def test_kernel_reads_a_bf16_cache(target_kernel, h, hkv, d):
    """bf16 serving keeps the cache in bf16: the kernel widens each key and value exactly, so it is held to the
    same bound as fp32 attention over the widened cache."""
    g = torch.Generator().manual_seed(h + d)
    ps, num_pages, b = 16, 30, 4
    kv_pages = torch.randn(num_pages, ps, 2 * hkv, d, generator=g).bfloat16()
    lens = torch.tensor([1, 16, 33, 70])
    p = int(max(-(-lens // ps)))
    table = (torch.randperm(num_pages - 1, generator=g)[: b * p] + 1).view(b, p).clone()
    q = torch.randn(b, h, d, generator=g) * d**-0.5
    got = cpu_attention.paged_decode_attention(target_kernel, q, kv_pages, table, lens, hkv)
    assert got.dtype == torch.float32
    _assert_within(got, reference(q, kv_pages.float(), table, lens, hkv))
    with pytest.raises(TypeError):
        cpu_attention.paged_decode_attention(target_kernel, q.bfloat16(), kv_pages, table, lens, hkv)


@pytest.mark.parametrize(
    "h,hkv,d,ps,dtype",
    [
        (9, 3, 40, 16, torch.float32),  # a head dim that is no multiple of the vector width: zero-padded scratch
        (6, 2, 8, 4, torch.bfloat16),  # pages shorter than a block of keys
        (16, 1, 72, 32, torch.float32),  # a 16-query group, two blocks a page
        (12, 4, 64, 64, torch.bfloat16),  # the largest page
        (8, 8, 128, 16, torch.bfloat16),  # no grouping, the 128 specialisation
    ],
)
def test_kernel_shapes_page_sizes_and_long_rows(target_kernel, h, hkv, d, ps, dtype):
    """Head dims, page sizes and groups around the kernel's blocking (VL keys a block, 4 accumulator vectors at a
    time), with rows up to ~1,000 keys whose peaked scores move the max across pages; the last rows' pages are
    prefetched across the row boundary."""
    g = torch.Generator().manual_seed(h * d + ps)
    lens = torch.tensor([1, ps - 1 if ps > 1 else 1, ps + 1, 3 * ps, 517, 1030])
    b, p = len(lens), int(max(-(-lens // ps)))
    num_pages = b * p + 1
    kv_pages = torch.randn(num_pages, ps, 2 * hkv, d, generator=g).to(dtype)
    table = (torch.randperm(num_pages - 1, generator=g)[: b * p] + 1).view(b, p).clone()
    for scale in (1.0, 12.0):
        q = torch.randn(b, h, d, generator=g) * d**-0.5 * scale
        got = cpu_attention.paged_decode_attention(target_kernel, q, kv_pages, table, lens, hkv)
        _assert_within(got, reference(q, kv_pages.float(), table, lens, hkv))
