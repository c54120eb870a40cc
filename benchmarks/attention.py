"""Benchmark the paged attention kernels on one GPU against the machine's own copy bandwidth and matmul rate.

    PYTHONPATH=. python benchmarks/attention.py --out results.json     # H200: about 5-7 minutes
    PYTHONPATH=. python benchmarks/attention.py --tiny                 # CPU, interpret mode, tiny shapes
    PYTHONPATH=. python benchmarks/attention.py --prefill-only --prefill-impls triton,mosaic-noturns,mosaic

``--prefill-impls`` names the prefill lowerings to compare, each checked against the reference and timed on the same
inputs: ``triton`` (prefill_attention.py), ``mosaic`` (prefill_attention_mgpu.py, Hopper) and ``mosaic-noturns``
(the same without the consumers' turn-taking barrier). A lowering that fails records its error in its own rows and
the run goes on; the JSON report is rewritten after every prefill row, so a run cut short keeps what it measured.
``--prefill-only`` skips the decode checks, the tile sweep and the decode timings; ``--prefill-sizes 16k,4k`` times
only those sizes, in that order.

Order: device rooflines (copy GB/s with torch ``b.copy_(a)`` in a subprocess before jax starts, bf16 matmul TFLOP/s),
correctness (bf16 kernels vs the f32 jnp references), a short sweep of kernel tile settings, then decode (batch x
context for a Llama-2-7B and a Llama-3-8B attention layout) and prefill (4k and 16k new tokens). Decode reports
bytes moved (K/V read + q/out), GB/s as a fraction of copy bandwidth and speed-up over the XLA-compiled reference;
prefill reports causal TFLOP/s as a fraction of the matmul rate. A compact table is printed last.

Decode is timed two ways. ``ms`` is one jitted call per step (host dispatch included: about 50-80 us on the H200
machine, which hides every kernel shorter than that). ``ms_in_jit`` chains ``DECODE_CHAIN`` calls inside one jit (each
call's output is the next one's q; each reads its own random page table, so repeats do not hit L2) and divides, as the
kernel runs inside a model step; launch gaps between kernels stay in. Every timing first runs the function for
``WARMUP_S`` so the GPU clocks are up (the first sweep entries of the 2026-11-29 v1 run were 15-25% slow without it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import sys
import time

from common import device_ceilings, git_commit

DECODE_CHAIN = 10  # decode calls per jit for ms_in_jit
MOSAIC_VARIANTS = {"mosaic-noturns": dict(schedule_barrier=False), "mosaic": dict(schedule_barrier=True)}
WARMUP_S = 0.1  # seconds of back-to-back calls before each timing

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported anywhere

# jax is imported only after the torch probe has run (see main()).
jax = jnp = np = None


def import_jax():
    global jax, jnp, np
    import jax as _jax
    import jax.numpy as _jnp
    import numpy as _np
    jax, jnp, np = _jax, _jnp, _np


def timeit(fn, *args, reps: int, inner: int = 1) -> float:
    """Median seconds per call; ``inner`` back-to-back calls per sample hide dispatch for short kernels.

    The first call compiles; then the function runs back to back for ``WARMUP_S`` so clocks are up before timing.
    """
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    while time.perf_counter() - start < WARMUP_S:
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / inner)
    return float(np.median(samples))


def probe_with_jax(copy_bytes: int, matmul_n: int, reps: int) -> dict:
    out = {}
    a = jnp.ones((copy_bytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda x: x + 1)  # one read, one write
    out["copy_gbps"] = 2 * a.size * 2 / timeit(copy, a, reps=reps, inner=5) / 1e9
    out["copy_source"] = f"jax elementwise x+1, {copy_bytes >> 20} MiB bf16, read+write"
    del a
    x = jnp.ones((matmul_n, matmul_n), jnp.bfloat16)
    out["matmul_tflops"] = 2 * matmul_n**3 / timeit(jax.jit(jnp.dot), x, x, reps=reps, inner=5) / 1e12
    out["matmul_source"] = f"jax bf16 {matmul_n}^3"
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclasses.dataclass
class Setup:
    tiny: bool
    interpret: bool
    page_size: int
    layouts: tuple
    batches: tuple
    contexts: tuple
    prefill: tuple  # (label, list of new-token counts per sequence)
    reps: int
    copy_bytes: int
    matmul_n: int
    ref_limit_bytes: float
    pool_limit_bytes: float
    block_q: int | None  # None: the kernel's defaults
    block_k: int | None
    decode_chain: int


def make_setup(tiny: bool) -> Setup:
    if tiny:
        return Setup(True, True, 8, (Layout("tiny-mha", 2, 2, 32), Layout("tiny-gqa4", 4, 1, 32)), (1, 2), (16, 40),
                     (("32", [32]), ("2x24", [24, 24])), 1, 1 << 20, 128, 1e9, 1e9, 16, 16, 2)
    return Setup(False, False, 16, (Layout("llama2-7b", 32, 32, 128), Layout("llama3-8b", 32, 8, 128)),
                 (1, 32, 128, 256), (128, 512, 2048, 8192),
                 (("1k", [1024]), ("4k", [4096]), ("16k", [16384]), ("4x4k", [4096] * 4)), 5, 2 << 30, 8192, 40e9,
                 60e9, None, None, DECODE_CHAIN)


def prefill_blocks(setup: Setup) -> dict:
    """block_q/block_k keyword arguments for the prefill kernel (empty: its defaults)."""
    return {k: v for k, v in (("block_q", setup.block_q), ("block_k", setup.block_k)) if v is not None}


def chained_decode(decode_fn, n: int):
    """jit of ``n`` decode calls in a row: call i reads page table ``tables[i]``; its output is call i+1's q."""
    def run(q, pool, layer, tables, lens):
        for i in range(n):
            q = decode_fn(q, pool, layer, tables[i], lens)
        return q
    return jax.jit(run)


