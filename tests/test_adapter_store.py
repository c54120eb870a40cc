"""AdapterStore: tiers (source -> host LRU -> pool), pinning, LRU eviction, failures, prefetch, thread safety.

Small fp32 pools (few slots / pages) so eviction happens; every resident adapter is read back from the pool through
the DESIGN.md addressing and compared with the original weights.
"""

from __future__ import annotations

import functools
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import random_lora

from pallas_kernels.lora_common import gather_lora_a, gather_lora_b, lora_scale, virtual_to_physical
from slora_jax.engine import compile_counter
from slora_jax.engine.adapter_store import (
    AdapterError,
    AdapterInUse,
    AdapterSource,
    AdapterStore,
    InMemorySource,
    NoRoom,
    SyntheticAdapterSource,
    synthetic_adapter,
)
from slora_jax.engine.pool import PagedPool
from slora_jax.lora.peft import load_peft_adapter
from slora_jax.lora.pool_rows import to_pool_rows
from slora_jax.model.adapter_weights import LoraAdapter
from slora_jax.model.config import MODULES, ModelConfig
from slora_jax.tools import synth

PAGE_SIZE = 4  # tiny model: page_rows = 2 * 2 kv heads * 4 = 16 vectors
MAX_RANK = 16
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
# Pages per adapter in the tiny model: rank r on q,k,v,o takes 28 r vectors per layer -> r4: 7 pages, r8: 14 pages.


@pytest.fixture
def rng(request):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"{request.node.name}: seed {seed}")  # shown on failure, to replay
    return np.random.default_rng(seed)


@pytest.fixture
def make_store(tiny_cfg):
    stores = []

    def make(num_pages=256, max_slots=4, host_budget_bytes=1 << 30, **kw) -> AdapterStore:
        pool = PagedPool(tiny_cfg, page_size=PAGE_SIZE, max_slots=max_slots, max_rank=MAX_RANK,
                         num_pages=num_pages, dtype=jnp.float32)
        store = AdapterStore(tiny_cfg, pool, host_budget_bytes=host_budget_bytes, max_rank=MAX_RANK,
                             dtype=np.float32, **kw)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def seed_of(rng) -> int:
    return int(rng.integers(2**31))


random_adapter = functools.partial(random_lora.random_adapter, targets=QKVO)  # S-LoRA's targets unless told


def rows_nbytes(adapter: LoraAdapter, cfg: ModelConfig) -> int:
    rows = to_pool_rows(adapter, cfg, np.float32)
    return sum(a.nbytes for a in (rows.vectors, rows.rank, rows.a_off, rows.b_off, rows.scale,
                                  rows.layer_num_vectors))


