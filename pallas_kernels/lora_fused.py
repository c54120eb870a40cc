"""LoRA for decode, fused: a projection group's shrink and expand in one kernel (the rank-r intermediate stays in
registers), so a layer launches one LoRA kernel per group instead of three (shrink, XLA sum, expand: lora_bgmv).

Why: at decode batch sizes the unfused kernels spend their time on launches and on the chain of dependent loads at
the head of every kernel (row slot -> adapter table -> page table -> pool vectors), not on bytes. Two plans, chosen
per group from the static shapes by a small cost model (``lora_plan.fused_plan``; ``FusedTuning`` overrides it):

* ``fused``: grid (output block, row). A program computes its row's ``u = scale * x @ A`` over all of d_in, then
  ``base + u @ B`` for its block of output vectors of one module. Programs of one (row, module) each read that
  module's A (the first from HBM, the rest mostly from L2): at large batch a program covers a whole module (nothing
  read twice); at small batch modules are cut into blocks so that more of the GPU works.
* ``split`` (small batch and a long A, e.g. down_proj at batch 1): d_in split over programs that write fp32 partials
  [S, T, M, R], and an expand kernel that sums them itself (two kernels, nothing between them).

``shared_rows`` S > 1 (fused mode; ``FusedTuning``): consecutive rows of one adapter share a program, up to S of
them, so the adapter's A and B tiles are loaded once for all of them instead of once per row. The engine orders a
decode batch's rows by adapter slot, so every run of rows of one adapter is consecutive; a program whose row starts
no run exits, one with a run of a single row takes the one-row body (no masked work).

Ranks mix freely: a row runs the branch of its rank class (the smallest of ``classes``, powers of two, that holds
its rank), whose tiles are [class, chunks, V], so a rank-8 row in a max-rank-64 batch moves full tiles of its own
rows instead of 64-row tiles with 56 rows masked. Rows with slot -1 and modules with rank 0 exit at once (base is
aliased to the output and stays as it is). The shrink reduces each tile over its V lanes (inside a warp) into a
[class, chunks] fp32 partial and sums the chunks once at the end.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.lora_bgmv import bgmv_expand, bgmv_expand_reference, bgmv_shrink, bgmv_shrink_reference
from pallas_kernels.lora_common import AdapterTable, block_module, layer_args, pick
from pallas_kernels.lora_plan import SPLIT_ROWS, SPLIT_TILE, FusedPlan, FusedTuning, fused_plan
from pallas_kernels.lowering import any_spec, load, next_pow2, pallas_call, resolve_interpret, store

__all__ = ["SPLIT_ROWS", "SPLIT_TILE", "FusedPlan", "FusedTuning", "bgmv_lora", "bgmv_lora_reference",
           "bgmv_lora_unfused", "fused_plan", "run_lengths"]

_F32 = jnp.float32
_I0 = np.int32(0)  # typed: jnp.where on two Python ints mis-lowers to i1 in Pallas Triton


class _Geom(NamedTuple):
    """Static shape facts every kernel body needs (hashable)."""

    modules: tuple[int, ...]
    out_vecs: tuple[int, ...]
    col_starts: tuple[int, ...]
    blk_starts: tuple[int, ...]
    vecs: int
    classes: tuple[int, ...]
    tile_elems: int
    n_chunks: int
    chunks_per_split: int
    splits: int
    page_rows: int
    vdim: int
    shared_rows: int = 1


class _Row(NamedTuple):
    """One program's row and module: traced scalars read from the adapter table."""

    t: jax.Array
    s: jax.Array  # slot, 0 for rows without an adapter (their rank is 0)
    m: jax.Array  # module id
    layer: jax.Array
    lbase: jax.Array
    rank: jax.Array


def _row(layer_ref, lbase_ref, slot_ref, rank_ref, t, m) -> _Row:
    slot = slot_ref[t]
    s = jnp.maximum(slot, 0)
    layer = layer_ref[0]
    return _Row(t, s, m, layer, lbase_ref[0], jnp.where(slot >= 0, rank_ref[s, layer, m], _I0))


def _by_class(row: _Row, classes, body) -> None:
    """``body(r_b)`` for this row's rank class (the smallest class >= rank); nothing for rank 0."""
    lo = 0
    for r_b in classes:
        pl.when((row.rank > lo) & (row.rank <= r_b))(functools.partial(body, r_b))
        lo = r_b


