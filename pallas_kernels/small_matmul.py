"""``x @ W`` for a few rows (decode batches): a weight-streaming GEMM whose grid covers the GPU at M = 1-16.

At decode batch sizes a projection's time is the time to read its weight once. On the H200 XLA's GEMMs for o_proj
and down_proj (d_out 4096) read theirs at 57-64% of the copy bandwidth at exactly one row, and at 87-91% at four
(``benchmarks/small_matmul.py``, NOTES session 16). Here every program owns a narrow column block (``block_n``)
and, where that leaves too few programs, a contiguous share of the contraction (``splits``); each streams its
``[K/splits, block_n]`` slab of W once, in ``block_k``-row tiles, against the (tiny, cached) rows of x. With one
split the kernel also adds the residual and writes the result in x's dtype, so projection and residual add are one
launch. Measured: down_proj at 94% of the bandwidth at one row, ahead of XLA at 64 rows (NOTES). The serving model
does not call it yet: GPU decode steps start at 4 rows instead (``TileDefaults.min_decode_bucket``).

Rows are padded to a ``tl.dot`` tile (16) inside the kernel by masked loads; nothing is padded in memory.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.lowering import any_spec, is_pow2, load, next_pow2, pallas_call, store
from pallas_kernels.paged_attention import dot_f32

_F32 = jnp.float32
MIN_ROWS_TILE = 16  # tl.dot's smallest M


class SmallMatmulPlan(NamedTuple):
    """How one ``[M, K] @ [K, N]`` is split: column block, contraction tile, contraction splits, warps, stages."""

    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 4


def plan_fits(plan: SmallMatmulPlan, k: int, n: int) -> bool:
    """Whether ``plan`` tiles a [K, N] weight exactly (no masked weight loads: every load is a full tile) with
    power-of-two tiles (the Triton lowering's rule; interpret mode would not catch it)."""
    return (is_pow2(plan.block_n) and is_pow2(plan.block_k) and plan.splits >= 1 and n % plan.block_n == 0
            and k % (plan.block_k * plan.splits) == 0)


def _kernel(x_ref, w_ref, *refs, rows: int, rows_tile: int, block_n: int, block_k: int, k_per_split: int,
            fused: bool):
    out_ref = refs[-1]  # after the residual when there is one (one split only)
    j, s = pl.program_id(0), pl.program_id(1)
    r = jnp.arange(rows_tile, dtype=jnp.int32)
    r_ok = r < rows
    n = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    k_first = s * k_per_split

    def body(i, acc):
        k = k_first + i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        xt = load(x_ref.at[r[:, None], k[None, :]], mask=r_ok[:, None], other=0.0)
        wt = load(w_ref.at[k[:, None], n[None, :]])
        return acc + dot_f32(xt, wt)

    acc = lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((rows_tile, block_n), _F32))
    if fused:  # one split: the whole sum here, plus the residual, in the output dtype
        if len(refs) == 2:
            res = load(refs[0].at[r[:, None], n[None, :]], mask=r_ok[:, None], other=0.0)
            acc = acc + res.astype(_F32)
        store(out_ref.at[r[:, None], n[None, :]], acc.astype(out_ref.dtype), mask=r_ok[:, None])
    else:  # one partial sum per split: out [splits, M, N] float32
        sv = jnp.full((rows_tile,), s, dtype=jnp.int32)
        store(out_ref.at[sv[:, None], r[:, None], n[None, :]], acc, mask=r_ok[:, None])


@functools.partial(jax.jit, static_argnames=("plan", "interpret"))
def small_matmul(x: jax.Array, w: jax.Array, residual: jax.Array | None = None, *, plan: SmallMatmulPlan,
                 interpret: bool | None = None) -> jax.Array:
    """``residual + x @ w`` (or ``x @ w`` when ``residual`` is None) in x's dtype, accumulated in float32.

    x: [M, K]; w: [K, N]; residual: [M, N] or None. ``plan`` must fit (``plan_fits``). With ``plan.splits > 1`` the
    kernel writes one float32 partial product per split and XLA sums them (fused with the residual add and the
    convert); with one split the kernel itself adds the residual and converts.
    """
    m, k = x.shape
    k2, n = w.shape
    if k2 != k or w.dtype != x.dtype or (residual is not None and residual.shape != (m, n)):
        raise ValueError(f"small_matmul: x {x.shape} {x.dtype}, w {w.shape} {w.dtype}, residual "
                         f"{None if residual is None else residual.shape} disagree")
    if not plan_fits(plan, k, n):
        raise ValueError(f"small_matmul: plan {plan} does not tile a [{k}, {n}] weight")
    rows_tile = max(MIN_ROWS_TILE, next_pow2(m))
    fused_residual = plan.splits == 1
    kernel = functools.partial(_kernel, rows=m, rows_tile=rows_tile, block_n=plan.block_n, block_k=plan.block_k,
                               k_per_split=k // plan.splits, fused=fused_residual)
    if fused_residual:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
    else:
        out_shape = jax.ShapeDtypeStruct((plan.splits, m, n), _F32)
    args = (x, w) if residual is None or not fused_residual else (x, w, residual)
    out = pallas_call(kernel, out_shape=out_shape, grid=(n // plan.block_n, plan.splits),
                      in_specs=[any_spec()] * len(args), out_specs=any_spec(), interpret=interpret,
                      num_warps=plan.num_warps, num_stages=plan.num_stages, name="small_matmul")(*args)
    if fused_residual:
        return out
    total = out.sum(axis=0)
    if residual is not None:
        total = total + residual.astype(_F32)
    return total.astype(x.dtype)


def small_matmul_reference(x: jax.Array, w: jax.Array, residual: jax.Array | None = None) -> jax.Array:
    """jnp version: one float32 dot, the residual added in float32, one rounding to x's dtype."""
    out = jnp.dot(x.astype(_F32), w.astype(_F32), precision=lax.Precision.HIGHEST)
    if residual is not None:
        out = out + residual.astype(_F32)
    return out.astype(x.dtype)
