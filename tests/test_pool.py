"""PagedPool + pool rows: adapters read back through the DESIGN.md addressing equal the original LoRA weights."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import random_lora

from pallas_kernels.lora_common import gather_lora_a, gather_lora_b, lora_scale
from slora_jax.engine.page_allocator import ADAPTER, KV, ForeignPage, OutOfPages, owner_kind
from slora_jax.engine.pool import OutOfSlots, PagedPool, max_adapter_vectors
from slora_jax.lora.pool_rows import bf16_bits, to_pool_rows
from slora_jax.model.adapter_weights import LoraAdapter, LoraModule
from slora_jax.model.config import MODULES, ModelConfig

CFG = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
PAGE_SIZE = 4  # page_rows = 2 * 2 * 4 = 16 vectors
MAX_RANK = 64


# this file's adapters: every projection, mixed ranks up to the pool's maximum, some (layer, module) pairs absent
random_adapter = functools.partial(random_lora.random_adapter, CFG, ranks=(4, 8, 16, 32, 64), p_absent=0.3)


def make_pool(num_pages=1024, max_slots=8, dtype=jnp.float32, max_rank=MAX_RANK) -> PagedPool:
    return PagedPool(CFG, page_size=PAGE_SIZE, max_slots=max_slots, max_rank=max_rank, num_pages=num_pages, dtype=dtype)


def read_module(pool_np: np.ndarray, table, slot: int, layer: int, mod: str) -> tuple[np.ndarray, np.ndarray]:
    """Gather (a, b) of one module straight from the pool array via the device table (DESIGN.md addressing)."""
    m = MODULES.index(mod)
    n_layers, num_pages, page_rows, vec = pool_np.shape
    pages = np.asarray(table.pages)[slot]
    r = int(np.asarray(table.rank)[slot, layer, m])
    a_off = int(np.asarray(table.a_off)[slot, layer, m])
    b_off = int(np.asarray(table.b_off)[slot, layer, m])
    flat = pool_np[layer].reshape(num_pages * page_rows, vec)
    d_in, d_out = CFG.module_dims(mod)

    def gather(off, width):
        k, c = np.meshgrid(np.arange(r), np.arange(width // vec), indexing="ij")
        virtual = off + k * (width // vec) + c
        phys = pages[virtual // page_rows] * page_rows + virtual % page_rows
        return flat[phys].reshape(r, width)  # [r, chunks, V] -> rows

    return gather(a_off, d_in).T, gather(b_off, d_out)


def assert_adapter_resident(pool: PagedPool, adapter: LoraAdapter) -> None:
    pool_np = np.asarray(pool.array)
    slot = pool.slot_of(adapter.name)
    rank = np.asarray(pool.table.rank)[slot]
    scale = np.asarray(pool.table.scale)[slot]
    for layer in range(CFG.num_hidden_layers):
        for m, mod in enumerate(MODULES):
            lm = adapter.modules.get((layer, mod))
            if lm is None:
                assert rank[layer, m] == 0 and scale[layer, m] == 0
                continue
            assert rank[layer, m] == lm.rank
            assert scale[layer, m] == np.float32(lm.scale)
            a, b = read_module(pool_np, pool.table, slot, layer, mod)
            np.testing.assert_array_equal(a, lm.a)
            np.testing.assert_array_equal(b, lm.b)


def check_with_kernel_reference(pool: PagedPool, adapters: list[LoraAdapter]) -> None:
    """The kernels' own jnp gather reads the same weights (slot -1 and absent modules read as zero)."""
    slots = jnp.asarray([pool.slot_of(ad.name) for ad in adapters] + [-1], jnp.int32)
    for layer in range(CFG.num_hidden_layers):
        for m, mod in enumerate(MODULES):
            d_in, d_out = CFG.module_dims(mod)
            a = np.asarray(gather_lora_a(pool.array, pool.table, layer, slots, m, d_in, MAX_RANK))
            b = np.asarray(gather_lora_b(pool.array, pool.table, layer, slots, m, d_out, MAX_RANK))
            scale = np.asarray(lora_scale(pool.table, layer, slots, m))
            for t, ad in enumerate(adapters + [None]):
                lm = ad.modules.get((layer, mod)) if ad else None
                r = lm.rank if lm else 0
                want_a = np.zeros((d_in, MAX_RANK), np.float32)
                want_b = np.zeros((MAX_RANK, d_out), np.float32)
                if lm:
                    want_a[:, :r], want_b[:r] = lm.a, lm.b
                np.testing.assert_array_equal(a[t], want_a)
                np.testing.assert_array_equal(b[t], want_b)
                assert scale[t] == (np.float32(lm.scale) if lm else 0)


