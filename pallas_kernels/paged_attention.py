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

from pallas_kernels.kv_cache import check_pool_layout, gather_kv_reference, write_kv
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


def _decode_kernel(q_ref, pool_ref, layer_ref, page_table_ref, lens_ref, *refs, group: int, group_pad: int,
                   head_dim: int, page_size: int, num_kv_heads: int, num_pages: int, page_rows: int, block_k: int,
                   num_splits: int, scale_log2: float, rope_widths: tuple[int, int] | None):
    """One (sequence, kv head, split): online softmax over the split's blocks of ``block_k`` tokens.

    q_ref: [B, n_heads, hd]; pool_ref: [L*NP*page_rows, hd]; layer_ref: int32[1]; page_table_ref: int32[B, max_pages];
    lens_ref: int32[B]. Outputs: ``o[B, n_heads, hd]`` (one split) or ``acc[B, S, n_heads, hd]``, ``m[B, S, n_heads]``,
    ``denom[B, S, n_heads]`` (f32, log2 domain) for the combine step.

    With ``rope_widths`` (q width, kv width) the step's new token comes in unrotated: q_ref is the projection output
    qkv [B, q_width + 2 * kv_width], followed by cos_ref, sin_ref [B, hd] (f32) and slots_ref int32[B] before the
    outputs, and the last output is the pool (aliased to pool_ref). The kernel rotates q and the new k (rotate-half,
    in f32, rounded to qkv's dtype as ``apply_rope``), split 0 writes the new k and v into the pool at the token's
    slot, and every split reads only the ``context_len - 1`` cached tokens from the pool: the split whose blocks hold
    the new token's position adds it from registers (another program's write need not be visible yet).
    """
    b = pl.program_id(0)
    h = pl.program_id(1)
    split = pl.program_id(2)
    g = jnp.arange(group_pad, dtype=jnp.int32)
    head_rows = h * group + g
    head_ok = g < group
    cols = jnp.arange(head_dim, dtype=jnp.int32)
    batch_rows = jnp.full((group_pad,), b, dtype=jnp.int32)
    context_len = lens_ref[b]
    layer = layer_ref[0]
    k_row0 = h * page_size
    v_row0 = (num_kv_heads + h) * page_size
    if rope_widths is None:
        out_refs = refs
        q = load(q_ref.at[batch_rows[:, None], head_rows[:, None], cols[None, :]], mask=head_ok[:, None], other=0.0)
        cached_len = context_len
    else:
        cos_ref, sin_ref, slots_ref, *out_refs = refs
        pool_out_ref = out_refs.pop()
        q_width, kv_width = rope_widths
        half = head_dim // 2
        swapped = lax.rem(cols + half, head_dim)
        sign = jnp.where(cols < half, -1.0, 1.0).astype(jnp.float32)
        vec_rows = jnp.full((head_dim,), b, dtype=jnp.int32)
        cos = load(cos_ref.at[vec_rows, cols])
        sin = load(sin_ref.at[vec_rows, cols])

        def rotate(rows, first_cols, mask):
            x = load(q_ref.at[rows, first_cols + cols[None, :]], mask=mask, other=0.0).astype(jnp.float32)
            x_sw = load(q_ref.at[rows, first_cols + swapped[None, :]], mask=mask, other=0.0).astype(jnp.float32)
            return (x * cos[None, :] + sign[None, :] * x_sw * sin[None, :]).astype(q_ref.dtype)

        q = rotate(batch_rows[:, None], head_rows[:, None] * head_dim, head_ok[:, None])
        one_row = jnp.full((1, 1), b, dtype=jnp.int32)
        k_new = rotate(one_row, q_width + h * head_dim, jnp.full((1, 1), True)).reshape(head_dim)
        k_new = k_new.astype(pool_ref.dtype)
        v_new = load(q_ref.at[vec_rows, q_width + kv_width + h * head_dim + cols]).astype(pool_ref.dtype)
        slot = slots_ref[b]
        write = jnp.broadcast_to((split == 0) & (slot >= 0) & (context_len > 0), (head_dim,))
        safe = jnp.maximum(slot, 0)
        row_new = (layer * num_pages + lax.div(safe, page_size)) * page_rows + lax.rem(safe, page_size)
        store(pool_out_ref.at[jnp.full((head_dim,), row_new + k_row0, jnp.int32), cols], k_new, mask=write)
        store(pool_out_ref.at[jnp.full((head_dim,), row_new + v_row0, jnp.int32), cols], v_new, mask=write)
        cached_len = context_len - 1
    q = q.astype(pool_ref.dtype)

    num_blocks = lax.div(context_len + (block_k - 1), block_k)
    blocks_per_split = lax.div(num_blocks + (num_splits - 1), num_splits)
    first_block = split * blocks_per_split
    end_block = jnp.minimum(first_block + blocks_per_split, num_blocks)
    # blocks holding no cached token are not read (with rope, the new token's block may hold only that token)
    cached_end = jnp.minimum(end_block, lax.div(cached_len + (block_k - 1), block_k))
    batch_toks = jnp.full((block_k,), b, dtype=jnp.int32)

    def body(block, carry):
        acc, m_prev, l_prev = carry
        tok = block * block_k + jnp.arange(block_k, dtype=jnp.int32)
        tok_ok = tok < cached_len
        page = load(page_table_ref.at[batch_toks, lax.div(tok, page_size)], mask=tok_ok, other=0)
        row = (layer * num_pages + page) * page_rows + lax.rem(tok, page_size)
        k = load(pool_ref.at[(row + k_row0)[:, None], cols[None, :]], mask=tok_ok[:, None], other=0.0)
        v = load(pool_ref.at[(row + v_row0)[:, None], cols[None, :]], mask=tok_ok[:, None], other=0.0)
        scores = dot_f32(q, k, trans_b=True) * scale_log2  # [group_pad, block_k], f32, log2 domain
        scores = jnp.where(tok_ok[None, :], scores, MASK_VALUE)
        return online_softmax_step(acc, m_prev, l_prev, scores, v)

    init = (jnp.zeros((group_pad, head_dim), jnp.float32), jnp.full((group_pad,), MASK_VALUE, jnp.float32),
            jnp.zeros((group_pad,), jnp.float32))
    acc, m, denom = lax.fori_loop(first_block, cached_end, body, init)
    if rope_widths is not None:  # the new token, from registers, in the split that holds its position
        new_block = lax.div(context_len - 1, block_k)
        owns = (context_len > 0) & (new_block >= first_block) & (new_block < end_block)
        s_new = jnp.sum(q.astype(jnp.float32) * k_new.astype(jnp.float32)[None, :], axis=1) * scale_log2
        m_new = jnp.where(owns, jnp.maximum(m, s_new), m)
        alpha = jnp.where(owns, jnp.exp2(m - m_new), 1.0)
        p = jnp.where(owns, jnp.exp2(s_new - m_new), 0.0).astype(v_new.dtype).astype(jnp.float32)
        acc = acc * alpha[:, None] + p[:, None] * v_new.astype(jnp.float32)[None, :]
        denom = denom * alpha + p
        m = m_new

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


