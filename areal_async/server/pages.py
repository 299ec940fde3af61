"""KV-cache pages for the engine: who holds which page, and which pages hold a prompt another request may reuse.

Why a module of its own: the rules here (refcounts, a registry of prompt pages chained by serial, least recently
released eviction, forgetting at a weight swap) decide whether two requests may share KV, so a bug is silent wrong
output. They need no model to test, and the engine's scheduler reads better when it only says *when* to allocate,
share, register and release.

Pages are numbered 1..num_pages-1; page 0 is never handed out (padded page-table entries point at it).

Sharing (what SGLang's radix cache does, at page granularity): once a page of prompt tokens has its KV written,
its holder may register it under the key (the previous page's registration serial, the page's tokens); the first
page of a prompt chains from `ROOT`. Equal keys therefore mean equal prompts up to and including that page, and a
request about to prefill walks the chain from `ROOT` to find how many leading pages it can map. Serials are never
reused, so a key whose parent was evicted or forgotten can never match again. A registered page that nobody holds
stays registered (its KV is still good) until an allocation needs the space; those pages are evicted least recently
released first. `forget()` drops every registration at once (the weights changed, so the KV is stale); pages still
held stay with their holders, who may keep using their own KV (an in-place pause resumes on it).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

ROOT = -1  # the parent serial of a prompt's first page

PageKey = tuple[int, tuple[int, ...]]  # (parent registration serial, the page's tokens)


class OutOfPages(RuntimeError):
    """An allocation asked for more pages than are free or evictable."""


class PagePool:
    """Refcounted pages plus the prefix registry. Single-threaded: the engine thread owns it."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2 or page_size < 1:
            raise ValueError(
                f"need num_pages >= 2 (page 0 is reserved) and page_size >= 1, got {num_pages}, {page_size}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages
        self._registry: dict[PageKey, tuple[int, int]] = {}  # key -> (page, serial)
        self._keys: dict[int, PageKey] = {}  # registered page -> its key
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # unheld registered pages
        self._next_serial = 0

    # ---- counts ----

    @property
    def usable(self) -> int:
        return self.num_pages - 1

    @property
    def available(self) -> int:
        """Pages an allocation can get: free ones plus registered ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Registered pages that nobody holds (kept for later requests, evicted first when space runs short)."""
        return len(self._evictable)

    @property
    def num_registered(self) -> int:
        return len(self._registry)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def is_registered(self, page: int) -> bool:
        return page in self._keys

    # ---- holding pages ----

    def allocate(self, n: int) -> list[int]:
        """n pages with refcount 1, evicting unheld registered pages (least recently released first) if the free
        list is short. Raises `OutOfPages` (and changes nothing) when fewer than n are available."""
        if n > self.available:
            raise OutOfPages(f"asked for {n} pages, {self.available} available")
        while n > len(self._free):
            page, _ = self._evictable.popitem(last=False)
            del self._registry[self._keys.pop(page)]
            self._free.append(page)
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page. A page nobody holds any more goes back to the free list, or, while it
        is registered, to the end of the eviction order. Released in reverse, so the next allocation gets the
        first of them first."""
        for page in reversed(pages):
            refs = self._refs[page] - 1
            if refs < 0:
                raise RuntimeError(f"page {page} released more often than it was held")
            self._refs[page] = refs
            if refs == 0:
                if page in self._keys:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def share(self, page: int) -> None:
        """Take a reference to a registered page found by `match` (it stops being evictable)."""
        if page not in self._keys:
            raise RuntimeError(f"page {page} is not registered; only registered pages are shared")
        if self._refs[page] == 0:
            del self._evictable[page]
        self._refs[page] += 1

    # ---- the prefix registry ----

    def match(self, tokens: Sequence[int], max_pages: int) -> list[tuple[int, int]]:
        """The registered pages `tokens` begins with, as (page, serial), at most `max_pages`, following the chain
        from `ROOT`. Takes no references (see `share`)."""
        ps = self.page_size
        out: list[tuple[int, int]] = []
        parent = ROOT
        for i in range(min(max_pages, len(tokens) // ps)):
            hit = self._registry.get((parent, tuple(tokens[i * ps : (i + 1) * ps])))
            if hit is None:
                break
            out.append(hit)
            parent = hit[1]
        return out

    def register(self, parent: int, tokens: Sequence[int], page: int) -> int | None:
        """Register a held page whose KV for `tokens` (one full page) is written, chained after registration
        `parent` (`ROOT` for a prompt's first page). Returns its serial, or None when the same key is already
        registered (another request got there first: the caller keeps its own page unshared)."""
        if len(tokens) != self.page_size:
            raise ValueError(f"a registered page holds exactly {self.page_size} tokens, got {len(tokens)}")
        if self._refs[page] <= 0:
            raise RuntimeError(f"page {page} is not held; only a holder may register it")
        if page in self._keys:
            raise RuntimeError(f"page {page} is already registered")
        key = (parent, tuple(tokens))
        if key in self._registry:
            return None
        serial = self._next_serial
        self._next_serial += 1
        self._registry[key] = (page, serial)
        self._keys[page] = key
        return serial

    def forget(self) -> None:
        """Drop every registration (the weights changed). Unheld cached pages become free; held pages stay with
        their holders as private pages, freed when released."""
        self._registry.clear()
        self._keys.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
