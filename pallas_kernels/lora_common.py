"""Adapter table, pool-layout helpers and kernel-body helpers shared by the LoRA kernels, their references and tests.

Layout (docs/DESIGN.md, "Unified pool layout"): ``pool: [L, NP, PR, V]``. Virtual vector ``v`` of the adapter in
slot ``s`` is the physical vector ``pages[s, v // PR] * PR + v % PR`` of ``pool[l].reshape(NP * PR, V)``. For
module ``m`` in layer ``l``, A^T row ``k`` chunk ``c`` is virtual vector ``a_off[s, l, m] + k * (d_in / V) + c`` and
B row ``k`` chunk ``c`` is ``b_off[s, l, m] + k * (d_out / V) + c``. ``rank = 0`` means "not adapted".

The jnp helpers here are deliberately plain (gather + einsum): kernels are checked against them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NUM_MODULES = 7  # q, k, v, o, gate, up, down (slora_jax.model.config.MODULES order)


class AdapterTable(NamedTuple):
    """Device table of resident adapters (a pytree; S = slots, L = layers, M = 7 modules).

    pages: int32[S, max_pages]  physical page ids of each slot's virtual vector sequence
    rank:  int32[S, L, M]       0 = module not adapted in that layer
    a_off: int32[S, L, M]       virtual vector of A^T row 0 chunk 0
    b_off: int32[S, L, M]       virtual vector of B row 0 chunk 0
    scale: float32[S, L, M]     alpha / r (or alpha / sqrt(r) for rsLoRA)
    """

    pages: jax.Array
    rank: jax.Array
    a_off: jax.Array
    b_off: jax.Array
    scale: jax.Array


class Tuning(NamedTuple):
    """Static launch knobs of the LoRA kernels; ``None`` = the kernel's heuristic (hashable: pass as a static arg).

    tile_elems: adapter elements one program loads per loop step (BGMV); num_warps: Triton warps per program;
    splits: programs sharing one d_in reduction (shrink); vecs: output vectors of V columns per program (SGMV expand);
    pipeline: double-buffer tiles in registers (BGMV shrink); rank_block: rank columns one program computes (SGMV
    shrink; programs of rank blocks past the largest rank of their tile's adapter over the group's modules return
    at once); unroll: vectors whose loads a program issues together, before their dots (SGMV: d_in chunks per loop
    step of the shrink; the expand's ``vecs`` output vectors at once when > 1).
    """

    tile_elems: int | None = None
    num_warps: int | None = None
    splits: int | None = None
    vecs: int | None = None
    pipeline: bool | None = None
    rank_block: int | None = None
    unroll: int | None = None


def layer_args(layer, pool_shape) -> tuple[jax.Array, jax.Array]:
    """(layer, first flat vector of the layer in ``pool.reshape(L * NP * PR, V)``) as int32[1] each (kernel inputs).

    Kernels index the pool as that 2D view: one int32 vector id per row of a tile plus the lane keeps the
    per-element address arithmetic small (vector ids fit int32 while the pool has < 2**31 vectors).
    """
    n_layers, num_pages, page_rows, _ = pool_shape
    assert n_layers * num_pages * page_rows < 2**31, pool_shape
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return layer, layer * (num_pages * page_rows)


# ----------------------------------------------------------------------------------------------------------------------
# Kernel-body helpers (traced inside the BGMV and SGMV kernels; plain jnp, so any Pallas lowering can use them)
# ----------------------------------------------------------------------------------------------------------------------


def pick(i, values):
    """``values[i]`` for a traced scalar ``i`` over a static tuple (a select chain; kernels cannot index constants)."""
    out = jnp.int32(values[0])
    for j in range(1, len(values)):
        out = jnp.where(i == j, jnp.int32(values[j]), out)
    return out


def block_module(j, blk_starts, modules, out_vecs):
    """(index in ``modules``, module id, output vectors) of expand column block ``j``; blocks of all modules lie end
    to end and ``blk_starts`` (static) gives each module's first block."""
    i = jnp.int32(0)
    for b in blk_starts[1:]:
        i = i + (j >= b).astype(jnp.int32)
    return i, pick(i, modules), pick(i, out_vecs)


# ----------------------------------------------------------------------------------------------------------------------
# Pure jnp gathers (references)
# ----------------------------------------------------------------------------------------------------------------------


def gather_vectors(pool: jax.Array, layer, pages_rows: jax.Array, v: jax.Array) -> jax.Array:
    """Pool vectors of virtual vectors ``v`` in layer ``layer``.

    pool: [L, NP, PR, V]; pages_rows: int32[..., max_pages] (one page list per leading index of ``v``);
    v: int32[..., *rest] -> [..., *rest, V]. Out-of-range virtual vectors are clamped: callers mask them.
    """
    pr = pool.shape[2]
    page_idx = jnp.clip(v // pr, 0, pages_rows.shape[-1] - 1)
    flat_pages = pages_rows.reshape(-1, pages_rows.shape[-1])
    flat_idx = page_idx.reshape(flat_pages.shape[0], -1)
    page = jnp.take_along_axis(flat_pages, flat_idx, axis=1).reshape(v.shape)
    return pool[jnp.asarray(layer, jnp.int32).reshape(()), page, v % pr]


def _slot_fields(table: AdapterTable, layer, slot: jax.Array, module: int):
    """(safe slot, rank with 0 for slot -1, layer as a scalar) for a batch of slots."""
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    valid = slot >= 0
    s = jnp.where(valid, slot, 0)
    return s, jnp.where(valid, table.rank[s, layer, module], 0), layer


def _gather_rows(pool: jax.Array, table: AdapterTable, layer, s: jax.Array, rank: jax.Array, off: jax.Array,
                 width: int, max_rank: int) -> jax.Array:
    """Rows ``k < rank`` of ``width`` elements starting at virtual vector ``off``: [T, max_rank, width]."""
    vdim = pool.shape[3]
    assert width % vdim == 0, (width, vdim)
    n = width // vdim
    k = jnp.arange(max_rank, dtype=jnp.int32)
    v = off[:, None, None] + k[None, :, None] * n + jnp.arange(n, dtype=jnp.int32)[None, None, :]
    vecs = gather_vectors(pool, layer, table.pages[s], v).reshape(s.shape[0], max_rank, width)
    return jnp.where((k[None, :] < rank[:, None])[:, :, None], vecs, 0)


def gather_lora_a(pool: jax.Array, table: AdapterTable, layer, slot: jax.Array, module: int, d_in: int,
                  max_rank: int) -> jax.Array:
    """Dense A of one module per row: slot int32[T] -> [T, d_in, max_rank] (pool.dtype), zero beyond rank / slot -1."""
    s, rank, layer = _slot_fields(table, layer, slot, module)
    rows = _gather_rows(pool, table, layer, s, rank, table.a_off[s, layer, module], d_in, max_rank)
    return jnp.swapaxes(rows, 1, 2)


def gather_lora_b(pool: jax.Array, table: AdapterTable, layer, slot: jax.Array, module: int, d_out: int,
                  max_rank: int) -> jax.Array:
    """Dense B of one module per row: slot int32[T] -> [T, max_rank, d_out] (pool.dtype), zero beyond rank / slot -1."""
    s, rank, layer = _slot_fields(table, layer, slot, module)
    return _gather_rows(pool, table, layer, s, rank, table.b_off[s, layer, module], d_out, max_rank)


def lora_scale(table: AdapterTable, layer, slot: jax.Array, module: int) -> jax.Array:
    """Per-row scale of one module: slot int32[T] -> float32[T] (0 for slot -1)."""
    s, _, layer = _slot_fields(table, layer, slot, module)
    return jnp.where(slot >= 0, table.scale[s, layer, module], 0.0).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------------------------------
# Host (numpy) layout and placement helpers
# ----------------------------------------------------------------------------------------------------------------------


def pack_offsets(ranks: np.ndarray, dims: list[tuple[int, int]] | tuple[tuple[int, int], ...],
                 vdim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pack every layer's modules one after another (A^T then B per module), starting at virtual vector 0.

    ranks: int[L, M]; dims[m] = (d_in, d_out) -> (a_off int32[L, M], b_off int32[L, M], vectors int64[L]).
    Pages the adapter needs: ceil(max(vectors) / page_rows).
    """
    ranks = np.asarray(ranks)
    n_layers, n_mod = ranks.shape
    a_off = np.zeros((n_layers, n_mod), np.int32)
    b_off = np.zeros((n_layers, n_mod), np.int32)
    vectors = np.zeros(n_layers, np.int64)
    for layer in range(n_layers):
        v = 0
        for m in range(n_mod):
            d_in, d_out = dims[m]
            a_off[layer, m] = v
            v += int(ranks[layer, m]) * (d_in // vdim)
            b_off[layer, m] = v
            v += int(ranks[layer, m]) * (d_out // vdim)
        vectors[layer] = v
    return a_off, b_off, vectors


def virtual_to_physical(pages_row: np.ndarray, v: np.ndarray, page_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(page, row-in-page) of virtual vectors ``v`` for one slot's page list."""
    v = np.asarray(v)
    return np.asarray(pages_row)[v // page_rows], v % page_rows


def write_module_np(pool: np.ndarray, layer: int, pages_row: np.ndarray, a_off: int, b_off: int,
                    a: np.ndarray, b: np.ndarray) -> None:
    """Write one module's ``a [d_in, r]`` and ``b [r, d_out]`` into a host pool ``[L, NP, PR, V]`` in place."""
    pr, vdim = pool.shape[2], pool.shape[3]
    for mat, off in ((np.asarray(a).T, a_off), (np.asarray(b), b_off)):
        r, width = mat.shape
        if r == 0:
            continue
        vecs = mat.reshape(r * (width // vdim), vdim)
        page, row = virtual_to_physical(pages_row, off + np.arange(vecs.shape[0]), pr)
        pool[layer, page, row] = vecs.astype(pool.dtype)
