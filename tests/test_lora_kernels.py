"""LoRA kernels (BGMV decode, SGMV prefill) against their jnp references and an independent dense numpy product.

Adapters are written into a poisoned pool on shuffled, non-contiguous pages through the documented layout
(docs/DESIGN.md); ranks are mixed per module and layer, some modules are not adapted (rank 0), some rows have no
adapter (slot -1). CPU runs use interpret mode with tiny shapes; ``gpu`` tests run the compiled kernels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lora_bgmv import bgmv_expand, bgmv_expand_reference, bgmv_shrink, bgmv_shrink_reference
from pallas_kernels.lora_common import AdapterTable, Tuning, pack_offsets, write_module_np
from pallas_kernels.lora_sgmv import make_tiles, sgmv_expand, sgmv_expand_reference, sgmv_shrink, sgmv_shrink_reference

RANKS = (4, 8, 16, 32, 64)
QKV, GATE_UP, O_PROJ, DOWN = (0, 1, 2), (4, 5), (3,), (6,)


@dataclasses.dataclass(frozen=True)
class Dims:
    """A tiny Llama: head_dim V, hidden, intermediate, q width, kv width."""

    vdim: int = 16
    hidden: int = 64
    inter: int = 96  # 6 vectors: exercises chunk counts that are not powers of two
    q: int = 64
    kv: int = 32
    layers: int = 2
    page_rows: int = 16

    def module_dims(self) -> tuple[tuple[int, int], ...]:
        h, i = self.hidden, self.inter
        return ((h, self.q), (h, self.kv), (h, self.kv), (self.q, h), (h, i), (h, i), (i, h))


@dataclasses.dataclass
class World:
    """A pool holding several adapters plus what was written, for dense checks."""

    dims: Dims
    pool: np.ndarray  # [L, NP, PR, V] float32
    table: AdapterTable  # numpy arrays
    weights: dict  # (slot, layer, module) -> (a [d_in, r], b [r, d_out], scale)
    slots: list[int]  # slots holding an adapter

    def device(self, dtype=jnp.float32):
        return jnp.asarray(self.pool, dtype), AdapterTable(*(jnp.asarray(a) for a in self.table))


def make_world(seed: int, dims: Dims = Dims(), n_adapters: int = 5, n_slots: int = 8, max_rank: int = 64) -> World:
    """Random adapters on shuffled pages of a poisoned pool, after some alloc/free churn."""
    rng = np.random.default_rng(seed)
    mdims = dims.module_dims()
    n_mod = len(mdims)
    ranks_allowed = [r for r in RANKS if r <= max_rank]
    slots = sorted(rng.choice(n_slots, size=n_adapters, replace=False).tolist())
    rank = rng.integers(0, 100, size=(n_slots, dims.layers, n_mod)).astype(np.int32)  # poison for unused slots
    for s in slots:
        base = rng.choice(ranks_allowed)
        per = rng.choice(ranks_allowed, size=(dims.layers, n_mod))
        rank[s] = np.where(rng.random((dims.layers, n_mod)) < 0.5, base, per)
        rank[s][rng.random((dims.layers, n_mod)) < 0.15] = 0  # not adapted here
    rank[slots[0], :, :] = np.maximum(rank[slots[0]], 1)  # one adapter with every module adapted
    rank[slots[0], 1, 0] = max_rank  # and the largest rank present
    a_off = rng.integers(0, 1000, size=rank.shape).astype(np.int32)
    b_off = rng.integers(0, 1000, size=rank.shape).astype(np.int32)
    need = {}
    for s in slots:
        a_off[s], b_off[s], vectors = pack_offsets(rank[s], mdims, dims.vdim)
        need[s] = int(-(-vectors.max() // dims.page_rows))
    # Page churn: allocate filler adapters between ours, then free the filler, so pages interleave.
    num_pages = int(sum(need.values()) * 2 + 8)
    free = list(rng.permutation(num_pages))
    pages_of = {}
    for s in slots:
        pages_of[s] = [free.pop() for _ in range(need[s])]
        filler = [free.pop() for _ in range(int(rng.integers(1, 4)))]
        free[:0] = filler
        rng.shuffle(free)
    max_pages = max(need.values()) + 2
    pages = rng.integers(0, num_pages, size=(n_slots, max_pages)).astype(np.int32)  # poison entries
    for s in slots:
        pages[s, : need[s]] = pages_of[s]
        assert not np.all(np.diff(pages_of[s]) == 1) or need[s] < 3
    pool = rng.normal(size=(dims.layers, num_pages, dims.page_rows, dims.vdim)).astype(np.float32)
    scale = rng.uniform(0.25, 2.0, size=rank.shape).astype(np.float32)
    weights = {}
    for s in slots:
        for layer in range(dims.layers):
            for m, (d_in, d_out) in enumerate(mdims):
                r = int(rank[s, layer, m])
                a = rng.normal(size=(d_in, r)).astype(np.float32) / np.sqrt(d_in)
                b = rng.normal(size=(r, d_out)).astype(np.float32)
                write_module_np(pool, layer, pages[s], int(a_off[s, layer, m]), int(b_off[s, layer, m]), a, b)
                weights[(s, layer, m)] = (a, b, float(scale[s, layer, m]))
    table = AdapterTable(pages, rank, a_off, b_off, scale)
    return World(dims, pool, table, weights, slots)


def random_rows(rng, world: World, n_rows: int, no_adapter: int = 2) -> np.ndarray:
    """Row slots drawn from the placed adapters, ``no_adapter`` of them -1."""
    row_slot = rng.choice(world.slots, size=n_rows).astype(np.int32)
    row_slot[rng.choice(n_rows, size=no_adapter, replace=False)] = -1
    return row_slot


def dense_delta(world: World, x: np.ndarray, row_slot: np.ndarray, layer: int, modules) -> list[np.ndarray]:
    """Independent check: per module, ``x @ A @ B * scale`` per row from the original weights (float64)."""
    mdims = world.dims.module_dims()
    out = []
    for m in modules:
        delta = np.zeros((x.shape[0], mdims[m][1]))
        for t, s in enumerate(row_slot):
            if s >= 0:
                a, b, scale = world.weights[(int(s), layer, m)]
                delta[t] = (x[t].astype(np.float64) @ a @ b) * scale
        out.append(delta)
    return out


def check_expand(out, out_ref, base, world, x, row_slot, layer, modules):
    """Expand output equals its reference and base + the dense delta; rows without an adapter keep base exactly."""
    close(out, out_ref, 1e-5)
    want = base + np.concatenate(dense_delta(world, x, row_slot, layer, modules), axis=1)
    close(out, want, 1e-5)
    np.testing.assert_array_equal(np.asarray(out)[row_slot < 0], base[row_slot < 0])


def dense_shrink(world: World, x: np.ndarray, row_slot: np.ndarray, layer: int, modules, max_rank: int) -> np.ndarray:
    y = np.zeros((x.shape[0], len(modules), max_rank))
    for i, m in enumerate(modules):
        for t, s in enumerate(row_slot):
            if s >= 0:
                a = world.weights[(int(s), layer, m)][0]
                y[t, i, : a.shape[1]] = x[t].astype(np.float64) @ a
    return y


def close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6)
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def group_dims(world: World, modules) -> tuple[int, tuple[int, ...]]:
    """(d_in, d_out of each module) of a projection group called together."""
    mdims = world.dims.module_dims()
    return mdims[modules[0]][0], tuple(mdims[m][1] for m in modules)


def layer_max_rank(world: World, layer: int, modules) -> int:
    r = max(int(world.table.rank[s, layer, m]) for s in world.slots for m in modules)
    return 1 << max(0, r - 1).bit_length()


# ----------------------------------------------------------------------------------------------------------------------
# BGMV (decode)
# ----------------------------------------------------------------------------------------------------------------------

BGMV_CASES = [
    # (seed, modules, layer, n_rows, tuning)
    (1, QKV, 1, 9, Tuning()),
    (2, GATE_UP, 0, 6, Tuning(tile_elems=256, splits=2)),  # d_in split across programs, several chunk steps
    (3, DOWN, 1, 5, Tuning(tile_elems=256, splits=3)),  # d_in = 6 vectors: masked last chunk, uneven split
    (4, O_PROJ, 0, 4, Tuning(tile_elems=64, pipeline=False)),  # the unpipelined shrink loop
    (5, DOWN, 0, 3, Tuning(tile_elems=512, pipeline=False)),
]


@pytest.mark.parametrize("seed,modules,layer,n_rows,tuning", BGMV_CASES)
def test_bgmv(seed, modules, layer, n_rows, tuning):
    world = make_world(seed)
    rng = np.random.default_rng(seed + 100)
    d_in, d_outs = group_dims(world, modules)
    max_rank = layer_max_rank(world, layer, modules)
    row_slot = random_rows(rng, world, n_rows)
    x = rng.normal(size=(n_rows, d_in)).astype(np.float32)
    base = rng.normal(size=(n_rows, sum(d_outs))).astype(np.float32)
    pool, table = world.device()
    args = (jnp.asarray(layer, jnp.int32), jnp.asarray(row_slot), table)

    y = bgmv_shrink(jnp.asarray(x), pool, *args, modules, max_rank, tuning=tuning)
    y_ref = bgmv_shrink_reference(jnp.asarray(x), pool, *args, modules, max_rank)
    close(y, y_ref, 1e-5)
    close(y, dense_shrink(world, x, row_slot, layer, modules, max_rank), 1e-5)
    assert np.all(np.asarray(y)[row_slot < 0] == 0)

    out = bgmv_expand(y, jnp.asarray(base), pool, *args, modules, d_outs, tuning=tuning)
    out_ref = bgmv_expand_reference(y_ref, jnp.asarray(base), pool, *args, modules, d_outs)
    check_expand(out, out_ref, base, world, x, row_slot, layer, modules)


def test_bgmv_bf16():
    """bf16 pool, x and base: fp32 accumulation keeps the error at bf16 rounding level."""
    world = make_world(7)
    rng = np.random.default_rng(77)
    layer, modules = 1, QKV
    _, d_outs = group_dims(world, modules)
    max_rank = layer_max_rank(world, layer, modules)
    row_slot = random_rows(rng, world, 7, no_adapter=1)
    x = rng.normal(size=(7, world.dims.hidden)).astype(np.float32)
    base = rng.normal(size=(7, sum(d_outs))).astype(np.float32)
    pool, table = world.device(jnp.bfloat16)
    args = (jnp.asarray(layer, jnp.int32), jnp.asarray(row_slot), table)
    xb, bb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(base, jnp.bfloat16)
    y = bgmv_shrink(xb, pool, *args, modules, max_rank)
    close(y, bgmv_shrink_reference(xb, pool, *args, modules, max_rank), 1e-3)
    out = bgmv_expand(y, bb, pool, *args, modules, d_outs)
    assert out.dtype == jnp.bfloat16
    close(out, bgmv_expand_reference(y, bb, pool, *args, modules, d_outs), 2e-2)
    want = base + np.concatenate(dense_delta(world, x, row_slot, layer, modules), axis=1)
    close(out, want, 3e-2)


def test_bgmv_in_layer_scan():
    """The model calls the kernels inside ``lax.scan`` over layers with a traced layer index."""
    world = make_world(8)
    rng = np.random.default_rng(88)
    modules, max_rank = GATE_UP, 64
    d_outs = (world.dims.inter, world.dims.inter)
    row_slot = random_rows(rng, world, 5, no_adapter=1)
    x = rng.normal(size=(world.dims.layers, 5, world.dims.hidden)).astype(np.float32)
    pool, table = world.device()

    def body(carry, inp):
        layer, xl = inp
        y = bgmv_shrink(xl, pool, layer, jnp.asarray(row_slot), table, modules, max_rank)
        out = bgmv_expand(y, jnp.zeros((5, sum(d_outs)), jnp.float32), pool, layer, jnp.asarray(row_slot), table,
                          modules, d_outs)
        return carry, out

    _, outs = jax.jit(lambda xs: jax.lax.scan(body, 0, (jnp.arange(world.dims.layers, dtype=jnp.int32), xs)))(
        jnp.asarray(x))
    for layer in range(world.dims.layers):
        close(outs[layer], np.concatenate(dense_delta(world, x[layer], row_slot, layer, modules), axis=1), 1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# SGMV (prefill)
# ----------------------------------------------------------------------------------------------------------------------


def test_make_tiles():
    rng = np.random.default_rng(5)
    for trial in range(20):
        lengths = rng.integers(1, 12, size=rng.integers(1, 8))
        seg_slots = rng.integers(-1, 4, size=lengths.shape[0])
        row_slot = np.repeat(seg_slots, lengths).astype(np.int32)
        block_t = int(rng.choice([1, 2, 4, 16]))
        tiles = make_tiles(row_slot, block_t)
        pad = int(trial % 3)
        padded = make_tiles(row_slot, block_t, len(tiles.start) + pad)
        np.testing.assert_array_equal(padded.start[: len(tiles.start)], tiles.start)
        assert np.all(padded.length[len(tiles.start):] == 0) and np.all(padded.slot[len(tiles.start):] == -1)
        covered = np.full(row_slot.shape, -2)
        for start, length, slot in zip(*tiles, strict=True):
            assert 1 <= length <= block_t and slot >= 0
            assert np.all(row_slot[start: start + length] == slot)  # inside one run
            assert np.all(covered[start: start + length] == -2)  # no overlap
            covered[start: start + length] = slot
        np.testing.assert_array_equal(covered, np.where(row_slot >= 0, row_slot, -2))  # every adapted row, once
        assert all(a.dtype == np.int32 for a in tiles)
    with pytest.raises(ValueError):
        make_tiles(np.zeros(9, np.int32), 4, num_tiles=2)
    empty = make_tiles(np.zeros(0, np.int32), 4, num_tiles=2)
    assert list(empty.length) == [0, 0] and list(empty.slot) == [-1, -1]


def segmented_rows(rng, world: World, lengths) -> np.ndarray:
    """Segments of the given lengths; one of them has no adapter and one adapter appears in two runs."""
    slots = list(rng.choice(world.slots, size=len(lengths)))
    slots[1] = -1
    slots[-1] = slots[0]
    return np.repeat(np.asarray(slots, np.int32), lengths)


def runnable_block_t(block_t: int) -> int:
    """Tiles of 2-8 rows make many segment/tile edges on tiny CPU shapes; compiled, Triton's dot needs >= 16 rows."""
    return max(block_t, 16) if jax.default_backend() == "gpu" else block_t


