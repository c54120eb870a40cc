"""The prefill LoRA kernels (SGMV shrink and expand) at the serving step's shapes, per launch setting, on the device.

    PYTHONPATH=.:benchmarks python benchmarks/sgmv_sweep.py --out sgmv.json     # H200: ~3-4 min
    PYTHONPATH=.:benchmarks python benchmarks/sgmv_sweep.py --tiny              # CPU smoke run (interpret mode)

A saturated S1 prefill step (NOTES, session 15) spends 1.77 ms of 14 ms in these kernels for 512 tokens, against
~0.3 ms of bytes. This script takes one Llama-2-7B layer's module groups (q,k,v and o for S1; down for all-7) at the
engine's bucket shapes (a 1024-row bucket holding two 260-token prompts, 2048 rows of eight 256-token prompts),
rank-8 adapters under the server's max rank of 64, and for every setting of the row tile (``block_t``, which sets
the tile count as the engine pads it), the shrink's rank block, d_in splits and chunks a loop step, the expand's
vectors a program (looped, or loaded together) and warps: checks the result against the jnp reference (fresh random
inputs), then takes the device time of the call's own kernels (the split sum and the zero fill included; not the
copy of ``base`` XLA makes here because the input is not donated) from a profiler trace. The floor is the group's
bytes (x read; y written and read; base read and written; adapter rows) over torch's copy bandwidth.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import itertools
import json
import os
import re

from common import device_ceilings, git_commit

MAX_PREFILL_SEQS = 16  # the engine's default: its SGMV tile count is ceil(T / block_t) + max_prefill_seqs + 1


def bucket_tiles(make_tiles, row_slot, block_t: int):
    """The SGMV tiles of ``row_slot`` padded to the count the engine's step runner gives the bucket."""
    return make_tiles(row_slot, block_t, -(-row_slot.shape[0] // block_t) + MAX_PREFILL_SEQS + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--max-rank", type=int, default=64)
    ap.add_argument("--groups", default="qkv,o,down")
    args = ap.parse_args()
    probe = {} if args.tiny else device_ceilings()
    bw = probe.get("copy_gbps", float("nan"))

    import jax
    import jax.numpy as jnp
    import numpy as np
    from decode_profile import kernel_profile

    from pallas_kernels.lora_common import AdapterTable, Tuning, pack_offsets
    from pallas_kernels.lora_sgmv import (
        make_tiles,
        sgmv_expand,
        sgmv_expand_reference,
        sgmv_shrink,
        sgmv_shrink_reference,
    )

    if args.tiny:
        hidden, inter, vdim, page_rows = 64, 96, 16, 32
        cases = [("T64 2x20", 64, (20, 20))]
        block_ts, rank_blocks, splits_l, vecs_l, warps_l, unrolls = (8, 16), (16,), (1, 2), (1, 2), (4,), (1, 2)
    else:
        hidden, inter, vdim, page_rows = 4096, 11008, 128, 1024
        cases = [("T1024 2x260", 1024, (260, 260)), ("T2048 8x256", 2048, (256,) * 8)]
        block_ts, rank_blocks, splits_l, vecs_l, warps_l, unrolls = (32, 64, 128), (64, 16), (1, 2, 4), \
            (1, 2, 4, 8), (4, 8), (1, 4, 8)
    dims = ((hidden, hidden), (hidden, hidden), (hidden, hidden), (hidden, hidden), (hidden, inter), (hidden, inter),
            (inter, hidden))
    groups = {"qkv": (0, 1, 2), "o": (3,), "gate_up": (4, 5), "down": (6,)}
    groups = {g: groups[g] for g in args.groups.split(",")}
    rng = np.random.default_rng()

    # adapters of rank `rank` on all 7 modules, each on random pages of a one-layer pool
    n_adapters = max(len(c[2]) for c in cases)
    rank_arr = np.full((n_adapters, 1, 7), args.rank, np.int32)
    a_off, b_off = np.zeros_like(rank_arr), np.zeros_like(rank_arr)
    need = 0
    for s in range(n_adapters):
        a_off[s], b_off[s], vecs = pack_offsets(rank_arr[s], dims, vdim)
        need = max(need, int(-(-vecs.max() // page_rows)))
    num_pages = n_adapters * need + 8
    pages = rng.permutation(num_pages)[: n_adapters * need].reshape(n_adapters, need).astype(np.int32)
    pool = jnp.asarray(rng.uniform(-1, 1, size=(1, num_pages, page_rows, vdim)), jnp.bfloat16)
    scale = rng.uniform(0.5, 2.0, size=rank_arr.shape).astype(np.float32)
    table = AdapterTable(*(jnp.asarray(a) for a in (pages, rank_arr, a_off, b_off, scale)))
    layer = jnp.int32(0)

    results = []
    for case, n_rows, seg_lens in cases:
        row_slot = np.full(n_rows, -1, np.int32)
        at = 0
        for s, n in enumerate(seg_lens):
            row_slot[at: at + n] = s
            at += n
        real = int((row_slot >= 0).sum())
        for g, modules in groups.items():
            d_in, d_outs = dims[modules[0]][0], tuple(dims[m][1] for m in modules)
            x = jnp.asarray(rng.normal(size=(n_rows, d_in)), jnp.bfloat16)
            base = jnp.asarray(rng.normal(size=(n_rows, sum(d_outs))), jnp.bfloat16)
            floor_bytes = (real * d_in * 2 + real * len(modules) * args.rank * 4 * 2 + real * sum(d_outs) * 4
                           + len(seg_lens) * args.rank * sum(d_in + d for d in d_outs) * 2)
            floor_us = floor_bytes / (bw * 1e3) if bw == bw else float("nan")
            jobs = {}  # (kernel, block_t, knobs) -> (jitted fn, args)
            for bt in block_ts:
                tiles = bucket_tiles(make_tiles, row_slot, bt)
                # the kernels' own plans first (all knobs unset), then the grid
                shrink_knobs = [(None, None, None, None)] + list(itertools.product(rank_blocks, splits_l, (4,),
                                                                                 unrolls))
                for rb, sp, w, un in shrink_knobs:
                    fn = jax.jit(functools.partial(sgmv_shrink, modules=modules, max_rank=args.max_rank, block_t=bt,
                                                   tuning=Tuning(rank_block=rb, splits=sp, num_warps=w, unroll=un)))
                    jobs["shrink", bt, (("rank_block", rb), ("splits", sp), ("warps", w), ("unroll", un))] = \
                        (fn, (x, pool, layer, tiles, table))
                for vv, w, un in [(None, None, None), *itertools.product(vecs_l, warps_l, (None, 1))]:
                    if un and (vv or 4) == 1:
                        continue  # one vector a program: nothing to issue together
                    fn = jax.jit(functools.partial(sgmv_expand, modules=modules, d_outs=d_outs, block_t=bt,
                                                   tuning=Tuning(vecs=vv, num_warps=w, unroll=un)))
                    jobs["expand", bt, (("vecs", vv), ("warps", w), ("unroll", un))] = \
                        (fn, [None, base, pool, layer, tiles, table])
            tiles0 = bucket_tiles(make_tiles, row_slot, block_ts[0])
            y_ref = sgmv_shrink_reference(x, pool, layer, tiles0, table, modules, args.max_rank, block_ts[0])
            delta = np.asarray(sgmv_expand_reference(y_ref, base, pool, layer, tiles0, table, modules, d_outs,
                                                     block_ts[0]), np.float32) - np.asarray(base, np.float32)
            for key, (_fn, fargs) in jobs.items():
                if key[0] == "expand":
                    fargs[0] = y_ref
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as ex:
                done = ex.map(_compile_or_reason, jobs.values())
                compiled = dict(zip(jobs, done, strict=True))
            y_scale = float(jnp.max(jnp.abs(y_ref))) + 1e-30
            d_scale = float(np.abs(delta).max()) + 1e-30
            for key, (_fn, fargs) in jobs.items():
                kern, bt, knobs = key
                call = compiled[key]
                if isinstance(call, str):  # did not compile (a tile past the shared memory): said, not timed
                    results.append(dict(case=case, group=g, kernel=kern, block_t=bt, **dict(knobs), us=float("inf"),
                                        rel_err=0.0, failed=call))
                    continue
                if kern == "shrink":
                    err = float(jnp.max(jnp.abs(call(*fargs) - y_ref))) / y_scale
                else:
                    got = np.asarray(call(*fargs[:1], jnp.array(base, copy=True), *fargs[2:]), np.float32)
                    err = float(np.abs(got - np.asarray(base, np.float32) - delta).max()) / d_scale
                us = float("nan") if args.tiny else _device_us(kernel_profile, call, *fargs)
                results.append(dict(case=case, group=g, kernel=kern, block_t=bt, **dict(knobs), us=us, rel_err=err))
            rows = [r for r in results if r["case"] == case and r["group"] == g]
            for kern, default in (("shrink", dict(block_t=64, rank_block=None, splits=None, warps=None, unroll=None)),
                                  ("expand", dict(block_t=64, vecs=None, warps=None, unroll=None))):
                mine = sorted((r for r in rows if r["kernel"] == kern), key=lambda r: r["us"])
                dflt = [r for r in mine if all(r.get(k) == v for k, v in default.items())]
                best = mine[0]
                knobs = {k: v for k, v in best.items() if k not in ("case", "group", "kernel", "us", "rel_err")}
                print(f"{case:12s} {g:8s} {kern:7s} floor (whole group) {floor_us:6.1f} us; default "
                      f"{dflt[0]['us'] if dflt else float('nan'):7.1f} us; best {best['us']:7.1f} us {knobs}")
            results.append(dict(case=case, group=g, kernel="floor", us=floor_us))
    worst = max(r.get("rel_err", 0) for r in results)
    print(f"largest error: {worst:.2e}")
    if worst > 2e-2:
        raise SystemExit("a variant disagrees with the reference")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(date=datetime.datetime.now(datetime.UTC).isoformat(),
                           device=jax.devices()[0].device_kind, jax=jax.__version__, commit=git_commit(),
                           copy_gbps=bw, rank=args.rank, max_rank=args.max_rank, results=results), f)


def _compile_or_reason(job):
    fn, args = job
    try:
        return fn.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - a launch setting the device refuses is a result, not a crash
        return f"{type(e).__name__}: {str(e)[:200]}"


def _device_us(kernel_profile, fn, *args) -> float:
    """Device us of the call's own kernels: the Pallas kernel, the split sum and the zero fill of y. Not the copy XLA
    makes of ``base`` (not donated here) for the expand's in-place output, which a step does not make."""
    prof = kernel_profile(lambda: fn(*args), calls=3, top=50)
    own = [us for name, _, us in prof["top_kernels"] if re.search(r"sgmv|reduce|memset", name, re.I)]
    return sum(own) if prof["kernels_per_step"] else float("nan")


if __name__ == "__main__":
    main()