def _gather(pool_ref, pages_ref, row: _Row, v, mask, g: _Geom):
    """Pool vectors ``[*v.shape, V]`` of the row's virtual vectors ``v``; masked entries read nothing (zeros)."""
    page = load(pages_ref.at[row.s, lax.div(v, g.page_rows)], mask=mask, other=0)
    vec = row.lbase + page * g.page_rows + lax.rem(v, g.page_rows)
    lane = jnp.arange(g.vdim, dtype=jnp.int32)
    return load(pool_ref.at[vec[..., None], lane[(None,) * vec.ndim + (slice(None),)]], mask=mask[..., None], other=0)


def _pow2_tile(tile_elems: int, r_b: int, vdim: int, span: int) -> int:
    """Vectors per tile row: a power of two, >= 1, no more than ``span`` needs."""
    n = max(1, min(tile_elems // (r_b * vdim), next_pow2(span)))
    return 1 << (n.bit_length() - 1)


def _live(mask, live):
    """``mask`` for a row that may be padding (``live`` traced), or as it is for the program's own row (True)."""
    return mask if live is True else mask & live


def _shrink(x_ref, pool_ref, pages_ref, row: _Row, a_off, r_b, lo, hi, span, g: _Geom, rows=None) -> list[jax.Array]:
    """``sum over chunks [lo, hi) of A^T[k] . x[t]`` for k < r_b (unscaled; zero for k >= rank): float32 [r_b] for
    each (t, live) of ``rows`` (default: the program's own row). Each A tile is loaded once for all of them."""
    rows = rows or [(row.t, True)]
    c = _pow2_tile(g.tile_elems, max(r_b, len(rows)), g.vdim, span)
    k = jnp.arange(r_b, dtype=jnp.int32)
    kmask = k < row.rank
    row0 = a_off + k * g.n_chunks  # virtual vector of A^T row k, chunk 0
    lane = jnp.arange(g.vdim, dtype=jnp.int32)

    def step(j, accs):
        cc = lo + j * c + jnp.arange(c, dtype=jnp.int32)
        cmask = cc < hi
        a = _gather(pool_ref, pages_ref, row, row0[:, None] + cc[None, :], kmask[:, None] & cmask[None, :], g)
        a = a.astype(_F32)
        out = []
        for acc, (t, live) in zip(accs, rows, strict=True):
            xc = load(x_ref.at[t, cc[:, None], lane[None, :]], mask=_live(cmask, live)[:, None], other=0)
            out.append(acc + jnp.sum(a * xc.astype(_F32)[None, :, :], axis=2))
        return tuple(out)

    accs = lax.fori_loop(0, -(-span // c), step, (jnp.zeros((r_b, c), _F32),) * len(rows))
    return [jnp.sum(acc, axis=1) for acc in accs]


def _expand_tiles(pool_ref, pages_ref, base_ref, row: _Row, b_off, n_out, col0, first, r_b, g: _Geom, rows):
    """(vectors per tile, tile(e) -> loads of step e, apply(loads, us, out_ref) -> stores) for the program's block,
    each B tile loaded once for every row of ``rows``."""
    n_c = _pow2_tile(g.tile_elems, max(r_b, len(rows)), g.vdim, g.vecs)
    k = jnp.arange(r_b, dtype=jnp.int32)
    kmask = k < row.rank
    row0 = b_off + k * n_out  # virtual vector of B row k, output vector 0
    lane = jnp.arange(g.vdim, dtype=jnp.int32)
    limit = jnp.minimum(first + g.vecs, n_out)

    def tile(e):
        cv = first + e * n_c + jnp.arange(n_c, dtype=jnp.int32)
        cmask = cv < limit
        b = _gather(pool_ref, pages_ref, row, row0[:, None] + cv[None, :], kmask[:, None] & cmask[None, :], g)
        cols = (col0 + cv)[:, None] * g.vdim + lane[None, :]  # base and out are [T, D]: vector c is columns c*V + lane
        olds = [load(base_ref.at[t, cols], mask=_live(cmask, live)[:, None], other=0) for t, live in rows]
        return b, olds, cols, cmask

    def apply(loads, us, out_ref):
        b, olds, cols, cmask = loads
        b = b.astype(_F32)
        for old, u, (t, live) in zip(olds, us, rows, strict=True):
            new = old.astype(_F32) + jnp.sum(b * u[:, None, None], axis=0)
            store(out_ref.at[t, cols], new.astype(out_ref.dtype), mask=_live(cmask, live)[:, None])

    return n_c, tile, apply


def _expand(pool_ref, pages_ref, base_ref, out_ref, row, b_off, n_out, col0, first, r_b, g, u_fn, rows=None):
    """``out = base + u @ B`` over the program's block for each row of ``rows`` (default: its own); ``u_fn()`` gives
    the scaled [r_b] intermediates, one a row. A block of one tile has its B and base loads issued before ``u_fn``
    runs, so they arrive while the shrink streams A."""
    rows = rows or [(row.t, True)]
    n_c, tile, apply = _expand_tiles(pool_ref, pages_ref, base_ref, row, b_off, n_out, col0, first, r_b, g, rows)
    if min(g.vecs, max(g.out_vecs)) <= n_c:
        loads = tile(0)
        apply(loads, u_fn(), out_ref)
        return
    us = u_fn()

    def step(e, carry):
        apply(tile(e), us, out_ref)
        return carry

    lax.fori_loop(0, lax.div(jnp.minimum(first + g.vecs, n_out) - first + (n_c - 1), n_c), step, _I0)


def _block(j, g: _Geom):
    """(index in modules, module id, its output vectors, its first output column, first vector of block j)."""
    i, m, n_out = block_module(j, g.blk_starts, g.modules, g.out_vecs)
    return i, m, n_out, pick(i, g.col_starts), (j - pick(i, g.blk_starts)) * g.vecs


def _fused_kernel(layer_ref, lbase_ref, slot_ref, rank_ref, aoff_ref, boff_ref, scale_ref, pages_ref, x_ref, pool_ref,
                  base_ref, out_ref, *, g: _Geom):
    _fused_body(pl.program_id(0), pl.program_id(1), None, layer_ref, lbase_ref, slot_ref, rank_ref, aoff_ref,
                boff_ref, scale_ref, pages_ref, x_ref, pool_ref, base_ref, out_ref, g)


def _shared_kernel(layer_ref, lbase_ref, run_ref, slot_ref, rank_ref, aoff_ref, boff_ref, scale_ref, pages_ref, x_ref,
                   pool_ref, base_ref, out_ref, *, g: _Geom):
    """The fused kernel over runs of rows of one adapter: program (block, t) serves rows t .. t + run[t] - 1."""
    t = pl.program_id(1)
    _fused_body(pl.program_id(0), t, run_ref[t], layer_ref, lbase_ref, slot_ref, rank_ref, aoff_ref, boff_ref,
                scale_ref, pages_ref, x_ref, pool_ref, base_ref, out_ref, g)


def _fused_body(j, t, n, layer_ref, lbase_ref, slot_ref, rank_ref, aoff_ref, boff_ref, scale_ref, pages_ref, x_ref,
                pool_ref, base_ref, out_ref, g: _Geom):
    """Block j of row t's module (``n`` None), or of the run of ``n`` rows from t (one-row body when n == 1, nothing
    when n == 0: row t is inside another program's run)."""
    i, m, n_out, col0, first = _block(j, g)
    row = _row(layer_ref, lbase_ref, slot_ref, rank_ref, t, m)
    a_off, b_off = aoff_ref[row.s, row.layer, m], boff_ref[row.s, row.layer, m]
    scale = scale_ref[row.s, row.layer, m]

    def body(rows, r_b):
        def u_fn():
            us = _shrink(x_ref, pool_ref, pages_ref, row, a_off, r_b, 0, g.n_chunks, g.n_chunks, g, rows)
            return [u * scale for u in us]

        _expand(pool_ref, pages_ref, base_ref, out_ref, row, b_off, n_out, col0, first, r_b, g, u_fn, rows)

    if n is None:
        _by_class(row, g.classes, functools.partial(body, None))
        return
    # the run's rows: n of them live, the rest clamped to the last row and masked
    rows = [(jnp.minimum(t + q, x_ref.shape[0] - 1), q < n) for q in range(g.shared_rows)]
    pl.when(n == 1)(lambda: _by_class(row, g.classes, functools.partial(body, None)))
    pl.when(n > 1)(lambda: _by_class(row, g.classes, functools.partial(body, rows)))


def run_lengths(row_slot: jax.Array, shared_rows: int) -> jax.Array:
    """int32[T]: how many rows the program of row t serves. Runs of equal consecutive slots are cut into pieces of
    at most ``shared_rows``; a piece's first row gets its length, every other row 0 (its program exits)."""
    n = row_slot.shape[0]
    t = jnp.arange(n, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((1,), bool), row_slot[1:] != row_slot[:-1]])
    run_start = lax.cummax(jnp.where(starts, t, 0))
    run_id = jnp.cumsum(starts.astype(jnp.int32)) - 1
    run_len = jnp.zeros((n,), jnp.int32).at[run_id].add(1)[run_id]
    offset = t - run_start
    return jnp.where(offset % shared_rows == 0, jnp.minimum(shared_rows, run_start + run_len - t), 0).astype(jnp.int32)


def _split_shrink_kernel(layer_ref, lbase_ref, slot_ref, rank_ref, aoff_ref, pages_ref, x_ref, pool_ref, y_ref, *,
                         g: _Geom):
    sp, i, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m = pick(i, g.modules)
    row = _row(layer_ref, lbase_ref, slot_ref, rank_ref, t, m)
    a_off = aoff_ref[row.s, row.layer, m]
    lo = sp * g.chunks_per_split
    hi = jnp.minimum(lo + g.chunks_per_split, g.n_chunks)

    def body(r_b):
        u = _shrink(x_ref, pool_ref, pages_ref, row, a_off, r_b, lo, hi, g.chunks_per_split, g)[0]
        store(y_ref.at[sp, t, i, jnp.arange(r_b, dtype=jnp.int32)], u)

    _by_class(row, g.classes, body)


def _split_expand_kernel(layer_ref, lbase_ref, slot_ref, rank_ref, boff_ref, scale_ref, pages_ref, y_ref, pool_ref,
                         base_ref, out_ref, *, g: _Geom):
    j, t = pl.program_id(0), pl.program_id(1)
    i, m, n_out, col0, first = _block(j, g)
    row = _row(layer_ref, lbase_ref, slot_ref, rank_ref, t, m)
    b_off, scale = boff_ref[row.s, row.layer, m], scale_ref[row.s, row.layer, m]
    sv = jnp.arange(next_pow2(g.splits), dtype=jnp.int32)

    def body(r_b):
        def u_fn():  # the shrink's partials, one per d_in split (entries of other rows' classes are never read)
            k = jnp.arange(r_b, dtype=jnp.int32)
            parts = load(y_ref.at[sv[:, None], t, i, k[None, :]], mask=(sv < g.splits)[:, None], other=0.0)
            return [jnp.sum(parts, axis=0) * scale]

        _expand(pool_ref, pages_ref, base_ref, out_ref, row, b_off, n_out, col0, first, r_b, g, u_fn)

    _by_class(row, g.classes, body)


@functools.partial(jax.jit, static_argnames=("modules", "max_rank", "d_outs", "interpret", "tuning"))
def bgmv_lora(x: jax.Array, base: jax.Array, pool: jax.Array, layer, row_slot: jax.Array, table: AdapterTable,
              modules: tuple[int, ...], max_rank: int, d_outs: tuple[int, ...], interpret: bool | None = None, *,
              tuning: FusedTuning | None = None) -> jax.Array:
    """``base`` plus ``scale * x[t] @ A @ B`` of ``row_slot[t]``'s adapter in module i's column slice, per row.

    x: [T, d_in] (shared by every module in ``modules``: q,k,v or gate,up); base: [T, sum(d_outs)] (module i owns
    columns ``sum(d_outs[:i]) : sum(d_outs[:i + 1])``); pool: [L, NP, PR, V]; layer: int32 scalar; row_slot:
    int32[T] (-1 = no adapter); max_rank: static >= every rank; d_outs: static widths (multiples of V). Returns
    base.dtype [T, sum(d_outs)], aliased to ``base`` (donate it to update in place). ``tuning`` overrides the plan.
    """
    interpret = resolve_interpret(interpret)
    n_rows, d_in = x.shape
    _, _, page_rows, vdim = pool.shape
    n_mod = len(modules)
    assert n_mod == len(d_outs) and d_in % vdim == 0, (modules, d_outs, x.shape)
    assert all(d % vdim == 0 for d in d_outs) and base.shape == (n_rows, sum(d_outs)), (base.shape, d_outs)
    out_vecs = tuple(d // vdim for d in d_outs)
    n_chunks = d_in // vdim
    p = fused_plan(n_rows, n_chunks, out_vecs, vdim, max_rank, jnp.dtype(pool.dtype).itemsize, interpret, tuning)
    blk_starts = tuple(sum(-(-n // p.vecs) for n in out_vecs[:i]) for i in range(n_mod))
    n_blocks = sum(-(-n // p.vecs) for n in out_vecs)
    g = _Geom(tuple(modules), out_vecs, tuple(sum(out_vecs[:i]) for i in range(n_mod)), blk_starts, p.vecs,
              p.classes, p.tile_elems, n_chunks, -(-n_chunks // p.splits), p.splits, page_rows, vdim, p.shared_rows)
    lay = layer_args(layer, pool.shape)
    slot = row_slot.astype(jnp.int32)
    xv, poolv = x.reshape(n_rows, n_chunks, vdim), pool.reshape(-1, vdim)
    call = functools.partial(pallas_call, out_specs=any_spec(), interpret=interpret, num_warps=p.num_warps)
    # base stays [T, D] in and out: a reshaped output stood as a convert kernel before the next RMSNorm (64 a step)
    out_shape = jax.ShapeDtypeStruct(base.shape, base.dtype)
    if p.mode == "fused" and p.shared_rows > 1:
        return call(functools.partial(_shared_kernel, g=g), out_shape=out_shape, grid=(n_blocks, n_rows),
                    in_specs=[any_spec()] * 12, input_output_aliases={11: 0}, name="lora_bgmv_shared")(
            *lay, run_lengths(slot, p.shared_rows), slot, table.rank, table.a_off, table.b_off, table.scale,
            table.pages, xv, poolv, base)
    if p.mode == "fused":
        out = call(functools.partial(_fused_kernel, g=g), out_shape=out_shape, grid=(n_blocks, n_rows),
                   in_specs=[any_spec()] * 11, input_output_aliases={10: 0}, name="lora_bgmv_fused")(
            *lay, slot, table.rank, table.a_off, table.b_off, table.scale, table.pages, xv, poolv, base)
        return out
    n_splits = -(-n_chunks // g.chunks_per_split)  # splits that have chunks to do
    g = g._replace(splits=n_splits)
    y = call(functools.partial(_split_shrink_kernel, g=g), grid=(n_splits, n_mod, n_rows), in_specs=[any_spec()] * 8,
             out_shape=jax.ShapeDtypeStruct((n_splits, n_rows, n_mod, p.classes[-1]), _F32),
             name="lora_bgmv_split_shrink")(*lay, slot, table.rank, table.a_off, table.pages, xv, poolv)
    out = call(functools.partial(_split_expand_kernel, g=g), out_shape=out_shape, grid=(n_blocks, n_rows),
               in_specs=[any_spec()] * 10, input_output_aliases={9: 0}, name="lora_bgmv_split_expand")(
        *lay, slot, table.rank, table.b_off, table.scale, table.pages, y, poolv, base)
    return out


@functools.partial(jax.jit, static_argnames=("modules", "max_rank", "d_outs", "interpret", "tuning"))
def bgmv_lora_unfused(x, base, pool, layer, row_slot, table, modules, max_rank, d_outs, interpret=None, *,
                      tuning=None):
    """The v1 decode path in the fused role's signature: ``bgmv_shrink`` (plus its XLA sum) then ``bgmv_expand``."""
    del tuning
    y = bgmv_shrink(x, pool, layer, row_slot, table, modules, max_rank, interpret=interpret)
    return bgmv_expand(y, base, pool, layer, row_slot, table, modules, d_outs, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("modules", "max_rank", "d_outs", "interpret", "tuning"))
def bgmv_lora_reference(x, base, pool, layer, row_slot, table, modules, max_rank, d_outs, interpret=None, *,
                        tuning=None):
    """jnp version of :func:`bgmv_lora`: each row's dense A and B gathered, two fp32 einsums, scaled, added."""
    del interpret, tuning
    y = bgmv_shrink_reference(x, pool, layer, row_slot, table, modules, max_rank)
    return bgmv_expand_reference(y, base, pool, layer, row_slot, table, modules, d_outs)
