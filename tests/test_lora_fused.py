"""Fused decode LoRA (one kernel per projection group, or the split pair) against its jnp reference and an
independent dense numpy product, over the same poisoned, shuffled-page pools as the unfused kernels' tests: mixed
ranks per module and layer (rows in different rank classes), modules an adapter leaves out (rank 0), rows with no
adapter. Outputs are aliased to a random base, so anything the kernel must not touch is checked to be base exactly.
CPU runs interpret mode with tiny shapes; the ``gpu`` test runs the compiled kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda
from test_lora_kernels import (
    DOWN,
    GATE_UP,
    GPU_DIMS,
    O_PROJ,
    QKV,
    close,
    dense_delta,
    group_dims,
    make_world,
    random_rows,
)

from pallas_kernels.lora_common import AdapterTable
from pallas_kernels.lora_fused import SPLIT_ROWS, SPLIT_TILE, FusedTuning, bgmv_lora, bgmv_lora_reference, fused_plan
from pallas_kernels.lowering import next_pow2


def untouched(world, row_slot, layer, modules, d_outs) -> np.ndarray:
    """Bool [T, sum(d_outs)]: entries no adapter writes (rows without one, modules their adapter leaves out)."""
    cols = []
    for m, d in zip(modules, d_outs, strict=True):
        rank = np.array([world.table.rank[s, layer, m] if s >= 0 else 0 for s in row_slot])
        cols.append(np.repeat((rank == 0)[:, None], d, axis=1))
    return np.concatenate(cols, axis=1)


def check_fused(world, modules, layer, n_rows, tuning, rng, dtype=jnp.float32, tol=1e-5, max_rank=64):
    d_in, d_outs = group_dims(world, modules)
    row_slot = random_rows(rng, world, n_rows, no_adapter=min(2, n_rows - 1))
    x = rng.normal(size=(n_rows, d_in)).astype(np.float32)
    base = rng.normal(size=(n_rows, sum(d_outs))).astype(np.float32)
    pool, table = world.device(dtype)
    xd, based = jnp.asarray(x, dtype), jnp.asarray(base, dtype)
    args = (pool, jnp.asarray(layer, jnp.int32), jnp.asarray(row_slot), table, modules, max_rank, d_outs)
    out = bgmv_lora(xd, based, *args, tuning=tuning)
    assert out.dtype == dtype and out.shape == base.shape
    close(out, bgmv_lora_reference(xd, based, *args), tol)
    want = np.asarray(based, np.float32) + np.concatenate(
        dense_delta(world, np.asarray(xd, np.float32), row_slot, layer, modules), axis=1)
    close(out, want, 3 * tol)
    keep = untouched(world, row_slot, layer, modules, d_outs)
    # Both kinds of entry are checked; a single row's adapter may touch every column, or leave the group out entirely.
    assert n_rows == 1 or (keep.any() and not keep.all())
    np.testing.assert_array_equal(np.asarray(out)[keep], np.asarray(based)[keep])


FUSED_CASES = [
    # (seed, modules, layer, n_rows, tuning)
    (1, QKV, 1, 7, FusedTuning()),  # interpret default: one program per (row, module)
    (2, GATE_UP, 0, 5, FusedTuning(vecs=2, tile_elems=256)),  # blocks of 2 of 6 vectors, many shrink/expand steps
    (3, DOWN, 1, 4, FusedTuning(mode="split", splits=4, vecs=1, tile_elems=256)),  # 6 chunks in splits of 2
    (4, O_PROJ, 0, 3, FusedTuning(mode="split", splits=3, tile_elems=64, classes=2)),  # ranks far below their class
    (5, QKV, 0, 5, FusedTuning(vecs=1, classes=1)),  # one class: every row in the max-rank tile
    (6, GATE_UP, 1, 4, FusedTuning(tile_elems=256, reduce_once=True)),  # [class, chunks, V] kept over many steps
    (7, DOWN, 0, 5, FusedTuning(mode="split", splits=4, tile_elems=512, reduce_once=True)),  # the partials too
    # unroll: 4 shrink tiles in steps of 3 (the last step's tail masked); blocks of 4 tiles and of 2 (dynamic count)
    (9, GATE_UP, 1, 4, FusedTuning(vecs=4, tile_elems=64, unroll=3)),
    (10, DOWN, 0, 5, FusedTuning(mode="split", splits=2, tile_elems=256, unroll=2)),  # 3 chunks a split, steps of 2
    (11, QKV, 1, 6, FusedTuning(vecs=2, tile_elems=256, unroll=8)),  # every tile in one straight-line step
]


@pytest.mark.parametrize("seed,modules,layer,n_rows,tuning", FUSED_CASES)
def test_bgmv_lora(seed, modules, layer, n_rows, tuning):
    check_fused(make_world(seed), modules, layer, n_rows, tuning, np.random.default_rng(seed + 200))


def test_bgmv_lora_bf16():
    """bf16 pool, x and base: fp32 accumulation keeps the error at bf16 rounding level."""
    rng = np.random.default_rng(207)
    world = make_world(7)
    check_fused(world, QKV, 1, 6, FusedTuning(vecs=2), rng, jnp.bfloat16, 1e-2)
    check_fused(world, DOWN, 0, 3, FusedTuning(mode="split", splits=2), rng, jnp.bfloat16, 1e-2)


def test_bgmv_lora_in_layer_scan():
    """The model calls the kernel inside ``lax.scan`` over layers with a traced layer index."""
    world = make_world(8)
    rng = np.random.default_rng(208)
    modules = GATE_UP
    d_in, d_outs = group_dims(world, modules)
    row_slot = random_rows(rng, world, 5, no_adapter=1)
    x = rng.normal(size=(world.dims.layers, 5, d_in)).astype(np.float32)
    base = rng.normal(size=(5, sum(d_outs))).astype(np.float32)
    pool, table = world.device()

    def body(carry, inp):
        layer, xl = inp
        return carry, bgmv_lora(xl, jnp.asarray(base), pool, layer, jnp.asarray(row_slot), table, modules, 64, d_outs)

    layers = jnp.arange(world.dims.layers, dtype=jnp.int32)
    _, outs = jax.jit(lambda xs: jax.lax.scan(body, 0, (layers, xs)))(jnp.asarray(x))
    for layer in range(world.dims.layers):
        want = base + np.concatenate(dense_delta(world, x[layer], row_slot, layer, modules), axis=1)
        close(outs[layer], want, 1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# The plan (GPU shapes, no kernel run) and the Triton lowering (lowered for CUDA on this machine, not compiled)
# ----------------------------------------------------------------------------------------------------------------------

LLAMA7B_GROUPS = {"qkv": (32, (32, 32, 32)), "o": (32, (32,)), "gate_up": (32, (86, 86)), "down": (86, (32,))}


@pytest.mark.parametrize("n_rows", [1, 16, 64, 256])
@pytest.mark.parametrize("max_rank", [8, 16, 64])
def test_plan_shapes(n_rows, max_rank):
    for n_chunks, out_vecs in LLAMA7B_GROUPS.values():
        p = fused_plan(n_rows, n_chunks, out_vecs, 128, max_rank, 2, interpret=False)
        assert p.mode in ("fused", "split") and p.vecs == next_pow2(p.vecs) <= next_pow2(max(out_vecs))
        assert p.classes[-1] == next_pow2(max_rank) and list(p.classes) == sorted(set(p.classes))
        assert 1 <= p.splits <= n_chunks and (p.mode == "split" or p.splits == 1) and p.est_us > 0
        if n_rows == 256:  # enough programs: a program covers a whole module, no A is read twice
            assert p.mode == "fused" and p.vecs >= max(out_vecs)
        if n_rows <= SPLIT_ROWS:  # the measured small-batch plan: d_in split, 8k-element tiles
            assert (p.mode, (p.tile_elems, p.num_warps)) == ("split", SPLIT_TILE)
        if n_rows == 1:  # modules cut into blocks (fused) or d_in cut into splits: more than 4 programs per module
            assert (p.mode == "fused" and max(out_vecs) // p.vecs > 4) or p.splits > 4
    tuned = FusedTuning(mode="split", vecs=4, splits=8, tile_elems=4096, num_warps=4, classes=2)
    p = fused_plan(n_rows, 86, (32,), 128, max_rank, 2, interpret=False, tuning=tuned)
    assert (p.mode, p.vecs, p.splits, p.tile_elems, p.num_warps, len(p.classes)) == ("split", 4, 8, 4096, 4, 2)
    assert not p.reduce_once and fused_plan(n_rows, 86, (32,), 128, max_rank, 2, interpret=False,
                                            tuning=tuned._replace(reduce_once=True)).reduce_once
    assert p.unroll == 1 and fused_plan(n_rows, 86, (32,), 128, max_rank, 2, interpret=False,
                                        tuning=tuned._replace(unroll=4)).unroll == 4


@pytest.mark.parametrize("reduce_once,unroll", [(False, 1), (True, 1), (False, 4)])
@pytest.mark.parametrize("mode", ["fused", "split"])
def test_lowers_through_triton(mode, reduce_once, unroll):
    """Every primitive of both plans has a Triton lowering rule (the GPU compile itself needs the GPU suite)."""

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    n_layers, slots = 2, 4
    table = AdapterTable(sds((slots, 8), jnp.int32), *(sds((slots, n_layers, 7), jnp.int32),) * 3,
                         sds((slots, n_layers, 7), jnp.float32))
    n_rows, d_in, d_outs = 3, 1024, (1024, 256, 256)

    def fn(x, base, pool, layer, row_slot, table):
        return bgmv_lora(x, base, pool, layer, row_slot, table, QKV, 64, d_outs, interpret=False,
                         tuning=FusedTuning(mode=mode, reduce_once=reduce_once, unroll=unroll))

    args = (sds((n_rows, d_in), jnp.bfloat16), sds((n_rows, sum(d_outs)), jnp.bfloat16),
            sds((n_layers, 16, 64, 128), jnp.bfloat16), sds((), jnp.int32), sds((n_rows,), jnp.int32), table)
    lowered = lower_for_cuda(fn, *args)
    assert lowered.as_text().count("xla.gpu.triton") == (1 if mode == "fused" else 2)


# ----------------------------------------------------------------------------------------------------------------------
# GPU: compiled kernels at moderate shapes, both plans, against the reference
# ----------------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("modules", [QKV, GATE_UP, O_PROJ, DOWN])
def test_gpu_bgmv_lora(modules, dtype, tol):
    world = make_world(61 + len(modules), GPU_DIMS, n_adapters=6, n_slots=12)
    rng = np.random.default_rng(71)
    for n_rows in (1, 37, 256):
        for tuning in (None, FusedTuning(mode="fused", vecs=2), FusedTuning(mode="split", splits=4),
                       FusedTuning(mode="split", tile_elems=8192, num_warps=8, reduce_once=True),
                       FusedTuning(mode="fused", reduce_once=True),
                       FusedTuning(mode="split", tile_elems=8192, num_warps=8, unroll=4),
                       FusedTuning(mode="fused", unroll=2)):
            check_fused(world, modules, 1, n_rows, tuning, rng, dtype, tol)
