"""Paged decode and ragged prefill attention against their jnp references and an independent dense softmax.

K/V are written with ``write_kv`` into one layer of a pool whose other pages and layers hold large junk, on pages
handed out by an allocator after random alloc/free churn (shuffled, non-contiguous); page-table entries past a
sequence's pages are junk too. Interpret mode starts output buffers as NaN, so any element a kernel forgets to write
shows up. CPU runs use interpret mode and tiny shapes; ``gpu`` tests run the compiled kernels at moderate sizes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_cache import gather_kv_reference, token_slots, write_kv
from pallas_kernels.paged_attention import (
    default_num_splits,
    default_pages_per_block,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_decode_attention_rope,
    paged_decode_attention_rope_reference,
)
from pallas_kernels.prefill_attention import (
    default_prefill_tiles,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    prefill_tile_map,
    prefill_tile_map_device,
)

ON_GPU = jax.default_backend() == "gpu"
JUNK = 1e4  # scale of whatever the pool holds outside the sequences' pages

# The jnp references and the cache writes run as one jitted program each: called eagerly, every op compiles on its
# own (a decode check made ~110 compiles, 5-6 s of its 10 s on the CPU; the GPU suite spent 20-50 s a check).
jit_token_slots = jax.jit(token_slots, static_argnums=3)
jit_write_kv = jax.jit(write_kv, static_argnums=5)
decode_reference = jax.jit(paged_decode_attention_reference,
                           static_argnames=("page_size", "num_kv_heads", "sm_scale", "num_splits"))
rope_reference_jit = jax.jit(paged_decode_attention_rope_reference,
                             static_argnames=("page_size", "num_heads", "num_kv_heads", "sm_scale"))
prefill_reference = jax.jit(paged_prefill_attention_reference,
                            static_argnames=("page_size", "num_kv_heads", "sm_scale", "block_q"))


class ChurnedAllocator:
    """Free list that has seen random alloc/free traffic, so sequences get shuffled, non-contiguous pages."""

    def __init__(self, num_pages: int, rng: np.random.Generator):
        self.rng = rng
        self.free = list(rng.permutation(num_pages))
        held = [self.take(int(rng.integers(1, 4))) for _ in range(num_pages // 6)]
        for pages in held:
            if rng.random() < 0.7:
                self.free += pages
        self.rng.shuffle(self.free)

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("test pool too small")
        return [self.free.pop(int(self.rng.integers(len(self.free)))) for _ in range(n)]


@dataclasses.dataclass
class Cache:
    """A pool with some sequences' K/V in one layer, plus the original K/V for dense checks."""

    pool: jax.Array  # [L, NP, 2*n_kv*P, hd]
    page_table: np.ndarray  # int32[B, max_pages]
    lens: np.ndarray  # int32[B]
    keys: list[np.ndarray]  # per sequence [len, n_kv, hd] float32
    values: list[np.ndarray]
    layer: int
    page_size: int
    num_kv_heads: int


def junk_pool(rng, num_layers, num_pages, num_kv_heads, page_size, head_dim) -> np.ndarray:
    shape = (num_layers, num_pages, 2 * num_kv_heads * page_size, head_dim)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(JUNK)


