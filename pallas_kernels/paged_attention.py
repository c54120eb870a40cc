"""Paged decode attention (one new query token per sequence) over the unified pool.

Flash-decoding: program ``(b, h, s)`` handles kv head ``h`` of sequence ``b`` for split ``s`` of its context, with all
``n_heads / n_kv`` query heads of that kv head as the rows of one ``tl.dot`` (padded to 16 rows), so every K/V page is
read once per kv head. Each sequence's own context is divided evenly over the splits, so batch 1 with a long context
still fills the GPU; a small jnp step merges the splits with log-sum-exp. With one split the kernel writes the final
output directly.

Pool layout (docs/DESIGN.md): ``pool[L, NP, 2*n_kv*P, hd]``, KV view ``[L, NP, 2, n_kv, P, hd]``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kv_cache import check_pool_layout, gather_kv_reference
from pallas_kernels.lowering import any_spec, is_pow2, load, next_pow2, pallas_call, store

MASK_VALUE = -1e30  # finite, so fully masked rows never compute inf - inf
LOG2E = math.log2(math.e)
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows
TARGET_PROGRAMS = 512  # about four programs per SM on an H200 (132 SMs)
MIN_BLOCKS_PER_SPLIT = 4


def default_pages_per_block(page_size: int) -> int:
    """Pages per inner step: about 64 tokens, at least 16 (the smallest dot)."""
    return max(1, 64 // page_size, MIN_DOT_ROWS // page_size)


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int) -> int:
    """Split the context until there are enough programs to fill the GPU, keeping a few blocks per split."""
    splits = 1
    while batch * num_kv_heads * splits < TARGET_PROGRAMS and 2 * splits * MIN_BLOCKS_PER_SPLIT <= max_blocks:
        splits *= 2
    return splits


def dot_f32(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
    """``a @ b`` (or ``a @ b.T``) accumulated in f32; lowers to ``tl.dot`` (``pl.dot`` moves between jax versions)."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def online_softmax_step(acc, m_prev, l_prev, scores, v):
    """One key block of flash attention (log2 domain): rescale the running sums, add this block's weighted values.

    acc [rows, hd] f32, m_prev / l_prev [rows] running max and denominator, scores [rows, block_k] (masked entries
    MASK_VALUE), v [block_k, hd]. Returns the new (acc, m, l).
    """
    m_new = jnp.maximum(m_prev, scores.max(axis=1))
    alpha = jnp.exp2(m_prev - m_new)
    p = jnp.exp2(scores - m_new[:, None])
    l_new = l_prev * alpha + p.sum(axis=1)
    return acc * alpha[:, None] + dot_f32(p.astype(v.dtype), v), m_new, l_new