def churn(pool: PagedPool, rng: np.random.Generator) -> list[list[int]]:
    """KV alloc/free churn so later adapter pages are scattered; returns the KV chunks still held."""
    chunks = [pool.alloc_kv_pages(int(rng.integers(1, 9)), owner=i) for i in range(40)]
    kept = []
    for i, pages in enumerate(chunks):
        if i % 2:
            pool.free_kv_pages(pages, owner=i)
        else:
            kept.append(pages)
    return kept


def test_pool_rows_layout_is_unpadded_and_sequential():
    rng = np.random.default_rng(0)
    adapter = random_adapter(rng, "x")
    rows = to_pool_rows(adapter, CFG)
    vec = CFG.head_dim
    for layer in range(CFG.num_hidden_layers):
        cursor = 0
        for m, mod in enumerate(MODULES):
            lm = adapter.modules.get((layer, mod))
            if lm is None:
                assert rows.rank[layer, m] == 0 and rows.scale[layer, m] == 0
                continue
            d_in, d_out = CFG.module_dims(mod)
            assert rows.rank[layer, m] == lm.rank  # no padding to max rank
            assert rows.a_off[layer, m] == cursor
            assert rows.b_off[layer, m] == cursor + lm.rank * d_in // vec
            cursor = rows.b_off[layer, m] + lm.rank * d_out // vec
            # A^T row k chunk c at a_off + k*(d_in/V) + c.
            k, c = lm.rank - 1, d_in // vec - 1
            np.testing.assert_array_equal(
                rows.vectors[layer, rows.a_off[layer, m] + k * (d_in // vec) + c], lm.a[c * vec : (c + 1) * vec, k]
            )
        assert rows.layer_num_vectors[layer] == cursor
        assert not rows.vectors[layer, cursor:].any()  # zero tail in the shorter layer
    assert rows.num_vectors == rows.layer_num_vectors.max()
    assert rows.total_vectors * vec == sum(m.a.size + m.b.size for m in adapter.modules.values())
    assert rows.pages_needed(16) == math.ceil(rows.num_vectors / 16)


def test_bf16_pool_rows_are_the_float32_rows_cast_by_ml_dtypes():
    """The bf16 layout writes bits (round to nearest even) instead of ml_dtypes' cast: the same bits, also for
    subnormals, signed zeros, ties and values that round up a binade; the cast alone also for the largest values
    (rounding to inf) and infinities."""
    rng = np.random.default_rng()
    adapter = random_adapter(rng, "x")
    key = next(iter(adapter.modules))
    a = np.array(adapter.modules[key].a, np.float32)
    edge = np.array([0.0, -0.0, 1e-40, -1e-40, 1.00390625, 1.0117188, -1.9960938, 9.18e-41], np.float32)
    a.flat[rng.choice(a.size, size=edge.size, replace=False)] = edge
    adapter.modules[key] = LoraModule(a, adapter.modules[key].b, adapter.modules[key].scale)
    want = to_pool_rows(adapter, CFG, np.float32).vectors.astype(ml_dtypes.bfloat16)
    got = to_pool_rows(adapter, CFG, ml_dtypes.bfloat16).vectors
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    # the cast alone, over the whole range (the value check keeps such weights out of the pool)
    x = rng.standard_normal(4096) * 10.0 ** rng.integers(-45, 38, 4096)
    x = np.concatenate([x, [3.3895e38, 3.39e38, -3.4e38, np.inf, -np.inf]]).astype(np.float32)
    np.testing.assert_array_equal(bf16_bits(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_pool_rows_rejects_bad_shapes():
    rng = np.random.default_rng(1)
    wrong_b = LoraModule(rng.standard_normal((64, 4)), rng.standard_normal((4, 64)), 1.0)  # k_proj d_out is 32
    bad = LoraAdapter("bad", {(0, "k_proj"): wrong_b})
    with pytest.raises(ValueError, match="k_proj"):
        to_pool_rows(bad, CFG)
    with pytest.raises(ValueError, match="layer 5"):
        to_pool_rows(LoraAdapter("far", {(5, "q_proj"): random_adapter(rng, "y").modules.popitem()[1]}), CFG)


def test_sizing_from_budget():
    pool = PagedPool(CFG, page_size=PAGE_SIZE, max_slots=2, max_rank=8, memory_bytes=10 * 4096 + 100)
    assert pool.page_rows == 16
    assert pool.page_bytes == 2 * 16 * 16 * 2  # L * page_rows * V * bf16
    assert pool.num_pages == (10 * 4096 + 100) // pool.page_bytes
    assert pool.array.shape == (2, pool.num_pages, 16, 16) and pool.array.dtype == jnp.bfloat16
    assert pool.max_pages == math.ceil(max_adapter_vectors(CFG, 8) / 16) == 32  # 8 ranks * 64 vectors / 16
    assert pool.table.pages.shape == (2, 32) and pool.table.rank.shape == (2, 2, 7)
    with pytest.raises(ValueError):
        PagedPool(CFG, page_size=PAGE_SIZE, max_slots=2, max_rank=8)


def test_load_after_churn_reads_back_exactly_and_unload_restores():
    rng = np.random.default_rng(2)
    pool = make_pool()
    kv_chunks = churn(pool, rng)
    start = pool.stats()
    adapters = [random_adapter(rng, f"ad{i}") for i in range(5)]
    slots = []
    for i, ad in enumerate(adapters):
        old = pool.array
        slots.append(pool.load_adapter(ad.name, to_pool_rows(ad, CFG)))
        assert old.is_deleted()  # the scatter ran in place on the donated pool
        if i == 1:
            kv_chunks.append(pool.alloc_kv_pages(3, owner="late"))
    assert sorted(slots) == list(range(5))
    assert pool.resident_adapters() == {ad.name: s for ad, s in zip(adapters, slots, strict=True)}

    # Pages really are scattered, and never shared between KV and adapters.
    all_adapter_pages = [p for ad in adapters for p in pool.adapter_pages(ad.name)]
    kv_pages = [p for c in kv_chunks for p in c]
    assert len(set(all_adapter_pages)) == len(all_adapter_pages)
    assert not set(all_adapter_pages) & set(kv_pages)
    assert any(np.any(np.diff(pool.adapter_pages(ad.name)) != 1) for ad in adapters)
    for p in all_adapter_pages:
        assert owner_kind(pool.allocator.owner_of(p)) == ADAPTER
    for p in kv_pages:
        assert owner_kind(pool.allocator.owner_of(p)) == KV

    # Scribble over every KV page (as attention writes would); adapters must be untouched.
    noise = rng.standard_normal((CFG.num_hidden_layers, len(kv_pages), pool.page_rows, pool.vec)).astype(np.float32)
    pool.array = pool.array.at[:, np.array(kv_pages)].set(noise)
    for ad in adapters:
        assert_adapter_resident(pool, ad)
    check_with_kernel_reference(pool, adapters)

    # Unload in a shuffled order: the stale slot reads as "no adapter", books return to where they started.
    for k in rng.permutation(len(adapters)):
        ad = adapters[k]
        slot = pool.slot_of(ad.name)
        pool.unload_adapter(ad.name)
        assert ad.name not in pool
        assert not np.asarray(pool.table.rank)[slot].any() and not np.asarray(pool.table.scale)[slot].any()
    pool.free_kv_pages(kv_chunks.pop())  # the "late" chunk
    assert pool.stats() == start
    pool.allocator.check_invariants()

    # Slots and pages are reusable.
    again = random_adapter(rng, "again")
    assert pool.load_adapter("again", to_pool_rows(again, CFG)) == 0
    assert_adapter_resident(pool, again)


def test_out_of_pages_leaves_everything_unchanged():
    rng = np.random.default_rng(3)
    small = random_adapter(rng, "small", ranks=(4,), p_absent=0.0)  # 4 ranks * 64 vectors = 16 pages
    big = random_adapter(rng, "big", ranks=(64,), p_absent=0.0)  # 256 pages
    pool = make_pool(num_pages=100)
    pool.alloc_kv_pages(30, owner="seq")
    pool.load_adapter("small", to_pool_rows(small, CFG))
    before_array = np.asarray(pool.array)
    before_table = [np.asarray(x) for x in pool.table]
    before_stats = pool.stats()
    with pytest.raises(OutOfPages):
        pool.load_adapter("big", to_pool_rows(big, CFG))
    assert "big" not in pool and pool.num_free_slots == pool.max_slots - 1
    assert pool.stats() == before_stats
    np.testing.assert_array_equal(np.asarray(pool.array), before_array)
    for got, want in zip(pool.table, before_table, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(OutOfPages):
        pool.alloc_kv_pages(pool.num_free_pages + 1)
    assert_adapter_resident(pool, small)


def test_out_of_slots_and_misuse_are_clear_errors():
    rng = np.random.default_rng(4)
    pool = make_pool(num_pages=600, max_slots=2)
    ads = [random_adapter(rng, f"a{i}", ranks=(4, 8)) for i in range(3)]
    for ad in ads[:2]:
        pool.load_adapter(ad.name, to_pool_rows(ad, CFG))
    free_before = pool.num_free_pages
    with pytest.raises(OutOfSlots):
        pool.load_adapter("a2", to_pool_rows(ads[2], CFG))
    assert pool.num_free_pages == free_before
    with pytest.raises(ValueError, match="already resident"):
        pool.load_adapter("a0", to_pool_rows(ads[0], CFG))
    with pytest.raises(KeyError):
        pool.unload_adapter("nope")
    with pytest.raises(KeyError):
        pool.slot_of("nope")
    with pytest.raises(ForeignPage):  # adapter pages cannot be freed as KV
        pool.free_kv_pages(pool.adapter_pages("a0")[:1])
    kv = pool.alloc_kv_pages(2, owner="s1")
    with pytest.raises(ForeignPage):
        pool.free_kv_pages(kv, owner="s2")
    pool.unload_adapter("a1")
    pool.load_adapter("a2", to_pool_rows(ads[2], CFG))
    assert_adapter_resident(pool, ads[0])
    assert_adapter_resident(pool, ads[2])

    too_big = make_pool(num_pages=600, max_rank=8)
    with pytest.raises(ValueError, match="max_rank"):
        too_big.load_adapter("r64", to_pool_rows(random_adapter(rng, "r64", ranks=(64,), p_absent=0), CFG))


def test_stats_live_bytes_and_split():
    rng = np.random.default_rng(5)
    pool = make_pool(num_pages=400)
    ad = random_adapter(rng, "ad")
    rows = to_pool_rows(ad, CFG)
    pool.load_adapter("ad", rows)
    kv = pool.alloc_kv_pages(5, owner="s")
    pool.kv_tokens_live = 17  # 5 pages of 4 tokens, 17 used
    s = pool.stats()
    token_bytes = CFG.num_hidden_layers * 2 * CFG.num_key_value_heads * CFG.head_dim * 4
    assert s["pages_kv"] == 5 and s["pages_adapter"] == rows.pages_needed(16)
    assert s["pages_free"] == 400 - 5 - rows.pages_needed(16)
    assert s["page_bytes"] == 2 * 16 * 16 * 4 and s["pool_bytes"] == 400 * s["page_bytes"]
    assert s["adapter_live_bytes"] == ad.nbytes()  # fp32 pool: exactly the LoRA weights, no padding
    assert s["kv_live_bytes"] == 17 * token_bytes
    assert s["live_bytes"] == ad.nbytes() + 17 * token_bytes
    assert s["utilisation"] == pytest.approx(s["live_bytes"] / s["pool_bytes"])
    assert s["kv_fraction"] == pytest.approx(5 / 400)
    assert s["adapter_fraction"] == pytest.approx(rows.pages_needed(16) / 400)
    assert pool.stats(kv_tokens_live=20)["kv_live_bytes"] == 20 * token_bytes
    with pytest.raises(ValueError):
        pool.stats(kv_tokens_live=21)  # more tokens than 5 KV pages hold
    pool.free_kv_pages(kv, owner="s")
    pool.kv_tokens_live = 0
    assert pool.stats()["live_bytes"] == ad.nbytes()


def test_bf16_pool_and_scatter_buckets():
    rng = np.random.default_rng(6)
    pool = make_pool(num_pages=300, dtype=jnp.bfloat16)
    assert [pool.page_bucket(n) for n in (0, 1, 2, 3, 4, 5, 17, 256)] == [1, 1, 2, 4, 4, 8, 32, 256]
    ad = random_adapter(rng, "bf", ranks=(8, 16))
    pool.load_adapter("bf", to_pool_rows(ad, CFG))
    pool_np = np.asarray(pool.array.astype(jnp.float32))
    slot = pool.slot_of("bf")
    for (layer, mod), lm in ad.modules.items():
        a, b = read_module(pool_np, pool.table, slot, layer, mod)
        np.testing.assert_array_equal(a, np.asarray(jnp.asarray(lm.a).astype(jnp.bfloat16).astype(jnp.float32)))
        np.testing.assert_array_equal(b, np.asarray(jnp.asarray(lm.b).astype(jnp.bfloat16).astype(jnp.float32)))
    assert pool.stats()["adapter_live_bytes"] == ad.nbytes() // 2


def test_one_compile_per_scatter_bucket():
    """Adapters whose page counts share a bucket reuse one scatter; table updates compile once."""
    from slora_jax.engine import pool as pool_mod

    if not hasattr(pool_mod._write_pages, "_cache_size"):
        pytest.skip("jit cache introspection not available in this jax")
    rng = np.random.default_rng(7)
    full = random_adapter(rng, "full", ranks=(4,), p_absent=0.0)  # 16 pages
    part = LoraAdapter("part", {k: v for k, v in random_adapter(rng, "p", ranks=(4,), p_absent=0.0).modules.items()
                                if k[1] != "down_proj"})  # 13 pages, same bucket of 16
    pool = make_pool(num_pages=200, max_slots=3, max_rank=16)
    scatter0, table0 = pool_mod._write_pages._cache_size(), pool_mod._set_slot._cache_size()
    for ad in (full, part):
        pool.load_adapter(ad.name, to_pool_rows(ad, CFG))
    pool.unload_adapter("full")
    pool.load_adapter("again", to_pool_rows(full, CFG))
    assert pool_mod._write_pages._cache_size() - scatter0 <= 1
    assert pool_mod._set_slot._cache_size() - table0 <= 1
    assert_adapter_resident(pool, part)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pre_staged_load_writes_exactly_what_an_inline_load_writes(dtype):
    rng = np.random.default_rng(8)
    adapters = [random_adapter(rng, f"s{i}") for i in range(3)]
    inline, staged = make_pool(num_pages=400, dtype=dtype), make_pool(num_pages=400, dtype=dtype)
    for pool in (inline, staged):
        churn(pool, np.random.default_rng(9))  # same churn: same free pages in both
    for ad in adapters:
        rows = to_pool_rows(ad, CFG)
        st = staged.stage(rows)
        assert st.bucket == staged.page_bucket(rows.pages_needed(staged.page_rows)) == st.vectors.shape[1]
        assert st.vectors.dtype == staged.dtype and st.n_pages == rows.pages_needed(staged.page_rows)
        assert inline.load_adapter(ad.name, rows) == staged.load_adapter(ad.name, rows, st)
        assert inline.adapter_pages(ad.name) == staged.adapter_pages(ad.name)
    np.testing.assert_array_equal(np.asarray(inline.array.astype(jnp.float32)),
                                  np.asarray(staged.array.astype(jnp.float32)))
    for a, b in zip(inline.table, staged.table, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if dtype == jnp.float32:
        for ad in adapters:
            assert_adapter_resident(staged, ad)


def test_staged_pages_of_other_rows_are_refused_and_change_nothing():
    rng = np.random.default_rng(10)
    pool = make_pool(num_pages=200, max_slots=3)
    big = to_pool_rows(random_adapter(rng, "big", ranks=(32,), p_absent=0.0), CFG)
    small = to_pool_rows(random_adapter(rng, "small", ranks=(4,), p_absent=0.0), CFG)
    free, slots, array = pool.num_free_pages, pool.num_free_slots, np.asarray(pool.array)
    with pytest.raises(ValueError, match="staged pages"):
        pool.load_adapter("small", small, pool.stage(big))
    other = make_pool(num_pages=200, max_slots=3, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="staged pages"):
        pool.load_adapter("small", small, other.stage(small))
    assert (pool.num_free_pages, pool.num_free_slots, "small" in pool) == (free, slots, False)
    np.testing.assert_array_equal(np.asarray(pool.array), array)


def test_staged_and_inline_loads_share_one_scatter_compile():
    from slora_jax.engine import pool as pool_mod

    if not hasattr(pool_mod._write_pages, "_cache_size"):
        pytest.skip("jit cache introspection not available in this jax")
    rng = np.random.default_rng(11)
    pool = make_pool(num_pages=176, max_slots=3, max_rank=16)  # a pool shape no other test uses
    ads = [random_adapter(rng, f"c{i}", ranks=(4,), p_absent=0.0) for i in range(2)]  # 16 pages each
    scatter0 = pool_mod._write_pages._cache_size()
    pool.load_adapter("c0", to_pool_rows(ads[0], CFG))
    rows = to_pool_rows(ads[1], CFG)
    pool.load_adapter("c1", rows, pool.stage(rows))
    assert pool_mod._write_pages._cache_size() - scatter0 <= 1
    for ad in ads:
        assert_adapter_resident(pool, ad)



def test_slot_modules_mirror_what_each_resident_adapter_targets():
    """The host mirror the engine uses to skip LoRA kernels: set at load, cleared at unload, right on slot reuse."""
    rng = np.random.default_rng()
    pool = make_pool(max_slots=2)

    qv = random_adapter(rng, "qv", targets=("q_proj", "v_proj"), p_absent=0.0)
    mlp = random_adapter(rng, "mlp", targets=("down_proj",), p_absent=0.0)
    s_qv = pool.load_adapter("qv", to_pool_rows(qv, CFG))
    s_mlp = pool.load_adapter("mlp", to_pool_rows(mlp, CFG))
    assert pool.slot_modules[s_qv].tolist() == [m in ("q_proj", "v_proj") for m in MODULES]
    assert pool.slot_modules[s_mlp].tolist() == [m == "down_proj" for m in MODULES]
    pool.unload_adapter("qv")
    assert not pool.slot_modules[s_qv].any()
    assert pool.load_adapter("mlp2", to_pool_rows(mlp, CFG)) == s_qv
    assert pool.slot_modules[s_qv].tolist() == [m == "down_proj" for m in MODULES]
