"""The prefix cache: shared prompt pages by reference count, keyed by adapter; output identical with and without it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.page_allocator import PageAllocator
from slora_jax.engine.prefix_cache import PREFIX_OWNER, PrefixCache
from slora_jax.engine.sampling import SamplingParams

P = 4  # tokens per page in these tests


def _cache(num_pages=64):
    alloc = PageAllocator(num_pages)
    return alloc, PrefixCache(alloc, P)


def _prefill(alloc, cache, adapter, prompt, owner):
    """What admission + a prefill do: match, take own pages for the rest, insert the prompt's full pages."""
    shared = cache.match(adapter, prompt)
    own = alloc.alloc(-(-len(prompt) // P) - len(shared), ("kv", owner))
    pages = shared + own
    return pages, cache.insert(adapter, prompt, pages, len(shared), ("kv", owner))


def test_shares_full_pages_of_the_same_prefix_and_adapter_only():
    rng = np.random.default_rng()
    alloc, cache = _cache()
    prefix = [int(t) for t in rng.integers(0, 500, size=3 * P)]
    a1, n1 = _prefill(alloc, cache, "a", prefix + [7, 8], "r1")
    assert n1 == 3 and all(alloc.owner_of(p) == PREFIX_OWNER for p in a1[:3]) and alloc.owner_of(a1[3]) == ("kv", "r1")
    a2 = cache.match("a", prefix + [9, 9, 9])
    assert a2 == a1[:3]  # the same adapter and prefix: the same pages
    assert cache.match("b", prefix + [9]) == []  # another adapter never shares
    assert cache.match(None, prefix + [9]) == []  # nor the base model
    assert cache.match("a", prefix[:P] + [1] + prefix[P + 1:] + [9]) == a1[:1]  # a changed token ends the chain
    assert cache.match("a", prefix) == a1[:2]  # a whole-prompt hit leaves its last token (page) to compute
    alloc.check_invariants()


def test_unused_pages_are_evicted_least_recent_first_leaves_before_parents():
    rng = np.random.default_rng()
    alloc, cache = _cache()
    old = [int(t) for t in rng.integers(0, 500, size=2 * P)]
    new = [int(t) for t in rng.integers(0, 500, size=2 * P)]
    p_old, _ = _prefill(alloc, cache, "a", old + [1], "r1")
    p_new, _ = _prefill(alloc, cache, "a", new + [1], "r2")
    held = cache.match("a", new + [2])  # in use: never evicted
    alloc.free(p_old[2:], ("kv", "r1"))
    alloc.free(p_new[2:], ("kv", "r2"))
    cache.release(p_old[:2])
    cache.release(p_new[:2])
    assert cache.evictable_pages == 2  # old's two pages; new's are still held once
    assert cache.evict(1) == 1 and cache.match("a", old + [3]) == p_old[:1]  # the leaf went first
    cache.release(p_old[:1])
    assert cache.evict(10) == 1 and cache.match("a", old + [3]) == []
    cache.release(held)
    assert cache.evict(10) == 2 and cache.num_pages == 0
    alloc.check_invariants()
    assert alloc.num_free == alloc.num_pages


def test_dropped_adapter_pages_are_never_hit_again_and_freed_on_release():
    alloc, cache = _cache()
    prompt = list(range(2 * P + 1))
    pages, _ = _prefill(alloc, cache, "a", prompt, "r1")
    cache.drop_adapter("a")
    assert cache.match("a", prompt) == []
    assert cache.num_pages == 2  # still referenced by r1
    cache.release(pages[:2])
    alloc.free(pages[2:], ("kv", "r1"))
    assert cache.num_pages == 0 and alloc.num_free == alloc.num_pages


BASE = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=2, max_model_len=64, page_size=P,
                    max_lora_rank=32, max_loras=3, num_pages=96, dtype="float32", backend="reference",
                    decode_lora_variants=False)


@pytest.fixture(scope="module")
def engines(tiny_dir, adapter_dirs):
    used = {k: adapter_dirs[k] for k in ("r4-qkvo", "r8-all7", "patterns", "r32-qv")}
    out = {}
    # "tight": 56 pages for adapters of 7 + 32 + 19 pages and KV of ~9 pages a request: cached prefixes and
    # adapters are evicted to make room
    for name, ecfg in (("off", BASE), ("on", dataclasses.replace(BASE, prefix_cache=True)),
                       ("tight", dataclasses.replace(BASE, prefix_cache=True, num_pages=56))):
        eng = Engine.from_model_dir(tiny_dir, ecfg, adapters=used, progress=False)
        eng.warmup(progress=False)
        out[name] = eng
    return out


def _run(engine, plan):
    """``plan``: (step to add it at, adapter, prompt, max_tokens). Returns each request's tokens, in plan order."""
    ids, done, step, plan = [], {}, 0, list(plan)
    while plan or engine.has_unfinished():
        while plan and plan[0][0] <= step:
            _, adapter, prompt, n = plan.pop(0)
            sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            ids.append(engine.add_request(prompt, adapter, sp))
        for out in engine.step():
            assert out.error is None, out.error
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return [done[i] for i in ids]


def test_engine_output_is_identical_with_and_without_the_cache(engines):
    rng = np.random.default_rng()
    vocab = engines["off"].cfg.vocab_size
    system = [int(t) for t in rng.integers(3, vocab, size=3 * P + 2)]  # a shared system prompt of 3.5 pages
    adapters = ["r4-qkvo", None, "r8-all7", "r4-qkvo", None, "patterns", "r4-qkvo", "r8-all7", None, "r4-qkvo"]
    plan = [(2 * i, a, system + [int(t) for t in rng.integers(3, vocab, size=int(rng.integers(1, 9)))],
             int(rng.integers(28, 42))) for i, a in enumerate(adapters)]
    plan.append((21, "r4-qkvo", list(system), 5))  # the whole system prompt as the prompt: its last page recomputed
    want = _run(engines["off"], plan)
    for name in ("on", "tight"):
        eng = engines[name]
        compiles = eng.compiles_since_warmup()
        hits0 = eng.stats()["prefix_cache"].get("hit_pages", 0)
        preempt0, evict0 = eng.stats()["preemptions"], eng.stats()["prefix_cache"].get("evicted", 0)
        assert _run(eng, plan) == want, name
        stats = eng.stats()
        assert stats["prefix_cache"]["hit_pages"] > hits0, "later requests should have hit the cached system prompt"
        assert eng.compiles_since_warmup() == compiles
        if name == "tight":  # a pool this small forces cached prefixes out and preempts growing sequences
            assert stats["prefix_cache"]["evicted"] > evict0 and stats["preemptions"] > preempt0
        eng.pool.allocator.check_invariants()
        assert stats["pool"]["pages_kv"] == eng.scheduler.prefix_cache.num_pages  # only the cache holds KV now


def test_unregistered_adapter_never_hits_its_old_pages(engines, adapter_dirs):
    eng = engines["on"]
    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(3, eng.cfg.vocab_size, size=3 * P + 1)]
    _run(eng, [(0, "r32-qv", prompt, 2)])
    eng.unregister_adapter("r32-qv")
    eng.register_adapter("r32-qv", adapter_dirs["r8-all7"])  # a different adapter under the old name
    hits0 = eng.stats()["prefix_cache"]["hit_pages"]
    ours = _run(eng, [(0, "r32-qv", prompt, 6)])
    assert eng.stats()["prefix_cache"]["hit_pages"] == hits0
    assert ours == _run(engines["off"], [(0, "r8-all7", prompt, 6)])


