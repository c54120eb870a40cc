"""LoRA kernel benchmark: BGMV (decode) and SGMV (prefill) at Llama-2-7B shapes, one layer.

    PYTHONPATH=. python benchmarks/kernels.py --out results.json      # H200: < 8 minutes
    PYTHONPATH=. python benchmarks/kernels.py --tiny --out /tmp/t.json # CPU, interpret mode, tiny shapes

Correctness first (bf16 kernels vs the fp32-accumulating jnp reference, relative error of the LoRA delta), then
median times of N calls run inside one jitted loop (so Python dispatch is not timed). For every case: bytes that
must move (adapter weights read + x, y, base/out), achieved GB/s against the copy bandwidth measured in this run
(torch ``b.copy_(a)`` on 2 GiB in a subprocess before jax starts; a jax copy if torch is absent), and speed-ups over
(i) the jnp reference compiled by XLA and (ii) a padded baseline (every adapter padded to the largest rank and
stacked densely, gathered per row with einsum, as dense-stacking servers do). Prefill also times the base
projections (x @ W) and reports the LoRA overhead.

Times are per layer. Module groups are timed separately (q,k,v | o | gate,up | down: one shrink + one expand each,
as the model calls them); "all7" sums the four groups, "qkvo" the first two. Decode also times the fused kernels
(``pallas_kernels.lora_fused``: one kernel per group) beside the v1 shrink + expand.

    PYTHONPATH=. python benchmarks/kernels.py --decode-table --out results.json   # H200: ~4 minutes

``--decode-table`` runs only issue 14's decode rows (batch 1/16/64/256, rank 16, all 7 projections, plus rank 16
under max rank 64 and a rank mix): v1 vs fused (its own plan and a few forced plans), each checked against the jnp
reference first; per group, the sum of groups, and one timing loop per layer (the four groups in one iteration, as
a decoder layer launches them) beside an empty loop (the loop's own cost per iteration); kernels per call counted
in the compiled HLO.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import time

from common import device_ceilings, git_commit

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

def torch_copy_bandwidth() -> dict:
    """Copy bandwidth from torch in a subprocess, before jax holds the GPU (read + write bytes per second)."""
    probe = device_ceilings()
    if "copy_gbps" not in probe:
        return {"ok": False, "why": probe.get("error", "no probe")}
    return {"ok": True, "gbps": probe["copy_gbps"], "method": probe["copy_source"], "device": probe.get("device")}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results.json")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, interpret mode (CPU smoke test)")
    p.add_argument("--no-sweep", action="store_true", help="skip the tuning sweep of the headline decode case")
    p.add_argument("--pool-gib", type=float, default=8.0, help="pool size (>4 GiB exercises 64-bit addressing)")
    p.add_argument("--decode-table", action="store_true", help="only issue 14's decode rows: v1 vs fused kernels")
    p.add_argument("--table-rows", type=int, default=None, help="with --decode-table: only the first N rows")
    p.add_argument("--rows", default=None, help="with --decode-table: the first row of each of these batch sizes")
    p.add_argument("--packed", action="store_true",
                   help="adapters on consecutive pages from page 0 (default: random pages over the whole pool)")
    p.add_argument("--layer-variants", default=None, help="with --decode-table: only these layer variants ('' none)")
    p.add_argument("--group-variants", default=None, help="with --decode-table: only these group variants ('' none)")
    return p.parse_args()


ARGS = parse_args()
COPY = {"ok": False, "why": "tiny"} if ARGS.tiny else torch_copy_bandwidth()

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from pallas_kernels.lora_bgmv import bgmv_expand, bgmv_expand_reference, bgmv_shrink, bgmv_shrink_reference  # noqa: E402
from pallas_kernels.lora_common import AdapterTable, Tuning, gather_lora_a, gather_lora_b, pack_offsets  # noqa: E402
from pallas_kernels.lora_fused import (  # noqa: E402
    FusedTuning,
    bgmv_lora,
    bgmv_lora_reference,
    bgmv_lora_unfused,
    fused_plan,
)
from pallas_kernels.lora_sgmv import (  # noqa: E402
    SegmentTiles,
    make_tiles,
    max_tiles,
    sgmv_expand,
    sgmv_expand_reference,
    sgmv_shrink,
    sgmv_shrink_reference,
)

BF16 = jnp.bfloat16

if ARGS.tiny:
    HIDDEN, INTER, VDIM, KV_WIDTH, PAGE_ROWS = 64, 96, 16, 64, 32
    DECODE_BATCHES, RANK_CONFIGS = (1, 4), {"r8": (8,), "mix": (4, 8)}
    PREFILL_TOKENS, PREFILL_ADAPTERS, PREFILL_RANK, BLOCK_T = 32, (1, 4), 8, 8
    MIN_LOOP_S, REPEATS = 0.0, 2
else:  # Llama-2-7B: hidden 4096, intermediate 11008, head_dim 128, 32 heads MHA; pages of 16 tokens
    HIDDEN, INTER, VDIM, KV_WIDTH, PAGE_ROWS = 4096, 11008, 128, 4096, 2 * 32 * 16
    DECODE_BATCHES, RANK_CONFIGS = (1, 16, 64, 256), {"r8": (8,), "r16": (16,), "r64": (64,), "mix": (8, 16, 32, 64)}
    PREFILL_TOKENS, PREFILL_ADAPTERS, PREFILL_RANK, BLOCK_T = 4096, (1, 8, 64), 16, 64
    MIN_LOOP_S, REPEATS = 0.03, 5

SWEEP_DEADLINE_S = 330  # run the optional tuning sweep only if the main cases finished by then

MODULE_DIMS = ((HIDDEN, HIDDEN), (HIDDEN, KV_WIDTH), (HIDDEN, KV_WIDTH), (HIDDEN, HIDDEN), (HIDDEN, INTER),
               (HIDDEN, INTER), (INTER, HIDDEN))
GROUPS = {"qkv": (0, 1, 2), "o": (3,), "gate_up": (4, 5), "down": (6,)}
MODULE_SETS = {"all7": ("qkv", "o", "gate_up", "down"), "qkvo": ("qkv", "o")}


def group_dims(modules):
    return MODULE_DIMS[modules[0]][0], tuple(MODULE_DIMS[m][1] for m in modules)


# ----------------------------------------------------------------------------------------------------------------------
# Pool and adapter tables
# ----------------------------------------------------------------------------------------------------------------------


def make_pool():
    """One layer of a bf16 pool filled with random values (every adapter's weights are what its pages hold)."""
    page_bytes = PAGE_ROWS * VDIM * 2
    top_rank = max(16, *(max(r) for r in RANK_CONFIGS.values()))  # the sweep uses rank 16
    need = max(max(DECODE_BATCHES) * pages_per_adapter(top_rank),
               max(PREFILL_ADAPTERS) * pages_per_adapter(PREFILL_RANK))
    num_pages = max(int(need * 1.25) + 8, int(ARGS.pool_gib * 2**30 // page_bytes) if not ARGS.tiny else 0)
    return jax.block_until_ready(_hash_fill((1, num_pages, PAGE_ROWS, VDIM)))


@functools.partial(jax.jit, static_argnums=0)
def _hash_fill(shape):
    """Pseudo-random values in [-1, 1) from a hash of the position: one fused pass, no multi-GiB temporaries."""
    p, r, v = (lax.broadcasted_iota(jnp.float32, shape, d) for d in (1, 2, 3))
    h = jnp.sin(p * 12.9898 + r * 78.233 + v * 37.719) * 43758.5453
    return ((h - jnp.floor(h)) * 2 - 1).astype(BF16)


def pages_per_adapter(rank: int) -> int:
    _, _, vectors = pack_offsets(np.full((1, 7), rank), MODULE_DIMS, VDIM)
    return int(-(-vectors.max() // PAGE_ROWS))


def make_table(rng, ranks: list[int], num_pages: int) -> AdapterTable:
    """Adapters (one per entry of ``ranks``, all 7 modules) on random non-contiguous pages of the pool (``--packed``:
    on consecutive pages, every adapter's pages in order: tells the cost of scattered pages apart from the kernels')."""
    n = len(ranks)
    need = [pages_per_adapter(r) for r in ranks]
    perm = np.arange(num_pages) if ARGS.packed else rng.permutation(num_pages)
    pages = np.zeros((n, max(need)), np.int32)
    rank = np.zeros((n, 1, 7), np.int32)
    a_off = np.zeros_like(rank)
    b_off = np.zeros_like(rank)
    used = 0
    for s, r in enumerate(ranks):
        pages[s, : need[s]] = perm[used: used + need[s]]
        used += need[s]
        rank[s, 0] = r
        a_off[s], b_off[s], _ = pack_offsets(rank[s], MODULE_DIMS, VDIM)
    scale = rng.uniform(0.5, 2.0, size=rank.shape).astype(np.float32)
    return AdapterTable(*(jnp.asarray(a) for a in (pages, rank, a_off, b_off, scale)))


def adapter_bytes(ranks, modules) -> int:
    return sum(r * (MODULE_DIMS[m][0] + MODULE_DIMS[m][1]) * 2 for r in ranks for m in modules)


def io_bytes(n_rows, modules, max_rank) -> int:
    """x read, y written and read (fp32), base read and out written."""
    d_in, d_outs = group_dims(modules)
    return n_rows * (d_in * 2 + len(modules) * max_rank * 4 * 2 + sum(d_outs) * 2 * 2)


# ----------------------------------------------------------------------------------------------------------------------
# Implementations of one module group: fn(x, base, *operands) -> base + LoRA delta
# ----------------------------------------------------------------------------------------------------------------------


def kernel_decode(x, base, pool, row_slot, table, *, modules, max_rank, tuning=None):
    d_outs = group_dims(modules)[1]
    y = bgmv_shrink(x, pool, jnp.int32(0), row_slot, table, modules, max_rank, tuning=tuning)
    return bgmv_expand(y, base, pool, jnp.int32(0), row_slot, table, modules, d_outs, tuning=tuning)


def reference_decode(x, base, pool, row_slot, table, *, modules, max_rank):
    d_outs = group_dims(modules)[1]
    y = bgmv_shrink_reference(x, pool, jnp.int32(0), row_slot, table, modules, max_rank)
    return bgmv_expand_reference(y, base, pool, jnp.int32(0), row_slot, table, modules, d_outs)


def fused_group(x, base, pool, row_slot, table, *, modules, max_rank, tuning=None):
    return bgmv_lora(x, base, pool, jnp.int32(0), row_slot, table, modules, max_rank, group_dims(modules)[1],
                     tuning=tuning)


def v1_group(x, base, pool, row_slot, table, *, modules, max_rank):
    return bgmv_lora_unfused(x, base, pool, jnp.int32(0), row_slot, table, modules, max_rank, group_dims(modules)[1])


def reference_group(x, base, pool, row_slot, table, *, modules, max_rank):
    return bgmv_lora_reference(x, base, pool, jnp.int32(0), row_slot, table, modules, max_rank,
                               group_dims(modules)[1])


LAYER_REPEAT = 4  # layers per timing-loop iteration, chained (the model runs its layers back to back, unrolled)


def layer_of(group_fn, repeat=LAYER_REPEAT, **kw):
    """``repeat`` layers of all four groups in model order, each layer's outputs feeding the next (x and base are
    tuples, one per group): the loop's own cost per iteration is shared by ``repeat`` layers."""
    fns = [functools.partial(group_fn, modules=m, **kw) for m in GROUPS.values()]

    def fn(xs, bases, *operands):
        for _ in range(repeat):
            outs = tuple(f(x, b, *operands) for f, x, b in zip(fns, xs, bases, strict=True))
            xs = tuple(lax.dynamic_update_slice(x, o[:1, :1].astype(x.dtype), (0, 0))
                       for x, o in zip(xs, outs, strict=True))
            bases = outs
        return bases

    return fn


def empty_group(x, base, *operands, modules=None, max_rank=None):
    """No LoRA at all: a timing loop of these measures the loop's own cost, which is in every other loop's time."""
    return base


def kernel_prefill(x, base, pool, tiles, table, *, modules, max_rank):
    d_outs = group_dims(modules)[1]
    y = sgmv_shrink(x, pool, jnp.int32(0), tiles, table, modules, max_rank, BLOCK_T)
    return sgmv_expand(y, base, pool, jnp.int32(0), tiles, table, modules, d_outs, BLOCK_T)


def reference_prefill(x, base, pool, tiles, table, *, modules, max_rank):
    d_outs = group_dims(modules)[1]
    y = sgmv_shrink_reference(x, pool, jnp.int32(0), tiles, table, modules, max_rank, BLOCK_T)
    return sgmv_expand_reference(y, base, pool, jnp.int32(0), tiles, table, modules, d_outs, BLOCK_T)


def padded_lora(x, base, a_stack, b_stack, scale, row_slot, *, modules):
    """Dense stacking: per module ``a_stack [S, d_in, r_max]``, ``b_stack [S, r_max, d_out]``, gathered per row."""
    outs = []
    for i in range(len(modules)):
        a = a_stack[i][row_slot]
        y = jnp.einsum("td,tdr->tr", x, a, preferred_element_type=jnp.float32)
        b = b_stack[i][row_slot]
        delta = jnp.einsum("tr,tro->to", y.astype(x.dtype), b, preferred_element_type=jnp.float32)
        outs.append(delta * scale[i][row_slot][:, None])
    return (base.astype(jnp.float32) + jnp.concatenate(outs, axis=1)).astype(base.dtype)


def base_matmul(x, base, w):
    del base
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def padded_stacks(pool, table, modules, r_max):
    """Dense padded copies of every adapter's weights (built once, outside timing)."""
    slots = jnp.arange(table.pages.shape[0], dtype=jnp.int32)
    d_in, d_outs = group_dims(modules)
    a = tuple(gather_lora_a(pool, table, 0, slots, m, d_in, r_max) for m in modules)
    b = tuple(gather_lora_b(pool, table, 0, slots, m, d, r_max) for m, d in zip(modules, d_outs, strict=True))
    scale = tuple(table.scale[:, 0, m] for m in modules)
    return jax.block_until_ready((a, b, scale))


# ----------------------------------------------------------------------------------------------------------------------
# Timing: N calls inside one jitted loop; each iteration feeds its output back so nothing can be hoisted.
# ----------------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _loop(fn, n, x, base, *operands):
    def body(_, carry):  # x and base may be tuples (one per module group: a whole layer per iteration)
        x, base = carry
        out = fn(x, base, *operands)
        x = jax.tree.map(lambda xi, oi: lax.dynamic_update_slice(xi, oi[:1, :1].astype(xi.dtype), (0, 0)), x, out)
        return x, out

    return lax.fori_loop(0, n, body, (x, base))


def compile_all(jobs: dict) -> dict:
    """Compile the timing loops of ``jobs`` ({key: (fn, args)}) in parallel threads (XLA and Triton compiles are
    the bulk of this script's wall time)."""
    lowered = {key: _loop.lower(fn, 1, *args) for key, (fn, args) in jobs.items()}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        futures = {key: pool.submit(lo.compile) for key, lo in lowered.items()}
        return {key: f.result() for key, f in futures.items()}


def time_compiled(compiled, args) -> float:
    """Median seconds per call of a compiled timing loop (``compiled(n, *args)`` runs n calls)."""
    jax.block_until_ready(compiled(1, *args))  # warm up
    n = 3
    while True:
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(n, *args))
        dt = time.perf_counter() - t0
        if dt >= MIN_LOOP_S or n >= 4096:
            break
        n = min(4096, max(2 * n, int(n * 1.2 * MIN_LOOP_S / max(dt, 1e-6))))
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(n, *args))
        times.append((time.perf_counter() - t0) / n)
    return float(np.median(times))


def time_fn(fn, *args) -> float:
    return time_compiled(compile_all({0: (fn, args)})[0], args)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


# ----------------------------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------------------------


def run_combo(kind, n_rows, ranks, max_rank, pool, table, row_slot, tiles, rng) -> dict:
    """Correctness, then kernel / reference / padded (/ base matmul) times for every module group."""
    jobs, inputs = {}, {}
    for g, modules in GROUPS.items():
        d_in, d_outs = group_dims(modules)
        x = jnp.asarray(rng.normal(size=(n_rows, d_in)), BF16)
        base = jnp.asarray(rng.normal(size=(n_rows, sum(d_outs))), BF16)
        inputs[g] = (x, base)
        kw = {"modules": modules, "max_rank": max_rank}
        if kind == "decode":
            kfn, rfn, sel = functools.partial(kernel_decode, **kw), functools.partial(reference_decode, **kw), row_slot
            jobs[g, "fused"] = (functools.partial(fused_group, **kw), (x, base, pool, sel, table))
        else:
            kfn, rfn, sel = functools.partial(kernel_prefill, **kw), functools.partial(reference_prefill, **kw), tiles
        jobs[g, "kernel"] = (kfn, (x, base, pool, sel, table))
        jobs[g, "reference"] = (rfn, (x, base, pool, sel, table))
        jobs[g, "padded"] = (functools.partial(padded_lora, modules=modules),
                             (x, base, *padded_stacks(pool, table, modules, max_rank), row_slot))
        if kind == "prefill":
            w = jnp.asarray(rng.normal(size=(d_in, sum(d_outs))) / np.sqrt(d_in), BF16)
            jobs[g, "base"] = (base_matmul, (x, base, w))
    compiled = compile_all(jobs)
    groups = {}
    for g, modules in GROUPS.items():
        x, base = inputs[g]
        # One loop step on base = 0 gives the delta. The reference accumulates exact bf16 products in fp32
        # (HIGHEST) and rounds once to bf16.
        zeros = jnp.zeros_like(base)
        got = compiled[g, "kernel"](1, x, zeros, *jobs[g, "kernel"][1][2:])[1]
        want = compiled[g, "reference"](1, x, zeros, *jobs[g, "reference"][1][2:])[1]
        err = rel_err(got, want)
        if (g, "fused") in compiled:
            err = max(err, rel_err(compiled[g, "fused"](1, x, zeros, *jobs[g, "fused"][1][2:])[1], want))
        res = {"rel_err": err, "adapter_bytes": adapter_bytes(ranks, modules),
               "io_bytes": io_bytes(n_rows, modules, max_rank)}
        for impl in ("kernel", "fused", "reference", "padded", "base"):
            if (g, impl) in compiled:
                res[f"{impl}_s"] = time_compiled(compiled[g, impl], jobs[g, impl][1])
        groups[g] = res
    return groups


def summarize(kind, set_name, groups: dict, n_rows, n_adapters, rank_name, copy_gbps):
    tot = {k: sum(groups[g][k] for g in MODULE_SETS[set_name]) for k in
           ("kernel_s", "reference_s", "padded_s", "adapter_bytes", "io_bytes")}
    row = {
        "kind": kind, "modules": set_name, "rows": n_rows, "adapters": n_adapters, "rank": rank_name,
        "time_us": tot["kernel_s"] * 1e6, "reference_us": tot["reference_s"] * 1e6, "padded_us": tot["padded_s"] * 1e6,
        "adapter_bytes": tot["adapter_bytes"], "total_bytes": tot["adapter_bytes"] + tot["io_bytes"],
        "rel_err": max(groups[g]["rel_err"] for g in MODULE_SETS[set_name]),
        "groups_us": {g: groups[g]["kernel_s"] * 1e6 for g in MODULE_SETS[set_name]},
    }
    row["adapter_gbps"] = row["adapter_bytes"] / tot["kernel_s"] / 1e9
    row["total_gbps"] = row["total_bytes"] / tot["kernel_s"] / 1e9
    row["pct_copy_adapter"] = 100 * row["adapter_gbps"] / copy_gbps
    row["pct_copy_total"] = 100 * row["total_gbps"] / copy_gbps
    row["speedup_vs_reference"] = tot["reference_s"] / tot["kernel_s"]
    row["speedup_vs_padded"] = tot["padded_s"] / tot["kernel_s"]
    if kind == "decode":
        fused_s = sum(groups[g]["fused_s"] for g in MODULE_SETS[set_name])
        row["fused_us"] = fused_s * 1e6
        row["fused_pct_copy_adapter"] = 100 * row["adapter_bytes"] / fused_s / 1e9 / copy_gbps
        row["fused_speedup_vs_v1"] = tot["kernel_s"] / fused_s
    if kind == "prefill":
        base_s = sum(groups[g]["base_s"] for g in MODULE_SETS[set_name])
        row["base_us"] = base_s * 1e6
        row["lora_overhead_pct"] = 100 * tot["kernel_s"] / base_s
    return row


SWEEP = (Tuning(), Tuning(tile_elems=4096), Tuning(tile_elems=16384, num_warps=8), Tuning(num_warps=4),
         Tuning(pipeline=False), Tuning(pipeline=False, tile_elems=16384, num_warps=8))


def tuning_sweep(pool, rng, copy_gbps):
    """Headline decode case (batch 256, 256 rank-16 adapters, all 7 modules) under a few launch configs."""
    n = max(DECODE_BATCHES)
    ranks = [16] * n
    table = make_table(rng, ranks, pool.shape[1])
    row_slot = jnp.asarray(rng.permutation(n).astype(np.int32))
    jobs = {}
    for c, tuning in enumerate(SWEEP):
        for g, modules in GROUPS.items():
            d_in, d_outs = group_dims(modules)
            x = jnp.asarray(rng.normal(size=(n, d_in)), BF16)
            base = jnp.asarray(rng.normal(size=(n, sum(d_outs))), BF16)
            fn = functools.partial(kernel_decode, modules=modules, max_rank=16, tuning=tuning)
            jobs[c, g] = (fn, (x, base, pool, row_slot, table))
    compiled = compile_all(jobs)
    out = []
    for c, tuning in enumerate(SWEEP):
        per = {g: time_compiled(compiled[c, g], jobs[c, g][1]) for g in GROUPS}
        total = sum(per.values())
        gbps = adapter_bytes(ranks, range(7)) / total / 1e9
        out.append({"tuning": tuning._asdict(), "time_us": total * 1e6, "adapter_gbps": gbps,
                    "pct_copy_adapter": 100 * gbps / copy_gbps, "groups_us": {g: t * 1e6 for g, t in per.items()}})
        name = ", ".join(f"{k}={v}" for k, v in tuning._asdict().items() if v is not None) or "defaults"
        print(f"  sweep {name:40s}: {total * 1e6:8.1f} us {gbps:7.1f} GB/s ({100 * gbps / copy_gbps:.0f}% copy)  "
              + " ".join(f"{g}={t * 1e6:.1f}" for g, t in per.items()), flush=True)
    return out


def _negate(x, base):
    return -base


def jax_copy_bandwidth() -> float:
    """Fallback copy bandwidth: an XLA elementwise pass over 2 GiB (64 MiB with --tiny), read + write bytes."""
    n = (64 << 20) if ARGS.tiny else (1 << 30)
    a = jnp.ones((n // 1024, 1024), BF16)
    return 2 * n * 2 / time_fn(_negate, a[:1, :1], a) / 1e9




# ----------------------------------------------------------------------------------------------------------------------
# --decode-table: issue 14's rows, v1 vs fused
# ----------------------------------------------------------------------------------------------------------------------

if ARGS.tiny:
    TABLE_ROWS = [(1, (8,), 8), (4, (4, 8), 8)]
else:  # (batch, ranks cycled over distinct adapters, max_rank): the issue's rows, then what the engine compiles
    TABLE_ROWS = [(1, (16,), 16), (16, (16,), 16), (64, (16,), 16), (256, (16,), 16),
                  (1, (16,), 64), (64, (16,), 64), (256, (8, 16, 32, 64), 64)]
TARGET_US = {1: 30, 16: 40, 64: 80, 256: 230}  # issue 14, rank 16 rows
# forced plans timed beside the plan's own choice (a variant whose plan equals one already timed is skipped)
VARIANTS = {"split": FusedTuning(mode="split"), "fused": FusedTuning(mode="fused"),
            "t8k": FusedTuning(tile_elems=8192, num_warps=8), "t32k": FusedTuning(tile_elems=32768, num_warps=16),
            "t16k": FusedTuning(tile_elems=16384, num_warps=8),
            "once": FusedTuning(reduce_once=True),  # the plan's own choice, its shrink reducing over V once
            # the plan's own choice issuing 2 / 4 tiles' loads together (session 25)
            "u2": FusedTuning(unroll=2), "u4": FusedTuning(unroll=4)}
# forced plans timed as whole layers too: the per-group timings (session 6, 8) favour the split plans at batch 1-64,
# where the cost model picks fused, but a group timed alone carries ~20 us of call overhead a layer loop does not
# (since session 15 the plan itself is split_t8k up to 64 rows; "fused" keeps the cost model's former pick in view)
LAYER_VARIANTS = {"fused": VARIANTS["fused"], "split": VARIANTS["split"],
                  "split_t8k": FusedTuning(mode="split", tile_elems=8192, num_warps=8),
                  "split_t4k": FusedTuning(mode="split", tile_elems=4096, num_warps=4),
                  # 2 / 4 / 8 tiles' loads issued together (session 25; session 24 timed reduce-once here: it lost)
                  "split_t8k_u2": FusedTuning(mode="split", tile_elems=8192, num_warps=8, unroll=2),
                  "split_t8k_u4": FusedTuning(mode="split", tile_elems=8192, num_warps=8, unroll=4),
                  "split_t8k_u8": FusedTuning(mode="split", tile_elems=8192, num_warps=8, unroll=8),
                  "split_t4k_u4": FusedTuning(mode="split", tile_elems=4096, num_warps=4, unroll=4),
                  "fused_u2": FusedTuning(mode="fused", unroll=2),
                  # one rank class (the table's rows are all rank 16): does each class's branch cost registers?
                  "split_t8k_c1": FusedTuning(mode="split", tile_elems=8192, num_warps=8, classes=1)}
def _chosen(variants: dict, names: str | None) -> dict:
    """``variants`` restricted to the comma-separated ``names`` (None: all; '': none)."""
    if names is None:
        return variants
    wanted = [v for v in names.split(",") if v]
    unknown = set(wanted) - set(variants)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {sorted(variants)}")
    return {k: variants[k] for k in wanted}


VARIANTS, LAYER_VARIANTS = _chosen(VARIANTS, ARGS.group_variants), _chosen(LAYER_VARIANTS, ARGS.layer_variants)
if ARGS.rows:  # the first row of each batch size named (the rank-16 rows of the issue's table)
    TABLE_ROWS = [next(r for r in TABLE_ROWS if r[0] == int(b)) for b in ARGS.rows.split(",")]
TABLE_DEADLINE_S = 420  # start no new row after this (one device call is 10 minutes)
LAUNCH_OPS = ("fusion", "custom-call", "copy", "copy-start", "reduce", "scatter", "gather", "sort",
              "dynamic-update-slice", "dynamic-slice", "all-reduce")


def count_launches(hlo_text: str) -> int:
    """Kernel-launching instructions of a compiled module outside fused computations (approximate)."""
    count, skip = 0, False
    for line in hlo_text.splitlines():
        head = line.strip()
        if head.endswith("{") and "=" not in head.split("(")[0]:  # a computation header
            name = head.removeprefix("ENTRY ").lstrip("%")
            skip = name.startswith(("fused", "wrapped", "horizontally_fused"))  # bodies of fusions
            continue
        if not skip and "=" in head:
            rhs = head.split("=", 1)[1]
            count += any(f" {op}(" in rhs for op in LAUNCH_OPS)
    return count


def plan_of(n_rows, modules, max_rank, tuning=None):
    d_in, d_outs = group_dims(modules)
    p = fused_plan(n_rows, d_in // VDIM, tuple(d // VDIM for d in d_outs), VDIM, max_rank, 2,
                   jax.default_backend() != "gpu", tuning)
    return p


def table_jobs(n, max_rank, pool, table, row_slot, rng):
    """Timing jobs of one row: per group v1 / reference / fused plans (variants whose plan equals another skipped),
    and per layer v1, fused and the empty loop. Returns (jobs, plans {(group, impl): plan})."""
    jobs, plans, xs, bases = {}, {}, [], []
    for g, modules in GROUPS.items():
        d_in, d_outs = group_dims(modules)
        x = jnp.asarray(rng.normal(size=(n, d_in)), BF16)
        base = jnp.asarray(rng.normal(size=(n, sum(d_outs))), BF16)
        xs.append(x)
        bases.append(base)
        kw, args = {"modules": modules, "max_rank": max_rank}, (x, base, pool, row_slot, table)
        jobs[g, "v1"] = (functools.partial(v1_group, **kw), args)
        jobs[g, "reference"] = (functools.partial(reference_group, **kw), args)
        seen = {}
        for name, tuning in {"auto": None, **VARIANTS}.items():
            p = plan_of(n, modules, max_rank, tuning)
            key = p._replace(est_us=0.0)
            if key in seen:
                continue
            seen[key] = name
            plans[g, name] = p
            jobs[g, name] = (functools.partial(fused_group, tuning=tuning, **kw), args)
    layer_args = (tuple(xs), tuple(bases), pool, row_slot, table)
    jobs["layer", "v1"] = (layer_of(v1_group, max_rank=max_rank), layer_args)
    jobs["layer", "auto"] = (layer_of(fused_group, max_rank=max_rank), layer_args)
    for name, tuning in LAYER_VARIANTS.items():
        jobs["layer", name] = (layer_of(fused_group, max_rank=max_rank, tuning=tuning), layer_args)
    jobs["layer", "empty"] = (layer_of(empty_group), layer_args)
    jobs["group", "empty"] = (empty_group, jobs["qkv", "v1"][1])
    return jobs, plans


def table_row(n, ranks, max_rank, pool, rng, copy_gbps) -> dict:
    table = make_table(rng, ranks, pool.shape[1])
    row_slot = jnp.asarray(rng.permutation(n).astype(np.int32))
    jobs, plans = table_jobs(n, max_rank, pool, table, row_slot, rng)
    compiled = compile_all(jobs)
    launches = {key: count_launches(c.as_text()) for key, c in compiled.items()}
    empty_launches, group_empty = launches["layer", "empty"], launches["group", "empty"]
    groups = {}
    for g, modules in GROUPS.items():  # correctness first: one call on base = 0 against the reference
        x, base = jobs[g, "v1"][1][:2]
        zeros = jnp.zeros_like(base)
        want = compiled[g, "reference"](1, x, zeros, *jobs[g, "v1"][1][2:])[1]
        impls = [k[1] for k in jobs if k[0] == g and k[1] != "reference"]
        res = {"adapter_bytes": adapter_bytes(ranks, modules)}
        for impl in impls:
            got = compiled[g, impl](1, x, zeros, *jobs[g, impl][1][2:])[1]
            res[impl] = {"rel_err": rel_err(got, want), "kernels": launches[g, impl] - group_empty}
            if (g, impl) in plans:
                res[impl]["plan"] = plans[g, impl]._asdict()
        groups[g] = res
    for g in GROUPS:
        for impl in list(groups[g]):
            if impl != "adapter_bytes":
                groups[g][impl]["us"] = time_compiled(compiled[g, impl], jobs[g, impl][1]) * 1e6
    layer = {impl: {"us": time_compiled(compiled["layer", impl], jobs["layer", impl][1]) * 1e6 / LAYER_REPEAT,
                    "kernels": (launches["layer", impl] - (0 if impl == "empty" else empty_launches)) / LAYER_REPEAT}
             for impl in ("v1", "auto", "empty", *LAYER_VARIANTS)}
    io = sum(n * (group_dims(m)[0] * 2 + sum(group_dims(m)[1]) * 4) for m in GROUPS.values())
    floor_bytes = adapter_bytes(ranks, range(7)) + io
    # best per group over every fused plan timed (what a tuned plan would give)
    best = {g: min((v["us"], k) for k, v in groups[g].items() if k not in ("adapter_bytes", "v1")) for g in GROUPS}
    return {
        "rows": n, "ranks": sorted(set(ranks)), "max_rank": max_rank, "groups": groups, "layer": layer,
        "v1_sum_us": sum(groups[g]["v1"]["us"] for g in GROUPS),
        "auto_sum_us": sum(groups[g]["auto"]["us"] for g in GROUPS),
        "best_sum_us": sum(b[0] for b in best.values()), "best_plans": {g: b[1] for g, b in best.items()},
        "floor_bytes": floor_bytes, "floor_us": floor_bytes / copy_gbps / 1e3,
        "target_us": TARGET_US.get(n) if set(ranks) == {16} and max_rank == 16 else None,
        "worst_rel_err": max(v["rel_err"] for g in GROUPS for k, v in groups[g].items() if k != "adapter_bytes"),
        "est_sum_us": sum(groups[g]["auto"]["plan"]["est_us"] for g in GROUPS),
    }


def decode_table(pool, rng, copy_gbps, t_start) -> list[dict]:
    out = []
    for n, rank_set, max_rank in TABLE_ROWS[: ARGS.table_rows]:
        if time.perf_counter() - t_start > TABLE_DEADLINE_S:
            print(f"skipped batch {n} ranks {rank_set} max {max_rank}: past {TABLE_DEADLINE_S} s", flush=True)
            continue
        ranks = [rank_set[i % len(rank_set)] for i in range(n)]
        r = table_row(n, ranks, max_rank, pool, rng, copy_gbps)
        out.append(r)
        per = "  ".join(f"{g}: v1 {r['groups'][g]['v1']['us']:.1f} auto {r['groups'][g]['auto']['us']:.1f} "
                        f"({r['groups'][g]['auto']['plan']['mode']} v{r['groups'][g]['auto']['plan']['vecs']}) "
                        f"best {r['best_plans'][g]}" for g in GROUPS)
        print(f"batch {n:3d} ranks {r['ranks']} max {max_rank}: v1 {r['v1_sum_us']:.1f} us, fused "
              f"{r['auto_sum_us']:.1f} us (layer loop: v1 {r['layer']['v1']['us']:.1f}, fused "
              f"{r['layer']['auto']['us']:.1f}, "
              + "".join(f"{v} {r['layer'][v]['us']:.1f}, " for v in LAYER_VARIANTS)
              + f"empty {r['layer']['empty']['us']:.1f}), err {r['worst_rel_err']:.1e}"
              f"  [{time.perf_counter() - t_start:.0f} s]\n    {per}", flush=True)
    print()
    head = (f"{'batch':>5s} {'ranks':14s} {'maxr':>4s} {'v1 sum':>8s} {'v1 layer':>8s} {'fu sum':>8s} "
            f"{'fu layer':>8s} {'best':>8s} {'empty':>6s} {'floor':>7s} {'target':>6s} {'model':>6s} {'k v1/fu':>7s} "
            f"{'relerr':>8s}")
    print(head)
    print("-" * len(head))
    for r in out:
        target = f"{r['target_us']:6.0f}" if r["target_us"] else f"{'':6s}"
        ks = f"{r['layer']['v1']['kernels']:.0f}/{r['layer']['auto']['kernels']:.0f}"
        print(f"{r['rows']:5d} {str(r['ranks']):14s} {r['max_rank']:4d} {r['v1_sum_us']:8.1f} "
              f"{r['layer']['v1']['us']:8.1f} {r['auto_sum_us']:8.1f} {r['layer']['auto']['us']:8.1f} "
              f"{r['best_sum_us']:8.1f} {r['layer']['empty']['us']:6.1f} {r['floor_us']:7.1f} {target} "
              f"{r['est_sum_us']:6.1f} {ks:>7s} {r['worst_rel_err']:8.1e}")
    print(f"(us per layer, all 7 projections; 'sum': four groups each in its own timing loop, as v1's table; "
          f"'layer': {LAYER_REPEAT} chained layers per loop iteration, divided by {LAYER_REPEAT}; 'empty': the "
          f"loop's own cost, likewise; 'best': the fastest fused plan per group; 'model': the plan's estimate; "
          f"'k': kernels per layer from the compiled HLO)")
    return out


def print_table(rows):
    head = (f"{'kind':7s} {'mods':4s} {'rows':>5s} {'adap':>4s} {'rank':>4s} {'us':>8s} {'GB/s':>7s} {'%copy':>5s} "
            f"{'xRef':>6s} {'xPad':>6s} {'relerr':>8s} {'base_us':>8s} {'ovh%':>6s}  (decode: fused us, x v1)")
    print(head)
    print("-" * len(head))
    for r in rows:
        extra = (f"{r['base_us']:8.1f} {r['lora_overhead_pct']:6.1f}" if r["kind"] == "prefill" else
                 f"{'':8s} {'':6s}  {r['fused_us']:8.1f} x{r['fused_speedup_vs_v1']:.2f}")
        print(f"{r['kind']:7s} {r['modules']:4s} {r['rows']:5d} {r['adapters']:4d} {r['rank']:>4s} {r['time_us']:8.1f} "
              f"{r['adapter_gbps']:7.1f} {r['pct_copy_adapter']:5.0f} {r['speedup_vs_reference']:6.2f} "
              f"{r['speedup_vs_padded']:6.2f} {r['rel_err']:8.1e} {extra}")


def main():
    t_start = time.perf_counter()
    copy = dict(COPY)
    if not copy.get("ok"):
        copy = {"ok": True, "gbps": jax_copy_bandwidth(), "method": f"jax negate (torch: {COPY.get('why')})"}
    copy_gbps = copy["gbps"]
    device = jax.devices()[0]
    print(f"device: {device.device_kind}  jax {jax.__version__}  "
          f"copy bandwidth {copy_gbps:.0f} GB/s ({copy['method']})", flush=True)
    pool = make_pool()
    print(f"pool: {pool.shape} {pool.dtype} ({pool.nbytes / 2**30:.1f} GiB)", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    if ARGS.decode_table:
        return write_result(device, copy, pool, t_start, decode_table=decode_table(pool, rng, copy_gbps, t_start))

    for n in DECODE_BATCHES:
        for rank_name, rank_set in RANK_CONFIGS.items():
            ranks = [rank_set[i % len(rank_set)] for i in range(n)]
            max_rank = max(ranks)
            table = make_table(rng, ranks, pool.shape[1])
            row_slot = jnp.asarray(rng.permutation(n).astype(np.int32))  # n distinct adapters, shuffled
            groups = run_combo("decode", n, ranks, max_rank, pool, table, row_slot, None, rng)
            for set_name in MODULE_SETS:
                rows.append(summarize("decode", set_name, groups, n, n, rank_name, copy_gbps))
            r = rows[-2]
            print(f"decode T={n:4d} {rank_name:4s}: {r['time_us']:8.1f} us  {r['adapter_gbps']:7.1f} GB/s "
                  f"({r['pct_copy_adapter']:.0f}% copy)  x{r['speedup_vs_reference']:.2f} ref  "
                  f"x{r['speedup_vs_padded']:.2f} padded  err {r['rel_err']:.1e}  "
                  f"[{time.perf_counter() - t_start:.0f} s]", flush=True)

    for n_ad in PREFILL_ADAPTERS:
        ranks = [PREFILL_RANK] * n_ad
        table = make_table(rng, ranks, pool.shape[1])
        seg = PREFILL_TOKENS // n_ad
        row_slot_np = np.repeat(rng.permutation(n_ad).astype(np.int32), seg)
        bucket = max_tiles(PREFILL_TOKENS, n_ad, BLOCK_T)
        tiles = SegmentTiles(*(jnp.asarray(a) for a in make_tiles(row_slot_np, BLOCK_T, bucket)))
        groups = run_combo("prefill", PREFILL_TOKENS, ranks, PREFILL_RANK, pool, table, jnp.asarray(row_slot_np), tiles,
                           rng)
        for set_name in MODULE_SETS:
            rows.append(summarize("prefill", set_name, groups, PREFILL_TOKENS, n_ad, f"r{PREFILL_RANK}", copy_gbps))
        r = rows[-2]
        print(f"prefill {PREFILL_TOKENS} tok / {n_ad:2d} adapters: {r['time_us']:8.1f} us  base {r['base_us']:8.1f} us "
              f"(overhead {r['lora_overhead_pct']:.1f}%)  x{r['speedup_vs_reference']:.2f} ref  "
              f"x{r['speedup_vs_padded']:.2f} padded  err {r['rel_err']:.1e}  [{time.perf_counter() - t_start:.0f} s]",
              flush=True)

    sweep = []
    if not ARGS.no_sweep:
        if time.perf_counter() - t_start < SWEEP_DEADLINE_S:
            sweep = tuning_sweep(pool, rng, copy_gbps)
        else:
            print("skipping the tuning sweep: not enough time left in the 8 minute budget")

    print()
    print_table(rows)
    headline = [r for r in rows if r["kind"] == "decode" and r["rows"] == max(DECODE_BATCHES)
                and r["rank"] == ("r16" if "r16" in RANK_CONFIGS else "r8") and r["modules"] == "all7"]
    if headline:
        print(f"\nheadline: decode batch {headline[0]['rows']}, distinct {headline[0]['rank']} adapters, all 7 modules:"
              f" {headline[0]['pct_copy_adapter']:.0f}% of copy bandwidth on adapter bytes (target >= 60%)")
    worst = max(r["rel_err"] for r in rows)
    print(f"worst relative error vs fp32 reference: {worst:.2e}")
    write_result(device, copy, pool, t_start, cases=rows, tuning_sweep=sweep, worst_rel_err=worst)


def write_result(device, copy, pool, t_start, **parts):
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "device": device.device_kind, "platform": device.platform, "jax_version": jax.__version__,
        "git_commit": git_commit(), "tiny": ARGS.tiny, "packed_pages": ARGS.packed, "copy_bandwidth": copy,
        "shapes": {"hidden": HIDDEN, "intermediate": INTER, "head_dim": VDIM, "kv_width": KV_WIDTH,
                   "page_rows": PAGE_ROWS, "pool_shape": list(pool.shape), "prefill_block_t": BLOCK_T},
        **parts, "wall_s": time.perf_counter() - t_start,
    }
    with open(ARGS.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {ARGS.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
