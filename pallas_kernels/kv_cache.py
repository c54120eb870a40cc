"""KV-cache writes into the unified pool, and plain-jnp gathers used by the attention references.

Pool layout (docs/DESIGN.md): ``pool[L, num_pages, page_rows, V]`` with ``V = head_dim`` and
``page_rows = 2 * n_kv * P``; the KV view of a page is ``[2, n_kv, P, V]`` (0 = K, 1 = V). A token's slot is
``page * P + offset``; slot -1 marks padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_pool_layout(pool: jax.Array, num_kv_heads: int, page_size: int, head_dim: int) -> None:
    """Fail early (at trace time) when the pool does not have the KV layout the kernels assume."""
    if pool.ndim != 4:
        raise ValueError(f"pool must be [L, num_pages, page_rows, V], got shape {pool.shape}")
    _, _, page_rows, vec = pool.shape
    if page_rows != 2 * num_kv_heads * page_size:
        raise ValueError(f"page_rows {page_rows} != 2 * num_kv_heads {num_kv_heads} * page_size {page_size}")
    if vec != head_dim:
        raise ValueError(f"pool vector width {vec} != head_dim {head_dim}")


def write_kv(pool: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array,
             page_size: int) -> jax.Array:
    """Scatter new tokens' K/V into layer ``layer`` of the pool and return the updated pool.

    pool: [L, NP, 2*n_kv*P, hd]; layer: int32 scalar; k, v: [T, n_kv, hd]; slots: int32[T] (``page*P + offset``,
    -1 = padding, dropped). One scatter of whole head_dim rows, so XLA updates the pool in place when it is donated
    (or carried through ``lax.scan``).
    """
    num_layers, num_pages, page_rows, vec = pool.shape
    num_tokens, num_kv_heads, head_dim = k.shape
    check_pool_layout(pool, num_kv_heads, page_size, head_dim)
    if v.shape != k.shape or slots.shape != (num_tokens,):
        raise ValueError(f"k {k.shape}, v {v.shape} and slots {slots.shape} disagree")
    slots = slots.astype(jnp.int32)
    # Padding token t goes to page num_pages + t: out of range, so mode="drop" discards it (a negative index would
    # wrap around), and distinct, so every index of the scatter is unique (in-range slots are: one token per slot).
    pad_page = num_pages + jnp.arange(num_tokens, dtype=jnp.int32)
    page = jnp.where(slots < 0, pad_page, slots // page_size)
    offset = jnp.where(slots < 0, 0, slots % page_size)
    head_rows = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :] * page_size + offset[:, None]  # [T, n_kv]
    rows = jnp.concatenate([head_rows, head_rows + num_kv_heads * page_size], axis=1)  # [T, 2*n_kv]: K then V
    values = jnp.concatenate([k, v], axis=1).astype(pool.dtype)  # [T, 2*n_kv, hd]
    # unique_indices: without it XLA's GPU scatter writes every element through an atomic read-modify-write, and for
    # bf16 that is a compare-and-swap loop (~250 GB/s measured on the H200: 6-8% of a prefill step)
    return pool.at[layer, page[:, None], rows].set(values, mode="drop", unique_indices=True)


def token_slots(page_table: jax.Array, seq_ids: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Slots of tokens at ``positions`` of sequences ``seq_ids``; negative seq id or position gives -1 (padding).

    page_table: int32[B, max_pages]; seq_ids, positions: int32[T] -> int32[T].
    """
    valid = (seq_ids >= 0) & (positions >= 0)
    safe_seq = jnp.where(valid, seq_ids, 0)
    safe_pos = jnp.where(valid, positions, 0)
    page = page_table[safe_seq, safe_pos // page_size]
    return jnp.where(valid, page * page_size + safe_pos % page_size, -1).astype(jnp.int32)


def gather_kv_reference(pool: jax.Array, layer: jax.Array, page_table: jax.Array, *, num_kv_heads: int,
                        page_size: int) -> tuple[jax.Array, jax.Array]:
    """Contiguous K and V of every sequence, for the jnp references (materialises them, so small shapes only).

    pool: [L, NP, 2*n_kv*P, hd]; page_table: int32[B, max_pages] -> k, v: [B, max_pages*P, n_kv, hd]. Table entries
    past a sequence's length may be junk: they are clamped into range here and callers mask those positions.
    """
    _, num_pages, _, head_dim = pool.shape
    check_pool_layout(pool, num_kv_heads, page_size, head_dim)
    batch, max_pages = page_table.shape
    gathered = pool[layer, jnp.clip(page_table, 0, num_pages - 1)]  # one gather, no copy of the layer
    gathered = gathered.reshape(batch, max_pages, 2, num_kv_heads, page_size, head_dim)
    gathered = gathered.transpose(2, 0, 1, 4, 3, 5).reshape(2, batch, max_pages * page_size, num_kv_heads, head_dim)
    return gathered[0], gathered[1]