def _decode_kernel(q_ref, pool_ref, layer_ref, page_table_ref, lens_ref, *out_refs, group: int, group_pad: int,
                   head_dim: int, page_size: int, num_kv_heads: int, num_pages: int, page_rows: int, block_k: int,
                   num_splits: int, scale_log2: float):
    """One (sequence, kv head, split): online softmax over the split's blocks of ``block_k`` tokens.

    q_ref: [B, n_heads, hd]; pool_ref: [L*NP*page_rows, hd]; layer_ref: int32[1]; page_table_ref: int32[B, max_pages];
    lens_ref: int32[B]. Outputs: ``o[B, n_heads, hd]`` (one split) or ``acc[B, S, n_heads, hd]``, ``m[B, S, n_heads]``,
    ``denom[B, S, n_heads]`` (f32, log2 domain) for the combine step.
    """
    b = pl.program_id(0)
    h = pl.program_id(1)
    split = pl.program_id(2)
    g = jnp.arange(group_pad, dtype=jnp.int32)
    head_rows = h * group + g
    head_ok = g < group
    cols = jnp.arange(head_dim, dtype=jnp.int32)
    batch_rows = jnp.full((group_pad,), b, dtype=jnp.int32)
    q = load(q_ref.at[batch_rows[:, None], head_rows[:, None], cols[None, :]], mask=head_ok[:, None], other=0.0)
    q = q.astype(pool_ref.dtype)

    context_len = lens_ref[b]
    layer = layer_ref[0]
    num_blocks = lax.div(context_len + (block_k - 1), block_k)
    blocks_per_split = lax.div(num_blocks + (num_splits - 1), num_splits)
    first_block = split * blocks_per_split
    end_block = jnp.minimum(first_block + blocks_per_split, num_blocks)
    k_row0 = h * page_size
    v_row0 = (num_kv_heads + h) * page_size
    batch_toks = jnp.full((block_k,), b, dtype=jnp.int32)

    def body(block, carry):
        acc, m_prev, l_prev = carry
        tok = block * block_k + jnp.arange(block_k, dtype=jnp.int32)
        tok_ok = tok < context_len
        page = load(page_table_ref.at[batch_toks, lax.div(tok, page_size)], mask=tok_ok, other=0)
        row = (layer * num_pages + page) * page_rows + lax.rem(tok, page_size)
        k = load(pool_ref.at[(row + k_row0)[:, None], cols[None, :]], mask=tok_ok[:, None], other=0.0)
        v = load(pool_ref.at[(row + v_row0)[:, None], cols[None, :]], mask=tok_ok[:, None], other=0.0)
        scores = dot_f32(q, k, trans_b=True) * scale_log2  # [group_pad, block_k], f32, log2 domain
        scores = jnp.where(tok_ok[None, :], scores, MASK_VALUE)
        return online_softmax_step(acc, m_prev, l_prev, scores, v)

    init = (jnp.zeros((group_pad, head_dim), jnp.float32), jnp.full((group_pad,), MASK_VALUE, jnp.float32),
            jnp.zeros((group_pad,), jnp.float32))
    acc, m, denom = lax.fori_loop(first_block, end_block, body, init)

    if num_splits == 1:
        (o_ref,) = out_refs
        out = acc / jnp.where(denom > 0, denom, 1.0)[:, None]  # context_len 0 -> acc = 0 -> zeros
        store(o_ref.at[batch_rows[:, None], head_rows[:, None], cols[None, :]], out.astype(o_ref.dtype),
              mask=head_ok[:, None])
    else:
        acc_ref, m_ref, denom_ref = out_refs
        split_rows = jnp.full((group_pad,), split, dtype=jnp.int32)
        store(acc_ref.at[batch_rows[:, None], split_rows[:, None], head_rows[:, None], cols[None, :]], acc,
              mask=head_ok[:, None])
        store(m_ref.at[batch_rows, split_rows, head_rows], m, mask=head_ok)
        store(denom_ref.at[batch_rows, split_rows, head_rows], denom, mask=head_ok)


def combine_splits(acc: jax.Array, m: jax.Array, denom: jax.Array, out_dtype) -> jax.Array:
    """Merge split partials by log-sum-exp: acc [B, S, H, hd], m, denom [B, S, H] (log2 domain) -> [B, H, hd]."""
    m_max = m.max(axis=1, keepdims=True)
    weight = jnp.exp2(m - m_max)  # empty splits have denom = 0, so they add nothing
    numerator = (acc * weight[..., None]).sum(axis=1)
    denominator = (denom * weight).sum(axis=1)
    safe = jnp.where(denominator > 0, denominator, 1.0)
    return jnp.where(denominator[..., None] > 0, numerator / safe[..., None], 0.0).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("page_size", "num_kv_heads", "sm_scale", "pages_per_block", "num_splits",
                                             "interpret", "num_warps", "num_stages"))
