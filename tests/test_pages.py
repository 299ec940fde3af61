"""The KV page pool and the prompt-page registry on their own (no model): allocation, refcounts, registration
chained by serial, least-recently-released eviction of unheld registered pages, forgetting at a weight swap."""

from __future__ import annotations

import pytest

from areal_async.server.pages import ROOT, OutOfPages, PagePool

PS = 4


def toks(start: int) -> list[int]:
    return list(range(start, start + PS))


def test_allocation_hands_out_low_pages_and_never_page_zero():
    pool = PagePool(6, PS)
    assert pool.usable == 5 and pool.available == 5
    a = pool.allocate(2)
    assert a == [1, 2] and [pool.refcount(p) for p in a] == [1, 1]
    b = pool.allocate(3)
    assert b == [3, 4, 5] and pool.available == 0
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    pool.release(a)
    assert pool.available == 2 and pool.refcount(1) == 0
    assert pool.allocate(2) == [1, 2]  # released pages come back first-first
    with pytest.raises(ValueError, match="page 0 is reserved"):
        PagePool(1, PS)


def test_over_release_is_an_error_not_a_silent_double_free():
    pool = PagePool(4, PS)
    (p,) = pool.allocate(1)
    pool.release([p])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([p])
    assert pool.available == 3


def test_registration_chains_by_serial():
    pool = PagePool(10, PS)
    prompt = toks(0) + toks(10) + toks(20)
    pages = pool.allocate(3)
    s0 = pool.register(ROOT, prompt[:PS], pages[0])
    s1 = pool.register(s0, prompt[PS : 2 * PS], pages[1])
    assert s0 is not None and s1 is not None and s1 != s0
    # the whole registered chain matches, and only up to max_pages
    assert pool.match(prompt, 5) == [(pages[0], s0), (pages[1], s1)]
    assert pool.match(prompt, 1) == [(pages[0], s0)]
    # the same second-page tokens after a different first page do not match: keys chain through the parent
    assert pool.match(toks(99) + toks(10), 5) == []
    # a first page that differs in one token matches nothing; a prefix shorter than a page matches nothing
    assert pool.match([0, 1, 2, 9] + toks(10), 5) == []
    assert pool.match(prompt[: PS - 1], 5) == []
    # a second registration of the same key is refused (the first holder's page stays the shared one)
    other = pool.allocate(1)
    assert pool.register(ROOT, prompt[:PS], other[0]) is None
    assert pool.match(prompt, 1) == [(pages[0], s0)]
    with pytest.raises(ValueError, match="exactly"):
        pool.register(ROOT, [1, 2], other[0])
    with pytest.raises(RuntimeError, match="already registered"):
        pool.register(s1, toks(50), pages[0])


def test_shared_pages_are_refcounted_and_cached_after_the_last_holder():
    pool = PagePool(6, PS)
    (p,) = pool.allocate(1)
    serial = pool.register(ROOT, toks(0), p)
    ((hit, s),) = pool.match(toks(0), 1)
    assert (hit, s) == (p, serial)
    pool.share(hit)
    assert pool.refcount(p) == 2
    pool.release([p])
    assert pool.refcount(p) == 1 and pool.num_cached == 0
    pool.release([p])
    # nobody holds it, but it stays registered and counts as available (evictable)
    assert pool.refcount(p) == 0 and pool.num_cached == 1 and pool.num_free == 4 and pool.available == 5
    assert pool.match(toks(0), 1) == [(p, serial)]
    pool.share(p)  # mapping a cached page takes it out of the eviction order
    assert pool.num_cached == 0 and pool.refcount(p) == 1
    (q,) = pool.allocate(1)
    with pytest.raises(RuntimeError, match="not registered"):
        pool.share(q)


def test_eviction_takes_least_recently_released_unheld_pages_only():
    pool = PagePool(5, PS)  # 4 usable pages
    pages = pool.allocate(4)
    serials = [pool.register(ROOT, toks(10 * i), p) for i, p in enumerate(pages)]
    # release in the order 3, 1, 2; page 0 stays held
    for i in (3, 1, 2):
        pool.release([pages[i]])
    assert pool.num_free == 0 and pool.num_cached == 3
    got = pool.allocate(2)  # evicts the two released longest ago: pages[3], then pages[1]
    assert sorted(got) == sorted([pages[3], pages[1]])
    assert pool.match(toks(30), 1) == [] and pool.match(toks(10), 1) == []
    assert pool.match(toks(20), 1) == [(pages[2], serials[2])]  # the most recently released survives
    assert pool.match(toks(0), 1) == [(pages[0], serials[0])]  # held pages are never evicted
    with pytest.raises(OutOfPages):
        pool.allocate(2)  # one evictable page left, the held one cannot go
    assert pool.num_registered == 2  # a refused allocation evicted nothing


def test_evicting_a_parent_orphans_its_children():
    """Serials are never reused: once a first page is evicted, its registered second page can never match again,
    even after the same first-page tokens are registered anew."""
    pool = PagePool(4, PS)  # 3 usable
    a, b = pool.allocate(2)
    s0 = pool.register(ROOT, toks(0), a)
    pool.register(s0, toks(10), b)
    pool.release([a])
    pool.release([b])  # a released first: a is evicted first, b stays cached under the gone serial
    got = pool.allocate(2)  # the one free page and the evicted a
    assert a in got and b not in got and pool.num_cached == 1
    fresh = got[0]
    s0_new = pool.register(ROOT, toks(0), fresh)
    assert s0_new is not None and s0_new != s0
    assert pool.match(toks(0) + toks(10), 2) == [(fresh, s0_new)]  # b's key names the old serial: no match


def test_forget_drops_every_registration_and_frees_cached_pages():
    pool = PagePool(6, PS)
    held, cached = pool.allocate(2)
    pool.register(ROOT, toks(0), held)
    pool.register(ROOT, toks(10), cached)
    pool.release([cached])
    assert pool.num_cached == 1
    pool.forget()
    assert pool.num_registered == 0 and pool.num_cached == 0 and pool.num_free == 4
    assert pool.match(toks(0), 1) == [] and pool.match(toks(10), 1) == []
    # the held page stays with its holder, now private: released, it goes straight back to the free list
    assert pool.refcount(held) == 1 and not pool.is_registered(held)
    pool.release([held])
    assert pool.num_free == 5 and pool.num_cached == 0
    # registering again after a forget starts a fresh chain with new serials
    (p,) = pool.allocate(1)
    s = pool.register(ROOT, toks(0), p)
    assert s is not None and pool.match(toks(0), 1) == [(p, s)]
