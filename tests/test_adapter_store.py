"""AdapterStore, the pool tier: exact placement of every source kind, pinning, eviction order (LRU and a custom
policy), room, prefetch (reads, staged loads) and warmup. The host tier has tests/test_host_tier.py.

Small fp32 pools (few slots / pages) so eviction happens; every resident adapter is read back from the pool through
the DESIGN.md addressing and compared with the original weights.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from store_helpers import (
    MAX_RANK,
    QKVO,
    GatedSource,
    assert_holds,
    random_adapter,
    record_stage_threads,
    seed_of,
    wait_host,
    wait_stagings,
)

from pallas_kernels.lora_common import gather_lora_a, gather_lora_b, lora_scale
from slora_jax.engine import compile_counter
from slora_jax.engine.adapter_store import AdapterInUse, EvictionPolicy, NoRoom
from slora_jax.lora.peft import load_peft_adapter
from slora_jax.lora.synthetic import SyntheticAdapterSource, synthetic_adapter
from slora_jax.model.config import MODULES, ModelConfig
from slora_jax.tools import synth

# ---- sources and exact placement -------------------------------------------------------------------------------------


def test_every_source_kind_lands_exactly_in_the_pool(make_store, tiny_cfg, tmp_path, rng):
    store = make_store(num_pages=128, max_slots=4)
    a_dir = synth.write_adapter(tmp_path / "a", tiny_cfg, rank=8, targets=QKVO, use_rslora=True, seed=seed_of(rng))
    b_dir = synth.write_adapter(tmp_path / "b", tiny_cfg, rank=4, alpha=6.0, seed=seed_of(rng),
                                targets=("q_proj", "gate_proj", "up_proj", "down_proj"), layers_to_transform=[1],
                                rank_pattern={"down_proj": 16}, alpha_pattern={"gate_proj": 3.0})
    mem = random_adapter(tiny_cfg, rng, "mem-original-name", ranks=(1, 4, 16), targets=MODULES, p_absent=0.4)
    store.register("a", a_dir)
    store.register("b", str(b_dir))
    store.register("mem", mem)
    syn = SyntheticAdapterSource(tiny_cfg, 4, ("q_proj", "v_proj", "gate_proj"), seed=seed_of(rng))
    store.register("syn", syn)
    want = {"a": load_peft_adapter(a_dir, tiny_cfg), "b": load_peft_adapter(b_dir, tiny_cfg), "mem": mem,
            "syn": syn.adapter("syn")}
    assert sorted(store.names()) == sorted(want) and "a" in store and "zzz" not in store

    slots = {name: store.acquire(name) for name in want}
    assert sorted(slots.values()) == [0, 1, 2, 3]
    for name, adapter in want.items():  # after all loads: no load overwrote another adapter
        assert_holds(store, name, adapter)

    # The kernels' own gathers read the same weights for all four slots at once.
    @jax.jit
    def gather_all(array, table, slot_ids):
        return {(layer, m): (gather_lora_a(array, table, layer, slot_ids, m, tiny_cfg.module_dims(mod)[0], MAX_RANK),
                             gather_lora_b(array, table, layer, slot_ids, m, tiny_cfg.module_dims(mod)[1], MAX_RANK),
                             lora_scale(table, layer, slot_ids, m))
                for layer in range(tiny_cfg.num_hidden_layers) for m, mod in enumerate(MODULES)}

    gathered = gather_all(store.pool.array, store.pool.table, jnp.asarray([slots[n] for n in want], jnp.int32))
    for layer in range(tiny_cfg.num_hidden_layers):
        for m, mod in enumerate(MODULES):
            got_a, got_b, got_s = (np.asarray(x) for x in gathered[(layer, m)])
            for t, adapter in enumerate(want.values()):
                lm = adapter.modules.get((layer, mod))
                r = lm.rank if lm else 0
                np.testing.assert_array_equal(got_a[t, :, :r], lm.a if lm else got_a[t, :, :0])
                np.testing.assert_array_equal(got_b[t, :r], lm.b if lm else got_b[t, :0])
                assert not got_a[t, :, r:].any() and not got_b[t, r:].any()
                assert got_s[t] == (np.float32(lm.scale) if lm else 0)

    s = store.stats()
    assert (s["resident"], s["pinned"], s["misses"], s["loads"], s["hits"]) == (4, 4, 4, 4, 0)
    assert store.acquire("a") == slots["a"] and store.pin_count("a") == 2 and store.stats()["hits"] == 1


def test_synthetic_adapters_are_distinct_deterministic_and_fast(tiny_cfg):
    one = synthetic_adapter(tiny_cfg, "x", rank=8, targets=MODULES, seed=1)
    again = synthetic_adapter(tiny_cfg, "x", rank=8, targets=MODULES, seed=1)
    other = synthetic_adapter(tiny_cfg, "y", rank=8, targets=MODULES, seed=2)
    assert set(one.modules) == {(layer, m) for layer in range(tiny_cfg.num_hidden_layers) for m in MODULES}
    for key, mod in one.modules.items():
        assert mod.a.shape == (tiny_cfg.module_dims(key[1])[0], 8) and np.isfinite(mod.a).all()
        np.testing.assert_array_equal(mod.a, again.modules[key].a)
        np.testing.assert_array_equal(mod.b, again.modules[key].b)
        assert not np.array_equal(mod.b, other.modules[key].b)
    assert not np.array_equal(one.modules[(0, "q_proj")].a, one.modules[(1, "q_proj")].a)  # layers differ too

    # Llama-2-7B shapes, bf16 host rows: rank 64 on q,k,v,o (128 MiB per adapter) well under 50 ms each.
    cfg7b = ModelConfig.from_dict(synth.preset_config("llama-2-7b"))
    bf16 = np.dtype(ml_dtypes.bfloat16)
    SyntheticAdapterSource(cfg7b, 64, seed=0).load_rows("warm", cfg7b, 64, bf16)  # the shared bank, once
    times = []
    for seed in range(1, 6):
        t0 = time.perf_counter()
        rows = SyntheticAdapterSource(cfg7b, 64, seed=seed).load_rows(f"s{seed}", cfg7b, 64, bf16)
        times.append(time.perf_counter() - t0)
        assert rows.vectors.dtype == bf16 and rows.vectors.shape == (32, 64 * 4 * 2 * 4096 // 128, 128)
        assert rows.pages_needed(2 * 32 * 16) == 16 and rows.max_rank == 64
    assert np.median(times) < 0.05, times


# ---- pool tier: eviction order, pins, room ---------------------------------------------------------------------------


def test_lru_eviction_order_by_slots_and_by_pages(make_store, tiny_cfg, rng):
    store = make_store(num_pages=256, max_slots=3)
    adapters = {n: random_adapter(tiny_cfg, rng, n) for n in "abcde"}
    for name, adapter in adapters.items():
        store.register(name, adapter)
    for name in "abc":
        store.acquire(name)
        store.release(name)
    store.acquire("a")  # a becomes most recently used
    store.release("a")
    assert store.resident() == ["b", "c", "a"]
    store.acquire("d")
    assert store.resident() == ["c", "a", "d"]
    store.acquire("e")
    assert store.resident() == ["a", "d", "e"]
    assert store.stats()["evictions"] == 2
    host_loads = store.stats()["host_loads"]
    store.release("d")
    store.acquire("b")  # evicted from the pool, still in host memory: reloaded without reading its source again
    assert store.resident() == ["d", "e", "b"] and store.stats()["host_loads"] == host_loads
    for name in ("e", "b"):
        assert_holds(store, name, adapters[name])

    # Pages run out before slots do: the least recently used unpinned adapter goes, others stay.
    store = make_store(num_pages=30, max_slots=8)
    for name, rank in (("r8a", 8), ("r4", 4), ("r8b", 8)):  # 14 / 7 / 14 pages
        store.register(name, random_adapter(tiny_cfg, rng, name, ranks=(rank,)))
    for name in ("r8a", "r4"):
        store.acquire(name)
        store.release(name)
    assert store.pool.num_free_pages == 9
    store.acquire("r8b")
    assert store.resident() == ["r4", "r8b"] and store.stats()["evictions"] == 1
    store.pool.allocator.check_invariants()


class MostRecentFirst(EvictionPolicy):
    """Evicts the most recently used adapter first: a whole eviction policy is this one class."""

    def __init__(self):
        self.order: list[str] = []  # least recently used first

    def mark_used(self, name):
        self.forget(name)
        self.order.append(name)

    def forget(self, name):
        if name in self.order:
            self.order.remove(name)

    def eviction_order(self, candidates):
        return (name for name in reversed(self.order) if name in candidates)


def test_a_new_eviction_policy_is_one_class(make_store, tiny_cfg, rng):
    store = make_store(num_pages=64, max_slots=3, eviction=MostRecentFirst())
    adapters = {n: random_adapter(tiny_cfg, rng, n, ranks=(4,)) for n in "abcde"}  # 7 pages each
    for name, adapter in adapters.items():
        store.register(name, adapter)
    for name in "abc":
        store.acquire(name)
        store.release(name)
    assert store.resident() == ["c", "b", "a"]
    store.acquire("d")  # no free slot: the most recently used unpinned adapter goes
    assert store.resident() == ["d", "b", "a"] and store.stats()["evictions"] == 1
    store.prefetch(["a"])  # resident: only marked used
    store.acquire("e")  # d is pinned: never a victim, whatever the policy says
    assert store.resident() == ["e", "d", "b"]
    assert store.reclaim_pages(64 - 3 * 7 + 7)  # one of 7 pages: e and d are pinned, so b goes
    assert store.resident() == ["e", "d"]
    for name in "de":
        assert_holds(store, name, adapters[name])


def test_pinned_adapters_are_never_evicted_and_no_room_changes_nothing(make_store, tiny_cfg, rng):
    store = make_store(num_pages=64, max_slots=2)
    adapters = {n: random_adapter(tiny_cfg, rng, n, ranks=(4,)) for n in "abc"}
    for name, adapter in adapters.items():
        store.register(name, adapter)
    store.acquire("a")
    store.acquire("b")
    before = (np.asarray(store.pool.array).copy(), [np.asarray(x).copy() for x in store.pool.table],
              store.pool.num_free_pages, store.resident(), store.stats()["loads"])
    with pytest.raises(NoRoom, match="'c' needs 7 pages and a slot.*2 pinned"):
        store.acquire("c")
    after = (np.asarray(store.pool.array), list(store.pool.table), store.pool.num_free_pages, store.resident(),
             store.stats()["loads"])
    np.testing.assert_array_equal(before[0], after[0])
    for x, y in zip(before[1], after[1], strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    assert before[2:] == after[2:] and store.pin_count("a") == store.pin_count("b") == 1
    wait_host(store, "c")  # NoRoom still started c's host read, so it is ready when room appears
    assert store.host.has_rows("c") and not store.is_resident("c")

    with pytest.raises(AdapterInUse):
        store.unregister("a")
    store.release("a")
    store.acquire("c")  # only a is unpinned: it goes, b stays
    assert store.resident() == ["b", "c"] and store.stats()["evictions"] == 1
    assert_holds(store, "b", adapters["b"])
    assert_holds(store, "c", adapters["c"])
    with pytest.raises(ValueError, match="not pinned"):
        store.release("a")

    # Out of pages: KV holds most of the pool, pinned adapters the rest.
    store = make_store(num_pages=20, max_slots=8)
    for name in "xy":
        store.register(name, random_adapter(tiny_cfg, rng, name, ranks=(4,)))
    store.acquire("x")
    kv = store.pool.alloc_kv_pages(8, owner="req")
    assert store.pages_needed_to_load("y") == 7 and store.pool.num_free_pages == 5
    with pytest.raises(NoRoom, match="5 pages"):
        store.acquire("y")
    assert store.resident() == ["x"] and not store.reclaim_pages(6)
    store.pool.free_kv_pages(kv, owner="req")
    store.acquire("y")
    assert store.resident() == ["x", "y"]


def test_pages_needed_evictable_pages_and_reclaim(make_store, tiny_cfg, rng):
    store = make_store(num_pages=40, max_slots=3)
    for name, rank in (("r8", 8), ("r4a", 4), ("r4b", 4), ("r2", 2)):  # 14 / 7 / 7 / 4 pages
        store.register(name, random_adapter(tiny_cfg, rng, name, ranks=(rank,)))
    assert [store.pages_needed_to_load(n) for n in ("r8", "r4a", "r2", "nope")] == [14, 7, 4, 0]
    assert [store.adapter_pages(n) for n in ("r8", "r2", "nope")] == [14, 4, 0]
    store.acquire("r8")
    assert store.pages_needed_to_load("r8") == 0 and store.evictable_pages() == 0
    store.acquire("r8")
    store.release("r8")
    assert store.evictable_pages() == 0  # still pinned once
    store.release("r8")
    assert store.evictable_pages() == 14 and store.stats()["evictable_pages"] == 14
    store.acquire("r4a")
    assert store.reclaim_pages(40 - 7)  # evicts r8 (unpinned), never r4a
    assert store.resident() == ["r4a"] and store.pool.num_free_pages == 33 and store.evictable_pages() == 0
    assert not store.reclaim_pages(34)


def test_acquire_reads_a_queued_adapter_itself_instead_of_waiting(make_store, tiny_cfg, rng):
    store = make_store(io_threads=1)
    gate = threading.Event()
    slow, fast = random_adapter(tiny_cfg, rng, "slow"), random_adapter(tiny_cfg, rng, "fast")
    store.register("slow", GatedSource(slow, gate))
    store.register("fast", fast)
    slow_future = store.host.fetch("slow")  # occupies the only IO thread
    queued = store.host.fetch("fast")  # queued behind it
    try:
        store.acquire("fast")
        assert queued.done() and not slow_future.done()
        assert_holds(store, "fast", fast)
    finally:
        gate.set()
    slow_future.result(timeout=30)
    store.acquire("slow")
    assert_holds(store, "slow", slow)


# ---- prefetch --------------------------------------------------------------------------------------------------------


def test_prefetch_reads_then_loads_without_pinning(make_store, tiny_cfg, rng):
    store = make_store(num_pages=64, max_slots=2)
    adapters = {n: random_adapter(tiny_cfg, rng, n, ranks=(4,)) for n in "xyzw"}
    for name, adapter in adapters.items():
        store.register(name, adapter)
    store.prefetch(["x", "y"])  # not in host memory yet: reads start, nothing blocks
    assert not store.is_resident("x") and store.stats()["host_misses"] == 2
    wait_host(store, "x", "y")
    store.prefetch(["x", "y"])  # now in host memory: pool loads, unpinned
    assert store.resident() == ["x", "y"] and store.pin_count("x") == store.pin_count("y") == 0
    assert store.stats()["prefetch_loads"] == 2
    loads = store.stats()["loads"]
    store.prefetch(["x", "y"])  # all resident: only the LRU order changes (the head of the queue goes last)
    assert store.resident() == ["y", "x"]
    assert store.stats()["loads"] == loads
    store.acquire("x")
    assert store.stats()["hits"] == 1 and store.stats()["misses"] == 0
    assert_holds(store, "x", adapters["x"])

    # A prefetched (unpinned) adapter is fair game for eviction; a pinned one never is.
    store.acquire("y")
    wait_host(store, "z")
    store.prefetch(["z"])
    assert not store.is_resident("z") and store.resident() == ["x", "y"]
    store.release("y")
    wait_stagings(store, 3)  # z's pages, copied on an IO thread: prefetch loads it once they are there
    store.prefetch(["z"])
    assert sorted(store.resident()) == ["x", "z"] and store.pin_count("x") == 1
    assert_holds(store, "z", adapters["z"])

    # Adapters named in one prefetch never evict each other; keep_free_pages is honoured.
    store.release("x")
    wait_host(store, "w", "y")
    store.prefetch(["x", "z", "w", "y"])
    assert store.resident() == ["z", "x"]
    store2 = make_store(num_pages=20, max_slots=4)
    for name in "ab":
        store2.register(name, adapters["x"])
    wait_host(store2, "a", "b")  # read without staging (not by prefetch)
    store2.prefetch(["a", "b"])  # copied to the device on IO threads first: nothing loads on this thread yet
    assert store2.resident() == [] and store2.stats()["staged_loads"] == 0
    wait_stagings(store2, 2)
    store2.prefetch(["a", "b"], keep_free_pages=7)  # 7 pages each of 20: a fits, b would leave only 6 free
    assert store2.resident() == ["a"]
    store2.prefetch(["a", "b"], max_pool_loads=0)
    assert store2.resident() == ["a"]
    store2.prefetch(["b"])
    assert store2.resident() == ["a", "b"] and store2.stats()["staged_loads"] == 2


def test_warmup_compiles_every_load_bucket_once(make_store, tiny_cfg, rng):
    compile_counter.install()
    store = make_store(num_pages=72, max_slots=2)  # a pool shape no other test uses: nothing compiled yet
    for name, rank, targets in (("p1", 1, ("q_proj",)), ("p7", 4, QKVO), ("p14", 8, QKVO), ("p32", 8, MODULES),
                                ("p64", 16, MODULES)):
        store.register(name, random_adapter(tiny_cfg, rng, name, ranks=(rank,), targets=targets))
        wait_host(store, name)
    start = compile_counter.compile_count()
    store.warmup()
    assert compile_counter.compile_count() > start
    assert store.pool.num_free_pages == 72 and store.pool.num_free_slots == 2 and store.resident() == []
    before = compile_counter.compile_count()
    for name in ("p1", "p7", "p14", "p32", "p64"):
        store.acquire(name)
        store.release(name)
    assert store.stats()["evictions"] >= 3
    assert compile_counter.compile_count() == before


# ---- loads from pages staged ahead on the IO threads -----------------------------------------------------------------


def test_prefetch_stages_on_io_threads_and_loads_use_it(make_store, tiny_cfg, rng):
    store = make_store(num_pages=64, max_slots=2)
    threads = record_stage_threads(store)
    adapters = {n: random_adapter(tiny_cfg, rng, n, ranks=(4,)) for n in "xyz"}
    for name, adapter in adapters.items():
        store.register(name, adapter)
    store.prefetch(["x", "y"])  # not in host memory: read, then staged, on IO threads
    wait_host(store, "x", "y")  # the host future is done only after the staging
    assert store.stats()["stagings"] == 2 and store.stats()["staged"] == 2
    assert threads and all(t.startswith("adapter-io") for t in threads)
    store.prefetch(["x", "y"])  # pool loads from the staged pages: no staging on the engine thread
    stats = store.stats()
    assert stats["prefetch_loads"] == 2 and stats["staged_loads"] == 2 and stats["staged"] == 0
    assert all(t.startswith("adapter-io") for t in threads)
    for name in "xy":
        assert_holds(store, name, adapters[name])

    # Already in host memory but no room: staged as a job of its own; acquire then uses it.
    store.acquire("x")
    store.acquire("y")
    wait_host(store, "z")
    store.prefetch(["z"])
    assert not store.is_resident("z")
    deadline = time.monotonic() + 30
    while store.stats()["stagings"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stats()["stagings"] == 3 and threads[-1].startswith("adapter-io")
    store.release("y")
    store.acquire("z")
    assert store.stats()["staged_loads"] == 3 and store.stats()["staged"] == 0
    assert_holds(store, "z", adapters["z"])
    assert_holds(store, "x", adapters["x"])

    # Without staging (acquire of an adapter nobody prefetched) the load stages inline, same contents.
    store.release("x")
    store.unregister("y")
    store.register("y", adapters["y"])
    store.acquire("y")
    assert store.stats()["staged_loads"] == 3 and threads[-1] == threading.current_thread().name
    assert_holds(store, "y", adapters["y"])


def test_prefetch_waits_for_a_staging_in_flight_instead_of_staging_again(make_store, tiny_cfg, rng):
    """A pool load whose pages an IO thread is still copying is left to a later prefetch: staging it again on the
    engine thread would block every step behind a host copy (seen at 2000 adapters on the H200)."""
    store = make_store(num_pages=64, max_slots=1)
    adapters = {n: random_adapter(tiny_cfg, rng, n, ranks=(4,)) for n in "xz"}
    for name, adapter in adapters.items():
        store.register(name, adapter)
    store.acquire("x")  # the only slot is pinned
    wait_host(store, "z")
    threads = record_stage_threads(store)
    gate = threading.Event()
    stage = store.pool.stage

    def slow(rows, **kw):
        if threading.current_thread().name.startswith("adapter-io"):
            assert gate.wait(30)
        return stage(rows, **kw)

    store.pool.stage = slow
    stagings = store.stats()["stagings"]
    store.prefetch(["z"])  # no room: staged as a job of its own, now held at the gate
    store.release("x")  # room now, staging still in flight
    store.prefetch(["z"])
    assert not store.is_resident("z")
    assert all(t.startswith("adapter-io") for t in threads), threads
    gate.set()
    wait_stagings(store, stagings + 1)
    store.prefetch(["z"])
    assert store.is_resident("z") and store.stats()["staged_loads"] == 1
    assert all(t.startswith("adapter-io") for t in threads), threads
    assert_holds(store, "z", adapters["z"])


def test_prefetch_loads_inline_after_a_staging_failure(make_store, tiny_cfg, rng):
    """Staging is an optimisation: when it fails, prefetch still loads the adapter (on the calling thread)."""
    store = make_store(num_pages=64, max_slots=2)
    adapter = random_adapter(tiny_cfg, rng, "x", ranks=(4,))
    store.register("x", adapter)
    stage = store.pool.stage

    def failing(rows, **kw):
        if threading.current_thread().name.startswith("adapter-io"):
            raise RuntimeError("out of device memory (simulated)")
        return stage(rows, **kw)

    store.pool.stage = failing
    store.prefetch(["x"])  # read, then the staging fails on the IO thread
    wait_host(store, "x")
    assert not store.is_resident("x") and store.stats()["stagings"] == 0
    store.prefetch(["x"])
    assert store.is_resident("x") and store.stats()["prefetch_loads"] == 1
    assert_holds(store, "x", adapter)