SGMV_CASES = [
    # (seed, modules, layer, segment lengths, block_t, splits)
    (11, QKV, 1, (1, 3, 5, 2, 7, 4, 1), 4, None),
    (12, GATE_UP, 0, (2, 6, 1, 9), 4, 2),
    (13, DOWN, 1, (3, 1, 8, 2), 8, 4),
    (14, O_PROJ, 0, (4, 2, 1, 3), 2, None),
]


@pytest.mark.parametrize("plan", ["looped", "unrolled"])
@pytest.mark.parametrize("seed,modules,layer,lengths,block_t,splits", SGMV_CASES)
def test_sgmv(seed, modules, layer, lengths, block_t, splits, plan):
    """``unrolled``: the shrink loads 2 d_in chunks a loop step in 16-wide rank blocks (the GPU plan's shape), the
    expand loads its 2 vectors together."""
    block_t = runnable_block_t(block_t)
    world = make_world(seed)
    rng = np.random.default_rng(seed + 100)
    d_in, d_outs = group_dims(world, modules)
    max_rank = layer_max_rank(world, layer, modules)
    row_slot = segmented_rows(rng, world, lengths)
    n_rows = row_slot.shape[0]
    tiles = make_tiles(row_slot, block_t)
    tiles = make_tiles(row_slot, block_t, num_tiles=len(tiles.start) + 3)  # a padded bucket
    x = rng.normal(size=(n_rows, d_in)).astype(np.float32)
    base = rng.normal(size=(n_rows, sum(d_outs))).astype(np.float32)
    pool, table = world.device()
    dtiles = type(tiles)(*(jnp.asarray(a) for a in tiles))
    layer_arr = jnp.asarray(layer, jnp.int32)

    unrolled = plan == "unrolled"
    shrink_tuning = Tuning(splits=splits, unroll=2, rank_block=16) if unrolled else Tuning(splits=splits)
    y = sgmv_shrink(jnp.asarray(x), pool, layer_arr, dtiles, table, modules, max_rank, block_t, tuning=shrink_tuning)
    y_ref = sgmv_shrink_reference(jnp.asarray(x), pool, layer_arr, dtiles, table, modules, max_rank, block_t)
    close(y, y_ref, 1e-5)
    close(y, dense_shrink(world, x, row_slot, layer, modules, max_rank), 1e-5)
    assert np.all(np.asarray(y)[row_slot < 0] == 0)

    out = sgmv_expand(y, jnp.asarray(base), pool, layer_arr, dtiles, table, modules, d_outs, block_t,
                      tuning=Tuning(vecs=2, unroll=1 if unrolled else None))
    out_ref = sgmv_expand_reference(y_ref, jnp.asarray(base), pool, layer_arr, dtiles, table, modules, d_outs, block_t)
    check_expand(out, out_ref, base, world, x, row_slot, layer, modules)


