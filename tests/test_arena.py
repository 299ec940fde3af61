"""The CPU engine's weights and KV cache: one zero-filled buffer, every tensor cache-line aligned, backed by huge
pages where the kernel allows them, and a weight load writes into that same memory."""

from __future__ import annotations

import pytest
import torch

from areal_async.host.memory import HUGE_PAGE, advise_huge_pages
from areal_async.server import arena


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def _huge_kib_over(lo: int, hi: int) -> int:
    """AnonHugePages (KiB) of this process's mappings that overlap [lo, hi)."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                overlaps = a < hi and lo < b
            elif head == "AnonHugePages:" and overlaps:
                total += int(line.split()[1])
    return total


def test_tensors_share_one_aligned_zeroed_buffer():
    shapes = [(3, 5), (7,), (960, 576), (1,), (1536, 576)]
    for dtype in (torch.float32, torch.bfloat16):
        ts = arena.zeros(shapes, torch.device("cpu"), dtype)
        assert [tuple(t.shape) for t in ts] == shapes and all(t.dtype == dtype for t in ts)
        assert all(t.data_ptr() % 64 == 0 and t.is_contiguous() for t in ts)
        assert len({t.untyped_storage().data_ptr() for t in ts}) == 1
        assert ts[0].untyped_storage().data_ptr() <= ts[0].data_ptr()
        assert all(float(t.abs().sum()) == 0 for t in ts)
        for t in ts:  # no tensor overlaps the next: each write stays in its own tensor
            t.fill_(1)
        assert sum(int(t.sum()) for t in ts) == sum(t.numel() for t in ts)


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_weights_get_huge_pages_and_a_load_keeps_them():
    shapes = [(4096, 1024)] * 4  # 64 MiB in fp32
    ts = arena.zeros(shapes, torch.device("cpu"), torch.float32)
    lo, hi = ts[0].data_ptr(), ts[-1].data_ptr() + ts[-1].numel() * 4
    assert lo % HUGE_PAGE == 0
    before = _huge_kib_over(lo, hi)
    assert before >= 32 * 1024, before  # at least half of it, whatever the kernel's khugepaged state
    ptrs = [t.data_ptr() for t in ts]
    for t in ts:
        t.copy_(torch.randn(t.shape))  # what a weight load or update does
    assert [t.data_ptr() for t in ts] == ptrs and _huge_kib_over(lo, hi) >= before


def test_advise_refuses_what_holds_no_whole_huge_page():
    assert advise_huge_pages(HUGE_PAGE + 1, HUGE_PAGE) == 0  # the aligned interior is empty
    assert advise_huge_pages(0, 0) == 0


def test_model_weights_live_in_the_buffer(tiny_ckpt):
    from areal_async.server.model import DecoderModel
    from areal_async.server.weights import load_checkpoint

    spec, tensors = load_checkpoint(tiny_ckpt)
    model = DecoderModel(spec, "cpu", torch.float32)
    ptrs = {n: t.data_ptr() for n, t in model.params.items()}
    model.load_tensors(tensors)
    assert len({t.untyped_storage().data_ptr() for t in model.params.values()}) == 1
    assert {n: t.data_ptr() for n, t in model.params.items()} == ptrs  # loaded in place
    assert all(torch.equal(model.params[n], t.to(model.params[n].dtype)) for n, t in tensors.items() if n in ptrs)


def test_kv_cache_is_in_huge_pages_when_large(tiny_ckpt):
    from areal_async.server.model import KVCache
    from areal_async.server.weights import read_spec

    spec = read_spec(tiny_ckpt)  # [layers, pages, 16, 2 * kv_heads, head_dim] per cache
    cache = KVCache(spec, max_tokens=65536, page_size=16, device=torch.device("cpu"), dtype=torch.float32)
    assert cache.kv.data_ptr() % HUGE_PAGE == 0 and float(cache.kv.abs().sum()) == 0
    if _thp_mode() in ("always", "madvise"):
        nbytes = cache.kv.numel() * 4
        assert nbytes >= 8 * HUGE_PAGE, nbytes
        assert _huge_kib_over(cache.kv.data_ptr(), cache.kv.data_ptr() + nbytes) >= nbytes // 2048