def paged_decode_attention(q: jax.Array, pool: jax.Array, layer: jax.Array, page_table: jax.Array,
                           context_lens: jax.Array, *, page_size: int, num_kv_heads: int, sm_scale: float,
                           pages_per_block: int | None = None, num_splits: int | None = None,
                           interpret: bool | None = None, num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Attention of one query token per sequence over its paged K/V (already including the current token).

    q: [B, n_heads, hd]; pool: [L, NP, 2*n_kv*P, hd]; layer: int32 scalar; page_table: int32[B, max_pages];
    context_lens: int32[B] (0 = padding row -> zeros) -> [B, n_heads, hd] in q.dtype. Only pages holding the first
    ``context_lens[b]`` tokens are read.
    """
    batch, num_heads, head_dim = q.shape
    num_layers, num_pages, page_rows, _ = pool.shape
    check_pool_layout(pool, num_kv_heads, page_size, head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"n_heads {num_heads} is not a multiple of n_kv {num_kv_heads}")
    if not (is_pow2(page_size) and is_pow2(head_dim)):
        raise ValueError(f"page_size {page_size} and head_dim {head_dim} must be powers of two")
    if num_layers * num_pages * page_rows >= 2**31:
        raise ValueError("pool has too many rows for int32 row indices")
    max_pages = page_table.shape[1]
    pages_per_block = pages_per_block or default_pages_per_block(page_size)
    block_k = pages_per_block * page_size
    if not is_pow2(block_k) or block_k < MIN_DOT_ROWS:
        raise ValueError(f"pages_per_block * page_size = {block_k} must be a power of two >= {MIN_DOT_ROWS}")
    max_blocks = -(-max_pages // pages_per_block)
    num_splits = num_splits or default_num_splits(batch, num_kv_heads, max_blocks)
    group = num_heads // num_kv_heads
    group_pad = max(MIN_DOT_ROWS, next_pow2(group))

    kernel = functools.partial(
        _decode_kernel, group=group, group_pad=group_pad, head_dim=head_dim, page_size=page_size,
        num_kv_heads=num_kv_heads, num_pages=num_pages, page_rows=page_rows, block_k=block_k, num_splits=num_splits,
        scale_log2=float(sm_scale) * LOG2E)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((batch, num_heads, head_dim), q.dtype)
        out_specs = any_spec()
    else:
        out_shape = (jax.ShapeDtypeStruct((batch, num_splits, num_heads, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((batch, num_splits, num_heads), jnp.float32),
                     jax.ShapeDtypeStruct((batch, num_splits, num_heads), jnp.float32))
        out_specs = (any_spec(), any_spec(), any_spec())
    result = pallas_call(
        kernel, out_shape=out_shape, grid=(batch, num_kv_heads, num_splits), in_specs=[any_spec()] * 5,
        out_specs=out_specs, interpret=interpret, num_warps=num_warps, num_stages=num_stages,
        name=f"paged_decode_g{group}_bk{block_k}_s{num_splits}",
    )(q, pool.reshape(-1, head_dim), jnp.asarray(layer, jnp.int32).reshape(1), page_table.astype(jnp.int32),
      context_lens.astype(jnp.int32))
    if num_splits == 1:
        return result
    return combine_splits(*result, q.dtype)


def paged_decode_attention_reference(q: jax.Array, pool: jax.Array, layer: jax.Array, page_table: jax.Array,
                                     context_lens: jax.Array, *, page_size: int, num_kv_heads: int, sm_scale: float,
                                     pages_per_block: int | None = None, num_splits: int | None = None,
                                     interpret: bool | None = None, **_tuning) -> jax.Array:
    """Plain jnp decode attention, same signature (tuning arguments ignored); f32 math, result in q.dtype.

    Materialises every sequence's K/V at ``max_pages * page_size`` tokens, so it is for checks and baselines.
    """
    del pages_per_block, num_splits, interpret
    batch, num_heads, head_dim = q.shape
    k, v = gather_kv_reference(pool, layer, page_table, num_kv_heads=num_kv_heads, page_size=page_size)
    num_tokens = k.shape[1]
    group = num_heads // num_kv_heads
    hi = lax.Precision.HIGHEST
    q_grouped = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("bkgd,bskd->bkgs", q_grouped, k.astype(jnp.float32), precision=hi) * sm_scale
    valid = jnp.arange(num_tokens)[None, :] < context_lens[:, None]  # [B, S]
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denominator = probs.sum(axis=-1, keepdims=True)
    v_valid = jnp.where(valid[:, :, None, None], v.astype(jnp.float32), 0.0)  # junk pages may hold NaN/inf
    out = jnp.einsum("bkgs,bskd->bkgd", probs, v_valid, precision=hi) / jnp.where(denominator > 0, denominator, 1.0)
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
