"""Causal attention for a ragged batch of new tokens, reading K/V from the paged pool.

The new tokens' K/V are written to the pool first (``write_kv``), so one kernel covers fresh prompts (no prior cache)
and continuations of an existing cache (preemption recompute, prefix reuse): new token ``i`` of sequence ``b`` sits at
absolute position ``context_lens[b] - n_new[b] + i`` and attends to every position up to its own.

The grid is ``(tile, query head)``. A tile is ``block_q`` consecutive rows of one sequence; tiles are described by a
small int32 table ``tile_map[num_tiles, 4] = (seq, row_start, row_end, pos_start)`` whose length depends only on
static shapes (``max_prefill_tiles``), so one compile serves every batch of the same bucket. Tiles over rows past
``q_starts[-1]`` write zeros; unused tiles do nothing. Tiles are ordered longest first, which balances the causal
triangle over the SMs. Key blocks wholly below a tile's first position skip the causal mask.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kv_cache import check_pool_layout, gather_kv_reference
from pallas_kernels.lowering import any_spec, is_pow2, load, pallas_call, store
from pallas_kernels.paged_attention import MASK_VALUE, dot_f32, online_softmax_step

LOG2E = math.log2(math.e)
NO_POSITION = -(2**30)  # pos_start of tiles that attend to nothing (padding rows, unused tiles)
TILE_FIELDS = 4  # seq, row_start, row_end, pos_start


def max_prefill_tiles(num_rows: int, batch: int, block_q: int) -> int:
    """Upper bound on tiles for ``num_rows`` rows in ``batch`` sequences plus the padding group (static)."""
    return -(-num_rows // block_q) + batch


def prefill_tile_map(q_starts: np.ndarray, context_lens: np.ndarray, num_rows: int, block_q: int,
                     num_tiles: int | None = None) -> np.ndarray:
    """Host (numpy) tile table: int32[num_tiles, 4] rows ``(seq, row_start, row_end, pos_start)``.

    q_starts: int[B+1] cumulative row starts; context_lens: int[B] (incl. new tokens); num_rows: rows of q (T).
    ``num_tiles`` defaults to ``max_prefill_tiles``; a smaller bucket must still hold every tile.
    """
    q_starts = np.asarray(q_starts, dtype=np.int64)
    context_lens = np.asarray(context_lens, dtype=np.int64)
    batch = context_lens.shape[0]
    num_tiles = max_prefill_tiles(num_rows, batch, block_q) if num_tiles is None else num_tiles
    group_starts = q_starts  # groups 0..B-1 are sequences, group B the padding rows
    group_ends = np.append(q_starts[1:], num_rows)
    group_sizes = np.maximum(group_ends - group_starts, 0)
    n_new = q_starts[1:] - q_starts[:-1]
    rows = []
    for group, (start, size) in enumerate(zip(group_starts, group_sizes, strict=True)):
        for row_start in range(int(start), int(start + size), block_q):
            if group < batch:
                pos_start = context_lens[group] - n_new[group] + row_start - start
                rows.append((group, row_start, start + size, pos_start))
            else:
                rows.append((0, row_start, start + size, NO_POSITION))
    if len(rows) > num_tiles:
        raise ValueError(f"{len(rows)} tiles do not fit the bucket of {num_tiles}")
    rows += [(0, num_rows, num_rows, NO_POSITION)] * (num_tiles - len(rows))
    table = np.asarray(rows, dtype=np.int64).reshape(num_tiles, TILE_FIELDS)
    order = np.argsort(-_tile_work(table, block_q), kind="stable")
    return table[order].astype(np.int32)


def default_prefill_tiles(block_q: int = 128, block_k: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None) -> tuple[int, int, int, int]:
    """Resolve ``(block_q, block_k, num_warps, num_stages)``; measured on an H200 (benchmarks/NOTES.md, 2026-11-29).

    At 16k tokens (llama3-8b layout) 128x128 with 8 warps and 2 stages ran 291 TFLOP/s and 128x64 with 4 warps and 3
    stages 286, against 223 for the former 128x64 / 8 warps / 3 stages (sweep); in the full run 16k went from 261 to
    298 TFLOP/s (llama3-8b) and 239 to 275 (llama2-7b) with the new default. 128x128 with 3 stages would need ~224 KiB
    of shared memory, so big tiles take 2 stages. Small ``block_q`` (the engine's CPU default) keeps block_k 64.
    """
    if block_k is None:
        block_k = 128 if block_q >= 128 else 64
    big = block_q * block_k >= 128 * 128
    num_warps = num_warps or (8 if big else 4)
    num_stages = num_stages or (2 if big else 3)
    return block_q, block_k, num_warps, num_stages


def _tile_work(table, block_q: int):
    """Keys a tile attends to (its last position + 1); works on numpy and jnp tables."""
    xp = jnp if isinstance(table, jax.Array) else np
    rows_in_tile = xp.clip(table[:, 2] - table[:, 1], 0, block_q)
    return xp.maximum(table[:, 3] + rows_in_tile, 0)


def prefill_tile_map_device(q_starts: jax.Array, context_lens: jax.Array, num_rows: int, block_q: int) -> jax.Array:
    """Same table as :func:`prefill_tile_map` (default bucket), computed in jnp for callers that stay on device."""
    batch = context_lens.shape[0]
    num_tiles = max_prefill_tiles(num_rows, batch, block_q)
    q_starts = q_starts.astype(jnp.int32)
    context_lens = context_lens.astype(jnp.int32)
    group_starts = q_starts
    group_ends = jnp.append(q_starts[1:], num_rows)
    group_tiles = (jnp.maximum(group_ends - group_starts, 0) + block_q - 1) // block_q
    tiles_end = jnp.cumsum(group_tiles)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.searchsorted(tiles_end, tile, side="right").astype(jnp.int32)
    used = group <= batch
    group_safe = jnp.minimum(group, batch)
    row_start = group_starts[group_safe] + (tile - (tiles_end[group_safe] - group_tiles[group_safe])) * block_q
    is_seq = group < batch
    seq_safe = jnp.minimum(group, batch - 1)
    n_new = q_starts[seq_safe + 1] - q_starts[seq_safe]
    pos_start = context_lens[seq_safe] - n_new + row_start - group_starts[seq_safe]
    table = jnp.stack([
        jnp.where(is_seq, group, 0),
        jnp.where(used, row_start, num_rows),
        jnp.where(used, group_ends[group_safe], num_rows),
        jnp.where(is_seq, pos_start, NO_POSITION),
    ], axis=1)
    order = jnp.argsort(-_tile_work(table, block_q), stable=True)
    return table[order]


def _prefill_kernel(tile_ref, q_ref, pool_ref, layer_ref, page_table_ref, o_ref, *, block_q: int, block_k: int,
                    head_dim: int, group: int, page_size: int, num_kv_heads: int, num_pages: int, page_rows: int,
                    scale_log2: float):
    """One (tile, query head): online softmax over key blocks, unmasked below the tile's first position.

    tile_ref: int32[num_tiles, 4]; q_ref, o_ref: [T, n_heads*hd]; pool_ref: [L*NP*page_rows, hd];
    layer_ref: int32[1]; page_table_ref: int32[B, max_pages].
    """
    tile = pl.program_id(0)
    q_head = pl.program_id(1)
    kv_head = q_head // group
    seq = tile_ref[tile, 0]
    row_start = tile_ref[tile, 1]
    row_end = tile_ref[tile, 2]
    pos_start = tile_ref[tile, 3]
    layer = layer_ref[0]

    offsets = jnp.arange(block_q, dtype=jnp.int32)
    rows = row_start + offsets
    row_ok = rows < row_end
    positions = pos_start + offsets
    cols = jnp.arange(head_dim, dtype=jnp.int32)
    q_cols = q_head * head_dim + cols
    q = load(q_ref.at[rows[:, None], q_cols[None, :]], mask=row_ok[:, None], other=0.0).astype(pool_ref.dtype)

    rows_in_tile = jnp.clip(row_end - row_start, 0, block_q)
    kv_len = jnp.maximum(pos_start + rows_in_tile, 0)  # keys up to the last valid row's position
    num_blocks = lax.div(kv_len + (block_k - 1), block_k)
    unmasked_blocks = jnp.minimum(lax.div(jnp.maximum(pos_start + 1, 0), block_k), num_blocks)
    k_row0 = kv_head * page_size
    v_row0 = (num_kv_heads + kv_head) * page_size
    seq_toks = jnp.full((block_k,), seq, dtype=jnp.int32)

    def body(block, carry, masked: bool):
        acc, m_prev, l_prev = carry
        tok = block * block_k + jnp.arange(block_k, dtype=jnp.int32)
        if masked:
            tok_ok = tok < kv_len
            page = load(page_table_ref.at[seq_toks, lax.div(tok, page_size)], mask=tok_ok, other=0)
            kv_mask = dict(mask=tok_ok[:, None], other=0.0)
        else:
            page = load(page_table_ref.at[seq_toks, lax.div(tok, page_size)])
            kv_mask = {}
        row = (layer * num_pages + page) * page_rows + lax.rem(tok, page_size)
        k = load(pool_ref.at[(row + k_row0)[:, None], cols[None, :]], **kv_mask)
        v = load(pool_ref.at[(row + v_row0)[:, None], cols[None, :]], **kv_mask)
        scores = dot_f32(q, k, trans_b=True) * scale_log2  # [block_q, block_k] f32, log2 domain
        if masked:
            causal = (tok[None, :] <= positions[:, None]) & tok_ok[None, :]
            scores = jnp.where(causal, scores, MASK_VALUE)
        return online_softmax_step(acc, m_prev, l_prev, scores, v)

    carry = (jnp.zeros((block_q, head_dim), jnp.float32), jnp.full((block_q,), MASK_VALUE, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    carry = lax.fori_loop(0, unmasked_blocks, functools.partial(body, masked=False), carry)
    acc, _, denom = lax.fori_loop(unmasked_blocks, num_blocks, functools.partial(body, masked=True), carry)
    out = acc / jnp.where(denom > 0, denom, 1.0)[:, None]  # rows that see no keys (padding) -> zeros
    store(o_ref.at[rows[:, None], q_cols[None, :]], out.astype(o_ref.dtype), mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("page_size", "num_kv_heads", "sm_scale", "block_q", "block_k",
                                             "interpret", "num_warps", "num_stages"))
def paged_prefill_attention(q: jax.Array, pool: jax.Array, layer: jax.Array, page_table: jax.Array,
                            q_starts: jax.Array, context_lens: jax.Array, *, page_size: int, num_kv_heads: int,
                            sm_scale: float, block_q: int = 128, block_k: int | None = None,
                            tile_map: jax.Array | None = None, interpret: bool | None = None,
                            num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """Causal attention of new tokens over their sequences' paged K/V (the new K/V already written).

    q: [T, n_heads, hd] (sequence b's rows are ``q_starts[b]:q_starts[b+1]``); pool: [L, NP, 2*n_kv*P, hd];
    layer: int32 scalar; page_table: int32[B, max_pages]; q_starts: int32[B+1] (q_starts[0] = 0); context_lens:
    int32[B] (total tokens incl. the new ones) -> [T, n_heads, hd] in q.dtype, zeros for rows past ``q_starts[-1]``.
    tile_map: optional int32[num_tiles, 4] from :func:`prefill_tile_map` (host); computed on device when omitted.
    block_k, num_warps, num_stages: None picks :func:`default_prefill_tiles`.
    """
    block_q, block_k, num_warps, num_stages = default_prefill_tiles(block_q, block_k, num_warps, num_stages)
    num_rows, num_heads, head_dim = q.shape
    num_layers, num_pages, page_rows, _ = pool.shape
    check_pool_layout(pool, num_kv_heads, page_size, head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"n_heads {num_heads} is not a multiple of n_kv {num_kv_heads}")
    if not all(is_pow2(n) for n in (head_dim, block_q, block_k)) or min(block_q, block_k) < 16:
        raise ValueError("head_dim, block_q and block_k must be powers of two; blocks at least 16")
    if num_layers * num_pages * page_rows >= 2**31:
        raise ValueError("pool has too many rows for int32 row indices")
    if tile_map is None:
        tile_map = prefill_tile_map_device(q_starts, context_lens, num_rows, block_q)
    num_tiles = tile_map.shape[0]
    kernel = functools.partial(
        _prefill_kernel, block_q=block_q, block_k=block_k, head_dim=head_dim, group=num_heads // num_kv_heads,
        page_size=page_size, num_kv_heads=num_kv_heads, num_pages=num_pages, page_rows=page_rows,
        scale_log2=float(sm_scale) * LOG2E)
    out = pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((num_rows, num_heads * head_dim), q.dtype),
        grid=(num_tiles, num_heads), in_specs=[any_spec()] * 5, out_specs=any_spec(), interpret=interpret,
        num_warps=num_warps, num_stages=num_stages,
        name=f"paged_prefill_bq{block_q}_bk{block_k}",
    )(tile_map.astype(jnp.int32), q.reshape(num_rows, num_heads * head_dim), pool.reshape(-1, head_dim),
      jnp.asarray(layer, jnp.int32).reshape(1), page_table.astype(jnp.int32))
    return out.reshape(num_rows, num_heads, head_dim)


def paged_prefill_attention_reference(q: jax.Array, pool: jax.Array, layer: jax.Array, page_table: jax.Array,
                                      q_starts: jax.Array, context_lens: jax.Array, *, page_size: int,
                                      num_kv_heads: int, sm_scale: float, block_q: int | None = None,
                                      interpret: bool | None = None, **_tuning) -> jax.Array:
    """Plain jnp version, same signature (tuning arguments ignored); f32 math, result in q.dtype.

    Scans over sequences with [T, n_heads, max_pages*P] f32 scores per step, so it is for checks and baselines.
    """
    del block_q, interpret
    num_rows, num_heads, head_dim = q.shape
    batch = context_lens.shape[0]
    group = num_heads // num_kv_heads
    k_all, v_all = gather_kv_reference(pool, layer, page_table, num_kv_heads=num_kv_heads, page_size=page_size)
    num_tokens = k_all.shape[1]
    rows = jnp.arange(num_rows)
    row_seq = jnp.clip(jnp.searchsorted(q_starts, rows, side="right") - 1, 0, batch - 1)
    row_ok = (rows >= q_starts[0]) & (rows < q_starts[batch])
    n_new = q_starts[1:] - q_starts[:-1]
    positions = context_lens[row_seq] - n_new[row_seq] + rows - q_starts[row_seq]
    q_grouped = q.reshape(num_rows, num_kv_heads, group, head_dim).astype(jnp.float32)
    hi = lax.Precision.HIGHEST

    def one_sequence(out, seq):
        k = k_all[seq].astype(jnp.float32)
        v = v_all[seq].astype(jnp.float32)
        visible = (jnp.arange(num_tokens)[None, :] <= positions[:, None]) & (row_seq == seq)[:, None] & row_ok[:, None]
        scores = jnp.einsum("tkgd,skd->tkgs", q_grouped, k, precision=hi) * sm_scale
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        row_max = scores.max(axis=-1, keepdims=True)
        probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
        denominator = probs.sum(axis=-1, keepdims=True)
        v = jnp.where((jnp.arange(num_tokens) < context_lens[seq])[:, None, None], v, 0.0)
        attended = jnp.einsum("tkgs,skd->tkgd", probs, v, precision=hi) / jnp.where(denominator > 0, denominator, 1)
        return out + jnp.where((row_seq == seq)[:, None, None, None] & row_ok[:, None, None, None], attended, 0), None

    out, _ = lax.scan(one_sequence, jnp.zeros_like(q_grouped), jnp.arange(batch))
    return out.reshape(num_rows, num_heads, head_dim).astype(q.dtype)
