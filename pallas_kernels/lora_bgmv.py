"""LoRA for decode (BGMV): every row has its own adapter, read straight from the paged pool.

Decode is memory-bound: each row reads its adapter's A (d_in x r) and B (r x d_out) once and does a handful of
FLOPs per byte. So the kernels are gathers + fp32 multiply-accumulate (no tensor cores), sized so that every program
streams a few KiB per loop step and enough programs exist to fill the GPU even at batch 1:

* shrink: grid (row, module, rank block x d_in split). Each program streams ``[r_blk, c_blk, V]`` tiles of A^T
  (``c_blk`` vectors of ``r_blk`` rows) against the matching chunk of x into an fp32 ``[r_blk]`` accumulator,
  double-buffering tiles in registers so two are in flight. With few rows the d_in loop is split across programs;
  the partial sums are added outside (a [splits, T, M, R] fp32 array: tiny).
* expand: grid (row, column block over all modules' outputs). Each program loops over the row's rank in blocks and
  adds ``scale * y @ B`` into its ``[n_blk, V]`` slice of ``base``, which is aliased to the output.

Rows with slot -1 and modules with rank 0 skip their loops (shrink writes zeros, expand leaves ``base`` as it is).
Ranks are mixed freely: loads are masked by ``k < rank`` so no memory is read for padding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.lora_common import (
    AdapterTable,
    Tuning,
    block_module,
    gather_lora_a,
    gather_lora_b,
    layer_args,
    lora_scale,
    pick,
)
from pallas_kernels.lowering import any_spec, load, next_pow2, pallas_call, resolve_interpret, store

GPU_TILE_ELEMS = 8192  # elements of adapter weights one program loads per loop step
GPU_TARGET_PROGRAMS = 1024  # ~8 programs per SM on an H100/H200 (132 SMs): enough to hide gather latency
GPU_PIPELINE = True  # shrink: double-buffer tiles in registers (72 registers at 8192 elements, 8 warps)
GPU_SHRINK_WARPS = 8
MAX_R_BLK = 16  # rank rows per shrink/expand step; larger ranks loop (expand) or use more programs (shrink)

_F32 = jnp.float32
_I0 = np.int32(0)  # typed: jnp.where on two Python ints mis-lowers to i1 in Pallas Triton


def _pages(pages_ref, s, v, mask, page_rows: int):
    """Physical page of each virtual vector ``v`` of slot ``s`` (0 where masked)."""
    return load(pages_ref.at[s, lax.div(v, page_rows)], mask=mask, other=0)


def _vectors(pool_ref, lbase, page, v, mask, page_rows: int, vdim: int):
    """Pool vectors ``[*v.shape, V]`` of virtual vectors ``v`` on ``page``; masked entries read nothing (zeros).

    pool_ref is the [L * NP * PR, V] view; ``lbase`` = first vector of the layer.
    """
    vec = lbase + page * page_rows + lax.rem(v, page_rows)
    lane = jnp.arange(vdim, dtype=jnp.int32)
    return load(pool_ref.at[vec[..., None], lane[(None,) * vec.ndim + (slice(None),)]], mask=mask[..., None], other=0)


def _page_gather(pool_ref, pages_ref, lbase, s, v, mask, page_rows: int, vdim: int):
    """Pool vectors of virtual vectors ``v`` of slot ``s``: ``[*v.shape, V]``; masked entries read zeros."""
    return _vectors(pool_ref, lbase, _pages(pages_ref, s, v, mask, page_rows), v, mask, page_rows, vdim)


def _shrink_kernel(layer_ref, lbase_ref, slot_ref, rank_ref, aoff_ref, pages_ref, x_ref, pool_ref, y_ref, *,
                   modules, r_blk, c_blk, splits, iters, n_chunks, page_rows, vdim, pipeline):
    """With ``pipeline``, software-pipelined in registers: step j reduces tile j while tile j+1 and the page ids
    of tile j+2 load, so a program keeps two tiles in flight and never waits on a page-table lookup."""
    t, i, q = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rb, sp = lax.div(q, splits), lax.rem(q, splits)
    slot = slot_ref[t]
    s = jnp.maximum(slot, 0)
    layer, lbase = layer_ref[0], lbase_ref[0]
    m = pick(i, modules)
    rank = jnp.where(slot >= 0, rank_ref[s, layer, m], _I0)
    k = rb * r_blk + jnp.arange(r_blk, dtype=jnp.int32)
    kmask = k < rank
    row_start = aoff_ref[s, layer, m] + k * n_chunks  # virtual vector of A^T row k, chunk 0
    lane = jnp.arange(vdim, dtype=jnp.int32)
    trip = jnp.where(rb * r_blk < rank, jnp.int32(iters), _I0)

    def at_step(j):
        """Chunks, virtual vectors and mask of step j (all masked once j >= trip)."""
        c = (sp * iters + j) * c_blk + jnp.arange(c_blk, dtype=jnp.int32)
        cmask = (c < n_chunks) & (j < trip)
        return c, cmask, row_start[:, None] + c[None, :], kmask[:, None] & cmask[None, :]

    def pages(j):
        _, _, v, mask = at_step(j)
        return _pages(pages_ref, s, v, mask, page_rows)

    def tile(j, page):
        c, cmask, v, mask = at_step(j)
        a = _vectors(pool_ref, lbase, page, v, mask, page_rows, vdim)
        xc = load(x_ref.at[t, c[:, None], lane[None, :]], mask=cmask[:, None], other=0)
        return a, xc

    def dot(a, xc):
        return jnp.sum(jnp.sum(a.astype(_F32) * xc.astype(_F32)[None, :, :], axis=2), axis=1)

    if pipeline:
        def step(j, carry):
            acc, a, xc, page_next = carry
            page_after = pages(j + 2)
            a_next, x_next = tile(j + 1, page_next)
            return acc + dot(a, xc), a_next, x_next, page_after

        a0, x0 = tile(0, pages(0))
        y = lax.fori_loop(0, trip, step, (jnp.zeros((r_blk,), _F32), a0, x0, pages(1)))[0]
    else:
        y = lax.fori_loop(0, trip, lambda j, acc: acc + dot(*tile(j, pages(j))), jnp.zeros((r_blk,), _F32))
    store(y_ref.at[sp, t, i, k], y)


def _shrink_plan(n_rows, n_mod, max_rank, n_chunks, vdim, interpret, tuning: Tuning):
    """Static tile sizes: (r_blk, n_rblk, c_blk, splits, iters)."""
    r_blk = min(next_pow2(max_rank), MAX_R_BLK)
    n_rblk = -(-max_rank // r_blk)
    tile_elems, splits = tuning.tile_elems or GPU_TILE_ELEMS, tuning.splits
    c_blk = max(1, min(next_pow2(n_chunks), tile_elems // (r_blk * vdim)))
    c_blk = 1 << (c_blk.bit_length() - 1)
    programs = n_rows * n_mod * n_rblk
    if splits is None:
        target = 1 if interpret else GPU_TARGET_PROGRAMS
        while c_blk > 1 and programs * -(-n_chunks // c_blk) < target:
            c_blk //= 2
        splits = max(1, min(-(-target // programs), -(-n_chunks // c_blk)))
    n_steps = -(-n_chunks // c_blk)
    iters = -(-n_steps // splits)
    splits = -(-n_steps // iters)  # drop splits that would have nothing to do
    return r_blk, n_rblk, c_blk, splits, iters


@functools.partial(jax.jit, static_argnames=("modules", "max_rank", "interpret", "tuning"))
def bgmv_shrink(x: jax.Array, pool: jax.Array, layer, row_slot: jax.Array, table: AdapterTable,
                modules: tuple[int, ...], max_rank: int, interpret: bool | None = None, *,
                tuning: Tuning | None = None) -> jax.Array:
    """``y[t, i, :r] = x[t] @ A[row_slot[t], layer, modules[i]]`` (unscaled; zero beyond rank and for slot -1).

    x: [T, d_in] (every module in ``modules`` reads the same x, e.g. q,k,v or gate,up); pool: [L, NP, PR, V];
    layer: int32 scalar; row_slot: int32[T] (-1 = no adapter); table: AdapterTable; modules: static module ids;
    max_rank: static >= every rank used. Returns float32[T, len(modules), max_rank].
    ``tuning`` (static) overrides tile_elems / num_warps / splits (the d_in split) for tests and tuning.
    """
    interpret, tuning = resolve_interpret(interpret), tuning or Tuning()
    n_rows, d_in = x.shape
    _, _, page_rows, vdim = pool.shape
    assert d_in % vdim == 0, (d_in, vdim)
    n_chunks = d_in // vdim
    n_mod = len(modules)
    r_blk, n_rblk, c_blk, splits, iters = _shrink_plan(n_rows, n_mod, max_rank, n_chunks, vdim, interpret, tuning)
    kernel = functools.partial(_shrink_kernel, modules=tuple(modules), r_blk=r_blk, c_blk=c_blk, splits=splits,
                               iters=iters, n_chunks=n_chunks, page_rows=page_rows, vdim=vdim,
                               pipeline=GPU_PIPELINE if tuning.pipeline is None else tuning.pipeline)
    y = pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, n_rows, n_mod, n_rblk * r_blk), _F32),
        grid=(n_rows, n_mod, n_rblk * splits),
        in_specs=[any_spec()] * 8,
        out_specs=any_spec(),
        interpret=interpret,
        num_warps=tuning.num_warps or GPU_SHRINK_WARPS,
        name="lora_bgmv_shrink",
    )(*layer_args(layer, pool.shape), row_slot.astype(jnp.int32), table.rank,
      table.a_off, table.pages, x.reshape(n_rows, n_chunks, vdim), pool.reshape(-1, vdim))
    y = y[0] if splits == 1 else jnp.sum(y, axis=0)
    return y[:, :, :max_rank]


def _expand_kernel(layer_ref, lbase_ref, slot_ref, rank_ref, boff_ref, scale_ref, pages_ref, y_ref, pool_ref,
                   base_ref, out_ref, *, modules, out_vecs, col_starts, blk_starts, n_blk, r_blk, page_rows, vdim):
    t, j = pl.program_id(0), pl.program_id(1)
    i, m, n_out = block_module(j, blk_starts, modules, out_vecs)
    slot = slot_ref[t]
    s = jnp.maximum(slot, 0)
    layer, lbase = layer_ref[0], lbase_ref[0]
    rank = jnp.where(slot >= 0, rank_ref[s, layer, m], _I0)
    cv = (j - pick(i, blk_starts)) * n_blk + jnp.arange(n_blk, dtype=jnp.int32)  # output vectors of this module
    cmask = cv < n_out
    lane = jnp.arange(vdim, dtype=jnp.int32)

    @pl.when(rank > 0)
    def _():
        b_off = boff_ref[s, layer, m]

        def step(rb, acc):
            k = rb * r_blk + jnp.arange(r_blk, dtype=jnp.int32)
            kmask = k < rank
            yk = load(y_ref.at[t, i, k], mask=kmask, other=0.0)
            mask = kmask[:, None] & cmask[None, :]
            b = _page_gather(pool_ref, pages_ref, lbase, s, b_off + k[:, None] * n_out + cv[None, :], mask,
                             page_rows, vdim)
            return acc + jnp.sum(b.astype(_F32) * yk.astype(_F32)[:, None, None], axis=0)

        acc = lax.fori_loop(0, lax.div(rank + (r_blk - 1), r_blk), step, jnp.zeros((n_blk, vdim), _F32))
        cols = (pick(i, col_starts) + cv)[:, None]
        old = load(base_ref.at[t, cols, lane[None, :]], mask=cmask[:, None], other=0)
        new = old.astype(_F32) + acc * scale_ref[s, layer, m]
        store(out_ref.at[t, cols, lane[None, :]], new.astype(out_ref.dtype), mask=cmask[:, None])


def _expand_plan(n_rows, out_vecs, max_rank, vdim, interpret, tuning: Tuning):
    """Static tile sizes: (r_blk, n_blk, block starts per module, total blocks)."""
    r_blk = min(next_pow2(max_rank), MAX_R_BLK)
    tile_elems = tuning.tile_elems or GPU_TILE_ELEMS
    n_blk = max(1, min(next_pow2(max(out_vecs)), tile_elems // (r_blk * vdim)))
    n_blk = 1 << (n_blk.bit_length() - 1)

    def blocks(nb):
        return sum(-(-n // nb) for n in out_vecs)

    target = 1 if interpret else GPU_TARGET_PROGRAMS
    while n_blk > 1 and n_rows * blocks(n_blk) < target:
        n_blk //= 2
    starts, acc = [], 0
    for n in out_vecs:
        starts.append(acc)
        acc += -(-n // n_blk)
    return r_blk, n_blk, tuple(starts), acc


@functools.partial(jax.jit, static_argnames=("modules", "d_outs", "interpret", "tuning"))
def bgmv_expand(y: jax.Array, base: jax.Array, pool: jax.Array, layer, row_slot: jax.Array, table: AdapterTable,
                modules: tuple[int, ...], d_outs: tuple[int, ...], interpret: bool | None = None, *,
                tuning: Tuning | None = None) -> jax.Array:
    """``base`` plus ``scale * y[t, i] @ B[row_slot[t], layer, modules[i]]`` in module i's column slice.

    y: float32[T, len(modules), R] (from bgmv_shrink, R >= every rank); base: [T, sum(d_outs)] (module i owns columns
    ``sum(d_outs[:i]) : sum(d_outs[:i + 1])``); pool: [L, NP, PR, V]; layer: int32 scalar; row_slot: int32[T];
    d_outs: static output widths (multiples of V). Returns base.dtype [T, sum(d_outs)]; ``base`` is aliased to the
    output, so donate it to update in place. ``tuning`` (static) overrides tile_elems / num_warps.
    """
    interpret, tuning = resolve_interpret(interpret), tuning or Tuning()
    n_rows, n_mod, max_rank = y.shape
    _, _, page_rows, vdim = pool.shape
    assert len(modules) == n_mod == len(d_outs), (modules, y.shape, d_outs)
    assert all(d % vdim == 0 for d in d_outs) and base.shape == (n_rows, sum(d_outs)), (base.shape, d_outs)
    out_vecs = tuple(d // vdim for d in d_outs)
    col_starts = tuple(sum(out_vecs[:i]) for i in range(n_mod))
    r_blk, n_blk, blk_starts, n_blocks = _expand_plan(n_rows, out_vecs, max_rank, vdim, interpret, tuning)
    kernel = functools.partial(_expand_kernel, modules=tuple(modules), out_vecs=out_vecs, col_starts=col_starts,
                               blk_starts=blk_starts, n_blk=n_blk, r_blk=r_blk, page_rows=page_rows, vdim=vdim)
    out = pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_rows, base.shape[1] // vdim, vdim), base.dtype),
        grid=(n_rows, n_blocks),
        in_specs=[any_spec()] * 10,
        out_specs=any_spec(),
        input_output_aliases={9: 0},
        interpret=interpret,
        num_warps=tuning.num_warps or 4,
        name="lora_bgmv_expand",
    )(*layer_args(layer, pool.shape), row_slot.astype(jnp.int32), table.rank,
      table.b_off, table.scale, table.pages, y.astype(_F32), pool.reshape(-1, vdim), base.reshape(n_rows, -1, vdim))
    return out.reshape(base.shape)


# ----------------------------------------------------------------------------------------------------------------------
# References: plain gather + einsum, same signatures.
# ----------------------------------------------------------------------------------------------------------------------

_HI = lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("modules", "max_rank", "interpret", "tuning"))
def bgmv_shrink_reference(x, pool, layer, row_slot, table, modules, max_rank, interpret=None, *, tuning=None):
    """jnp version of :func:`bgmv_shrink` (gathers each row's dense A)."""
    del interpret, tuning
    ys = []
    for m in modules:
        a = gather_lora_a(pool, table, layer, row_slot, m, x.shape[1], max_rank)
        ys.append(jnp.einsum("td,tdr->tr", x, a, precision=_HI, preferred_element_type=_F32))
    return jnp.stack(ys, axis=1)


@functools.partial(jax.jit, static_argnames=("modules", "d_outs", "interpret", "tuning"))
def bgmv_expand_reference(y, base, pool, layer, row_slot, table, modules, d_outs, interpret=None, *, tuning=None):
    """jnp version of :func:`bgmv_expand` (gathers each row's dense B)."""
    del interpret, tuning
    deltas = []
    for i, (m, d_out) in enumerate(zip(modules, d_outs, strict=True)):
        b = gather_lora_b(pool, table, layer, row_slot, m, d_out, y.shape[2])
        delta = jnp.einsum("tr,tro->to", y[:, i].astype(_F32), b.astype(_F32), precision=_HI)
        deltas.append(delta * lora_scale(table, layer, row_slot, m)[:, None])
    return (base.astype(_F32) + jnp.concatenate(deltas, axis=1)).astype(base.dtype)