def test_cached_prefixes_give_way_to_an_adapter_load(tiny_dir, adapter_dirs):
    """Pages that only unused cached prefixes hold are evicted for an adapter that needs them. Admission counted them
    as obtainable, but the store makes room from free pages and unpinned adapters only, so the request once waited
    forever in an idle engine."""
    rng = np.random.default_rng()
    eng = Engine.from_model_dir(tiny_dir, dataclasses.replace(BASE, prefix_cache=True, num_pages=48),
                                adapters={"r8-all7": adapter_dirs["r8-all7"]}, progress=False)
    need = eng.store.pages_needed_to_load("r8-all7")
    vocab = eng.cfg.vocab_size
    # three base-model prompts of 11 full pages (+1 token) each: 33 pages stay cached after they finish
    _run(eng, [(0, None, [int(t) for t in rng.integers(3, vocab, size=11 * P + 1)], 1) for _ in range(3)])
    assert eng.pool.num_free_pages + eng.store.evictable_pages() < need <= eng.scheduler.obtainable_pages()
    prompt = [int(t) for t in rng.integers(3, vocab, size=5)]
    steps = 0
    rid = eng.add_request(prompt, "r8-all7", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished() and steps < 50:
        for out in eng.step():
            assert out.error is None, out.error
        steps += 1
    assert eng.requests[rid].finish_reason == "length"
    assert eng.stats()["prefix_cache"]["evicted"] > 0
    eng.pool.allocator.check_invariants()