def test_sgmv_bf16():
    world = make_world(15)
    rng = np.random.default_rng(115)
    layer, modules, block_t = 1, QKV, runnable_block_t(4)
    _, d_outs = group_dims(world, modules)
    max_rank = layer_max_rank(world, layer, modules)
    row_slot = segmented_rows(rng, world, (5, 2, 6, 3))
    n_rows = row_slot.shape[0]
    tiles = type(make_tiles(row_slot, block_t))(*(jnp.asarray(a) for a in make_tiles(row_slot, block_t)))
    x = rng.normal(size=(n_rows, world.dims.hidden)).astype(np.float32)
    base = rng.normal(size=(n_rows, sum(d_outs))).astype(np.float32)
    pool, table = world.device(jnp.bfloat16)
    xb, bb, la = jnp.asarray(x, jnp.bfloat16), jnp.asarray(base, jnp.bfloat16), jnp.asarray(layer, jnp.int32)
    y = sgmv_shrink(xb, pool, la, tiles, table, modules, max_rank, block_t)
    close(y, sgmv_shrink_reference(xb, pool, la, tiles, table, modules, max_rank, block_t), 1e-3)
    out = sgmv_expand(y, bb, pool, la, tiles, table, modules, d_outs, block_t)
    assert out.dtype == jnp.bfloat16
    close(out, sgmv_expand_reference(y, bb, pool, la, tiles, table, modules, d_outs, block_t), 2e-2)
    want = base + np.concatenate(dense_delta(world, x, row_slot, layer, modules), axis=1)
    close(out, want, 3e-2)


