"""Free-list allocator for the pages of the unified pool (KV cache and adapter weights share it).

Pages are plain ints; the allocator never touches device memory. A free list keeps alloc/free O(1) per page and
makes fragmentation impossible (any free page serves any request). Every page remembers its owner so that double
frees, frees of pages we never handed out and frees by the wrong owner fail loudly instead of corrupting the pool.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable

KV = "kv"
ADAPTER = "adapter"
KINDS: tuple[str, ...] = (KV, ADAPTER)

# An owner is either a bare kind ("kv" / "adapter") or (kind, id), e.g. ("kv", request_id) or ("adapter", name).
Owner = str | tuple[str, Hashable]


class PageAllocatorError(RuntimeError):
    """Base class: misuse or exhaustion of the page allocator."""


class OutOfPages(PageAllocatorError):
    """Not enough free pages; nothing was allocated."""


class DoubleFree(PageAllocatorError):
    """A page was freed that is already free (or twice in one call)."""


class ForeignPage(PageAllocatorError):
    """A page id this allocator never handed out (out of range) or owned by someone other than the caller."""


def owner_kind(owner: Owner) -> str:
    """The accounting kind of an owner; rejects owners that fit neither kind so the books always balance."""
    kind = owner if isinstance(owner, str) else (owner[0] if isinstance(owner, tuple) and owner else None)
    if kind not in KINDS:
        raise ValueError(f"owner must be one of {KINDS} or a (kind, id) tuple, got {owner!r}")
    return kind


class PageAllocator:
    """Hands out page ids ``0 .. num_pages-1`` to KV sequences and adapters from one free list."""

    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = int(num_pages)
        # Stack of free pages; reversed so a fresh allocator hands out 0, 1, 2, ... first.
        self._free: list[int] = list(range(self._num_pages - 1, -1, -1))
        self._owner: list[Owner | None] = [None] * self._num_pages
        self._kind_count: dict[str, int] = {k: 0 for k in KINDS}

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return self._num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def count(self, kind: str) -> int:
        """Pages currently held by owners of ``kind``."""
        return self._kind_count[kind]

    def counts(self) -> dict[str, int]:
        """Pages per kind plus ``free``; the values always sum to ``num_pages``."""
        return {**self._kind_count, "free": len(self._free)}

    def owner_of(self, page: int) -> Owner | None:
        """The owner of an allocated page, None if it is free."""
        return self._owner[self._check_range(page)]

    def alloc(self, n: int, owner: Owner) -> list[int]:
        """Take ``n`` pages for ``owner``; all or nothing (raises :class:`OutOfPages` and changes nothing)."""
        kind = owner_kind(owner)
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise OutOfPages(
                f"need {n} pages for {owner!r} but only {len(self._free)} of {self._num_pages} are free "
                f"(kv={self._kind_count[KV]}, adapter={self._kind_count[ADAPTER]})"
            )
        if n == 0:
            return []
        cut = len(self._free) - n
        pages = self._free[cut:][::-1]
        del self._free[cut:]
        for p in pages:
            self._owner[p] = owner
        self._kind_count[kind] += n
        return pages

    def free(self, pages: Iterable[int], owner: Owner | None = None) -> None:
        """Return pages to the free list; validates every page first so a bad call changes nothing.

        With ``owner`` given, every page must belong to exactly that owner.
        """
        pages = [self._check_range(p) for p in pages]
        seen: set[int] = set()
        for p in pages:
            current = self._owner[p]
            if current is None or p in seen:
                raise DoubleFree(f"page {p} is already free")
            if owner is not None and current != owner:
                raise ForeignPage(f"page {p} belongs to {current!r}, not {owner!r}")
            seen.add(p)
        for p in pages:
            self._kind_count[owner_kind(self._owner[p])] -= 1
            self._owner[p] = None
            self._free.append(p)

    def transfer(self, pages: Iterable[int], owner: Owner, new_owner: Owner) -> None:
        """Hand pages from ``owner`` to ``new_owner`` (same kind: the books of kinds stay as they are), e.g. a
        sequence's prompt pages to the prefix cache; validates every page first so a bad call changes nothing."""
        if owner_kind(owner) != owner_kind(new_owner):
            raise ValueError(f"cannot transfer pages between kinds ({owner!r} -> {new_owner!r})")
        pages = [self._check_range(p) for p in pages]
        for p in pages:
            if self._owner[p] != owner:
                raise ForeignPage(f"page {p} belongs to {self._owner[p]!r}, not {owner!r}")
        for p in pages:
            self._owner[p] = new_owner

    def check_invariants(self) -> None:
        """O(num_pages) self-check for tests and debugging: books balance, free list and owners agree."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        owned = {p for p, o in enumerate(self._owner) if o is not None}
        assert not (free & owned), "a page is both free and owned"
        assert len(free) + len(owned) == self._num_pages, "a page is neither free nor owned (leak)"
        for kind in KINDS:
            n = sum(1 for o in self._owner if o is not None and owner_kind(o) == kind)
            assert n == self._kind_count[kind], f"{kind} count {self._kind_count[kind]} != {n} owned pages"

    def _check_range(self, page: int) -> int:
        try:
            p = operator.index(page)
        except TypeError as e:
            raise ForeignPage(f"page id must be an int, got {page!r}") from e
        if not 0 <= p < self._num_pages:
            raise ForeignPage(f"page {p} is not a page of this allocator (0..{self._num_pages - 1})")
        return p
