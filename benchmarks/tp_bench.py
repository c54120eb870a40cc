"""Tensor parallelism on one host (issue 11): the link, the all-reduce, the decode step at TP1 vs TPN against its
floor, and the S-LoRA serving workload at TPN. Random weights are made on the devices, each its own shard.

    nvidia-smi topo -m                                                   # (every mode records it in its JSON)
    PYTHONPATH=. python benchmarks/tp_bench.py allreduce --tp 2 --out ar.json             # 16 KB .. 4 MB, bf16
    PYTHONPATH=. python benchmarks/tp_bench.py step --preset llama-2-13b --tp 1,2 --out step13.json
    PYTHONPATH=. python benchmarks/tp_bench.py step --preset llama-2-70b --tp 2 --out step70.json
    PYTHONPATH=. python benchmarks/tp_bench.py serving --preset llama-2-13b --tp 2 --out serve13.json
    XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. python benchmarks/tp_bench.py step --tiny --tp 1,2

``step``: one decode step of ``--batch`` sequences (each ``--context`` tokens of KV, its own rank ``--rank`` q,k,v,o
adapter), steps queued back to back as the engine does; the floor is the bytes one device reads (its weight shards
except the embedding, its KV heads' share of the context, its share of each adapter) over the copy bandwidth measured
by torch, plus the step's all-reduces at their measured time. ``--tp 1,2`` runs each size in its own process.
``serving``: S1 (rank 8) and S2 (ranks 64/32/16/8) on q,k,v,o at n = 5 and 1000 adapters, saturation traces
(serving.py's run_trace and workload.make_trace), with the same per-device floor per decode step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import zlib

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from common import device_ceilings, git_commit  # noqa: E402

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
AR_SIZES = [16 << 10 << i for i in range(9)]  # 16 KB .. 4 MB


def topology() -> str:
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except Exception as exc:  # noqa: BLE001
        return f"unavailable: {exc!r}"


def allreduce_us(tp_size: int, sizes=AR_SIZES, reps: int = 50) -> dict[int, float]:
    """Median microseconds of one bf16 all-reduce of each size over ``tp_size`` devices: ``reps`` chained psums in
    one jitted loop (the loop's own cost, measured with the psum left out, subtracted)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()[:tp_size]), ("tp",))
    out = {}
    for size in sizes:
        n = size // 2

        def loop(x, reduce):
            def body(_, x):
                return (jax.lax.psum(x, "tp") if reduce else x + 1) * 0.5
            return jax.lax.fori_loop(0, reps, body, x)

        timings = {}
        for reduce in (True, False):
            fn = jax.jit(jax.shard_map(lambda x, reduce=reduce: loop(x, reduce), mesh=mesh, in_specs=P("tp"),
                                       out_specs=P("tp"), check_vma=False))
            x = jnp.ones((tp_size * n,), jnp.bfloat16)
            fn(x).block_until_ready()
            runs = []
            for _ in range(7):
                t = time.perf_counter()
                fn(x).block_until_ready()
                runs.append(time.perf_counter() - t)
            timings[reduce] = float(np.median(runs))
        out[size] = max(timings[True] - timings[False], 0.0) / reps * 1e6
    return out


def random_params_on_devices(cfg, dtype, tp, stacked: bool = False, seed: int = 0):
    """Random params in the serving layout, each device generating only its shard (partitionable threefry)."""
    import jax
    import jax.numpy as jnp

    from slora_jax.model.streaming_loader import param_shapes

    jax.config.update("jax_threefry_partitionable", True)
    shapes = param_shapes(cfg, dtype, tp, stacked)
    paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(paths))
    made = []
    for key, (path, s) in zip(keys, paths, strict=True):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            made.append(jnp.ones(s.shape, s.dtype, device=s.sharding))
            continue
        scale = 1.0 if "embed" in name else 1.0 / float(s.shape[-2]) ** 0.5
        make = jax.jit(lambda k, shape=s.shape, dt=s.dtype, sc=scale: jax.random.normal(k, shape, dt) * sc,
                       out_shardings=s.sharding)
        made.append(make(key).block_until_ready())
    return jax.tree.unflatten(treedef, made)


