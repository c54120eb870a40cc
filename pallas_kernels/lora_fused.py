"""LoRA for decode, fused: a projection group's shrink and expand in one kernel (the rank-r intermediate stays in
registers), so a layer launches one LoRA kernel per group instead of three (shrink, XLA sum, expand: lora_bgmv).

Why: at decode batch sizes the unfused kernels spend their time on launches and on the chain of dependent loads at
the head of every kernel (row slot -> adapter table -> page table -> pool vectors), not on bytes. Two plans, chosen
per group from the static shapes by a small cost model (:func:`fused_plan`; ``FusedTuning`` overrides it):

* ``fused``: grid (output block, row). A program computes its row's ``u = scale * x @ A`` over all of d_in, then
  ``base + u @ B`` for its block of output vectors of one module. Programs of one (row, module) each read that
  module's A (the first from HBM, the rest mostly from L2): at large batch a program covers a whole module (nothing
  read twice); at small batch modules are cut into blocks so that more of the GPU works.
* ``split`` (small batch and a long A, e.g. down_proj at batch 1): d_in split over programs that write fp32 partials
  [S, T, M, R], and an expand kernel that sums them itself (two kernels, nothing between them).

Ranks mix freely: a row runs the branch of its rank class (the smallest of ``classes``, powers of two, that holds
its rank), whose tiles are [class, chunks, V], so a rank-8 row in a max-rank-64 batch moves full tiles of its own
rows instead of 64-row tiles with 56 rows masked. Rows with slot -1 and modules with rank 0 exit at once (base is
aliased to the output and stays as it is). The shrink reduces each tile over its V lanes (inside a warp) into a
[class, chunks] fp32 partial and sums the chunks once at the end; with ``reduce_once`` it keeps the whole
[class, chunks, V] product in fp32 registers and reduces over V and the chunks once, after its last step (no warp
shuffles in the loop, at the cost of a tile's worth of fp32 registers; a variant for the benchmark, off by default).
With ``unroll`` = G > 1 a loop step covers G tiles and issues their loads in two waves (every page lookup, then every
pool vector) before it computes on any: a program's dependent loads then cost two round trips per G tiles instead of
two per tile (the programs at 16-64 rows run 1-6 tiles and wait on their loads, session 22-24); off by default.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.lora_bgmv import bgmv_expand, bgmv_expand_reference, bgmv_shrink, bgmv_shrink_reference
from pallas_kernels.lora_common import AdapterTable, block_module, layer_args, pick
from pallas_kernels.lowering import any_spec, load, next_pow2, pallas_call, resolve_interpret, store

GPU_TILE_ELEMS = 16384  # adapter elements a program moves per loop step (32 KB of bf16) ...
GPU_WARPS = 8
SMALL_TILE_ELEMS = 32768  # ... or, when the grid has fewer programs than SMs, twice that over twice the warps
SMALL_WARPS = 16
N_CLASSES = 4  # rank classes: next_pow2(max_rank) and the powers of two below it
PLAN_RANK = 16  # the rank the plan assumes for a row (true ranks are known only on the device)
# Up to this many rows the plan is the split one with 8k-element tiles (its splits and blocks still from the cost
# model). Measured as whole layers (all 7 projections, rank 16, H200, session 15, kernels.py --decode-table), the
# cost model's own picks lost there: 42.6 / 52.6 / 100.8 us a layer at 1 / 16 / 64 rows against 27.2 / 43.8 / 97.3.
# At 256 rows its pick (fused) was within 3% of the best; above 64 it decides.
SPLIT_ROWS = 64
SPLIT_TILE = (8192, 8)  # (tile_elems, num_warps)

# Cost model of the plan (H200; microseconds and bytes per microsecond). KERNEL_US: launch gap plus the dependent
# loads at a kernel's head; a program streams at most its tile per LATENCY_US, and at most SM_BPUS.
NUM_SMS = 132
KERNEL_US = 4.0
LATENCY_US = 0.8
SM_BPUS = 100e3
L2_BPUS = 6.0e6
HBM_BPUS = 4.2e6

_F32 = jnp.float32
_I0 = np.int32(0)  # typed: jnp.where on two Python ints mis-lowers to i1 in Pallas Triton


class FusedTuning(NamedTuple):
    """Static overrides of :func:`fused_plan` (``None`` = the plan's choice; hashable, pass as a static arg).

    mode: "fused" | "split"; vecs: output vectors (of V columns) per program; splits: d_in splits (split mode);
    tile_elems: adapter elements per program step; num_warps; classes: how many rank classes; reduce_once: the
    shrink reduces over V once, after its loop, instead of at every step; unroll: tiles whose loads one loop step
    issues together (1: a tile a step).
    """

    mode: str | None = None
    vecs: int | None = None
    splits: int | None = None
    tile_elems: int | None = None
    num_warps: int | None = None
    classes: int | None = None
    reduce_once: bool | None = None
    unroll: int | None = None


class FusedPlan(NamedTuple):
    mode: str
    vecs: int
    splits: int
    tile_elems: int
    num_warps: int
    classes: tuple[int, ...]
    est_us: float  # the cost model's estimate (0 in interpret mode)
    reduce_once: bool = False  # not in the cost model: only a tuning sets it
    unroll: int = 1  # likewise


def _kernel_us(programs, per_prog, l2_bytes, hbm_bytes, tile_bytes, resident) -> float:
    """Estimated time of one kernel: launch + max(slowest program, L2 traffic, HBM traffic)."""
    prog_bpus = min(tile_bytes / LATENCY_US, SM_BPUS)
    waves = math.ceil(programs / (resident * NUM_SMS))
    return KERNEL_US + max(per_prog / prog_bpus * waves + LATENCY_US, l2_bytes / L2_BPUS, hbm_bytes / HBM_BPUS)


def _estimate(mode, vecs, splits, tile, n_rows, n_chunks, out_vecs, vdim, rank, itemsize) -> float:
    tile_elems, warps = tile
    a = rank * n_chunks * vdim * itemsize  # A of one (row, module)
    bs = [rank * n * vdim * itemsize for n in out_vecs]
    blocks = [-(-n // vecs) for n in out_vecs]
    b_blk = rank * min(vecs, max(out_vecs)) * vdim * itemsize
    resident = max(1, 16 // warps)  # programs per SM the registers allow, roughly
    tile_bytes, hbm = tile_elems * itemsize, n_rows * (a * len(out_vecs) + sum(bs))
    if mode == "fused":
        return _kernel_us(n_rows * sum(blocks), a + b_blk, n_rows * (a * sum(blocks) + sum(bs)), hbm, tile_bytes,
                          resident)
    shrink = _kernel_us(n_rows * len(out_vecs) * splits, a / splits, n_rows * a * len(out_vecs),
                        n_rows * a * len(out_vecs), tile_bytes, resident)
    return shrink + _kernel_us(n_rows * sum(blocks), b_blk, n_rows * sum(bs), n_rows * sum(bs), tile_bytes, resident)


def fused_plan(n_rows: int, n_chunks: int, out_vecs: tuple[int, ...], vdim: int, max_rank: int, itemsize: int,
               interpret: bool, tuning: FusedTuning | None = None) -> FusedPlan:
    """Static launch plan of one group: the cheapest (mode, vecs, splits, tile) under the cost model, with every
    field ``tuning`` sets taken as given. Interpret mode (CPU tests) defaults to one fused program per module."""
    tuning = tuning or FusedTuning()
    top = next_pow2(max_rank)
    n_cls = tuning.classes or N_CLASSES
    classes = tuple(sorted({max(1, top >> i) for i in range(n_cls)}))
    if interpret:
        cands = [(tuning.mode or "fused", tuning.vecs or next_pow2(max(out_vecs)), tuning.splits or 1,
                  (tuning.tile_elems or GPU_TILE_ELEMS, tuning.num_warps or GPU_WARPS), 0.0)]
    else:
        vec_opts = [tuning.vecs] if tuning.vecs else [1 << i for i in range(next_pow2(max(out_vecs)).bit_length())]
        split_opts = [tuning.splits] if tuning.splits else [1 << i for i in range(next_pow2(n_chunks).bit_length())]
        tiles = [(GPU_TILE_ELEMS, GPU_WARPS), (SMALL_TILE_ELEMS, SMALL_WARPS)]
        if tuning.tile_elems or tuning.num_warps:
            tiles = [(tuning.tile_elems or GPU_TILE_ELEMS, tuning.num_warps or GPU_WARPS)]
        modes = [tuning.mode] if tuning.mode else ["fused", "split"]
        if n_rows <= SPLIT_ROWS and not (tuning.mode or tuning.tile_elems or tuning.num_warps):
            modes, tiles = ["split"], [SPLIT_TILE]
        rank = min(top, PLAN_RANK)
        cands = []
        for mode, vecs, tile in itertools.product(modes, vec_opts, tiles):
            for splits in (split_opts if mode == "split" else [1]):
                est = _estimate(mode, vecs, splits, tile, n_rows, n_chunks, out_vecs, vdim, rank, itemsize)
                cands.append((mode, vecs, splits, tile, est))
        # cheapest; ties (within 2%) go to fused, then to fewer, larger programs
        best = min(c[4] for c in cands)
        cands = [c for c in cands if c[4] <= best * 1.02]
        cands.sort(key=lambda c: (c[0] != "fused", -c[1], c[2], c[3][0], c[4]))
    mode, vecs, splits, (tile_elems, warps), est = cands[0]
    if mode not in ("fused", "split"):
        raise ValueError(f"unknown fused LoRA mode {mode!r}")
    vecs = min(vecs, next_pow2(max(out_vecs)))
    splits = min(splits, n_chunks)
    return FusedPlan(mode, vecs, splits, tile_elems, warps, classes, est, bool(tuning.reduce_once),
                     max(1, int(tuning.unroll or 1)))


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
    reduce_once: bool = False
    unroll: int = 1


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


def _pool_index(pages_ref, row: _Row, v, mask, g: _Geom):
    """Pool vector indices of the row's virtual vectors ``v``: the page lookup, the first load of a gather."""
    page = load(pages_ref.at[row.s, lax.div(v, g.page_rows)], mask=mask, other=0)
    return row.lbase + page * g.page_rows + lax.rem(v, g.page_rows)


def _pool_vectors(pool_ref, vec, mask, g: _Geom):
    """Pool vectors ``[*vec.shape, V]`` at pool indices ``vec``; masked entries read nothing (zeros)."""
    lane = jnp.arange(g.vdim, dtype=jnp.int32)
    return load(pool_ref.at[vec[..., None], lane[(None,) * vec.ndim + (slice(None),)]], mask=mask[..., None], other=0)


def _pow2_tile(tile_elems: int, r_b: int, vdim: int, span: int) -> int:
    """Vectors per tile row: a power of two, >= 1, no more than ``span`` needs."""
    n = max(1, min(tile_elems // (r_b * vdim), next_pow2(span)))
    return 1 << (n.bit_length() - 1)


def _shrink(x_ref, pool_ref, pages_ref, row: _Row, a_off, r_b, lo, hi, span, g: _Geom):
    """``sum over chunks [lo, hi) of A^T[k] . x[t]`` for k < r_b (unscaled; zero for k >= rank): float32 [r_b]."""
    c = _pow2_tile(g.tile_elems, r_b, g.vdim, span)
    k = jnp.arange(r_b, dtype=jnp.int32)
    kmask = k < row.rank
    row0 = a_off + k * g.n_chunks  # virtual vector of A^T row k, chunk 0
    lane = jnp.arange(g.vdim, dtype=jnp.int32)
    steps = -(-span // c)
    n_tiles = max(1, min(g.unroll, steps))  # tiles a loop step loads together

    def step(j, acc):
        # chunks past ``hi`` (the last step's tail, or a step's tiles past the span) are masked: they load nothing
        ccs = [lo + (j * n_tiles + u) * c + jnp.arange(c, dtype=jnp.int32) for u in range(n_tiles)]
        masks = [cc < hi for cc in ccs]
        amasks = [kmask[:, None] & cm[None, :] for cm in masks]
        tiles = range(n_tiles)
        vecs = [_pool_index(pages_ref, row, row0[:, None] + ccs[u][None, :], amasks[u], g) for u in tiles]
        xcs = [load(x_ref.at[row.t, ccs[u][:, None], lane[None, :]], mask=masks[u][:, None], other=0) for u in tiles]
        a = [_pool_vectors(pool_ref, vecs[u], amasks[u], g) for u in tiles]
        for u in tiles:  # every load is issued above; the math waits for them here
            prod = a[u].astype(_F32) * xcs[u].astype(_F32)[None, :, :]
            acc = acc + (prod if g.reduce_once else jnp.sum(prod, axis=2))
        return acc

    shape = (r_b, c, g.vdim) if g.reduce_once else (r_b, c)
    n_steps = -(-steps // n_tiles)
    if n_tiles > 1 and n_steps == 1:  # straight-line: nothing to loop over
        acc = step(0, jnp.zeros(shape, _F32))
    else:
        acc = lax.fori_loop(0, n_steps, step, jnp.zeros(shape, _F32))
    return jnp.sum(jnp.sum(acc, axis=2) if g.reduce_once else acc, axis=1)


def _expand_tiles(pool_ref, pages_ref, base_ref, row: _Row, b_off, n_out, col0, first, r_b, g: _Geom):
    """(vectors per tile, tiles(e0, n) -> loads of tiles e0 .. e0 + n - 1, apply(loads, u, out_ref) -> stores) for
    the program's block. ``tiles`` issues every page lookup before any pool or base load."""
    n_c = _pow2_tile(g.tile_elems, r_b, g.vdim, g.vecs)
    k = jnp.arange(r_b, dtype=jnp.int32)
    kmask = k < row.rank
    row0 = b_off + k * n_out  # virtual vector of B row k, output vector 0
    lane = jnp.arange(g.vdim, dtype=jnp.int32)
    limit = jnp.minimum(first + g.vecs, n_out)

    def tiles(e0, n):
        cvs = [first + (e0 + u) * n_c + jnp.arange(n_c, dtype=jnp.int32) for u in range(n)]
        cmasks = [cv < limit for cv in cvs]  # tiles past the block's end load and store nothing
        bmasks = [kmask[:, None] & cm[None, :] for cm in cmasks]
        vecs = [_pool_index(pages_ref, row, row0[:, None] + cvs[u][None, :], bmasks[u], g) for u in range(n)]
        cols = [(col0 + cv)[:, None] * g.vdim + lane[None, :] for cv in cvs]  # base, out [T, D]: vector c*V + lane
        bs = [_pool_vectors(pool_ref, vecs[u], bmasks[u], g) for u in range(n)]
        olds = [load(base_ref.at[row.t, cols[u]], mask=cmasks[u][:, None], other=0) for u in range(n)]
        return [(bs[u], olds[u], cols[u], cmasks[u]) for u in range(n)]

    def apply(loads, u, out_ref):
        for b, old, cols, cmask in loads:
            new = old.astype(_F32) + jnp.sum(b.astype(_F32) * u[:, None, None], axis=0)
            store(out_ref.at[row.t, cols], new.astype(out_ref.dtype), mask=cmask[:, None])

    return n_c, tiles, apply


def _expand(pool_ref, pages_ref, base_ref, out_ref, row, b_off, n_out, col0, first, r_b, g, u_fn):
    """``out = base + u @ B`` over the program's block; ``u_fn()`` gives the scaled [r_b] intermediate. A block that
    one loop step covers has its B and base loads issued before ``u_fn`` runs, so they arrive while the shrink
    streams A."""
    n_c, tiles, apply = _expand_tiles(pool_ref, pages_ref, base_ref, row, b_off, n_out, col0, first, r_b, g)
    per_block = -(-min(g.vecs, max(g.out_vecs)) // n_c)  # tiles of the widest block
    n_tiles = max(1, min(g.unroll, per_block))  # tiles a loop step loads together
    if per_block <= n_tiles:
        loads = tiles(0, per_block)
        apply(loads, u_fn(), out_ref)
        return
    u = u_fn()

    def step(e, carry):
        apply(tiles(e * n_tiles, n_tiles), u, out_ref)
        return carry

    n_steps = lax.div(jnp.minimum(first + g.vecs, n_out) - first + (n_c * n_tiles - 1), n_c * n_tiles)
    lax.fori_loop(0, n_steps, step, _I0)


def _block(j, g: _Geom):
    """(index in modules, module id, its output vectors, its first output column, first vector of block j)."""
    i, m, n_out = block_module(j, g.blk_starts, g.modules, g.out_vecs)
    return i, m, n_out, pick(i, g.col_starts), (j - pick(i, g.blk_starts)) * g.vecs


def _fused_kernel(layer_ref, lbase_ref, slot_ref, rank_ref, aoff_ref, boff_ref, scale_ref, pages_ref, x_ref, pool_ref,
                  base_ref, out_ref, *, g: _Geom):
    j, t = pl.program_id(0), pl.program_id(1)
    i, m, n_out, col0, first = _block(j, g)
    row = _row(layer_ref, lbase_ref, slot_ref, rank_ref, t, m)
    a_off, b_off = aoff_ref[row.s, row.layer, m], boff_ref[row.s, row.layer, m]
    scale = scale_ref[row.s, row.layer, m]

    def body(r_b):
        def u_fn():
            return _shrink(x_ref, pool_ref, pages_ref, row, a_off, r_b, 0, g.n_chunks, g.n_chunks, g) * scale

        _expand(pool_ref, pages_ref, base_ref, out_ref, row, b_off, n_out, col0, first, r_b, g, u_fn)

    _by_class(row, g.classes, body)


def _split_shrink_kernel(layer_ref, lbase_ref, slot_ref, rank_ref, aoff_ref, pages_ref, x_ref, pool_ref, y_ref, *,
                         g: _Geom):
    sp, i, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m = pick(i, g.modules)
    row = _row(layer_ref, lbase_ref, slot_ref, rank_ref, t, m)
    a_off = aoff_ref[row.s, row.layer, m]
    lo = sp * g.chunks_per_split
    hi = jnp.minimum(lo + g.chunks_per_split, g.n_chunks)

    def body(r_b):
        u = _shrink(x_ref, pool_ref, pages_ref, row, a_off, r_b, lo, hi, g.chunks_per_split, g)
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
            return jnp.sum(parts, axis=0) * scale

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
              p.classes, p.tile_elems, n_chunks, -(-n_chunks // p.splits), p.splits, page_rows, vdim, p.reduce_once,
              p.unroll)
    lay = layer_args(layer, pool.shape)
    slot = row_slot.astype(jnp.int32)
    xv, poolv = x.reshape(n_rows, n_chunks, vdim), pool.reshape(-1, vdim)
    call = functools.partial(pallas_call, out_specs=any_spec(), interpret=interpret, num_warps=p.num_warps)
    # base stays [T, D] in and out: a reshaped output stood as a convert kernel before the next RMSNorm (64 a step)
    out_shape = jax.ShapeDtypeStruct(base.shape, base.dtype)
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
