"""How exact is a bf16 GEMM whose dot returns bf16 (``Linear(narrow_out=True)``) against one that returns float32 and
is rounded after? On the GPU XLA may split a small-batch GEMM's contraction (split-K) and sum the partial products in
the dot's output type, so a bf16 output could round more than once.

    PYTHONPATH=.:benchmarks python benchmarks/gemm_out_precision.py --out gemm_out.json   # H200: < 1 minute
    PYTHONPATH=.:benchmarks python benchmarks/gemm_out_precision.py --shapes 8:64:32 # CPU smoke run

For each (rows, d_in, d_out) of Llama-2-7B's projections at decode and prefill batch sizes: random bf16 x and W
(fresh per trial), the exact product (float64 on the host), and both routes' errors in units of the result's bf16
ulp (``|out - exact| / ulp(exact)``; one rounding of the exact product is <= 0.5). Reported: the largest error and
the share of entries off by more than one ulp, per route, and the largest error in the ulp of the row's RMS (entries
near zero by cancellation have ulps far below the float32 sum's error). A route that rounds once shows a per-entry
max near 0.5, a share near 0, and a row-RMS max of ~2 (entries a few times the RMS carry larger ulps of their own).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

from common import git_commit

# (rows, d_in, d_out): q,k,v fused, o, gate,up fused, down; decode batches 1-256, prefill 512 and 2048
SEVEN_B = [(m, 4096, 12288) for m in (1, 16, 64, 256)] + [(m, 4096, 4096) for m in (1, 16, 64, 256, 512, 2048)] + \
    [(m, 4096, 22016) for m in (64, 256)] + [(m, 11008, 4096) for m in (1, 16, 64, 256, 512, 2048)]


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in part.split(":")) for part in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help="rows:d_in:d_out,... (default: Llama-2-7B's projections)")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    shapes = parse_shapes(args.shapes) if args.shapes else SEVEN_B
    narrow = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16))
    wide = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    rng = np.random.default_rng()
    rows = []
    print(f"{'rows':>5} {'d_in':>6} {'d_out':>6} | {'f32 out max ulp':>15} {'>1 ulp':>8} {'rms ulp':>7} | "
          f"{'bf16 out max ulp':>16} {'>1 ulp':>8} {'rms ulp':>7}")
    for m, k, n in shapes:
        row = {"rows": m, "d_in": k, "d_out": n}
        stats = {"f32_out": [0.0, 0.0, 0.0], "bf16_out": [0.0, 0.0, 0.0]}  # max ulp, share over 1 ulp, max row ulp
        for _ in range(args.trials):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            w = jnp.asarray(rng.standard_normal((k, n)) * k ** -0.5, jnp.bfloat16)
            exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
            # ulp of bf16 at |exact|: 2^(floor(log2|e|) - 7); values near 0 measured at 2^-20
            ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 2.0 ** -20))) - 7)
            # entries near zero (cancellation) have tiny ulps of their own: also measure in the ulp of the row's RMS
            row_ulp = 2.0 ** (np.floor(np.log2(np.sqrt(np.mean(exact ** 2, axis=1, keepdims=True)))) - 7)
            for name, fn in (("f32_out", wide), ("bf16_out", narrow)):
                diff = np.abs(np.asarray(fn(x, w), np.float64) - exact)
                err = diff / ulp
                st = stats[name]
                st[0], st[1] = max(st[0], float(err.max())), max(st[1], float((err > 1.0).mean()))
                st[2] = max(st[2], float((diff / row_ulp).max()))
        for name, (worst, share, row_worst) in stats.items():
            row[name] = {"max_ulp": round(worst, 3), "share_over_1_ulp": share, "max_row_rms_ulp": round(row_worst, 3)}
        rows.append(row)
        f, b = row["f32_out"], row["bf16_out"]
        print(f"{m:>5} {k:>6} {n:>6} | {f['max_ulp']:>15.3f} {f['share_over_1_ulp']:>8.2e} "
              f"{f['max_row_rms_ulp']:>7.3f} | {b['max_ulp']:>16.3f} {b['share_over_1_ulp']:>8.2e} "
              f"{b['max_row_rms_ulp']:>7.3f}")
    if args.out:
        dev = jax.devices()[0]
        with open(args.out, "w") as fh:
            json.dump({"date": datetime.date.today().isoformat(), "device": dev.device_kind, "platform": dev.platform,
                       "jax_version": jax.__version__, "git_commit": git_commit(),
                       "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