def _check_decode_shapes(num_heads, head_dim, pool, num_kv_heads, page_size):
    num_layers, num_pages, page_rows, _ = pool.shape
    check_pool_layout(pool, num_kv_heads, page_size, head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"n_heads {num_heads} is not a multiple of n_kv {num_kv_heads}")
    if not (is_pow2(page_size) and is_pow2(head_dim)):
        raise ValueError(f"page_size {page_size} and head_dim {head_dim} must be powers of two")
    if num_layers * num_pages * page_rows >= 2**31:
        raise ValueError("pool has too many rows for int32 row indices")


def _decode_call(q, pool, layer, page_table, context_lens, rope_inputs, *, batch, num_heads, head_dim, page_size,
                 num_kv_heads, sm_scale, pages_per_block, num_splits, interpret, num_warps, num_stages, rope_widths,
                 out_dtype):
    """Launch the decode kernel; returns its raw outputs (the pool last when ``rope_widths`` is set)."""
    _, num_pages, page_rows, _ = pool.shape
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
        scale_log2=float(sm_scale) * LOG2E, rope_widths=rope_widths)
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((batch, num_heads, head_dim), out_dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((batch, num_splits, num_heads, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((batch, num_splits, num_heads), jnp.float32),
                     jax.ShapeDtypeStruct((batch, num_splits, num_heads), jnp.float32)]
    flat_pool = pool.reshape(-1, head_dim)
    aliases = None
    if rope_widths is not None:
        out_shape.append(jax.ShapeDtypeStruct(flat_pool.shape, flat_pool.dtype))
        aliases = {1: len(out_shape) - 1}  # the pool, written in place
    inputs = (q, flat_pool, jnp.asarray(layer, jnp.int32).reshape(1), page_table.astype(jnp.int32),
              context_lens.astype(jnp.int32), *rope_inputs)
    rope = "_rope" if rope_widths is not None else ""
    result = pallas_call(
        kernel, out_shape=tuple(out_shape), grid=(batch, num_kv_heads, num_splits),
        in_specs=[any_spec()] * len(inputs), out_specs=tuple(any_spec() for _ in out_shape), interpret=interpret,
        num_warps=num_warps, num_stages=num_stages, input_output_aliases=aliases,
        name=f"paged_decode_g{group}_bk{block_k}_s{num_splits}{rope}",
    )(*inputs)
    return list(result)


def _finish(outputs, out_dtype):
    """The attention output from the kernel's outputs: direct with one split, else the log-sum-exp combine."""
    return outputs[0] if len(outputs) == 1 else combine_splits(*outputs, out_dtype)


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
    _check_decode_shapes(num_heads, head_dim, pool, num_kv_heads, page_size)
    outputs = _decode_call(q, pool, layer, page_table, context_lens, (), batch=batch, num_heads=num_heads,
                           head_dim=head_dim, page_size=page_size, num_kv_heads=num_kv_heads, sm_scale=sm_scale,
                           pages_per_block=pages_per_block, num_splits=num_splits, interpret=interpret,
                           num_warps=num_warps, num_stages=num_stages, rope_widths=None, out_dtype=q.dtype)
    return _finish(outputs, q.dtype)


@functools.partial(jax.jit, static_argnames=("page_size", "num_heads", "num_kv_heads", "sm_scale", "pages_per_block",
                                             "num_splits", "interpret", "num_warps", "num_stages"),
                   donate_argnums=(3,))
def paged_decode_attention_rope(qkv: jax.Array, cos: jax.Array, sin: jax.Array, pool: jax.Array, layer: jax.Array,
                                page_table: jax.Array, context_lens: jax.Array, kv_slots: jax.Array, *,
                                page_size: int, num_heads: int, num_kv_heads: int, sm_scale: float,
                                pages_per_block: int | None = None, num_splits: int | None = None,
                                interpret: bool | None = None, num_warps: int = 4,
                                num_stages: int = 2) -> tuple[jax.Array, jax.Array]:
    """The decode step's rotary embedding, KV write and attention in one kernel (two launches fewer a layer).

    qkv: [B, n_heads * hd + 2 * n_kv * hd], the unrotated projection output (q heads, then k, then v); cos, sin:
    [B, hd] float32 (``rope_cos_sin`` of each row's position); kv_slots: int32[B], the new token's slot (-1 =
    padding: nothing written); context_lens counts the new token. Returns (attention [B, n_heads, hd] in qkv.dtype,
    the pool with every row's new k (rotated) and v written), equal to rotating q and k, ``write_kv`` and
    :func:`paged_decode_attention` for rows as the engine builds them: a padding row has slot -1 and context 0, a
    real row both a slot and a context (a row with only one of them is not written, or not read, as those steps
    would). The pool is donated (called outside a jit, the caller's array is consumed); the kernel writes it in
    place.
    """
    batch, width = qkv.shape
    head_dim = pool.shape[3]
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    if width != q_width + 2 * kv_width:
        raise ValueError(f"qkv width {width} != {num_heads} q heads + 2 x {num_kv_heads} kv heads of {head_dim}")
    if cos.shape != (batch, head_dim) or sin.shape != cos.shape or kv_slots.shape != (batch,):
        raise ValueError(f"cos {cos.shape}, sin {sin.shape} and kv_slots {kv_slots.shape} disagree with qkv")
    _check_decode_shapes(num_heads, head_dim, pool, num_kv_heads, page_size)
    rope_inputs = (cos.astype(jnp.float32), sin.astype(jnp.float32), kv_slots.astype(jnp.int32))
    outputs = _decode_call(qkv, pool, layer, page_table, context_lens, rope_inputs, batch=batch, num_heads=num_heads,
                           head_dim=head_dim, page_size=page_size, num_kv_heads=num_kv_heads, sm_scale=sm_scale,
                           pages_per_block=pages_per_block, num_splits=num_splits, interpret=interpret,
                           num_warps=num_warps, num_stages=num_stages, rope_widths=(q_width, kv_width),
                           out_dtype=qkv.dtype)
    new_pool = outputs.pop().reshape(pool.shape)
    return _finish(outputs, qkv.dtype), new_pool


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


def rope_reference(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding of x [T, heads, hd] with cos, sin [T, hd], in f32, result in x.dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def paged_decode_attention_rope_reference(qkv: jax.Array, cos: jax.Array, sin: jax.Array, pool: jax.Array,
                                          layer: jax.Array, page_table: jax.Array, context_lens: jax.Array,
                                          kv_slots: jax.Array, *, page_size: int, num_heads: int, num_kv_heads: int,
                                          sm_scale: float, **_tuning) -> tuple[jax.Array, jax.Array]:
    """:func:`paged_decode_attention_rope` as the unfused steps: rotate q and k, ``write_kv``, attend (jnp)."""
    batch, head_dim = qkv.shape[0], pool.shape[3]
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    q = rope_reference(qkv[:, :q_width].reshape(batch, num_heads, head_dim), cos, sin)
    k = rope_reference(qkv[:, q_width:q_width + kv_width].reshape(batch, num_kv_heads, head_dim), cos, sin)
    v = qkv[:, q_width + kv_width:].reshape(batch, num_kv_heads, head_dim)
    pool = write_kv(pool, layer, k, v, kv_slots, page_size)
    out = paged_decode_attention_reference(q, pool, layer, page_table, context_lens, page_size=page_size,
                                           num_kv_heads=num_kv_heads, sm_scale=sm_scale)
    return out, pool