def build_cache(rng, lens, *, num_kv_heads, head_dim, page_size, num_layers=3, layer=1, max_pages=None,
                prior_lens=None, dtype=jnp.float32) -> Cache:
    """Write sequences of ``lens`` tokens into ``layer``: first ``prior_lens`` tokens, then the rest, as an engine
    would (two write_kv calls with padding slots mixed in)."""
    lens = np.asarray(lens, np.int32)
    prior_lens = np.zeros_like(lens) if prior_lens is None else np.asarray(prior_lens, np.int32)
    pages_needed = -(-lens // page_size)
    max_pages = max_pages or int(pages_needed.max(initial=0)) + 2
    num_pages = int(pages_needed.sum()) * 2 + 16
    alloc = ChurnedAllocator(num_pages, rng)
    # Junk entries past each sequence's pages: other pages, out-of-range ids, -1.
    table = rng.integers(-1, num_pages + 8, size=(len(lens), max_pages)).astype(np.int32)
    for p in range(int(pages_needed.max(initial=0))):  # round-robin so sequences' pages interleave
        for b in np.flatnonzero(pages_needed > p):
            table[b, p] = alloc.take(1)[0]
    keys = [rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32) for n in lens]
    values = [rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32) for n in lens]
    pool = jnp.asarray(junk_pool(rng, num_layers, num_pages, num_kv_heads, page_size, head_dim), dtype)
    for lo, hi in ((np.zeros_like(lens), prior_lens), (prior_lens, lens)):
        spans = list(zip(lo, hi, strict=True))
        seq_ids = np.concatenate([np.full(end - start, b) for b, (start, end) in enumerate(spans)] + [[-1] * 3])
        pos = np.concatenate([np.arange(start, end) for start, end in spans] + [[0] * 3])
        order = rng.permutation(len(seq_ids))
        seq_ids, pos = seq_ids[order].astype(np.int32), pos[order].astype(np.int32)
        slots = jit_token_slots(jnp.asarray(table), jnp.asarray(seq_ids), jnp.asarray(pos), page_size)
        k = np.stack([keys[s][p] if s >= 0 else np.zeros((num_kv_heads, head_dim), np.float32)
                      for s, p in zip(seq_ids, pos, strict=True)])
        v = np.stack([values[s][p] if s >= 0 else np.zeros((num_kv_heads, head_dim), np.float32)
                      for s, p in zip(seq_ids, pos, strict=True)])
        pool = jit_write_kv(pool, jnp.int32(layer), jnp.asarray(k, dtype), jnp.asarray(v, dtype), slots, page_size)
    return Cache(pool, table, lens, keys, values, layer, page_size, num_kv_heads)


