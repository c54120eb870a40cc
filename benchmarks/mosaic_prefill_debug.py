"""Localise a wrong or hanging Mosaic GPU prefill kernel in one short GPU run: cases from one matmul to the full kernel.

    PYTHONPATH=. python benchmarks/mosaic_prefill_debug.py --out $OUT/mosaic_prefill_debug.json   # H200, ~1-2 min
    PYTHONPATH=. python benchmarks/mosaic_prefill_debug.py --list          # the cases, no GPU needed
    PYTHONPATH=. python benchmarks/mosaic_prefill_debug.py --cases 0,5-7   # some of them

Why a driver. A kernel that deadlocks cannot be interrupted from Python, so the cases run in a child process that
prints a line as each case begins and one (JSON) as it ends; the parent gives each case its own time limit, and on a
hang kills the child (its own), records the case as ``hang`` and starts a new child at the next case. Without hangs
all cases share one process (one JAX start-up, about 60 s for the list below on an H200).

The cases, simplest first (``--list``):

* ``micro/...``: one warpgroup, one key block, no pipeline: q rows -> tiled shared memory by the kernel's own
  ``load_q_rows``, S = q k^T by ``block_scores`` (wgmma, K transposed in shared memory), P = exp2 of the row-max
  shifted S, O = P v by ``block_accumulate`` (wgmma, P in registers). Errors of S and O are reported apart, so a
  wrong transposed-B matmul, a wrong register-A matmul or a wrong row reduction each show on their own.
* ``full/...``: the whole kernel (``paged_prefill_attention_mosaic``) against the jnp reference: one tile, then
  unmasked blocks, two consumers with and without turns, ragged batches, GQA, head_dim 64, other pages and blocks,
  last the cases refused by default (8-token pages).
* Cases marked ``expect=wrong`` check the diagnosis of the first run: q rows copied by TMA straight into tiled shared
  memory from a row that is not a multiple of 8 come back partly zero. They should FAIL; if they pass, that
  diagnosis is wrong and the 0.7 error has another cause.

Per full case: max abs error, how many query rows are wrong (|err| > tol + tol*|ref| anywhere in the row), the first
wrong rows, their row % 8, how many of them lie in a warpgroup whose first row is not a multiple of 8, and NaNs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import selectors
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

TOL = 2e-2
FIRST_CASE_S = 180.0  # JAX start-up + first compile
CASE_S = 60.0


@dataclasses.dataclass(frozen=True)
class Micro:
    name: str
    head_dim: int = 128
    block_k: int = 128
    row0: int = 0
    head: int = 0
    q_load: str = "direct"
    expect: str = "right"


@dataclasses.dataclass(frozen=True)
class Full:
    name: str
    n_new: tuple
    prior: tuple
    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 128
    page_size: int = 16
    block_q: int = 128
    block_k: int = 128
    turns: bool = True
    q_load: str = "auto"
    pad_rows: int = 5
    min_page_size: int | None = None  # lower the kernel's refusal (debug only)
    expect: str = "right"


CASES = [
    Micro("micro/qk+pv hd128 bk128, q row 0 (TMA into tile)"),
    Micro("micro/qk+pv hd128 bk64", block_k=64),
    Micro("micro/qk+pv hd64 bk128", head_dim=64),
    Micro("micro/q from row 5 by TMA into the tile (expect wrong)", row0=5, head=1, expect="wrong"),
    Micro("micro/q from row 5 staged", row0=5, head=1, q_load="staged"),
    Micro("micro/q from row 8 staged", row0=8, head=1, q_load="staged"),
    Full("full/one tile: 64 rows from pos 0, 1 wg, page 64 = block_k 64", (64,), (0,), page_size=64, block_q=64,
         block_k=64, turns=False),
    Full("full/64 rows at pos 128: 2 unmasked blocks + 1 masked", (64,), (128,), page_size=64, block_q=64, block_k=64,
         turns=False),
    Full("full/128 rows at pos 256, 2 consumers, no turns, page 16", (128,), (256,), turns=False),
    Full("full/same with turns", (128,), (256,)),
    Full("full/ragged, starts on multiples of 8, MHA 4 heads", (128, 64, 200), (0, 300, 17), num_heads=4,
         num_kv_heads=4),
    Full("full/ragged, starts off multiples of 8, q by TMA into tile (expect wrong)", (5, 100, 3, 60), (0, 40, 700, 9),
         num_heads=2, num_kv_heads=2, q_load="direct", expect="wrong"),
    Full("full/same starts, q auto (staged where misaligned)", (5, 100, 3, 60), (0, 40, 700, 9), num_heads=2,
         num_kv_heads=2),
    Full("full/same, no turns", (5, 100, 3, 60), (0, 40, 700, 9), num_heads=2, num_kv_heads=2, turns=False),
    Full("full/benchmark batch, llama3 GQA 32/8", (700, 1, 300), (0, 1500, 250), num_heads=32, num_kv_heads=8),
    Full("full/gpu-test batch, hd64 GQA 16/4", (700, 1, 0, 300, 129), (0, 900, 40, 250, 7), num_heads=16,
         num_kv_heads=4, head_dim=64, pad_rows=24),
    Full("full/block_q 64, GQA 8/2", (700, 1, 300), (0, 1500, 250), num_heads=8, num_kv_heads=2, block_q=64),
    Full("full/block_k 64, page 16 (4 stages)", (2048, 77), (0, 1000), num_heads=8, num_kv_heads=2, block_k=64,
         pad_rows=51),
    Full("full/page 128 > block_k 64", (2048, 77), (0, 1000), num_heads=8, num_kv_heads=2, page_size=128, block_k=64,
         pad_rows=51),
    Full("full/page 8, block_k 64 (refused by default; hung or timed out in the first run)", (2048, 77), (0, 1000),
         num_heads=8, num_kv_heads=2, page_size=8, block_k=64, pad_rows=51, min_page_size=8),
]


# ----------------------------------------------------------------------------------------------- the cases (child)

def run_micro(case: Micro, rng) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels import prefill_attention_mgpu as mk

    hd, bk, rows, wg = case.head_dim, case.block_k, 96, mk.WG_ROWS
    dtype = jnp.bfloat16
    q3 = jnp.asarray(rng.standard_normal((rows, 2, hd)), dtype)
    k = jnp.asarray(rng.standard_normal((bk, hd)), dtype)
    v = jnp.asarray(rng.standard_normal((bk, hd)), dtype)
    scale_log2 = hd**-0.5 * mk.LOG2E
    dims = dict(interpret=False, q_load=case.q_load)
    tiled = (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))

    def body(meta_ref, q_ref, k_ref, v_ref, s_ref, o_ref):
        def scoped(q_s, k_s, v_s, stage, s_st, bars):
            row0, head = meta_ref[0], meta_ref[1]
            plgpu.copy_gmem_to_smem(k_ref, k_s, bars.at[1])
            plgpu.copy_gmem_to_smem(v_ref, v_s, bars.at[2])
            mk.load_q_rows(q_ref.at[pl.ds(row0, wg), head], q_s, stage, bars.at[0], row0, dims)
            plgpu.barrier_wait(bars.at[1])
            scores = mk.block_scores(q_s, k_s, None, dims)
            s_st[...] = scores
            m = scores.max(axis=1) * scale_log2
            p = jnp.exp2(scores * scale_log2 - lax.broadcast_in_dim(m, scores.shape, [0]))
            denom = p.sum(axis=1)
            acc = plgpu.layout_cast(jnp.zeros((wg, hd), jnp.float32), plgpu.Layout.WGMMA)
            plgpu.barrier_wait(bars.at[2])
            acc = mk.block_accumulate(acc, p.astype(dtype), v_s, dims)
            stage[...] = (acc / lax.broadcast_in_dim(denom, acc.shape, [0])).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_st, s_ref)
            plgpu.copy_smem_to_gmem(stage, o_ref)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((wg, hd), dtype, transforms=tiled),
                      plgpu.SMEM((bk, hd), dtype, transforms=tiled), plgpu.SMEM((bk, hd), dtype, transforms=tiled),
                      plgpu.SMEM((wg, hd), dtype), plgpu.SMEM((wg, bk), jnp.float32), plgpu.Barrier(num_barriers=3))

    call = plgpu.kernel(body, out_type=(jax.ShapeDtypeStruct((wg, bk), jnp.float32),
                                        jax.ShapeDtypeStruct((wg, hd), dtype)),
                        compiler_params=plgpu.CompilerParams(approx_math=True))
    meta = jnp.asarray([case.row0, case.head], jnp.int32)
    s, o = jax.block_until_ready(jax.jit(call)(meta, q3, k, v))
    qf = np.asarray(q3, np.float32)[case.row0:case.row0 + wg, case.head]
    qf = np.pad(qf, ((0, wg - qf.shape[0]), (0, 0)))
    s_want = qf @ np.asarray(k, np.float32).T
    p = np.exp((s_want - s_want.max(axis=1, keepdims=True)) * hd**-0.5)
    o_want = (p / p.sum(axis=1, keepdims=True)) @ np.asarray(v, np.float32)
    s_err = np.abs(np.asarray(s) - s_want)
    o_err = np.abs(np.asarray(o, np.float32) - o_want)
    bad_rows = np.flatnonzero((s_err > 0.05 + 0.01 * np.abs(s_want)).any(axis=1))
    ok = s_err.max() < 0.05 + 0.01 * np.abs(s_want).max() and o_err.max() < TOL
    return dict(max_abs_err_scores=float(s_err.max()), max_abs_err_out=float(o_err.max()), ok=bool(ok),
                wrong_score_rows=len(bad_rows), first_wrong_rows=bad_rows[:8].tolist(),
                wrong_rows_mod8=sorted({int(r) % 8 for r in bad_rows}))


def _full_inputs(case: Full, rng):
    import jax.numpy as jnp
    import numpy as np

    n_new, prior = np.asarray(case.n_new), np.asarray(case.prior)
    lens = n_new + prior
    pages_each = -(-lens // case.page_size)
    max_pages = int(pages_each.max()) + 2
    num_pages = int(pages_each.sum()) * 2 + 8
    pool = rng.standard_normal((3, num_pages, 2 * case.num_kv_heads * case.page_size, case.head_dim))
    used = rng.permutation(num_pages)[: int(pages_each.sum())]
    table = rng.integers(-1, num_pages + 8, size=(len(lens), max_pages))  # junk past each sequence's pages
    start = 0
    for b, n in enumerate(pages_each):
        table[b, :n] = used[start:start + n]
        start += n
    junk = np.setdiff1d(np.arange(num_pages), used)
    pool[:, junk] *= 1e3  # pages no sequence owns: large, so a wrong page shows
    q_starts = np.concatenate([[0], np.cumsum(n_new)])
    num_rows = int(q_starts[-1]) + case.pad_rows
    q = rng.standard_normal((num_rows, case.num_heads, case.head_dim))
    return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(pool, jnp.bfloat16), jnp.int32(1),
            jnp.asarray(table, jnp.int32), jnp.asarray(q_starts, jnp.int32), jnp.asarray(lens, jnp.int32))


def run_full(case: Full, rng) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import prefill_attention_mgpu as mk
    from pallas_kernels.prefill_attention import paged_prefill_attention_reference, prefill_tile_map

    if case.min_page_size is not None:
        mk.MIN_PAGE_SIZE = case.min_page_size
    args = _full_inputs(case, rng)
    kw = dict(page_size=case.page_size, num_kv_heads=case.num_kv_heads, sm_scale=case.head_dim**-0.5)
    out = mk.paged_prefill_attention_mosaic(*args, **kw, block_q=case.block_q, block_k=case.block_k,
                                            schedule_barrier=case.turns, q_load=case.q_load)
    out = np.asarray(jax.block_until_ready(out), np.float32)
    q, pool = args[0], args[1]
    want = np.asarray(paged_prefill_attention_reference(q.astype(jnp.float32), pool.astype(jnp.float32), *args[2:],
                                                        **kw), np.float32)
    q_starts = np.asarray(args[4])
    real = int(q_starts[-1])
    err = np.abs(out - want)
    row_bad = (~(err <= TOL + TOL * np.abs(want))).reshape(out.shape[0], -1).any(axis=1)
    row_bad[real:] = (out[real:] != 0).reshape(out.shape[0] - real, -1).any(axis=1)  # padding rows must be zero
    bad = np.flatnonzero(row_bad)
    tiles = prefill_tile_map(q_starts, np.asarray(args[5]), out.shape[0], case.block_q)
    misaligned_wg = np.zeros(out.shape[0], bool)
    for _, row_start, row_end, _ in tiles:
        for w in range(case.block_q // mk.WG_ROWS):
            first = row_start + mk.WG_ROWS * w
            if first < row_end and first % mk.TILE_ROWS:
                misaligned_wg[first:min(first + mk.WG_ROWS, row_end)] = True
    return dict(max_abs_err=float(np.nan_to_num(err[:real], nan=np.inf).max(initial=0.0)), ok=bool(not len(bad)),
                wrong_rows=int(len(bad)), rows=int(out.shape[0]), first_wrong_rows=bad[:8].tolist(),
                wrong_rows_mod8=sorted({int(r) % 8 for r in bad}),
                wrong_rows_in_misaligned_wg=int(misaligned_wg[bad].sum()),
                rows_in_misaligned_wg=int(misaligned_wg.sum()), nans=int(np.isnan(out).sum()))


def child(indices: list[int]) -> None:
    import jax
    import numpy as np

    print(f"DEVICE {jax.devices()[0].device_kind} jax {jax.__version__}", flush=True)
    for i in indices:
        case = CASES[i]
        print(f"BEGIN {i}", flush=True)
        t0 = time.time()
        try:
            result = (run_micro if isinstance(case, Micro) else run_full)(case, np.random.default_rng(i))
        except Exception as exc:  # noqa: BLE001 - a case that cannot compile or run is a finding, not the end
            result = dict(ok=False, error=f"{type(exc).__name__}: {str(exc)[:600]}")
        result.update(index=i, case=case.name, expect=case.expect, seconds=round(time.time() - t0, 1))
        print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------- the driver (parent)

def drive(indices: list[int], case_s: float, first_s: float) -> tuple[list[dict], str]:
    """Run the cases in a child; a case past its limit is killed and recorded, and a new child takes the rest."""
    results, device, todo = [], "", list(indices)

    def lost(i: int, why: str) -> None:
        case = CASES[i]
        results.append(dict(index=i, case=case.name, expect=case.expect, ok=False, hang=why == "hang",
                            error="no result within its time limit (hang?)" if why == "hang" else why))
        print(_row(results[-1]), flush=True)

    while todo:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", ",".join(map(str, todo))],
                                stdout=subprocess.PIPE, bufsize=0)
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        current, deadline, pending, eof = None, time.monotonic() + first_s, b"", False
        while True:
            if b"\n" not in pending and not eof:  # own line buffer: select() cannot see Python-buffered lines
                if not sel.select(timeout=max(deadline - time.monotonic(), 0.0)):
                    proc.kill()  # the child this driver started: its kernel is stuck on the GPU
                    proc.wait()
                    if current is None:  # stuck before any case began (start-up)
                        for i in todo:
                            lost(i, "hang")
                        return results, device
                    lost(current, "hang")
                    todo = todo[todo.index(current) + 1:]
                    break
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                pending += chunk
                eof = not chunk
                continue
            if b"\n" not in pending:  # the child exited: a crash inside a case ends it
                rc = proc.wait()
                if current is not None and current in todo:
                    lost(current, f"child died with rc {rc} inside this case")
                    todo = todo[todo.index(current) + 1:]
                elif todo:  # died before a case began: nothing more will run
                    for i in todo:
                        lost(i, f"child died with rc {rc} before this case")
                    todo = []
                break
            raw, pending = pending.split(b"\n", 1)
            line = raw.decode(errors="replace")
            if line.startswith("DEVICE "):
                device = line[7:].strip()
            elif line.startswith("BEGIN "):
                current = int(line.split()[1])
                deadline = time.monotonic() + (case_s if results else first_s)
            elif line.startswith("RESULT "):
                result = json.loads(line[7:])
                results.append(result)
                todo.remove(result["index"])
                print(_row(result), flush=True)
    return results, device


def as_expected(r: dict) -> bool:
    if r["expect"] == "right":
        return bool(r["ok"])
    return not r["ok"] and "error" not in r  # wrong values, not a failure to compile or run


def _row(r: dict) -> str:
    verdict = "HANG" if r.get("hang") else ("ok" if r["ok"] else ("ERROR" if "error" in r else "WRONG"))
    if r["expect"] == "wrong":
        verdict += " (as expected)" if as_expected(r) else " (UNEXPECTED)"
    if "error" in r and not r.get("hang"):
        detail = r["error"]
    elif "max_abs_err_out" in r:
        detail = (f"err S {r['max_abs_err_scores']:.3g} O {r['max_abs_err_out']:.3g}, wrong S rows "
                  f"{r['wrong_score_rows']}/64 {r['first_wrong_rows']} mod8 {r['wrong_rows_mod8']}")
    elif "max_abs_err" in r:
        detail = (f"err {r['max_abs_err']:.3g}, wrong rows {r['wrong_rows']}/{r['rows']} first {r['first_wrong_rows']}"
                  f" mod8 {r['wrong_rows_mod8']}, in misaligned wg {r['wrong_rows_in_misaligned_wg']}"
                  f"/{r['rows_in_misaligned_wg']}, nans {r['nans']}")
    else:
        detail = r.get("error", "")
    return f"[{r['index']:2d}] {verdict:<34} {r.get('seconds', '-')!s:>5}s {r['case']}: {detail}"


def _indices(spec: str | None) -> list[int]:
    if not spec:
        return list(range(len(CASES)))
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", help="indices to run, e.g. 0,3-5 (default all)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--out", help="JSON report path")
    parser.add_argument("--case-seconds", type=float, default=CASE_S)
    parser.add_argument("--first-seconds", type=float, default=FIRST_CASE_S)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.child is not None:
        child(_indices(args.child))
        return
    if args.list:
        for i, case in enumerate(CASES):
            print(f"[{i:2d}] {case.name}")
        return
    t0 = time.time()
    results, device = drive(_indices(args.cases), args.case_seconds, args.first_seconds)
    summary = dict(device=device, seconds=round(time.time() - t0, 1), results=results,
                   as_expected=[r["index"] for r in results if as_expected(r)],
                   not_as_expected=[r["index"] for r in results if not as_expected(r)])
    print(f"\n{device}: {len(summary['as_expected'])} cases as expected, not: {summary['not_as_expected']} "
          f"({summary['seconds']} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