def random_pool(key, num_pages: int, layout: Layout, page_size: int, dtype, distinct_pages: int = 512):
    """[1, >= num_pages, page_rows, hd]: a block of random pages repeated (one fused write, no RNG over tens of GB).

    The page count is rounded up to a multiple of the block; callers read it from ``pool.shape[1]``.
    """
    chunk_pages = min(num_pages, distinct_pages)
    page_shape = (2 * layout.num_kv_heads * page_size, layout.head_dim)
    chunk = jax.random.uniform(key, (1, 1, chunk_pages, *page_shape), dtype, -2.0, 2.0)
    repeats = -(-num_pages // chunk_pages)
    return jnp.broadcast_to(chunk, (1, repeats, chunk_pages, *page_shape)).reshape(1, -1, *page_shape)


def page_tables(rng, batch: int, pages_each: int, num_pages: int):
    """Each sequence gets ``pages_each`` distinct pages drawn at random from the pool (non-contiguous)."""
    return jnp.asarray(rng.permutation(num_pages)[: batch * pages_each].reshape(batch, pages_each), jnp.int32)


def decode_kv_bytes(layout: Layout, batch: int, context: int, itemsize: int) -> int:
    kv = batch * context * layout.num_kv_heads * layout.head_dim * 2 * itemsize
    return kv + 2 * batch * layout.num_heads * layout.head_dim * itemsize


def decode_reference_bytes(layout: Layout, batch: int, context: int) -> float:
    """Peak-ish memory of the jnp reference: gathered bf16 K/V, their f32 copies, f32 scores and probabilities."""
    kv = batch * context * layout.num_kv_heads * layout.head_dim * 2
    return kv * 2 + kv * 4 + 3 * batch * layout.num_heads * context * 4


def prefill_flops(layout: Layout, new_tokens: list[int]) -> float:
    """Causal attention flops: QK^T and PV, 2 flops per multiply-add, key count = position + 1."""
    keys = sum(n * (n + 1) // 2 for n in new_tokens)
    return 4.0 * layout.num_heads * layout.head_dim * keys


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def prefill_impls(names: list[str], setup: Setup) -> dict:
    """name -> prefill function with the kernel's signature per lowering named (a failed import raises when called)."""
    from pallas_kernels.prefill_attention import paged_prefill_attention
    out = {}
    for name in names:
        if name == "triton":
            out[name] = functools.partial(paged_prefill_attention, **prefill_blocks(setup), interpret=setup.interpret)
        elif name in MOSAIC_VARIANTS:
            try:
                from pallas_kernels.prefill_attention_mgpu import paged_prefill_attention_mosaic
                out[name] = functools.partial(paged_prefill_attention_mosaic, **MOSAIC_VARIANTS[name])
            except Exception as exc:  # noqa: BLE001
                out[name] = functools.partial(_raise, exc)
        else:
            raise SystemExit(f"unknown prefill lowering {name!r}; known: triton, {', '.join(MOSAIC_VARIANTS)}")
    return out


def _raise(exc, *args, **kwargs):
    raise exc


def correctness(setup: Setup, kernels, impls: dict, decode_too: bool = True) -> list[dict]:
    """bf16 kernels against the f32 references on the same (bf16-rounded) data; each prefill lowering on its own."""
    decode, decode_ref, _, prefill_ref = kernels
    rng = np.random.default_rng(0)
    results = []
    page_size = setup.page_size
    for layout in setup.layouts:
        batch, max_context = (3, 40) if setup.tiny else (8, 3000)
        lens = rng.integers(1, max_context, size=batch).astype(np.int32)
        lens[-1] = 0 if batch > 2 else lens[-1]
        pages_each = -(-max_context // page_size)
        num_pages = batch * pages_each + 8
        pool = random_pool(jax.random.key(1), num_pages, layout, page_size, jnp.bfloat16)
        table = page_tables(rng, batch, pages_each, pool.shape[1])
        q = jax.random.normal(jax.random.key(2), (batch, layout.num_heads, layout.head_dim), jnp.bfloat16)
        kw = dict(page_size=page_size, num_kv_heads=layout.num_kv_heads, sm_scale=layout.head_dim**-0.5)
        for splits in (1, None) if decode_too else ():
            got = decode(q, pool, jnp.int32(0), table, jnp.asarray(lens), num_splits=splits, **kw,
                         interpret=setup.interpret)
            want = decode_ref(q.astype(jnp.float32), pool.astype(jnp.float32), jnp.int32(0), table, jnp.asarray(lens),
                              **kw)
            err = float(jnp.abs(got.astype(jnp.float32) - want).max())
            results.append(dict(kernel="decode", layout=layout.name, splits=splits, max_abs_err=err, ok=err < 3e-2))
        n_new = [24, 1, 40] if setup.tiny else [700, 1, 300]
        prior = [0, 15, 8] if setup.tiny else [0, 1500, 250]
        lens = np.asarray([a + b for a, b in zip(n_new, prior, strict=True)], np.int32)
        q_starts = jnp.asarray(np.concatenate([[0], np.cumsum(n_new)]), jnp.int32)
        rows = sum(n_new) + 5
        pages_each = -(-int(lens.max()) // page_size)
        num_pages = 3 * pages_each + 8
        pool = random_pool(jax.random.key(3), num_pages, layout, page_size, jnp.bfloat16)
        table = page_tables(rng, 3, pages_each, pool.shape[1])
        q = jax.random.normal(jax.random.key(4), (rows, layout.num_heads, layout.head_dim), jnp.bfloat16)
        want = prefill_ref(q.astype(jnp.float32), pool.astype(jnp.float32), jnp.int32(0), table, q_starts,
                           jnp.asarray(lens), **kw)
        for impl, prefill in impls.items():
            try:
                got = prefill(q, pool, jnp.int32(0), table, q_starts, jnp.asarray(lens), **kw)
                diff = jnp.abs(got.astype(jnp.float32) - want)
                err = float(jnp.where(jnp.isnan(diff), jnp.inf, diff).max())  # NaN counts as a failure
                results.append(dict(kernel="prefill", impl=impl, layout=layout.name, max_abs_err=err, ok=err < 3e-2))
            except Exception as exc:  # noqa: BLE001
                results.append(dict(kernel="prefill", impl=impl, layout=layout.name, ok=False, error=repr(exc)[:400]))
            print(f"correctness prefill/{impl}/{layout.name}: {results[-1]}", flush=True)
    return results


def sweep(setup: Setup, kernels, deadline: Deadline) -> dict:
    """A few tile settings at one representative decode and prefill shape, so defaults can be checked on the spot."""
    decode, _, prefill, _ = kernels
    out = {"decode": [], "prefill": []}
    if setup.tiny:
        return out
    rng = np.random.default_rng(5)
    layout = setup.layouts[1]
    page_size = setup.page_size
    batch, context = 32, 2048
    pages_each = context // page_size
    num_pages = batch * pages_each
    pool = random_pool(jax.random.key(6), num_pages, layout, page_size, jnp.bfloat16)
    tables = jnp.stack([page_tables(rng, batch, pages_each, pool.shape[1]) for _ in range(setup.decode_chain)])
    lens = jnp.full((batch,), context, jnp.int32)
    q = jax.random.normal(jax.random.key(7), (batch, layout.num_heads, layout.head_dim), jnp.bfloat16)
    kw = dict(page_size=page_size, num_kv_heads=layout.num_kv_heads, sm_scale=layout.head_dim**-0.5)
    nbytes = decode_kv_bytes(layout, batch, context, 2)
    for ppb, warps, stages in ((4, 4, 2), (4, 4, 3), (8, 4, 2), (8, 8, 3), (2, 4, 3), (4, 8, 2)):
        if deadline.left() < 0:
            break
        fn = chained_decode(lambda *a, ppb=ppb, warps=warps, stages=stages: decode(
            *a, **kw, pages_per_block=ppb, num_warps=warps, num_stages=stages), setup.decode_chain)
        try:
            t = timeit(fn, q, pool, jnp.int32(0), tables, lens, reps=setup.reps, inner=3) / setup.decode_chain
            out["decode"].append(dict(pages_per_block=ppb, num_warps=warps, num_stages=stages, ms=t * 1e3,
                                      gbps=nbytes / t / 1e9))
        except Exception as exc:  # noqa: BLE001
            out["decode"].append(dict(pages_per_block=ppb, num_warps=warps, num_stages=stages, error=repr(exc)[:300]))
    del pool
    n = 16384
    pool = random_pool(jax.random.key(8), n // page_size, layout, page_size, jnp.bfloat16)
    table = page_tables(rng, 1, n // page_size, pool.shape[1])
    q = jax.random.normal(jax.random.key(9), (n, layout.num_heads, layout.head_dim), jnp.bfloat16)
    q_starts = jnp.asarray([0, n], jnp.int32)
    lens = jnp.asarray([n], jnp.int32)
    flops = prefill_flops(layout, [n])
    for bq, bk, warps, stages in ((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                                  (128, 32, 4, 4), (64, 128, 4, 2)):
        if deadline.left() < 0:
            break
        fn = jax.jit(lambda *a, bq=bq, bk=bk, warps=warps, stages=stages: prefill(
            *a, **kw, block_q=bq, block_k=bk, num_warps=warps, num_stages=stages))
        try:
            t = timeit(fn, q, pool, jnp.int32(0), table, q_starts, lens, reps=setup.reps)
            out["prefill"].append(dict(block_q=bq, block_k=bk, num_warps=warps, num_stages=stages, ms=t * 1e3,
                                       tflops=flops / t / 1e12))
        except Exception as exc:  # noqa: BLE001
            out["prefill"].append(dict(block_q=bq, block_k=bk, num_warps=warps, num_stages=stages,
                                       error=repr(exc)[:300]))
    return out


def bench_decode(setup: Setup, kernels, probe: dict, deadline: Deadline) -> list[dict]:
    decode, decode_ref, _, _ = kernels
    rng = np.random.default_rng(10)
    rows = []
    page_size = setup.page_size
    for layout in setup.layouts:
        # One pool per layout, sized for the biggest combo that fits; every combo draws pages from it at random.
        per_token = 2 * layout.num_kv_heads * layout.head_dim * 2
        fitting = [b * c for b in setup.batches for c in setup.contexts if b * c * per_token <= setup.pool_limit_bytes]
        num_pages = max(fitting) // page_size + 64
        pool = random_pool(jax.random.key(11), num_pages, layout, page_size, jnp.bfloat16)
        kw = dict(page_size=page_size, num_kv_heads=layout.num_kv_heads, sm_scale=layout.head_dim**-0.5)
        kernel = jax.jit(lambda *a, kw=kw: decode(*a, **kw, interpret=setup.interpret))
        chain = chained_decode(lambda *a, kw=kw: decode(*a, **kw, interpret=setup.interpret), setup.decode_chain)
        reference = jax.jit(lambda *a, kw=kw: decode_ref(*a, **kw))
        for batch in setup.batches:
            for context in setup.contexts:
                row = dict(layout=layout.name, batch=batch, context=context)
                rows.append(row)
                if batch * context * per_token > setup.pool_limit_bytes:
                    row["skipped"] = "K/V would not fit"
                    continue
                if deadline.left() < 0:
                    row["skipped"] = "time budget"
                    continue
                pages_each = context // page_size if context % page_size == 0 else context // page_size + 1
                table = page_tables(rng, batch, pages_each, pool.shape[1])
                lens = jnp.full((batch,), context, jnp.int32)
                q = jax.random.normal(jax.random.key(batch + context), (batch, layout.num_heads, layout.head_dim),
                                      jnp.bfloat16)
                args = (q, pool, jnp.int32(0), table, lens)
                nbytes = decode_kv_bytes(layout, batch, context, 2)
                t = timeit(kernel, *args, reps=setup.reps, inner=1 if setup.tiny else 5)
                row.update(ms=t * 1e3, bytes=nbytes, gbps=nbytes / t / 1e9)
                if t < 1e-3 or setup.tiny:  # longer calls are device-bound already: back-to-back calls overlap dispatch
                    tables = jnp.stack([table] + [page_tables(rng, batch, pages_each, pool.shape[1])
                                                  for _ in range(setup.decode_chain - 1)])
                    t_jit = timeit(chain, q, pool, jnp.int32(0), tables, lens, reps=setup.reps,
                                   inner=1 if setup.tiny else 5) / setup.decode_chain
                    del tables
                    row["chain"] = setup.decode_chain
                else:
                    t_jit = t
                    row["chain"] = 1
                row.update(ms_in_jit=t_jit * 1e3, gbps_in_jit=nbytes / t_jit / 1e9)
                if probe.get("copy_gbps"):
                    row["frac_copy_bw"] = row["gbps"] / probe["copy_gbps"]
                    row["frac_copy_bw_in_jit"] = row["gbps_in_jit"] / probe["copy_gbps"]
                if decode_reference_bytes(layout, batch, context) > setup.ref_limit_bytes:
                    row["reference"] = "skipped: reference would materialise too much memory"
                elif deadline.left() > 0:
                    t_ref = timeit(reference, *args, reps=setup.reps, inner=1 if setup.tiny else 3)
                    row.update(ref_ms=t_ref * 1e3, speedup=t_ref / t)
        del pool
    return rows


def bench_prefill(setup: Setup, kernels, impls: dict, probe: dict, deadline: Deadline,
                  checkpoint=lambda rows: None) -> list[dict]:
    """One row per (layout, size, lowering); a lowering's error stays in its row. ``checkpoint`` sees every row."""
    prefill_ref = kernels[3]
    rng = np.random.default_rng(20)
    rows = []
    page_size = setup.page_size
    for layout in setup.layouts:
        kw = dict(page_size=page_size, num_kv_heads=layout.num_kv_heads, sm_scale=layout.head_dim**-0.5)
        reference = jax.jit(lambda *a, kw=kw: prefill_ref(*a, **kw))
        for label, new_tokens in setup.prefill:
            if deadline.left() < 0:
                rows += [dict(layout=layout.name, tokens=label, impl=impl, skipped="time budget") for impl in impls]
                continue
            batch, total = len(new_tokens), sum(new_tokens)
            pages_each = -(-max(new_tokens) // page_size)
            num_pages = batch * pages_each + 8
            pool = random_pool(jax.random.key(21), num_pages, layout, page_size, jnp.bfloat16)
            table = page_tables(rng, batch, pages_each, pool.shape[1])
            q = jax.random.normal(jax.random.key(22), (total, layout.num_heads, layout.head_dim), jnp.bfloat16)
            q_starts = jnp.asarray(np.concatenate([[0], np.cumsum(new_tokens)]), jnp.int32)
            lens = jnp.asarray(new_tokens, jnp.int32)
            args = (q, pool, jnp.int32(0), table, q_starts, lens)
            flops = prefill_flops(layout, new_tokens)
            t_ref = None
            for impl, prefill in impls.items():
                row = dict(layout=layout.name, tokens=label, impl=impl)
                rows.append(row)
                try:
                    t = timeit(jax.jit(lambda *a, prefill=prefill, kw=kw: prefill(*a, **kw)), *args, reps=setup.reps)
                except Exception as exc:  # noqa: BLE001
                    row["error"] = repr(exc)[:400]
                    print(f"prefill {impl} {layout.name} {label}: {row['error']}", flush=True)
                    checkpoint(rows)
                    continue
                row.update(ms=t * 1e3, tflops=flops / t / 1e12)
                if probe.get("matmul_tflops"):
                    row["frac_matmul"] = row["tflops"] / probe["matmul_tflops"]
                ref_bytes = 3 * total * layout.num_heads * max(new_tokens) * 4
                if ref_bytes > setup.ref_limit_bytes:
                    row["reference"] = "skipped: reference scores would not fit"
                elif t_ref is None and deadline.left() > 0:
                    t_ref = timeit(reference, *args, reps=setup.reps)
                if t_ref is not None:
                    row.update(ref_ms=t_ref * 1e3, speedup=t_ref / t)
                print(f"prefill {impl} {layout.name} {label}: {t * 1e3:.2f} ms {row['tflops']:.0f} TFLOP/s", flush=True)
                checkpoint(rows)
            del pool
    return rows


def fmt(value, spec):
    return format(value, spec) if isinstance(value, int | float) else "-"


def print_tables(report: dict) -> None:
    probe = report["probe"]
    print(f"\n== {report['device']} | jax {report['jax']} | commit {report['commit'][:10]} | "
          f"copy {fmt(probe.get('copy_gbps'), '.0f')} GB/s | matmul {fmt(probe.get('matmul_tflops'), '.0f')} TFLOP/s")
    checks = [f"{r['kernel']}/{r.get('impl', '')}/{r['layout']}" + (f"/splits={r['splits']}" if "splits" in r else "")
              + (f" err {r['max_abs_err']:.1e}" if "max_abs_err" in r else " error") + (" ok" if r["ok"] else " FAIL")
              for r in report["correctness"]]
    print("correctness: " + ", ".join(checks))
    print(f"prefill tiles (block_q, block_k, warps, stages): {report.get('prefill_tiles')}; decode chain "
          f"{report.get('decode_chain')} calls per jit for the in-jit columns")
    print(f"{'decode layout':<12} {'batch':>5} {'ctx':>5} {'ms':>8} {'%copy':>6} {'jit ms':>8} {'GB/s':>7} "
          f"{'%copy':>6} {'ref ms':>8} {'x ref':>6}")
    for r in report["decode"]:
        if "skipped" in r:
            print(f"{r['layout']:<12} {r['batch']:>5} {r['context']:>5}  skipped: {r['skipped']}")
            continue
        print(f"{r['layout']:<12} {r['batch']:>5} {r['context']:>5} {r['ms']:>8.3f} "
              f"{fmt(100 * r['frac_copy_bw'] if 'frac_copy_bw' in r else None, '.0f'):>6} "
              f"{r['ms_in_jit']:>8.3f} {r['gbps_in_jit']:>7.0f} "
              f"{fmt(100 * r['frac_copy_bw_in_jit'] if 'frac_copy_bw_in_jit' in r else None, '.0f'):>6} "
              f"{fmt(r.get('ref_ms'), '.3f'):>8} {fmt(r.get('speedup'), '.1f'):>6}")
    print(f"{'prefill layout':<14} {'tokens':>6} {'lowering':>14} {'ms':>8} {'TFLOP/s':>8} {'%mm':>5} {'ref ms':>8} "
          f"{'x ref':>6}")
    for r in report["prefill"]:
        if "skipped" in r or "error" in r:
            print(f"{r['layout']:<14} {r['tokens']:>6} {r.get('impl', ''):>14}  {r.get('skipped') or r['error'][:90]}")
            continue
        print(f"{r['layout']:<14} {r['tokens']:>6} {r.get('impl', ''):>14} {r['ms']:>8.2f} {r['tflops']:>8.1f} "
              f"{fmt(100 * r['frac_matmul'] if 'frac_matmul' in r else None, '.0f'):>5} "
              f"{fmt(r.get('ref_ms'), '.1f'):>8} {fmt(r.get('speedup'), '.1f'):>6}")
    for kind in ("decode", "prefill"):
        for r in report["sweep"].get(kind, []):
            print(f"sweep {kind}: " + " ".join(f"{k}={fmt(v, '.1f') if isinstance(v, float) else v}"
                                               for k, v in r.items()))




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--tiny", action="store_true", help="interpret mode, tiny shapes (CPU smoke run)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-setting sweep")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new measurements after this")
    parser.add_argument("--prefill-impls", default="triton",
                        help="comma-separated prefill lowerings to check and time: triton, mosaic, mosaic-noturns")
    parser.add_argument("--prefill-only", action="store_true", help="skip decode checks, the sweep and decode timings")
    parser.add_argument("--prefill-sizes", default=None,
                        help="prefill size labels to time, in this order (default all: 1k,4k,16k,4x4k)")
    args = parser.parse_args()
    started = time.monotonic()
    deadline = Deadline(args.budget_s)
    setup = make_setup(args.tiny)
    if args.prefill_sizes:
        sizes = dict(setup.prefill)
        setup.prefill = tuple((label, sizes[label]) for label in args.prefill_sizes.split(",") if label in sizes)

    probe = {} if args.tiny else device_ceilings(setup.copy_bytes, setup.matmul_n)
    import_jax()
    from pallas_kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference
    from pallas_kernels.prefill_attention import (
        default_prefill_tiles,
        paged_prefill_attention,
        paged_prefill_attention_reference,
    )

    if "copy_gbps" not in probe:
        torch_error = probe.get("error")
        probe = probe_with_jax(setup.copy_bytes, setup.matmul_n, setup.reps)
        if torch_error:
            probe["torch_error"] = torch_error
    kernels = (paged_decode_attention, paged_decode_attention_reference, paged_prefill_attention,
               paged_prefill_attention_reference)
    impls = prefill_impls([name for name in args.prefill_impls.split(",") if name], setup)
    report = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), jax=jax.__version__,
        commit=git_commit(), tiny=setup.tiny, interpret=setup.interpret, page_size=setup.page_size, probe=probe,
        layouts=[dataclasses.asdict(x) for x in setup.layouts],
        prefill_tiles=list(default_prefill_tiles(**prefill_blocks(setup))), decode_chain=setup.decode_chain,
        prefill_impls=list(impls), prefill_only=args.prefill_only,
        timing=("median of reps; decode 'ms' = one jitted call incl. host dispatch, 'ms_in_jit' = chained calls in one "
                f"jit / chain; {WARMUP_S} s warm-up before each timing"),
    )

    def save(**parts):
        report.update(parts, elapsed_s=time.monotonic() - started)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)

    save(correctness=correctness(setup, kernels, impls, decode_too=not args.prefill_only), sweep={}, decode=[],
         prefill=[])
    if not args.prefill_only:
        save(sweep={} if args.no_sweep else sweep(setup, kernels, Deadline(min(90.0, deadline.left()))))
        save(decode=bench_decode(setup, kernels, probe, deadline))
    save(prefill=bench_prefill(setup, kernels, impls, probe, deadline, checkpoint=lambda rows: save(prefill=rows)))
    print_tables(report)
    print(f"elapsed {report['elapsed_s']:.0f} s" + (f", report in {args.out}" if args.out else ""))
    if not all(r["ok"] for r in report["correctness"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
