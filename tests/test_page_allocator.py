"""PageAllocator: random alloc/free sequences keep the books exact; misuse fails loudly and changes nothing."""

from __future__ import annotations

import copy
import random

import pytest

from slora_jax.engine.page_allocator import (
    ADAPTER,
    KV,
    DoubleFree,
    ForeignPage,
    OutOfPages,
    PageAllocator,
    owner_kind,
)


def _snapshot(alloc: PageAllocator):
    return alloc.counts(), [alloc.owner_of(p) for p in range(alloc.num_pages)]


def _check_against_model(alloc: PageAllocator, held: dict) -> None:
    """``held`` maps owner -> pages we believe it holds; the allocator must agree exactly."""
    alloc.check_invariants()
    all_held = [p for pages in held.values() for p in pages]
    assert len(all_held) == len(set(all_held)), "one page handed to two owners"
    assert alloc.num_free + len(all_held) == alloc.num_pages, "leak: free + allocated != total"
    for owner, pages in held.items():
        for p in pages:
            assert alloc.owner_of(p) == owner
    for kind in (KV, ADAPTER):
        assert alloc.count(kind) == sum(len(v) for o, v in held.items() if owner_kind(o) == kind)
    assert sum(alloc.counts().values()) == alloc.num_pages


@pytest.mark.parametrize("seed", range(8))
def test_random_alloc_free_sequences(seed):
    rng = random.Random(seed)
    num_pages = rng.choice([1, 7, 64, 257])
    alloc = PageAllocator(num_pages)
    held: dict = {}
    ever_freed: set[int] = set()
    next_id = 0
    for _ in range(600):
        if held and rng.random() < 0.45:
            owner = rng.choice(list(held))
            pages = held[owner]
            if rng.random() < 0.5:
                alloc.free(pages, owner if rng.random() < 0.5 else None)
                ever_freed.update(pages)
                del held[owner]
            else:
                k = rng.randint(1, len(pages))
                part = rng.sample(pages, k)
                alloc.free(part)
                ever_freed.update(part)
                held[owner] = [p for p in pages if p not in set(part)]
                if not held[owner]:
                    del held[owner]
        else:
            n = rng.randint(0, max(1, num_pages // 3))
            kind = rng.choice((KV, ADAPTER))
            owner = (kind, next_id) if rng.random() < 0.8 else kind
            next_id += 1
            if owner in held:
                continue
            if alloc.can_alloc(n):
                pages = alloc.alloc(n, owner)
                assert len(pages) == n
                if pages:
                    held[owner] = pages
            else:
                before = _snapshot(alloc)
                with pytest.raises(OutOfPages):
                    alloc.alloc(n, owner)
                assert _snapshot(alloc) == before
        _check_against_model(alloc, held)

    # Every page, freed at some point or never used, is reusable once everything is returned.
    for owner, pages in held.items():
        alloc.free(pages, owner)
    assert alloc.num_free == num_pages
    assert sorted(alloc.alloc(num_pages, KV)) == list(range(num_pages))
    assert ever_freed <= set(range(num_pages))


def test_out_of_pages_changes_nothing():
    alloc = PageAllocator(10)
    alloc.alloc(4, (KV, "a"))
    alloc.alloc(3, (ADAPTER, "x"))
    twin = copy.deepcopy(alloc)
    with pytest.raises(OutOfPages, match="need 4 pages"):
        alloc.alloc(4, (KV, "b"))
    assert alloc.counts() == {KV: 4, ADAPTER: 3, "free": 3}
    # The free list itself is untouched: both hand out the same pages in the same order.
    assert alloc.alloc(3, KV) == twin.alloc(3, KV)


def test_fresh_allocator_is_in_order_and_freed_pages_come_back():
    alloc = PageAllocator(6)
    assert alloc.alloc(3, KV) == [0, 1, 2]
    alloc.free([1])
    assert alloc.alloc(1, ADAPTER) == [1]
    assert alloc.alloc(0, KV) == []
    assert alloc.counts() == {KV: 2, ADAPTER: 1, "free": 3}


def test_double_free_and_foreign_pages_are_errors_and_change_nothing():
    alloc = PageAllocator(8)
    a = alloc.alloc(3, (KV, 1))
    b = alloc.alloc(2, (ADAPTER, "x"))
    alloc.free([a[0]])
    before = _snapshot(alloc)
    with pytest.raises(DoubleFree):
        alloc.free([a[0]])
    with pytest.raises(DoubleFree):
        alloc.free([a[1], a[1]])
    with pytest.raises(DoubleFree):
        alloc.free([a[1], 7])  # 7 was never allocated; a[1] must stay allocated
    with pytest.raises(ForeignPage):
        alloc.free([a[1], 8])
    with pytest.raises(ForeignPage):
        alloc.free([-1])
    with pytest.raises(ForeignPage):
        alloc.free(["3"])
    with pytest.raises(ForeignPage, match="belongs to"):
        alloc.free(b, (KV, 1))
    assert _snapshot(alloc) == before
    alloc.free(b, (ADAPTER, "x"))
    alloc.check_invariants()


def test_bad_owner_and_counts_rejected():
    alloc = PageAllocator(4)
    for bad in ("weights", ("cache", 1), (), None):
        with pytest.raises(ValueError):
            alloc.alloc(1, bad)
    with pytest.raises(ValueError):
        alloc.alloc(-1, KV)
    assert not alloc.can_alloc(5) and not alloc.can_alloc(-1) and alloc.can_alloc(4)
    assert alloc.num_free == 4


def test_large_pool_is_fast_enough():
    """Per-page cost is O(1): a big pool churns without quadratic blow-up."""
    alloc = PageAllocator(200_000)
    chunks = [alloc.alloc(1000, (KV, i)) for i in range(200)]
    assert alloc.num_free == 0
    for i, pages in enumerate(chunks[::2]):
        alloc.free(pages, (KV, 2 * i))
    assert alloc.num_free == 100_000
    assert len(alloc.alloc(100_000, ADAPTER)) == 100_000