def device_bytes(params, device) -> int:
    import jax

    return sum(sh.data.nbytes for leaf in jax.tree.leaves(params) for sh in leaf.addressable_shards
               if sh.device == device)


def decode_floor_s(engine, weights: int, bw_gbps: float, ar_us: dict, batch: int, ctx_tokens: int,
                   adapter_ranks: float) -> tuple[float, dict]:
    """(seconds, parts) one device needs at least for a decode step: its weight shards, its KV heads' share of
    ``ctx_tokens``, its share of adapters totalling ``adapter_ranks`` (sum over the batch's distinct adapters of
    their rank) of q,k,v,o, over ``bw_gbps``; plus 2 all-reduces per layer of [batch, hidden] at the measured time
    of the nearest size in ``ar_us``."""
    cfg, pool, n = engine.cfg, engine.pool, engine.ecfg.tensor_parallel_size
    kv = ctx_tokens * pool.kv_token_bytes // n
    per_rank = sum(int(pool.vectors_per_rank[i]) for i in range(4)) * cfg.head_dim * pool.dtype.itemsize
    adapters = adapter_ranks * cfg.num_hidden_layers * per_rank
    size = batch * cfg.hidden_size * pool.dtype.itemsize
    near = min(ar_us, key=lambda k: abs(k - size)) if ar_us else None
    collectives = 2 * cfg.num_hidden_layers * (ar_us[near] if near is not None else 0.0) * 1e-6
    parts = dict(weight_bytes_per_device=weights, kv_bytes_per_device=kv, adapter_bytes_per_device=adapters,
                 allreduce_ms_per_step=collectives * 1e3)
    return (weights + kv + adapters) / (bw_gbps * 1e9) + collectives, parts


def build_engine(args, tp_size: int, num_pages: int | None = None):
    import jax.numpy as jnp

    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    from slora_jax.model.config import ModelConfig
    from slora_jax.model.sharding import TensorParallel
    from slora_jax.tools.synth import preset_config

    cfg = ModelConfig.from_dict(preset_config("tiny" if args.tiny else args.preset))
    tp = TensorParallel.maybe(cfg, tp_size, args.fully_sharded_loras)
    if args.tiny:
        ecfg = EngineConfig(max_batch_size=max(args.batch), max_prefill_tokens=512, max_prefill_seqs=8,
                            max_model_len=512, page_size=16, max_lora_rank=64, max_loras=max(args.adapters, 8),
                            num_pages=num_pages or 1024, dtype="float32", backend="reference",
                            min_prefill_bucket=64, layer_loop="unroll")
        dtype = jnp.float32
    else:
        ecfg = EngineConfig(max_batch_size=max(args.batch), max_prefill_tokens=args.max_prefill_tokens,
                            max_prefill_seqs=16, max_model_len=1024, page_size=16, max_lora_rank=64,
                            max_loras=max(args.adapters, 128), pool_bytes=int(args.pool_gb * 2**30),
                            dtype="bfloat16", backend="pallas", min_prefill_bucket=256, min_decode_bucket=16,
                            host_budget_bytes=64 << 30, layer_loop="unroll",
                            decode_lora_variants=not args.no_lora_variants)
        dtype = jnp.bfloat16
    import dataclasses

    ecfg = dataclasses.replace(ecfg, tensor_parallel_size=tp_size, fully_sharded_loras=args.fully_sharded_loras)
    params = random_params_on_devices(cfg, dtype, tp, stacked=False)
    weights = device_bytes(params, params["lm_head"].addressable_shards[0].device)
    weights -= params["embed"].addressable_shards[0].data.nbytes  # the embedding is gathered, not read
    engine = Engine(cfg, params, ecfg)
    return engine, weights


