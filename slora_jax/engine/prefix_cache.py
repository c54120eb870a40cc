"""Prefix cache: full KV pages of prompts, shared by reference count between sequences with the same adapter and the
same token prefix, so a shared system prompt is computed once.

A page is found by its key: (the key of the page before it, the adapter, the page's tokens). The key holds the
tokens themselves (a dict compares them), so two different prefixes never collide, and it holds the adapter, so a
page is never shared across adapters or with the base model (their K/V differ: LoRA on k/v changes them). Only full
pages of a prompt are cached and only after the prefill that writes them was dispatched (device work runs in order,
so any later step reads them written). A sequence always computes at least its last prompt token, whose logits it
needs, so a whole-prompt hit still runs one token.

Cached pages belong to the cache in the page allocator (owner ``PREFIX_OWNER``); a sequence holds references to the
ones it uses (``Sequence.shared_pages`` leading entries of ``kv_pages``) and owns the rest. Pages no sequence uses stay
cached and are evicted least-recently-used when the pool needs room; the oldest leaf goes first (a lookup touches a
chain from its end back to its root, so a parent is never older than its child). Sharing stops at full pages, so no
shared page is ever written: decode and prefill continuations write only the sequence's own pages.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, OrderedDict
from collections.abc import Hashable

from .page_allocator import KV, PageAllocator

PREFIX_OWNER = (KV, "prefix-cache")


@dataclasses.dataclass(eq=False)
class _Page:
    key: tuple
    page: int
    uid: int  # children refer to their parent by uid (page ids are reused after eviction, uids never)
    refs: int = 0
    dropped: bool = False  # its adapter was unregistered: freed when its last reference goes


class PrefixCache:
    """``retain=False``: a page is freed when its last reference goes instead of staying cached (the samples of one
    request share their prompt this way when prefix caching is off; see ``forks``)."""

    def __init__(self, allocator: PageAllocator, page_size: int, retain: bool = True):
        self.allocator, self.page_size, self.retain = allocator, page_size, retain
        self._by_key: dict[tuple, _Page] = {}
        self._by_page: dict[int, _Page] = {}
        self._unused: OrderedDict[int, _Page] = OrderedDict()  # refs == 0, least recently used first
        self._uids = itertools.count(1)
        self.counts: Counter[str] = Counter()  # hit_pages, miss_pages, inserted, evicted

    # ---------------------------------------------------------------- lookups
    def _keys(self, adapter: str | None, tokens: list[int], n_pages: int):
        """Walk the chain of cached pages for ``tokens``; yields the _Page of each hit, stops at the first miss."""
        parent, p = 0, self.page_size
        for i in range(n_pages):
            entry = self._by_key.get((parent, adapter, tuple(tokens[i * p:(i + 1) * p])))
            if entry is None:
                return
            yield entry
            parent = entry.uid

    def match(self, adapter: str | None, prompt_ids: list[int]) -> list[int]:
        """Take references on the longest cached prefix of ``prompt_ids``'s full pages (leaving at least one token
        to compute); returns their page ids, in order. Release them with :meth:`release`; once the sequence is
        admitted, :meth:`count` the match (an admission that is undone counts nothing)."""
        hits = list(self._keys(adapter, prompt_ids, self._matchable(prompt_ids)))
        for entry in reversed(hits):  # the chain's end becomes least recent: leaves are evicted before parents
            entry.refs += 1
            self._unused.pop(entry.uid, None)
        return [e.page for e in hits]

    def count(self, prompt_ids: list[int], n_hit: int) -> None:
        """Count an admitted sequence's match: ``n_hit`` pages shared, the rest of its matchable pages missed."""
        self.counts["hit_pages"] += n_hit
        self.counts["miss_pages"] += self._matchable(prompt_ids) - n_hit

    def _matchable(self, prompt_ids: list[int]) -> int:
        return (len(prompt_ids) - 1) // self.page_size

    def release(self, pages: list[int]) -> None:
        """Drop one reference on each page (a sequence finished, was aborted or preempted)."""
        for page in reversed(pages):
            entry = self._by_page[page]
            entry.refs -= 1
            if entry.refs == 0:
                if entry.dropped or not self.retain:
                    self._forget(entry)
                else:
                    self._unused[entry.uid] = entry

    def insert(self, adapter: str | None, prompt_ids: list[int], pages: list[int], n_shared: int,
               owner: Hashable) -> int:
        """After the prefill of a sequence holding ``pages`` (its first ``n_shared`` already cache references, the
        rest owned by ``owner``): hand its prompt's other full pages to the cache, keeping a reference for the
        sequence. Returns the sequence's new count of shared pages. A page whose key another sequence cached first
        stays the sequence's own (the chain stops there)."""
        n_full = min(len(prompt_ids) // self.page_size, len(pages))
        if n_full <= n_shared:
            return n_shared
        chain = list(self._keys(adapter, prompt_ids, n_shared))
        if len(chain) != n_shared or [e.page for e in chain] != pages[:n_shared]:
            return n_shared  # its prefix was dropped meanwhile (adapter unregistered): cache nothing after it
        parent = chain[-1].uid if chain else 0
        p, shared = self.page_size, n_shared
        for i in range(n_shared, n_full):
            key = (parent, adapter, tuple(prompt_ids[i * p:(i + 1) * p]))
            if key in self._by_key:
                break
            self.allocator.transfer([pages[i]], owner, PREFIX_OWNER)
            entry = _Page(key, pages[i], next(self._uids), refs=1)
            self._by_key[key], self._by_page[entry.page] = entry, entry
            self.counts["inserted"] += 1
            parent, shared = entry.uid, i + 1
        return shared

    # ---------------------------------------------------------------- room
    @property
    def num_pages(self) -> int:
        return len(self._by_page)

    @property
    def evictable_pages(self) -> int:
        """Cached pages no sequence uses: what :meth:`evict` could free."""
        return len(self._unused)

    def evict(self, n_pages: int) -> int:
        """Free up to ``n_pages`` unused cached pages, least recently used first; returns how many were freed."""
        freed = 0
        while freed < n_pages and self._unused:
            _, entry = self._unused.popitem(last=False)
            self._forget(entry)
            self.counts["evicted"] += 1
            freed += 1
        return freed

    def drop_adapter(self, adapter: str | None) -> None:
        """Forget every page of ``adapter`` (unregistered: a new adapter of that name must not hit them)."""
        for entry in [e for e in self._by_page.values() if e.key[1] == adapter]:
            self._by_key.pop(entry.key, None)
            entry.dropped = True
            if entry.refs == 0:
                self._unused.pop(entry.uid, None)
                self._forget(entry)

    def clear(self) -> None:
        """Free every unused page and forget every key (pages still referenced are freed on release)."""
        for adapter in {e.key[1] for e in self._by_page.values()}:
            self.drop_adapter(adapter)

    def _forget(self, entry: _Page) -> None:
        if self._by_key.get(entry.key) is entry:
            del self._by_key[entry.key]
        del self._by_page[entry.page]
        self.allocator.free([entry.page], owner=PREFIX_OWNER)

    def stats(self) -> dict[str, int]:
        return {"cached_pages": self.num_pages, "unused_pages": self.evictable_pages, **self.counts}
