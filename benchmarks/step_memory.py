"""What XLA plans to keep live in each compiled step: arguments, outputs, how much of them alias (the donated pool
updated in place) and temporaries. A pool copied inside the step (an alias XLA could not honour) shows as a
temporary of the pool's size; this is how the "hlo_rematerialization ... only reduced to 192GiB" warning of a 64 GiB
pool is checked against what the step really holds.

    PYTHONPATH=. python benchmarks/step_memory.py --preset llama-2-7b --pool-gb 16 [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--pool-gb", type=float, default=1.0)
    ap.add_argument("--backend", default="pallas")
    ap.add_argument("--layer-loop", default="auto", choices=["auto", "unroll", "scan"])
    ap.add_argument("--all-buckets", action="store_true", help="every bucket and decode variant, not just the largest")
    ap.add_argument("--execute", action="store_true",
                    help="also run each step once: was the pool donated, and the device's peak bytes in use")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="EngineConfig fields to override (JSON values), e.g. max_loras=128 min_decode_bucket=16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from serving import random_params

    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    from slora_jax.engine.step_runner import pack_inputs
    from slora_jax.model.config import ModelConfig
    from slora_jax.tools.synth import preset_config

    cfg = ModelConfig.from_dict(preset_config(args.preset))
    on_cpu = jax.default_backend() == "cpu"
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    ecfg = EngineConfig(max_batch_size=128, max_prefill_tokens=2048, max_prefill_seqs=16, max_model_len=1024,
                        page_size=16, max_lora_rank=16, max_loras=128, pool_bytes=int(args.pool_gb * 2**30),
                        dtype="float32" if on_cpu else "bfloat16", backend=args.backend,
                        layer_loop=args.layer_loop)
    ecfg = dataclasses.replace(ecfg, **{k: json.loads(v) for k, v in (a.split("=", 1) for a in args.set)})
    engine = Engine(cfg, random_params(cfg, dtype), ecfg)
    runner, pool, ecfg = engine.runner, engine.pool, engine.runner.ecfg  # the platform's buckets resolved
    rows = []
    jobs = [("prefill", ecfg.prefill_buckets[-1], None), ("decode", ecfg.decode_buckets[-1], "all")]
    if args.all_buckets:
        jobs = [("prefill", n, None) for n in ecfg.prefill_buckets]
        jobs += [("decode", n, v) for n in ecfg.decode_buckets for v in runner._decode]
    device = jax.devices()[0]
    for kind, n, variant in jobs:
        build = runner.build_prefill([], n_rows=n) if kind == "prefill" else runner.build_decode([], n=n)
        packed, layout = pack_inputs(*build)
        fn = runner.step_fn(kind, variant)
        compiled = fn.lower(layout, engine.params, pool.array, pool.table, packed, runner._no_prev,
                            runner.penalty_state).compile()
        m = compiled.memory_analysis()
        row = {"step": kind, "bucket": n, "pool_bytes": int(pool.array.nbytes),
               "argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
               "alias_bytes": int(m.alias_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes)}
        row["peak_estimate_bytes"] = (row["argument_bytes"] + row["output_bytes"] - row["alias_bytes"]
                                      + row["temp_bytes"])
        if args.execute:
            before = device.memory_stats() or {}
            pool_in = pool.array
            # through the jit function, as serving calls it (an AOT ``compiled`` call would skip jit's argument
            # handling, where an uncommitted pool once cost a second pool-sized buffer)
            out, runner.penalty_state, pool.array = fn(layout, engine.params, pool_in, pool.table, packed,
                                                       runner._no_prev, runner.penalty_state)
            out.tokens.block_until_ready()
            after = device.memory_stats() or {}
            row |= {"donated": pool_in.is_deleted(), "bytes_in_use_before": before.get("bytes_in_use", 0),
                    "bytes_in_use_after": after.get("bytes_in_use", 0), "peak_bytes_in_use": after.get(
                        "peak_bytes_in_use", 0)}
            print(f"  ran: pool donated {row['donated']}, in use {row['bytes_in_use_after'] / 2**30:.2f} GiB, "
                  f"peak {row['peak_bytes_in_use'] / 2**30:.2f} GiB", flush=True)
        rows.append(row)
        g = {k: v / 2**30 for k, v in row.items() if k.endswith("bytes")}
        print(f"{kind:8s} bucket {n:5d}: pool {g['pool_bytes']:7.2f} GiB  args {g['argument_bytes']:7.2f}  out "
              f"{g['output_bytes']:7.2f}  alias {g['alias_bytes']:7.2f}  temp {g['temp_bytes']:7.3f}  peak "
              f"{g['peak_estimate_bytes']:7.2f} GiB", flush=True)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "device": jax.devices()[0].device_kind,
              "jax_version": jax.__version__, "git_commit": git_commit(), "preset": args.preset, "steps": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
