"""The launch plan of the fused decode LoRA kernels (lora_fused): which mode, tiles, blocks and splits a projection
group runs with at a given batch, from a small cost model of the H200 and the plans measured there. Kept apart from
the kernels so that the model can be read, tested and tuned without them.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

from pallas_kernels.lowering import next_pow2

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


class FusedTuning(NamedTuple):
    """Static overrides of :func:`fused_plan` (``None`` = the plan's choice; hashable, pass as a static arg).

    mode: "fused" | "split"; vecs: output vectors (of V columns) per program; splits: d_in splits (split mode);
    tile_elems: adapter elements per program step; num_warps; classes: how many rank classes.
    """

    mode: str | None = None
    vecs: int | None = None
    splits: int | None = None
    tile_elems: int | None = None
    num_warps: int | None = None
    classes: int | None = None
    shared_rows: int | None = None  # fused mode: up to this many consecutive rows of one adapter a program (pow2)


class FusedPlan(NamedTuple):
    mode: str
    vecs: int
    splits: int
    tile_elems: int
    num_warps: int
    classes: tuple[int, ...]
    est_us: float  # the cost model's estimate (0 in interpret mode)
    shared_rows: int = 1  # rows of one adapter one program serves (fused mode); 1 = a program per row


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
    shared = tuning.shared_rows or 1
    if shared != next_pow2(shared):
        raise ValueError(f"shared_rows must be a power of two, not {shared}")
    return FusedPlan(mode, vecs, splits, tile_elems, warps, classes, est, shared if mode == "fused" else 1)
