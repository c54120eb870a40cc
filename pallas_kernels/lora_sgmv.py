"""LoRA for prefill (SGMV): rows come in per-adapter segments, so one adapter tile feeds many rows through tl.dot.

The host cuts the batch into tiles of at most ``block_t`` rows that never cross a run of equal slots
(:func:`make_tiles`), padded with empty tiles to a bucketed count so that the device shapes stay fixed:

* shrink: grid (tile, rank block x d_in split). Each program walks d_in one vector (V columns) at a time: x tile
  ``[block_t, V]`` (read once for all modules of the call) times each module's A^T tile ``[r_blk, V]``.
  Partial sums over d_in splits are added outside.
* expand: grid (tile, column block over all modules' outputs). ``y [block_t, r_blk] @ B [r_blk, V]`` per output
  vector, scaled and added into ``base`` (aliased to the output).

Rows with slot -1 get no tiles: their y stays zero and their base rows are untouched. Empty tiles and rank-0 modules
skip their loops. Dots run in the pool's dtype (bf16 on the GPU) with fp32 accumulation.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.lora_bgmv import bgmv_expand_reference, bgmv_shrink_reference
from pallas_kernels.lora_common import AdapterTable, Tuning, block_module, layer_args, pick
from pallas_kernels.lowering import any_spec, load, next_pow2, pallas_call, resolve_interpret, store

GPU_WARPS = 8  # expand: fewer registers per thread than 4 warps for these tile shapes (no spills at rank 64)
GPU_EXPAND_VECS = 4  # output vectors (of V columns) per expand program
# The shrink's GPU plan, measured on the H200 at the serving step's shapes (benchmarks/sgmv_sweep.py, NOTES session
# 17: rank-8 adapters under max rank 64, 1024- and 2048-row buckets; 26% less time summed over q,k,v / o / down than
# the plan before it, d_in split for ~264 programs with 64-wide rank blocks and 8 warps): 16-wide rank blocks
# (programs past an adapter's rank return at once), d_in in 4 splits, 4 chunks of V loaded together a loop step,
# 4 warps. Interpret mode takes one split, rank blocks of the max rank and one chunk a step (fewest grid steps).
GPU_SHRINK = Tuning(num_warps=4, splits=4, rank_block=16, unroll=4)
MIN_DOT = 16  # tl.dot needs every dimension >= 16
MAX_R_BLK = 64

_F32 = jnp.float32
_I0 = np.int32(0)  # typed: jnp.where on two Python ints mis-lowers to i1 in Pallas Triton


class SegmentTiles(NamedTuple):
    """Row tiles of a segmented batch (host numpy or device int32 arrays, all [num_tiles]).

    start: first row; length: rows in the tile (0 = padding); slot: adapter slot of every row in the tile.
    """

    start: np.ndarray | jax.Array
    length: np.ndarray | jax.Array
    slot: np.ndarray | jax.Array


def make_tiles(row_slot: np.ndarray, block_t: int, num_tiles: int | None = None) -> SegmentTiles:
    """Cut every run of equal slots ``>= 0`` into tiles of ``<= block_t`` rows; pad with empty tiles to ``num_tiles``.

    row_slot: int[T] (rows of one adapter should be contiguous; a slot may still appear in several runs).
    Returns int32[num_tiles] arrays (``num_tiles`` defaults to the count needed; fewer raises ValueError).
    Rows with slot -1 belong to no tile.
    """
    row_slot = np.asarray(row_slot, np.int32)
    n = row_slot.shape[0]
    if n:
        change = np.flatnonzero(row_slot[1:] != row_slot[:-1]) + 1
        run_start = np.concatenate([[0], change]).astype(np.int64)
        run_end = np.concatenate([change, [n]]).astype(np.int64)
        keep = row_slot[run_start] >= 0
        run_start, run_end = run_start[keep], run_end[keep]
    else:
        run_start = run_end = np.zeros(0, np.int64)
    per_run = -(-(run_end - run_start) // block_t)
    run_of_tile = np.repeat(np.arange(run_start.shape[0]), per_run)
    first_tile = np.cumsum(per_run) - per_run
    start = run_start[run_of_tile] + (np.arange(run_of_tile.shape[0]) - first_tile[run_of_tile]) * block_t
    length = np.minimum(block_t, run_end[run_of_tile] - start)
    slot = row_slot[run_start][run_of_tile]
    count = start.shape[0]
    num_tiles = count if num_tiles is None else num_tiles
    if count > num_tiles:
        raise ValueError(f"batch needs {count} tiles of {block_t} rows, bucket has {num_tiles}")
    pad = num_tiles - count
    return SegmentTiles(np.concatenate([start, np.zeros(pad, np.int64)]).astype(np.int32),
                        np.concatenate([length, np.zeros(pad, np.int64)]).astype(np.int32),
                        np.concatenate([slot, np.full(pad, -1, np.int64)]).astype(np.int32))


def max_tiles(n_rows: int, n_segments: int, block_t: int) -> int:
    """Upper bound on :func:`make_tiles`' count for a bucket: every segment may add one partial tile."""
    return -(-n_rows // block_t) + n_segments


def _dot_dtype(x_dtype, pool_dtype):
    """Dots run in the narrower input dtype when both are 16-bit (tensor cores), else in float32."""
    dt = jnp.promote_types(x_dtype, pool_dtype)
    return dt if jnp.dtype(dt).itemsize == 2 else jnp.dtype(_F32)


def _row_gather(pool_ref, pages_ref, lbase, s, v, mask, page_rows: int, vdim: int):
    """Pool vectors of virtual vectors ``v`` [R] of slot ``s``: [R, V]; masked rows read nothing (zeros).

    pool_ref is the [L * NP * PR, V] view; ``lbase`` = first vector of the layer.
    """
    page = load(pages_ref.at[s, lax.div(v, page_rows)], mask=mask, other=0)
    vec = lbase + page * page_rows + lax.rem(v, page_rows)
    lane = jnp.arange(vdim, dtype=jnp.int32)
    return load(pool_ref.at[vec[:, None], lane[None, :]], mask=mask[:, None], other=0)


def _dot(a, b, dtype, *, transpose_b: bool):
    prec = lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
    dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
    return lax.dot_general(a.astype(dtype), b.astype(dtype), dims, precision=prec, preferred_element_type=_F32)


def _shrink_kernel(layer_ref, lbase_ref, start_ref, len_ref, slot_ref, rank_ref, aoff_ref, pages_ref, x_ref,
                   pool_ref, _y_in, y_ref, *, modules, block_t, r_blk, splits, iters, unroll, n_chunks, page_rows,
                   vdim, dot_dtype):
    g, q = pl.program_id(0), pl.program_id(1)
    rb, sp = lax.div(q, splits), lax.rem(q, splits)
    slot, length = slot_ref[g], len_ref[g]
    s = jnp.maximum(slot, 0)
    layer, lbase = layer_ref[0], lbase_ref[0]
    offs = jnp.arange(block_t, dtype=jnp.int32)
    rows = start_ref[g] + offs
    rmask = offs < length
    k = rb * r_blk + jnp.arange(r_blk, dtype=jnp.int32)
    lane = jnp.arange(vdim, dtype=jnp.int32)
    ranks = [jnp.where(slot >= 0, rank_ref[s, layer, m], _I0) for m in modules]
    row_starts = [aoff_ref[s, layer, m] + k * n_chunks for m in modules]
    top = ranks[0]
    for r in ranks[1:]:
        top = jnp.maximum(top, r)
    active = (rb * r_blk < top) & (length > 0)

    @pl.when(active)
    def _():
        def step(j, accs):
            # `unroll` chunks a step: every load of the step is issued before its dots
            cs = [(sp * iters + j) * unroll + u for u in range(unroll)]
            valid = [c < n_chunks for c in cs]
            xts = [load(x_ref.at[rows[:, None], c * vdim + lane[None, :]], mask=rmask[:, None] & cv, other=0)
                   for c, cv in zip(cs, valid, strict=True)]
            a_tiles = [[_row_gather(pool_ref, pages_ref, lbase, s, row_start + c, (k < rank) & cv, page_rows, vdim)
                        for c, cv in zip(cs, valid, strict=True)] for rank, row_start in zip(ranks, row_starts,
                                                                                             strict=True)]
            new = []
            for acc, tiles in zip(accs, a_tiles, strict=True):
                for xt, a in zip(xts, tiles, strict=True):
                    acc = acc + _dot(xt, a, dot_dtype, transpose_b=True)
                new.append(acc)
            return tuple(new)

        init = tuple(jnp.zeros((block_t, r_blk), _F32) for _ in modules)
        accs = lax.fori_loop(0, iters, step, init)
        for i, acc in enumerate(accs):
            store(y_ref.at[sp, rows[:, None], i, k[None, :]], acc, mask=rmask[:, None])


def _shrink_plan(max_rank, n_chunks, splits=None, rank_block=None, unroll=None):
    """(rank block, rank blocks, d_in splits, loop steps a split, chunks a step)."""
    r_blk = min(max(next_pow2(rank_block or max_rank), MIN_DOT), MAX_R_BLK, max(next_pow2(max_rank), MIN_DOT))
    n_rblk = -(-max_rank // r_blk)
    unroll = max(1, min(unroll or 1, n_chunks))
    n_steps = -(-n_chunks // unroll)  # loop steps of `unroll` chunks over the whole of d_in
    iters = -(-n_steps // min(splits or 1, n_steps))
    splits = -(-n_steps // iters)
    return r_blk, n_rblk, splits, iters, unroll


@functools.partial(jax.jit, static_argnames=("modules", "max_rank", "block_t", "interpret", "tuning"))
def sgmv_shrink(x: jax.Array, pool: jax.Array, layer, tiles: SegmentTiles, table: AdapterTable,
                modules: tuple[int, ...], max_rank: int, block_t: int, interpret: bool | None = None, *,
                tuning: Tuning | None = None) -> jax.Array:
    """``y[t, i, :r] = x[t] @ A[slot(t), layer, modules[i]]`` for segmented rows (unscaled; zero for slot -1).

    x: [T, d_in]; pool: [L, NP, PR, V]; layer: int32 scalar; tiles: SegmentTiles of int32[num_tiles] from
    :func:`make_tiles` with the same ``block_t`` (static; >= 16 on the GPU); modules: static ids sharing x;
    max_rank: static >= every rank. Returns float32[T, len(modules), max_rank]. ``tuning``: splits, num_warps,
    rank_block, unroll; on a GPU its unset knobs come from ``GPU_SHRINK``.
    """
    interpret = resolve_interpret(interpret)
    tuning = tuning or Tuning()
    if not interpret:  # unset knobs from the measured GPU plan; float32 tiles load half as many chunks at once
        gpu_plan = GPU_SHRINK if jnp.dtype(_dot_dtype(x.dtype, pool.dtype)).itemsize == 2 else \
            GPU_SHRINK._replace(unroll=GPU_SHRINK.unroll // 2)
        tuning = Tuning(*(mine if mine is not None else gpu for mine, gpu in zip(tuning, gpu_plan, strict=True)))
    n_rows, d_in = x.shape
    _, _, page_rows, vdim = pool.shape
    assert d_in % vdim == 0, (d_in, vdim)
    assert interpret or block_t >= MIN_DOT, "tl.dot needs block_t >= 16"
    n_chunks = d_in // vdim
    n_mod = len(modules)
    n_tiles = tiles.start.shape[0]
    r_blk, n_rblk, splits, iters, unroll = _shrink_plan(max_rank, n_chunks, tuning.splits, tuning.rank_block,
                                                        tuning.unroll)
    kernel = functools.partial(_shrink_kernel, modules=tuple(modules), block_t=block_t, r_blk=r_blk, splits=splits,
                               iters=iters, unroll=unroll, n_chunks=n_chunks, page_rows=page_rows, vdim=vdim,
                               dot_dtype=_dot_dtype(x.dtype, pool.dtype))
    y_shape = (splits, n_rows, n_mod, n_rblk * r_blk)
    y = pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y_shape, _F32),
        grid=(n_tiles, n_rblk * splits),
        in_specs=[any_spec()] * 11,
        out_specs=any_spec(),
        input_output_aliases={10: 0},  # zeros for rows no tile covers
        interpret=interpret,
        num_warps=tuning.num_warps or GPU_WARPS,
        num_stages=3,
        name="lora_sgmv_shrink",
    )(*layer_args(layer, pool.shape), *(jnp.asarray(a, jnp.int32) for a in tiles), table.rank, table.a_off,
      table.pages, x, pool.reshape(-1, vdim), jnp.zeros(y_shape, _F32))
    y = y[0] if splits == 1 else jnp.sum(y, axis=0)
    return y[:, :, :max_rank]


def _expand_kernel(layer_ref, lbase_ref, start_ref, len_ref, slot_ref, rank_ref, boff_ref, scale_ref, pages_ref,
                   y_ref, pool_ref, base_ref, out_ref, *, modules, out_vecs, col_starts, blk_starts, n_blk, block_t,
                   r_blk, max_rank, page_rows, vdim, dot_dtype, hoist):
    g, j = pl.program_id(0), pl.program_id(1)
    i, m, n_out = block_module(j, blk_starts, modules, out_vecs)
    slot, length = slot_ref[g], len_ref[g]
    s = jnp.maximum(slot, 0)
    layer, lbase = layer_ref[0], lbase_ref[0]
    rank = jnp.where(slot >= 0, rank_ref[s, layer, m], _I0)

    @pl.when((rank > 0) & (length > 0))
    def _():
        offs = jnp.arange(block_t, dtype=jnp.int32)
        rows = start_ref[g] + offs
        rmask = offs < length
        k = jnp.arange(r_blk, dtype=jnp.int32)
        kmask = k < rank
        lane = jnp.arange(vdim, dtype=jnp.int32)
        yt = load(y_ref.at[rows[:, None], i, k[None, :]], mask=rmask[:, None] & (k < max_rank)[None, :], other=0.0)
        b_row = boff_ref[s, layer, m] + k * n_out
        scale = scale_ref[s, layer, m]
        first = (j - pick(i, blk_starts)) * n_blk
        col0 = pick(i, col_starts)

        def one(cv, b, old):
            delta = _dot(yt, b, dot_dtype, transpose_b=False)
            store(out_ref.at[rows[:, None], ((col0 + cv) * vdim + lane)[None, :]],
                  (old.astype(_F32) + delta * scale).astype(out_ref.dtype), mask=rmask[:, None] & (cv < n_out))

        def loads(cv):
            cvalid = cv < n_out
            b = _row_gather(pool_ref, pages_ref, lbase, s, b_row + cv, kmask & cvalid, page_rows, vdim)
            old = load(base_ref.at[rows[:, None], ((col0 + cv) * vdim + lane)[None, :]],
                       mask=rmask[:, None] & cvalid, other=0)
            return b, old

        if hoist:  # every vector's loads first (the stores write the columns just read: no other program's)
            cvs = [first + c for c in range(n_blk)]
            tiles = [loads(cv) for cv in cvs]
            for cv, (b, old) in zip(cvs, tiles, strict=True):
                one(cv, b, old)
        else:
            def step(c_local, carry):
                cv = first + c_local
                one(cv, *loads(cv))
                return carry

            lax.fori_loop(0, n_blk, step, jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("modules", "d_outs", "block_t", "interpret", "tuning"))
def sgmv_expand(y: jax.Array, base: jax.Array, pool: jax.Array, layer, tiles: SegmentTiles, table: AdapterTable,
                modules: tuple[int, ...], d_outs: tuple[int, ...], block_t: int, interpret: bool | None = None, *,
                tuning: Tuning | None = None) -> jax.Array:
    """``base`` plus ``scale * y[t, i] @ B[slot(t), layer, modules[i]]`` in module i's column slice, per tile.

    y: float32[T, len(modules), R] (R >= every rank); base: [T, sum(d_outs)]; pool: [L, NP, PR, V]; layer: int32
    scalar; tiles: SegmentTiles from :func:`make_tiles` with this ``block_t``; d_outs: static widths (multiples
    of V). Returns base.dtype [T, sum(d_outs)], aliased to ``base``. ``tuning``: vecs (output vectors per program),
    num_warps.
    """
    interpret, tuning = resolve_interpret(interpret), tuning or Tuning()
    n_rows, n_mod, max_rank = y.shape
    _, _, page_rows, vdim = pool.shape
    assert len(modules) == n_mod == len(d_outs), (modules, y.shape, d_outs)
    assert all(d % vdim == 0 for d in d_outs) and base.shape == (n_rows, sum(d_outs)), (base.shape, d_outs)
    assert interpret or block_t >= MIN_DOT, "tl.dot needs block_t >= 16"
    out_vecs = tuple(d // vdim for d in d_outs)
    col_starts = tuple(sum(out_vecs[:i]) for i in range(n_mod))
    expand_vecs = tuning.vecs or (next_pow2(max(out_vecs)) if interpret else GPU_EXPAND_VECS)
    blk_starts = tuple(sum(-(-n // expand_vecs) for n in out_vecs[:i]) for i in range(n_mod))
    n_blocks = sum(-(-n // expand_vecs) for n in out_vecs)
    r_blk = max(next_pow2(max_rank), MIN_DOT)
    kernel = functools.partial(_expand_kernel, modules=tuple(modules), out_vecs=out_vecs, col_starts=col_starts,
                               blk_starts=blk_starts, n_blk=expand_vecs, block_t=block_t, r_blk=r_blk,
                               max_rank=max_rank, page_rows=page_rows, vdim=vdim,
                               dot_dtype=_dot_dtype(base.dtype, pool.dtype), hoist=bool(tuning.unroll)
                               and expand_vecs > 1)
    return pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(base.shape, base.dtype),
        grid=(tiles.start.shape[0], n_blocks),
        in_specs=[any_spec()] * 12,
        out_specs=any_spec(),
        input_output_aliases={11: 0},
        interpret=interpret,
        num_warps=tuning.num_warps or GPU_WARPS,
        num_stages=3,
        name="lora_sgmv_expand",
    )(*layer_args(layer, pool.shape), *(jnp.asarray(a, jnp.int32) for a in tiles), table.rank, table.b_off,
      table.scale, table.pages, y.astype(_F32), pool.reshape(-1, vdim), base)


# ----------------------------------------------------------------------------------------------------------------------
# References: rebuild each row's slot from the tiles, then the BGMV references (gather + einsum).
# ----------------------------------------------------------------------------------------------------------------------


def tiles_to_row_slot(tiles: SegmentTiles, n_rows: int, block_t: int) -> jax.Array:
    """int32[T] slot per row as the tiles say (-1 for rows in no tile)."""
    offs = jnp.arange(block_t, dtype=jnp.int32)
    start, length, slot = (jnp.asarray(a, jnp.int32) for a in tiles)
    rows = jnp.where(offs[None, :] < length[:, None], start[:, None] + offs[None, :], n_rows)
    slots = jnp.broadcast_to(slot[:, None], rows.shape)
    return jnp.full((n_rows,), -1, jnp.int32).at[rows.reshape(-1)].set(slots.reshape(-1), mode="drop")


@functools.partial(jax.jit, static_argnames=("modules", "max_rank", "block_t", "interpret", "tuning"))
def sgmv_shrink_reference(x, pool, layer, tiles, table, modules, max_rank, block_t, interpret=None, *, tuning=None):
    """jnp version of :func:`sgmv_shrink`."""
    del interpret, tuning
    row_slot = tiles_to_row_slot(tiles, x.shape[0], block_t)
    return bgmv_shrink_reference(x, pool, layer, row_slot, table, modules, max_rank)


@functools.partial(jax.jit, static_argnames=("modules", "d_outs", "block_t", "interpret", "tuning"))
def sgmv_expand_reference(y, base, pool, layer, tiles, table, modules, d_outs, block_t, interpret=None, *,
                          tuning=None):
    """jnp version of :func:`sgmv_expand`."""
    del interpret, tuning
    row_slot = tiles_to_row_slot(tiles, y.shape[0], block_t)
    return bgmv_expand_reference(y, base, pool, layer, row_slot, table, modules, d_outs)
