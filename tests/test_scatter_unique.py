"""The pool's scatters (KV write, adapter page load) declare their indices unique, and still write what a plain loop
writes: padding dropped, every other slot or page set, nothing else touched.

Why: without ``unique_indices`` XLA's GPU scatter writes each element through an atomic read-modify-write, which for
bf16 is a compare-and-swap loop (measured ~250 GB/s on the H200, 6-8% of a prefill step). Declaring it is only right
while the indices really are distinct, padding included, so these tests check both the attribute and the values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_cache import write_kv
from slora_jax.engine.pool import PagedPool, _scatter_pages
from slora_jax.model.config import ModelConfig
from slora_jax.tools.synth import preset_config

L, NP, NKV, P, HD = 3, 7, 2, 4, 8  # layers, pages, kv heads, page size, head dim


def lowered_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def write_kv_loop(pool: np.ndarray, layer: int, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The KV write one token and head at a time (the layout of kv_cache's docstring)."""
    out = pool.copy()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        page, off = divmod(int(slot), P)
        for h in range(NKV):
            out[layer, page, h * P + off] = k[t, h]
            out[layer, page, (NKV + h) * P + off] = v[t, h]
    return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_write_kv_declares_unique_indices_and_matches_a_loop(dtype):
    rng = np.random.default_rng()
    n_tokens = 9
    pool = rng.standard_normal((L, NP, 2 * NKV * P, HD)).astype(np.float32)
    k, v = (rng.standard_normal((n_tokens, NKV, HD)).astype(np.float32) for _ in range(2))
    slots = rng.choice(NP * P, n_tokens, replace=False).astype(np.int32)  # distinct, as the engine gives them
    slots[rng.choice(n_tokens, 3, replace=False)] = -1  # padding among the tokens, several of it
    layer = int(rng.integers(L))
    args = (jnp.asarray(pool, dtype), jnp.int32(layer), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(slots))

    def fn(pool_, layer_, k_, v_, slots_):
        return write_kv(pool_, layer_, k_, v_, slots_, P)

    assert "unique_indices = true" in lowered_text(fn, *args)
    cast = np.asarray(jnp.asarray(pool, dtype).astype(jnp.float32))  # the inputs as the pool's dtype holds them
    k_c, v_c = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (k, v))
    want = write_kv_loop(cast, layer, k_c, v_c, slots)
    got = np.asarray(jax.jit(fn)(*args).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_page_load_declares_unique_indices_and_matches_a_loop(dtype):
    rng = np.random.default_rng()
    bucket, n_pages = 4, 3  # three pages of an adapter, one padding page in the bucket
    pool = rng.standard_normal((L, NP, 2 * NKV * P, HD)).astype(np.float32)
    vectors = rng.standard_normal((L, bucket, 2 * NKV * P, HD)).astype(np.float32)
    pages = rng.choice(NP, n_pages, replace=False)
    page_ids = NP + np.arange(bucket, dtype=np.int32)  # as PagedPool._page_ids pads: distinct, out of range
    page_ids[:n_pages] = pages
    args = (jnp.asarray(pool, dtype), jnp.asarray(page_ids), jnp.asarray(vectors, dtype))

    assert "unique_indices = true" in lowered_text(_scatter_pages, *args)
    want = np.asarray(args[0].astype(jnp.float32)).copy()
    want[:, pages] = np.asarray(args[2].astype(jnp.float32))[:, :n_pages]
    got = np.asarray(jax.jit(_scatter_pages)(*args).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)


def test_pool_pads_page_ids_with_distinct_out_of_range_ids():
    cfg = ModelConfig.from_dict(preset_config("tiny"), "tiny")
    pool = PagedPool(cfg, num_pages=16, page_size=4, max_rank=8, max_slots=4, dtype=jnp.float32)
    ids = pool._page_ids([5, 2, 9], 8)
    assert list(ids[:3]) == [5, 2, 9]
    assert len(set(ids.tolist())) == 8 and all(i >= pool.num_pages for i in ids[3:])