def dense_attention(q, keys, values, positions, sm_scale) -> np.ndarray:
    """Softmax attention of q [n, H, hd] at ``positions`` over keys/values [S, n_kv, hd] (positions <= own)."""
    num_heads = q.shape[1]
    group = num_heads // keys.shape[1]
    k = np.repeat(keys.astype(np.float64), group, axis=1)
    v = np.repeat(values.astype(np.float64), group, axis=1)
    scores = np.einsum("thd,shd->ths", q.astype(np.float64), k) * sm_scale
    scores = np.where(np.arange(len(keys))[None, None, :] <= np.asarray(positions)[:, None, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("ths,shd->thd", probs / probs.sum(-1, keepdims=True), v)


def assert_close(actual, expected, tol):
    actual = np.asarray(actual, np.float32)
    assert np.isfinite(actual).all(), "kernel output has NaN/inf (unwritten or poisoned values)"
    np.testing.assert_allclose(actual, np.asarray(expected, np.float32), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------------- write_kv


def test_write_kv_places_rows_and_drops_padding():
    rng = np.random.default_rng(0)
    num_layers, num_pages, page_size, num_kv_heads, head_dim, layer = 3, 7, 4, 2, 8, 2
    pool = junk_pool(rng, num_layers, num_pages, num_kv_heads, page_size, head_dim)
    slots = np.array([5, -1, 0, 27, -1, 13], np.int32)
    k = rng.standard_normal((len(slots), num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((len(slots), num_kv_heads, head_dim)).astype(np.float32)
    write = jax.jit(write_kv, static_argnums=5, donate_argnums=0)
    out = np.asarray(write(jnp.asarray(pool), jnp.int32(layer), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                           page_size))
    expected = pool.copy()
    kv_view = expected.reshape(num_layers, num_pages, 2, num_kv_heads, page_size, head_dim)
    for t, slot in enumerate(slots):
        if slot >= 0:
            kv_view[layer, slot // page_size, 0, :, slot % page_size] = k[t]
            kv_view[layer, slot // page_size, 1, :, slot % page_size] = v[t]
    np.testing.assert_array_equal(out, expected)


def test_gather_kv_reference_round_trips():
    rng = np.random.default_rng(1)
    cache = build_cache(rng, [5, 19, 1], num_kv_heads=2, head_dim=8, page_size=4, prior_lens=[2, 10, 0])
    k, v = gather_kv_reference(cache.pool, jnp.int32(cache.layer), jnp.asarray(cache.page_table),
                               num_kv_heads=2, page_size=4)
    for b, n in enumerate(cache.lens):
        np.testing.assert_array_equal(np.asarray(k[b, :n]), cache.keys[b])
        np.testing.assert_array_equal(np.asarray(v[b, :n]), cache.values[b])


# ------------------------------------------------------------------------------------------------------ decode

DECODE_CASES = [  # (num_kv_heads, num_heads, head_dim, page_size, num_splits)
    pytest.param(2, 2, 64, 16, 1, id="mha-hd64-one-split"),
    pytest.param(1, 4, 128, 8, 3, id="gqa4-hd128-three-splits"),
    pytest.param(1, 8, 64, 16, None, id="gqa8-hd64-default-splits"),
]


@pytest.mark.parametrize("num_kv_heads,num_heads,head_dim,page_size,num_splits", DECODE_CASES)
def test_paged_decode_matches_reference_and_dense(num_kv_heads, num_heads, head_dim, page_size, num_splits):
    rng = np.random.default_rng(hash((num_heads, head_dim, page_size)) % 2**32)
    lens = np.concatenate([rng.integers(1, 301, size=3), [0]])  # a padding row with no context
    cache = build_cache(rng, lens, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size)
    q = rng.standard_normal((len(lens), num_heads, head_dim)).astype(np.float32)
    sm_scale = head_dim**-0.5
    args = (jnp.asarray(q), cache.pool, jnp.int32(cache.layer), jnp.asarray(cache.page_table), jnp.asarray(lens))
    kw = dict(page_size=page_size, num_kv_heads=num_kv_heads, sm_scale=sm_scale, num_splits=num_splits)
    out = paged_decode_attention(*args, **kw)
    ref = decode_reference(*args, **kw)
    assert_close(out, ref, 2e-5)
    for b, n in enumerate(lens):
        if n == 0:
            np.testing.assert_array_equal(np.asarray(out[b]), 0.0)
        else:
            dense = dense_attention(q[b][None], cache.keys[b], cache.values[b], [n - 1], sm_scale)[0]
            assert_close(out[b], dense, 2e-5)


def test_paged_decode_bf16_pool():
    rng = np.random.default_rng(7)
    lens = rng.integers(1, 301, size=2)
    cache = build_cache(rng, lens, num_kv_heads=1, head_dim=64, page_size=16, dtype=jnp.bfloat16, layer=2)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    args = (jnp.asarray(q, jnp.bfloat16), cache.pool, jnp.int32(2), jnp.asarray(cache.page_table), jnp.asarray(lens))
    kw = dict(page_size=16, num_kv_heads=1, sm_scale=0.125, num_splits=2)
    out = paged_decode_attention(*args, **kw)
    assert out.dtype == jnp.bfloat16
    assert_close(out, decode_reference(*args, **kw), 2e-2)


# ------------------------------------------------------------------------------------ decode with RoPE and KV write

ROPE_CASES = [  # (num_kv_heads, num_heads, head_dim, page_size, num_splits, lens, max_pages)
    # one split; a context of only the new token; the new token alone in a 64-token block (65 = 64 + 1); padding
    pytest.param(2, 2, 64, 16, 1, [65, 1, 140, 0], None, id="mha-one-split"),
    pytest.param(1, 4, 128, 8, 3, [129, 2, 300, 0], None, id="gqa4-three-splits"),
    # a 64-page table: 16 blocks, so the default takes 4 splits (the short rows leave some splits empty)
    pytest.param(1, 8, 64, 16, None, [257, 37, 1, 0], 64, id="gqa8-default-splits"),
]


def rope_case(rng, num_kv_heads, num_heads, head_dim, page_size, lens, dtype, max_pages=None):
    """A cache holding each sequence's first ``len - 1`` tokens (the new token's slot holds junk), the step's
    unrotated qkv rows, cos/sin of the new positions and the new tokens' slots."""
    lens = np.asarray(lens, np.int32)
    cache = build_cache(rng, lens, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
                        max_pages=max_pages)
    positions = np.maximum(lens - 1, 0)
    slots = np.asarray(jit_token_slots(jnp.asarray(cache.page_table), jnp.asarray(np.where(lens > 0, 0, -1) +
                                       np.arange(len(lens)) * (lens > 0)), jnp.asarray(positions), page_size))
    slots = np.where(lens > 0, slots, -1).astype(np.int32)
    # poison the new token's slot: a kernel that read it instead of its registers would go wrong
    pool = np.array(cache.pool, np.float32)
    kv_view = pool.reshape(pool.shape[0], pool.shape[1], 2, num_kv_heads, page_size, head_dim)
    for slot in slots[slots >= 0]:
        kv_view[cache.layer, slot // page_size, :, :, slot % page_size] = 3e4
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = rng.standard_normal((len(lens), width)).astype(np.float32)
    inv = 1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)
    angles = positions[:, None] * inv[None, :]
    angles = np.concatenate([angles, angles], axis=1)
    return cache, jnp.asarray(pool, dtype), qkv, np.cos(angles).astype(np.float32), np.sin(angles).astype(
        np.float32), slots


def rotate_np(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


@pytest.mark.parametrize("num_kv_heads,num_heads,head_dim,page_size,num_splits,lens,max_pages", ROPE_CASES)
def test_paged_decode_rope_matches_unfused_steps_and_dense(num_kv_heads, num_heads, head_dim, page_size, num_splits,
                                                           lens, max_pages):
    rng = np.random.default_rng()
    cache, pool, qkv, cos, sin, slots = rope_case(rng, num_kv_heads, num_heads, head_dim, page_size, lens,
                                                  jnp.float32, max_pages)
    if num_splits is None:  # the case is there to run the default's several splits
        blocks = -(-cache.page_table.shape[1] // default_pages_per_block(page_size))
        assert default_num_splits(len(lens), num_kv_heads, blocks) > 1
    lens = np.asarray(lens, np.int32)
    sm_scale = head_dim**-0.5
    kw = dict(page_size=page_size, num_heads=num_heads, num_kv_heads=num_kv_heads, sm_scale=sm_scale)
    args = (jnp.asarray(qkv), jnp.asarray(cos), jnp.asarray(sin))
    rest = (jnp.int32(cache.layer), jnp.asarray(cache.page_table), jnp.asarray(lens), jnp.asarray(slots))
    want_out, want_pool = rope_reference_jit(*args, jnp.array(pool, copy=True), *rest, **kw)
    out, new_pool = paged_decode_attention_rope(*args, jnp.array(pool, copy=True), *rest, **kw,
                                                num_splits=num_splits)
    assert_close(out, want_out, 2e-5)
    # the new rows (rounding order of the rotation aside), nothing else
    np.testing.assert_allclose(np.asarray(new_pool), np.asarray(want_pool), rtol=1e-6, atol=1e-6)
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    for b, n in enumerate(lens):
        if n == 0:
            np.testing.assert_array_equal(np.asarray(out[b]), 0.0)
            continue
        q = rotate_np(qkv[b, :q_width].reshape(1, num_heads, head_dim), cos[b], sin[b])
        k_new = rotate_np(qkv[b, q_width:q_width + kv_width].reshape(1, num_kv_heads, head_dim), cos[b], sin[b])
        v_new = qkv[b, q_width + kv_width:].reshape(1, num_kv_heads, head_dim)
        keys = np.concatenate([cache.keys[b][: n - 1], k_new])
        values = np.concatenate([cache.values[b][: n - 1], v_new])
        assert_close(out[b], dense_attention(q, keys, values, [n - 1], sm_scale)[0], 2e-5)


def test_paged_decode_rope_bf16():
    rng = np.random.default_rng()
    cache, pool, qkv, cos, sin, slots = rope_case(rng, 1, 4, 64, 16, [90, 200, 0], jnp.bfloat16)
    kw = dict(page_size=16, num_heads=4, num_kv_heads=1, sm_scale=0.125)
    args = (jnp.asarray(qkv, jnp.bfloat16), jnp.asarray(cos), jnp.asarray(sin))
    rest = (jnp.int32(cache.layer), jnp.asarray(cache.page_table), jnp.asarray([90, 200, 0], jnp.int32),
            jnp.asarray(slots))
    want_out, want_pool = rope_reference_jit(*args, jnp.array(pool, copy=True), *rest, **kw)
    out, new_pool = paged_decode_attention_rope(*args, jnp.array(pool, copy=True), *rest, **kw, num_splits=2)
    assert out.dtype == jnp.bfloat16
    assert_close(out, want_out, 2e-2)
    np.testing.assert_allclose(np.asarray(new_pool, np.float32), np.asarray(want_pool, np.float32), rtol=8e-3,
                               atol=1e-6)  # one bf16 step of rounding


# ----------------------------------------------------------------------------------------------------- prefill


def test_prefill_tile_map_host_equals_device_and_covers_rows():
    rng = np.random.default_rng(3)
    block_q = 16
    n_new = np.array([0, 37, 16, 1, 90])
    lens = n_new + rng.integers(0, 50, size=len(n_new))
    q_starts = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    num_rows = int(q_starts[-1]) + 21
    host = prefill_tile_map(q_starts, lens, num_rows, block_q)
    device = np.asarray(prefill_tile_map_device(jnp.asarray(q_starts), jnp.asarray(lens, jnp.int32), num_rows,
                                                block_q))
    np.testing.assert_array_equal(host, device)
    covered = np.zeros(num_rows, int)
    for seq, row_start, row_end, pos_start in host:
        rows = np.arange(row_start, min(row_start + block_q, row_end))
        covered[rows] += 1
        if len(rows) and row_start < q_starts[-1]:
            assert q_starts[seq] <= row_start and row_end == q_starts[seq + 1]
            assert pos_start == lens[seq] - n_new[seq] + row_start - q_starts[seq]
    np.testing.assert_array_equal(covered, 1)


PREFILL_CASES = [  # (num_kv_heads, num_heads, head_dim, page_size, block_q, block_k, continue_cache, host_tiles)
    pytest.param(2, 2, 64, 16, 32, 32, False, False, id="mha-hd64-fresh"),
    pytest.param(1, 4, 128, 8, 32, 32, True, True, id="gqa4-hd128-continue-host-tiles"),
    pytest.param(1, 8, 64, 16, 16, 64, True, False, id="gqa8-hd64-continue"),
]


@pytest.mark.parametrize("num_kv_heads,num_heads,head_dim,page_size,block_q,block_k,continue_cache,host_tiles",
                         PREFILL_CASES)
def test_paged_prefill_matches_reference_and_dense(num_kv_heads, num_heads, head_dim, page_size, block_q, block_k,
                                                   continue_cache, host_tiles):
    rng = np.random.default_rng(hash((num_heads, head_dim, continue_cache)) % 2**32)
    batch = 3
    if continue_cache:  # prior cache, a sequence with no new tokens, totals up to 300
        n_new = np.array([int(rng.integers(1, 100)), 0, int(rng.integers(1, 100))])
        prior = rng.integers(1, 201, size=batch)
    else:
        n_new = rng.integers(1, 121, size=batch)
        prior = np.zeros(batch, np.int64)
    lens = (prior + n_new).astype(np.int32)
    cache = build_cache(rng, lens, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                        prior_lens=prior, layer=2)
    q_starts = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    num_rows = int(q_starts[-1]) + 5  # padding rows must come back as zeros
    q = rng.standard_normal((num_rows, num_heads, head_dim)).astype(np.float32)
    sm_scale = head_dim**-0.5
    args = (jnp.asarray(q), cache.pool, jnp.int32(cache.layer), jnp.asarray(cache.page_table), jnp.asarray(q_starts),
            jnp.asarray(lens))
    kw = dict(page_size=page_size, num_kv_heads=num_kv_heads, sm_scale=sm_scale, block_q=block_q)
    tiles = jnp.asarray(prefill_tile_map(q_starts, lens, num_rows, block_q)) if host_tiles else None
    out = paged_prefill_attention(*args, **kw, block_k=block_k, tile_map=tiles)
    assert_close(out, prefill_reference(*args, **kw), 2e-5)
    np.testing.assert_array_equal(np.asarray(out[q_starts[-1]:]), 0.0)
    for b in range(batch):
        positions = prior[b] + np.arange(n_new[b])
        dense = dense_attention(q[q_starts[b]:q_starts[b + 1]], cache.keys[b], cache.values[b], positions, sm_scale)
        assert_close(out[q_starts[b]:q_starts[b + 1]], dense, 2e-5)


def test_default_prefill_tiles():
    """Defaults measured on an H200: big query tiles take 128 keys, 8 warps, 2 stages; small ones keep 64 keys."""
    assert default_prefill_tiles() == (128, 128, 8, 2)
    assert default_prefill_tiles(128, 64) == (128, 64, 4, 3)
    assert default_prefill_tiles(16) == (16, 64, 4, 3)
    assert default_prefill_tiles(64, 64, 8, 4) == (64, 64, 8, 4)


# ---------------------------------------------------------------------------------------------- GPU (compiled)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("num_kv_heads,num_heads", [(8, 8), (8, 32), (2, 16)])
@pytest.mark.parametrize("num_splits", [1, None])
def test_gpu_paged_decode(num_kv_heads, num_heads, num_splits):
    rng = np.random.default_rng(11)
    lens = np.concatenate([rng.integers(1, 3000, size=15), [0]])
    cache = build_cache(rng, lens, num_kv_heads=num_kv_heads, head_dim=128, page_size=16, dtype=jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((len(lens), num_heads, 128)), jnp.bfloat16)
    args = (q, cache.pool, jnp.int32(cache.layer), jnp.asarray(cache.page_table), jnp.asarray(lens))
    kw = dict(page_size=16, num_kv_heads=num_kv_heads, sm_scale=128**-0.5, num_splits=num_splits)
    out = paged_decode_attention(*args, **kw, interpret=False)
    assert_close(out, decode_reference(*args, **kw), 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("num_kv_heads,num_heads,head_dim", [(8, 8, 128), (8, 32, 128), (4, 16, 64)])
@pytest.mark.parametrize("block_q,block_k", [(128, 64), (64, 64), (128, None)])
def test_gpu_paged_prefill(num_kv_heads, num_heads, head_dim, block_q, block_k):
    rng = np.random.default_rng(12)
    n_new = np.array([700, 1, 0, 300])
    prior = np.array([0, 900, 40, 250])
    lens = (n_new + prior).astype(np.int32)
    cache = build_cache(rng, lens, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=16, prior_lens=prior,
                        dtype=jnp.bfloat16)
    q_starts = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    num_rows = int(q_starts[-1]) + 24
    q = jnp.asarray(rng.standard_normal((num_rows, num_heads, head_dim)), jnp.bfloat16)
    args = (q, cache.pool, jnp.int32(cache.layer), jnp.asarray(cache.page_table), jnp.asarray(q_starts),
            jnp.asarray(lens))
    kw = dict(page_size=16, num_kv_heads=num_kv_heads, sm_scale=head_dim**-0.5, block_q=block_q)
    out = paged_prefill_attention(*args, **kw, block_k=block_k, interpret=False)
    assert_close(out, prefill_reference(*args, **kw), 2e-2)
    np.testing.assert_array_equal(np.asarray(out[q_starts[-1]:], np.float32), 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("num_kv_heads,num_heads", [(8, 8), (8, 32), (32, 32)])
@pytest.mark.parametrize("num_splits", [1, None])
def test_gpu_paged_decode_rope(num_kv_heads, num_heads, num_splits):
    rng = np.random.default_rng()
    lens = np.concatenate([rng.integers(2, 3000, size=13), [1, 65, 0]])
    cache, pool, qkv, cos, sin, slots = rope_case(rng, num_kv_heads, num_heads, 128, 16, lens, jnp.bfloat16)
    kw = dict(page_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, sm_scale=128**-0.5)
    args = (jnp.asarray(qkv, jnp.bfloat16), jnp.asarray(cos), jnp.asarray(sin))
    rest = (jnp.int32(cache.layer), jnp.asarray(cache.page_table), jnp.asarray(lens, jnp.int32), jnp.asarray(slots))
    want_out, want_pool = rope_reference_jit(*args, jnp.array(pool, copy=True), *rest, **kw)
    out, new_pool = paged_decode_attention_rope(*args, jnp.array(pool, copy=True), *rest, **kw,
                                                num_splits=num_splits, interpret=False)
    assert_close(out, want_out, 2e-2)
    np.testing.assert_allclose(np.asarray(new_pool, np.float32), np.asarray(want_pool, np.float32), rtol=8e-3,
                               atol=1e-6)  # one bf16 step of rounding
