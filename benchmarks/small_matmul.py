"""The decode projections' GEMMs at few rows: XLA's against ``pallas_kernels.small_matmul``, per plan, on the device.

    PYTHONPATH=.:benchmarks python benchmarks/small_matmul.py --out sm.json     # H200: ~2-3 min
    PYTHONPATH=.:benchmarks python benchmarks/small_matmul.py --tiny            # CPU smoke run (interpret mode)

For Llama-2-7B's o (4096 -> 4096), down (11008 -> 4096), q,k,v (4096 -> 12288) and gate,up (4096 -> 22016) at M
rows: first every Pallas plan is checked against the jnp reference (fresh random inputs), then timed as the step
uses it. o and down add the residual (XLA: float32 dot + add + convert, as ``Linear`` at decode); q,k,v and
gate,up return bf16. Each timed call cycles through enough copies of W to overflow the 50 MB L2, as in a step,
where 31 other layers' weights pass between two uses of one. Device time comes from a profiler trace (every kernel
of the call, the split-K reduction included). The floor is W's bytes over torch's copy bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json

from common import device_ceilings, git_commit

SHAPES = {"o": (4096, 4096, True), "down": (11008, 4096, True), "qkv": (4096, 12288, False),
          "gate_up": (4096, 22016, False)}
TINY_SHAPES = {"o": (256, 128, True), "down": (384, 128, True)}


def plans(k: int, n: int, tiny: bool):
    """Candidate plans that tile [K, N] exactly, with 128-1024 programs (1-8 per SM)."""
    from pallas_kernels.small_matmul import SmallMatmulPlan, plan_fits

    if tiny:
        return [SmallMatmulPlan(32, 64, 2), SmallMatmulPlan(64, 128, 1)]
    out = []
    for bn, bk, sp in itertools.product((16, 32, 64, 128), (64, 128, 256), (1, 2, 4, 8)):
        p = SmallMatmulPlan(bn, bk, sp, 4, 4)
        if plan_fits(p, k, n) and 128 <= (n // bn) * sp <= 1024 and bk * bn <= 256 * 64:
            out.append(p)
    return out


def device_us(fn, *args) -> float:
    """Device microseconds of one call of ``fn`` (every kernel it runs), from ``decode_profile.kernel_profile``."""
    from decode_profile import kernel_profile

    prof = kernel_profile(lambda: fn(*args)[-1], calls=3)  # the outputs of one call are ready together
    return sum(prof["device_us_per_step"].values()) if prof["kernels_per_step"] else float("nan")


def xla_matmul(x, w, r):
    """The step's own form: bf16 out for q,k,v and gate,up; float32 dot + residual + convert for o and down."""
    import jax.numpy as jnp

    if r is None:
        return jnp.dot(x, w, preferred_element_type=jnp.bfloat16)
    return (r + jnp.dot(x, w, preferred_element_type=jnp.float32)).astype(x.dtype)