# ----------------------------------------------------------------------------------------------------------------------
# GPU: compiled kernels at moderate shapes against the references
# ----------------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
GPU_DIMS = Dims(vdim=128, hidden=1024, inter=2816, q=1024, kv=256, layers=2, page_rows=64)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("modules", [QKV, GATE_UP, O_PROJ, DOWN])
def test_gpu_bgmv(modules, dtype, tol):
    world = make_world(21 + len(modules), GPU_DIMS, n_adapters=6, n_slots=12)
    rng = np.random.default_rng(31)
    layer = 1
    d_in, d_outs = group_dims(world, modules)
    for n_rows in (1, 37, 256):
        row_slot = random_rows(rng, world, n_rows, no_adapter=min(2, n_rows - 1))
        x = jnp.asarray(rng.normal(size=(n_rows, d_in)), dtype)
        base = jnp.asarray(rng.normal(size=(n_rows, sum(d_outs))), dtype)
        pool, table = world.device(dtype)
        args = (jnp.asarray(layer, jnp.int32), jnp.asarray(row_slot), table)
        y = bgmv_shrink(x, pool, *args, modules, 64)
        close(y, bgmv_shrink_reference(x, pool, *args, modules, 64), tol)
        out = bgmv_expand(y, base, pool, *args, modules, d_outs)
        close(out, bgmv_expand_reference(y, base, pool, *args, modules, d_outs), tol)
        want = np.asarray(base, np.float32) + np.concatenate(
            dense_delta(world, np.asarray(x, np.float32), row_slot, layer, modules), axis=1)
        close(out, want, 3 * tol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("modules", [QKV, GATE_UP, DOWN])
def test_gpu_sgmv(modules, dtype, tol):
    world = make_world(41 + len(modules), GPU_DIMS, n_adapters=6, n_slots=12)
    rng = np.random.default_rng(51)
    layer, block_t = 1, 32
    d_in, d_outs = group_dims(world, modules)
    row_slot = segmented_rows(rng, world, (1, 17, 40, 3, 64, 100, 31, 9))
    n_rows = row_slot.shape[0]
    tiles = make_tiles(row_slot, block_t, num_tiles=32)
    tiles = type(tiles)(*(jnp.asarray(a) for a in tiles))
    x = jnp.asarray(rng.normal(size=(n_rows, d_in)), dtype)
    base = jnp.asarray(rng.normal(size=(n_rows, sum(d_outs))), dtype)
    pool, table = world.device(dtype)
    la = jnp.asarray(layer, jnp.int32)
    y = sgmv_shrink(x, pool, la, tiles, table, modules, 64, block_t)
    close(y, sgmv_shrink_reference(x, pool, la, tiles, table, modules, 64, block_t), tol)
    out = sgmv_expand(y, base, pool, la, tiles, table, modules, d_outs, block_t)
    close(out, sgmv_expand_reference(y, base, pool, la, tiles, table, modules, d_outs, block_t), tol)
    want = np.asarray(base, np.float32) + np.concatenate(
        dense_delta(world, np.asarray(x, np.float32), row_slot, layer, modules), axis=1)
    close(out, want, 3 * tol)