def run_step(args, tp_size: int) -> dict:
    import jax

    from slora_jax.engine import compile_counter
    from slora_jax.engine.step_runner import StepItem
    from slora_jax.lora.synthetic import SyntheticAdapterSource

    engine, weights = build_engine(args, tp_size)
    cfg, pool, runner = engine.cfg, engine.pool, engine.runner
    for i in range(args.adapters):
        src = SyntheticAdapterSource(cfg, args.rank, ATTN, seed=zlib.crc32(f"a{i}".encode()))
        pool.load_adapter(f"a{i}", pool.shard_rows(src.load_rows(f"a{i}", cfg, args.rank, pool.dtype)))
    bw = float("nan") if args.tiny else device_ceilings().get("copy_gbps", float("nan"))
    page = pool.page_size
    ar = allreduce_us(tp_size, sizes=sorted({b * cfg.hidden_size * pool.dtype.itemsize for b in args.batch})) \
        if tp_size > 1 else {}
    rows = []
    for batch in args.batch:
        items = []
        for b in range(batch):
            pages = pool.alloc_kv_pages(-(-args.context // page))
            items.append(StepItem([1], args.context - 1, pages, pool.slot_of(f"a{b % args.adapters}"), None, 0, 0))
        tokens, pool.array = runner.decode(engine.params, pool.array, pool.table, items, lora="attn")
        tokens.block_until_ready()  # compiled
        compiles = compile_counter.compile_count()
        t = time.perf_counter()
        for _ in range(args.steps):  # queued back to back: the host builds step k+1 while the device runs step k
            tokens, pool.array = runner.decode(engine.params, pool.array, pool.table, items, lora="attn")
        tokens.block_until_ready()
        step_s = (time.perf_counter() - t) / args.steps
        for it in items:
            pool.free_kv_pages(it.pages)
        floor_s, parts = decode_floor_s(engine, weights, bw, ar, batch, batch * args.context,
                                        min(batch, args.adapters) * args.rank)
        rows.append(dict(tp=tp_size, batch=batch, context=args.context, step_ms=step_s * 1e3,
                         floor_ms=floor_s * 1e3, over_floor=step_s / floor_s, **parts,
                         compiles_while_timed=compile_counter.compile_count() - compiles))
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    return {"copy_gbps": bw, "allreduce_us": ar, "rows": rows, "device": jax.devices()[0].device_kind}


def run_serving(args, tp_size: int) -> dict:
    import numpy as np
    from serving import run_trace
    from workload import make_trace

    from slora_jax.lora.synthetic import SyntheticAdapterSource

    engine, weights = build_engine(args, tp_size)
    cfg, pool = engine.cfg, engine.pool
    t = time.monotonic()
    engine.warmup(progress=True)
    warm = time.monotonic() - t
    bw = float("nan") if args.tiny else device_ceilings().get("copy_gbps", float("nan"))
    ar = allreduce_us(tp_size, sizes=[b * cfg.hidden_size * pool.dtype.itemsize for b in (16, 32, 64, 128, 256)]) \
        if tp_size > 1 else {}
    in_range, n_req = ((8, 64), 24) if args.tiny else ((8, 512), args.requests)
    budget_end = time.monotonic() + args.budget_s
    results = []
    for setting, ranks in (("S1", [8]), ("S2", [64, 32, 16, 8])):
        for n in args.ns:
            name = f"{setting}-qkvo-n{n}-tp{tp_size}"
            names = [f"{name}-{i}" for i in range(n)]
            for i, an in enumerate(names):
                engine.store.register(an, SyntheticAdapterSource(cfg, ranks[i % len(ranks)], ATTN,
                                                                 seed=zlib.crc32(an.encode())))
            trace = make_trace(n, 1000.0, n_req, alpha=1.0, cv=1.0, in_range=in_range, out_range=in_range, seed=0)
            res, steps = run_trace(engine, name, trace, names, cfg.vocab_size, budget_end)
            dec = [s for s in steps if s["kind"] == "decode" and s["batch"] >= (4 if args.tiny else 64)]
            if dec:
                mean_rank = float(np.mean(ranks))
                floors = [decode_floor_s(engine, weights, bw, ar, st["batch"], st["ctx"],
                                         st["adapters"] * mean_rank)[0] for st in dec]
                res["decode_step_ms_median"] = float(np.median([st["t"] for st in dec]) * 1e3)
                res["decode_floor_ms_median"] = float(np.median(floors) * 1e3)
                res["decode_over_floor"] = float(np.median([st["t"] / f for st, f in zip(dec, floors, strict=True)]))
            res.update(setting=setting, n_adapters=n, tp=tp_size)
            results.append(res)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
    return {"copy_gbps": bw, "allreduce_us": ar, "warmup_s": warm, "results": results,
            "compiles_after_warmup": engine.compiles_since_warmup()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["allreduce", "step", "serving"])
    ap.add_argument("--tp", default="2", help="comma list of tensor-parallel sizes (each in its own process)")
    ap.add_argument("--preset", default="llama-2-13b", help="configs/NAME.json (random weights of its shapes)")
    ap.add_argument("--tiny", action="store_true", help="the tiny model on CPU (set XLA_FLAGS for host devices)")
    ap.add_argument("--fully-sharded-loras", action="store_true")
    ap.add_argument("--batch", default="1,16,64", help="step: decode batch sizes (serving: the largest is the "
                    "engine's max batch)")
    ap.add_argument("--context", type=int, default=512, help="step: KV tokens per sequence")
    ap.add_argument("--rank", type=int, default=8, help="step: adapter rank (q,k,v,o)")
    ap.add_argument("--adapters", type=int, default=128, help="step: distinct adapters (row b uses b % N)")
    ap.add_argument("--steps", type=int, default=30, help="step: timed steps per batch size")
    ap.add_argument("--pool-gb", type=float, default=40.0, help="pool per device")
    ap.add_argument("--max-prefill-tokens", type=int, default=2048,
                    help="largest prefill bucket (fewer buckets: a shorter warm-up for 70B)")
    ap.add_argument("--no-lora-variants", action="store_true",
                    help="compile one decode variant per bucket instead of three (shorter warm-up)")
    ap.add_argument("--ns", default="5,1000", help="serving: adapter counts")
    ap.add_argument("--requests", type=int, default=256, help="serving: requests per saturation trace")
    ap.add_argument("--budget-s", type=float, default=1500.0, help="serving: stop starting traces after this")
    ap.add_argument("--compilation-cache-dir", default=os.path.join(os.environ.get(
        "SLORA_JAX_CACHE_DIR", os.path.expanduser("~/.cache/slora_jax")), "xla"),
        help="JAX's persistent compilation cache: a second run (or the other TP size) skips its compiles; '' = off")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(x) for x in args.tp.split(",")]
    args.batch = [int(x) for x in args.batch.split(",")]
    args.ns = [int(x) for x in args.ns.split(",")]
    if len(sizes) > 1:  # one process per size: each starts with all device memory free
        runs = []
        for size in sizes:
            stem = (args.out or "tp_bench.json").removesuffix(".json")
            out = f"{stem}.tp{size}.json"
            argv = [a for a in sys.argv[1:]]
            i = argv.index("--tp")
            argv[i + 1] = str(size)
            if "--out" in argv:
                argv[argv.index("--out") + 1] = out
            else:
                argv += ["--out", out]
            subprocess.run([sys.executable, __file__, *argv], check=True)
            with open(out) as f:
                runs.append(json.load(f))
        report = {"runs": runs}
        step_rows = {(r["tp"], r["batch"]): r["step_ms"] for run in runs for r in run.get("rows", [])}
        report["tp_over_tp1"] = {f"tp{t}-b{b}": ms / step_rows[(1, b)] for (t, b), ms in step_rows.items()
                                 if t != 1 and (1, b) in step_rows}
        print(json.dumps(report["tp_over_tp1"], indent=1))
    else:
        import jax

        from slora_jax.engine import compile_counter

        if args.compilation_cache_dir:
            compile_counter.enable_persistent_cache(args.compilation_cache_dir)
        size = sizes[0]
        report = {"mode": args.mode, "tp": size, "preset": "tiny" if args.tiny else args.preset,
                  "fully_sharded_loras": args.fully_sharded_loras, "topology": topology(),
                  "date": datetime.datetime.now(datetime.UTC).isoformat(), "jax_version": jax.__version__,
                  "git_commit": git_commit(), "devices": [d.device_kind for d in jax.devices()]}
        if args.mode == "allreduce":
            report["allreduce_us"] = allreduce_us(size)
            report["bus_gbps"] = {s: 2 * (size - 1) / size * s / (us * 1e-6) / 1e9 if us else None
                                  for s, us in report["allreduce_us"].items()}
            print(json.dumps(report["allreduce_us"], indent=1))
        elif args.mode == "step":
            report |= run_step(args, size)
        else:
            report |= run_serving(args, size)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