class ShapeBench:
    """One projection's weight copies (enough to overflow L2) and the rows measured against them."""

    def __init__(self, name: str, k: int, n: int, residual: bool, bw_gbps: float, tiny: bool, rng, results: list):
        import jax.numpy as jnp

        self.name, self.k, self.n, self.residual, self.rng, self.results = name, k, n, residual, rng, results
        w_bytes = k * n * 2
        self.copies = 1 if tiny else max(2, -(-200 * 2**20 // w_bytes))
        self.ws = [jnp.asarray(rng.normal(size=(k, n)) * 0.02, jnp.bfloat16) for _ in range(self.copies)]
        self.floor_us = w_bytes / (bw_gbps * 1e3) if bw_gbps == bw_gbps else float("nan")

    def measure(self, label: str, one, m: int, plan=None) -> dict:
        """Check ``one`` (x, w, r) -> [m, n] against the reference, then time it cycling through the copies."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from pallas_kernels.small_matmul import small_matmul_reference

        x = jnp.asarray(self.rng.normal(size=(m, self.k)), jnp.bfloat16)
        r = jnp.asarray(self.rng.normal(size=(m, self.n)), jnp.bfloat16) if self.residual else None
        got = np.asarray(one(x, self.ws[0], r), np.float32)
        want = np.asarray(small_matmul_reference(x, self.ws[0], r), np.float32)
        err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
        cycle = jax.jit(lambda x, r, *ws: [one(x, w, r) for w in ws])
        us = device_us(cycle, x, r, *self.ws) / self.copies
        row = dict(shape=self.name, k=self.k, n=self.n, rows=m, impl=label, plan=plan, us=round(us, 2),
                   floor_us=round(self.floor_us, 2), of_bw=round(self.floor_us / us, 3) if us == us else None,
                   rel_err=err)
        if err > 2e-2:
            row["error"] = f"rel_err {err:.3g}"
        self.results.append(row)
        return row

    def sweep(self, m: int, cands) -> tuple[dict, dict | None]:
        """XLA's time and the fastest correct plan of ``cands`` at ``m`` rows."""
        from pallas_kernels.small_matmul import small_matmul

        base, best = self.measure("xla", xla_matmul, m), None
        for p in cands:
            try:
                row = self.measure("pallas", functools.partial(small_matmul, plan=p), m, plan=list(p))
            except Exception as exc:  # noqa: BLE001 - a plan Triton cannot compile is a result too
                self.results.append(dict(shape=self.name, rows=m, impl="pallas", plan=list(p), error=repr(exc)[:200]))
                continue
            if "error" not in row and (best is None or not row["us"] >= best["us"]):  # NaN (CPU, no trace): last
                best = row
        return base, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rows", default="1", help="M values of the full sweep")
    ap.add_argument("--more-rows", default="4,16,32,64", help="M values for XLA and the best plans only")
    ap.add_argument("--top", type=int, default=4, help="plans of the full sweep timed at --more-rows")
    ap.add_argument("--shapes", default="o,down,qkv,gate_up")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ceil = {} if args.tiny else device_ceilings()  # before JAX takes the GPU
    import jax
    import numpy as np

    bw = ceil.get("copy_gbps", float("nan"))
    shapes = TINY_SHAPES if args.tiny else SHAPES
    rng = np.random.default_rng(0)
    rows_full = [int(v) for v in args.rows.split(",")]
    rows_more = [int(v) for v in args.more_rows.split(",") if v]
    results: list[dict] = []
    for name in args.shapes.split(","):
        if name not in shapes:
            continue
        bench = ShapeBench(name, *shapes[name], bw, args.tiny, rng, results)
        for m in rows_full + rows_more:
            cands = plans(bench.k, bench.n, args.tiny) if m in rows_full else \
                best_plans(results, name, rows_full, args.top)
            base, best = bench.sweep(m, cands)
            b = f"best pallas {best['us']:.1f} us ({pct(best)}) {best['plan']}" if best else "no pallas plan"
            print(f"{name:8s} M={m:3d}: floor {bench.floor_us:6.1f} us  xla {base['us']:6.1f} us ({pct(base)})  {b}",
                  flush=True)

    out = dict(date=datetime.datetime.now(datetime.UTC).isoformat(), device=jax.devices()[0].device_kind,
               jax=jax.__version__, commit=git_commit(), copy_gbps=bw, results=results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def pct(row: dict) -> str:
    return f"{row['of_bw']:.0%}" if row.get("of_bw") is not None else "-"


def best_plans(results: list[dict], shape: str, rows_full: list[int], top: int) -> list:
    """The ``top`` fastest correct plans of ``shape`` over the full sweep's rows only (by their summed time), so
    every further row count times the same plans."""
    from pallas_kernels.small_matmul import SmallMatmulPlan

    tot: dict[tuple, float] = {}
    for r in results:
        if r["shape"] == shape and r["impl"] == "pallas" and r["rows"] in rows_full and "error" not in r:
            tot[tuple(r["plan"])] = tot.get(tuple(r["plan"]), 0.0) + r["us"]
    return [SmallMatmulPlan(*p) for p, _ in sorted(tot.items(), key=lambda kv: kv[1])[:top]]


if __name__ == "__main__":
    main()