def assert_holds(store: AdapterStore, name: str, adapter: LoraAdapter) -> None:
    """The pool, read through the slot's page list and offsets (DESIGN.md addressing), holds exactly ``adapter``."""
    pool, cfg = store.pool, store.model_cfg
    arr = np.asarray(pool.array)
    slot = pool.slot_of(name)
    pages = np.asarray(pool.table.pages)[slot]
    rank, scale = np.asarray(pool.table.rank)[slot], np.asarray(pool.table.scale)[slot]
    a_off, b_off = np.asarray(pool.table.a_off)[slot], np.asarray(pool.table.b_off)[slot]
    vec = cfg.head_dim
    for layer in range(cfg.num_hidden_layers):
        for m, mod in enumerate(MODULES):
            want = adapter.modules.get((layer, mod))
            if want is None:
                assert rank[layer, m] == 0 and scale[layer, m] == 0, (name, layer, mod)
                continue
            r, (d_in, d_out) = want.rank, cfg.module_dims(mod)
            assert rank[layer, m] == r and scale[layer, m] == np.float32(want.scale), (name, layer, mod)
            for off, width, expect in ((a_off[layer, m], d_in, want.a.T), (b_off[layer, m], d_out, want.b)):
                page, row = virtual_to_physical(pages, off + np.arange(r * width // vec), pool.page_rows)
                np.testing.assert_array_equal(arr[layer, page, row].reshape(r, width), expect)


def wait_host(store: AdapterStore, *names: str) -> None:
    for name in names:
        store.fetch_to_host(name).result(timeout=30)


# ---- sources and exact placement ----------------------------------------------------------------------------------


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


# ---- pool tier: LRU eviction, pins, room ---------------------------------------------------------------------------


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
    assert store.in_host("c") and not store.is_resident("c")

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


def test_pages_needed_can_make_resident_and_reclaim(make_store, tiny_cfg, rng):
    store = make_store(num_pages=40, max_slots=3)
    for name, rank in (("r8", 8), ("r4a", 4), ("r4b", 4), ("r2", 2)):  # 14 / 7 / 7 / 4 pages
        store.register(name, random_adapter(tiny_cfg, rng, name, ranks=(rank,)))
    assert [store.pages_needed_to_load(n) for n in ("r8", "r4a", "r2", "nope")] == [14, 7, 4, 0]
    assert store.can_make_resident(["r8", "r4a", "r4b"])  # 28 of 40 pages, 3 slots
    assert not store.can_make_resident(["r8", "r4a", "r4b", "r2"])  # 4 adapters, 3 slots
    assert not store.can_make_resident(["r8", "r4a"], free_pages_budget=20)
    store.acquire("r8")
    assert store.pages_needed_to_load("r8") == 0 and store.evictable_pages() == 0
    store.release("r8")
    assert store.evictable_pages() == 14
    # r8 is unpinned and not wanted, so its pages count as available; wanting it too keeps it.
    assert store.can_make_resident(["r4a", "r4b"], free_pages_budget=0)
    assert not store.can_make_resident(["r8", "r4a", "r4b"], free_pages_budget=10)
    store.acquire("r4a")
    assert store.reclaim_pages(40 - 7)  # evicts r8 (unpinned), never r4a
    assert store.resident() == ["r4a"] and store.pool.num_free_pages == 33
    assert not store.reclaim_pages(34)


# ---- host tier -----------------------------------------------------------------------------------------------------


def test_host_cache_is_lru_within_its_byte_budget(make_store, tiny_cfg, rng):
    adapters = {n: random_adapter(tiny_cfg, rng, n, ranks=(4,)) for n in "abcd"}
    size = rows_nbytes(adapters["a"], tiny_cfg)
    store = make_store(host_budget_bytes=int(2.5 * size))
    for name, adapter in adapters.items():
        store.register(name, adapter)
    wait_host(store, "a", "b")
    wait_host(store, "a")  # a most recently used
    wait_host(store, "c")  # over budget: b (least recently used) goes
    assert [store.in_host(n) for n in "abcd"] == [True, False, True, False]
    s = store.stats()
    assert (s["in_host"], s["host_bytes"], s["host_evictions"], s["host_loads"], s["host_hits"]) == (2, 2 * size, 1,
                                                                                                      3, 1)
    assert (s["resident"], s["source_only"]) == (0, 2)
    store.acquire("b")  # read again from its source
    assert store.stats()["host_loads"] == 4 and [store.in_host(n) for n in "abc"] == [False, True, True]
    assert_holds(store, "b", adapters["b"])
    assert store.stats()["source_only"] == 2  # a (dropped from host memory) and d

    # Count cap, and an adapter bigger than the whole budget is served but never cached.
    capped = make_store(max_host_adapters=1)
    tiny_budget = make_store(host_budget_bytes=size // 2)
    for name, adapter in adapters.items():
        capped.register(name, adapter)
        tiny_budget.register(name, adapter)
    wait_host(capped, "a", "b")
    assert [capped.in_host(n) for n in "ab"] == [False, True]
    assert tiny_budget.fetch_to_host("a").result(timeout=30).name == "a"
    assert not tiny_budget.in_host("a") and tiny_budget.stats()["host_too_large"] == 1
    tiny_budget.acquire("a")
    assert_holds(tiny_budget, "a", adapters["a"])


def test_concurrent_host_loads_respect_budget(make_store, tiny_cfg, rng):
    adapters = {f"m{i}": random_adapter(tiny_cfg, rng, f"m{i}", ranks=(4,)) for i in range(16)}
    size = rows_nbytes(adapters["m0"], tiny_cfg)
    store = make_store(host_budget_bytes=3 * size, io_threads=4)
    for name, adapter in adapters.items():
        store.register(name, adapter)
    gate = threading.Event()
    store.register("gated", GatedSource(adapters["m0"], gate))
    gated = store.fetch_to_host("gated")
    assert store.fetch_to_host("gated") is gated, "a second fetch while loading must join the first"
    futures = {name: store.fetch_to_host(name) for name in adapters}
    gate.set()
    gated.result(timeout=30)
    for name, future in futures.items():
        rows = future.result(timeout=30)
        np.testing.assert_array_equal(rows.vectors, to_pool_rows(adapters[name], tiny_cfg, np.float32).vectors)
    s = store.stats()
    assert s["host_loads"] == 17 and s["in_host"] == 3 and s["host_bytes"] == 3 * size and s["loading"] == 0


class GatedSource(AdapterSource):
    """An in-memory adapter whose read waits for a gate: an IO worker that is busy for as long as the test wants."""

    def __init__(self, adapter: LoraAdapter, gate: threading.Event):
        self.inner, self.gate = InMemorySource(adapter), gate

    def rank_table(self, name, model_cfg, max_rank):
        return self.inner.rank_table(name, model_cfg, max_rank)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        assert self.gate.wait(30)
        return self.inner.load_rows(name, model_cfg, max_rank, dtype)


def test_acquire_reads_a_queued_adapter_itself_instead_of_waiting(make_store, tiny_cfg, rng):
    store = make_store(io_threads=1)
    gate = threading.Event()
    slow, fast = random_adapter(tiny_cfg, rng, "slow"), random_adapter(tiny_cfg, rng, "fast")
    store.register("slow", GatedSource(slow, gate))
    store.register("fast", fast)
    slow_future = store.fetch_to_host("slow")  # occupies the only IO thread
    queued = store.fetch_to_host("fast")  # queued behind it
    try:
        store.acquire("fast")
        assert queued.done() and not slow_future.done()
        assert_holds(store, "fast", fast)
    finally:
        gate.set()
    slow_future.result(timeout=30)
    store.acquire("slow")
    assert_holds(store, "slow", slow)


# ---- failures ------------------------------------------------------------------------------------------------------


def test_broken_adapters_fail_with_their_reason_and_poison_nothing(make_store, tiny_cfg, tmp_path, rng):
    root = tmp_path / "adapters"
    good = {n: synth.write_adapter(root / n, tiny_cfg, rank=4, seed=seed_of(rng)) for n in ("good1", "good2")}
    bad = synth.write_adapter(root / "corrupt", tiny_cfg, rank=4, seed=seed_of(rng))
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-not-a-header")
    synth.write_adapter(root / "dora", tiny_cfg, rank=4, extra_config={"use_dora": True})
    (root / "not-an-adapter").mkdir()

    store = make_store(num_pages=64, max_slots=2)
    with pytest.raises(AdapterError, match="'dora'.*DoRA"):
        store.register_dir(root, strict=True)
    store = make_store(num_pages=64, max_slots=2)
    assert store.register_dir(root) == ["corrupt", "dora", "good1", "good2"]
    assert store.errors() == {"dora": "DoRA (use_dora) is not supported"}

    with pytest.raises(AdapterError, match="unreadable adapter_model.safetensors") as info:
        store.fetch_to_host("corrupt").result(timeout=30)
    assert info.value.adapter == "corrupt"
    with pytest.raises(AdapterError, match="unreadable adapter_model.safetensors"):
        store.acquire("corrupt")  # the recorded failure: no second read
    with pytest.raises(AdapterError, match="DoRA"):
        store.acquire("dora")
    with pytest.raises(AdapterError, match="not registered"):
        store.acquire("missing")
    assert store.pages_needed_to_load("corrupt") == 0 and set(store.errors()) == {"corrupt", "dora"}
    store.prefetch(["corrupt", "dora", "good2"])  # skips the broken ones, raises nothing

    for name, path in good.items():
        store.acquire(name)
        assert_holds(store, name, load_peft_adapter(path, tiny_cfg))
    s = store.stats()
    assert (s["load_errors"], s["failed"], s["resident"], s["host_loads"]) == (1, 2, 2, 2)

    # Fixed on disk: retry clears the failure and the next use reads it again.
    synth.write_adapter(bad, tiny_cfg, rank=4, seed=seed_of(rng))
    store.retry("corrupt")
    store.release("good1")
    store.acquire("corrupt")
    assert_holds(store, "corrupt", load_peft_adapter(bad, tiny_cfg))


def test_register_validates_cheaply_and_loads_check_the_rest(make_store, tiny_cfg, tmp_path, rng):
    store = make_store(num_pages=64)
    too_big = synth.write_adapter(tmp_path / "r32", tiny_cfg, rank=32, seed=seed_of(rng))
    with pytest.raises(AdapterError, match="'r32'.*above the configured maximum 16"):
        store.register("r32", too_big)
    with pytest.raises(AdapterError, match="'gone'.*not a directory"):
        store.register("gone", tmp_path / "nowhere")
    no_weights = synth.write_adapter(tmp_path / "nw", tiny_cfg, rank=4, seed=seed_of(rng))
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="missing adapter_model.safetensors"):
        store.register("nw", no_weights)
    wrong = random_adapter(tiny_cfg, rng, "w")
    wrong.modules[(0, "q_proj")].a = wrong.modules[(0, "q_proj")].a[:32]
    with pytest.raises(AdapterError, match="'w'.*do not match"):
        store.register("w", wrong)
    with pytest.raises(AdapterError, match="rank 32 is outside"):
        store.register("s", SyntheticAdapterSource(tiny_cfg, 32))
    # An adapter bigger than the whole pool can never be served.
    with pytest.raises(AdapterError, match="needs 14 pool pages; the pool has 10"):
        make_store(num_pages=10).register("r8", random_adapter(tiny_cfg, rng, "r8", ranks=(8,)))
    assert store.names() == []

    nan = random_adapter(tiny_cfg, rng, "nan")
    nan.modules[(1, "v_proj")].b[0, 0] = np.nan
    store.register("nan", nan)  # weights are only scanned on load, off the engine thread
    store.register("ok", random_adapter(tiny_cfg, rng, "ok", ranks=(8,)))
    with pytest.raises(AdapterError, match="'nan'.*non-finite"):
        store.acquire("nan")
    store.acquire("ok")
    with pytest.raises(ValueError, match="already registered"):
        store.register("ok", nan)

    with pytest.raises(AdapterInUse):
        store.unregister("ok")
    store.release("ok")
    free = store.pool.num_free_pages
    store.unregister("ok")
    assert "ok" not in store and not store.is_resident("ok") and store.pool.num_free_pages == free + 14
    store.unregister("nan")
    assert store.errors() == {} and store.stats()["registered"] == 0
    with pytest.raises(KeyError):
        store.unregister("ok")


# ---- prefetch ------------------------------------------------------------------------------------------------------


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


# ---- device staging ahead of pool loads ---------------------------------------------------------------------------


def wait_stagings(store: AdapterStore, n: int) -> None:
    deadline = time.monotonic() + 30
    while store.stats()["stagings"] < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stats()["stagings"] >= n


def record_stage_threads(store: AdapterStore) -> list[str]:
    threads, stage = [], store.pool.stage

    def traced(rows, **kw):
        threads.append(threading.current_thread().name)
        return stage(rows, **kw)

    store.pool.stage = traced
    return threads


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


def test_read_ahead_reads_only_into_free_host_room(make_store, tiny_cfg, rng):
    """Reads for requests deep in the queue never evict the head's cached rows or staged pages, and stop where the
    host tier is full (no read that would be thrown away again)."""
    adapters = {f"a{i}": random_adapter(tiny_cfg, rng, f"a{i}", ranks=(4,)) for i in range(8)}
    store = make_store(num_pages=64, max_slots=1, max_host_adapters=4)
    for name, adapter in adapters.items():
        store.register(name, adapter)
    store.acquire("a0")  # the only slot is pinned: the head stays staged, not loaded
    store.prefetch(["a1", "a2"])
    wait_host(store, "a1", "a2")
    wait_stagings(store, 2)
    host_before = store.stats()["in_host"]
    store.read_ahead([f"a{i}" for i in range(3, 8)])  # 4 host slots, 3 taken: one read fits
    deadline = time.monotonic() + 30
    while store.stats()["loading"] and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = store.stats()
    assert stats["read_aheads"] == 4 - host_before == 1
    assert store.in_host("a1") and store.in_host("a2") and store.in_host("a3") and stats["host_evictions"] == 0
    assert stats["staged"] == 2
    store.read_ahead(["a4", "a5"])  # full: nothing starts
    assert store.stats()["read_aheads"] == 1

    none = make_store(num_pages=64, max_slots=1, max_host_adapters=0)
    none.register("x", adapters["a0"])
    none.read_ahead(["x"])
    assert none.stats()["read_aheads"] == 0 and none.stats()["host_misses"] == 0


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


def test_staged_pages_are_dropped_and_never_cross_names(make_store, tiny_cfg, rng):
    store = make_store(num_pages=128, max_slots=4, max_staged=2)
    adapters = {n: random_adapter(tiny_cfg, rng, n, ranks=(4, 8)) for n in "abcd"}
    for name, adapter in adapters.items():
        store.register(name, adapter)

    store.prefetch(["a"])
    wait_host(store, "a")
    assert store.stats()["staged"] == 1
    # Unregister drops it; a new adapter under the same name never picks it up.
    store.unregister("a")
    assert store.stats()["staged"] == 0
    fresh = random_adapter(tiny_cfg, rng, "a", ranks=(2,))
    store.register("a", fresh)
    store.acquire("a")
    assert store.stats()["staged_loads"] == 0
    assert_holds(store, "a", fresh)
    store.release("a")

    # A re-registration while the old staging is pending: the new registration reads and stages afresh.
    store.prefetch(["b"])
    store.unregister("b")
    store.register("b", adapters["c"])
    wait_host(store, "b")
    store.acquire("b")
    assert_holds(store, "b", adapters["c"])
    store.release("b")

    # Bounded: at most max_staged held, the oldest dropped first.
    store.unregister("b")
    store.register("b", adapters["b"])
    store.prefetch(["b", "c", "d"], max_pool_loads=0)
    wait_host(store, "b", "c", "d")
    stats = store.stats()
    assert stats["staged"] <= 2 and stats["staged_dropped"] >= 1
    for name in "bcd":  # each adapter loads its own weights, staged or not
        store.acquire(name)
        assert_holds(store, name, adapters[name])
    assert store.stats()["staged"] == 0


def test_staged_pages_are_dropped_with_their_host_rows(make_store, tiny_cfg, rng):
    adapters = {n: random_adapter(tiny_cfg, rng, n, ranks=(4,)) for n in "ab"}
    store = make_store(num_pages=64, max_slots=2, max_host_adapters=1)
    for name, adapter in adapters.items():
        store.register(name, adapter)
    store.prefetch(["a"])
    wait_host(store, "a")
    assert store.stats()["staged"] == 1
    wait_host(store, "b")  # evicts a's rows from host memory, and with them its staged pages
    assert not store.in_host("a") and store.stats()["staged"] == 0
    store.acquire("a")
    assert store.stats()["staged_loads"] == 0
    assert_holds(store, "a", adapters["a"])

    # Rows too large for the host tier are not staged either (their load reads again).
    small = make_store(num_pages=64, max_slots=2, host_budget_bytes=0)
    small.register("a", adapters["a"])
    small.prefetch(["a"])
    small.fetch_to_host("a").result(timeout=30)
    assert small.stats()["staged"] == 0
    small.acquire("a")
    assert_holds(small, "a", adapters["a"])
