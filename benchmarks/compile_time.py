"""Where a step compile's time goes, and which XLA flags shorten it without slowing the step: for a few buckets of
the server's default engine (7B shapes, the pool sized from the free memory as the server does), time tracing,
lowering to MLIR and the XLA compile, read the compiled memory plan, run the step a few times; once per flag set,
each in its own process (XLA_FLAGS is read when the backend starts). The baseline process also logs XLA's per-pass
times (TF_CPP_VMODULE=hlo_pass_pipeline=1). With ``--warmup`` two more processes time the whole warm-up as the server
runs it (compiled ahead on threads, persistent cache on): cold, then again from the cache (a restart).

    PYTHONPATH=. python benchmarks/compile_time.py --preset llama-2-7b --out results.json
    PYTHONPATH=. python benchmarks/compile_time.py --preset tiny --variants baseline --buckets prefill:32 --warmup
    PYTHONPATH=. python benchmarks/compile_time.py --preset tiny --engine suite --buckets prefill:64,decode:8:all \
        --variants suite,suite-no-triton-gemm,suite-cheap-llvm        # the GPU suite's step compiles

A flag this XLA does not know ends its process with an error; the report keeps its return code and log tail.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit  # noqa: E402

VARIANTS = {  # name -> XLA flags added to the environment's
    "baseline": "",
    "no-remat": "--xla_disable_hlo_passes=rematerialization",
    "slop-400": "--xla_gpu_memory_limit_slop_factor=400",
    "no-lhs": "--xla_gpu_enable_latency_hiding_scheduler=false",
    "autotune-0": "--xla_gpu_autotune_level=0",
    # the GPU suite's setting, then without XLA's Triton GEMM fusions (dots to cuBLAS: no Triton kernel compiled per
    # dot) and with LLVM's expensive passes off: which shortens a tiny test engine's step compile (session 12)
    "suite": "--xla_gpu_autotune_level=0",
    "suite-no-triton-gemm": "--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false",
    "suite-cheap-llvm": "--xla_gpu_autotune_level=0 --xla_llvm_disable_expensive_passes=true",
}
DEFAULT_BUCKETS = "prefill:2048,decode:256:all,decode:16:attn"
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "to_mlir_s",
          "/jax/core/compile/backend_compile_duration": "xla_compile_s"}
PASS_LINE = re.compile(r"HLO pass:? (?P<name>.+?) time: .*?\((?P<us>\d+) us\)")


def engine_for(preset: str, kind: str = "server"):
    """``server``: the server's defaults on this platform (batch up to 256 on a GPU, as the pool holds, decode LoRA
    variants, pool from free memory). ``suite``: an engine as the test suite builds them
    (tests/test_prefix_cache.py's: float32, reference LoRA path, batch 8, 96 pages of 4 tokens, matmuls at full
    precision as tests/conftest.py asks on a GPU)."""
    import jax
    import jax.numpy as jnp
    from serving import random_params

    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    from slora_jax.model.config import ModelConfig
    from slora_jax.serve.cli import GPU_BATCH_BOUND
    from slora_jax.tools.synth import preset_config

    cfg = ModelConfig.from_dict(preset_config(preset))
    if kind == "suite":
        jax.config.update("jax_default_matmul_precision", "highest")
        ecfg = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=2, max_model_len=64,
                            page_size=4, max_lora_rank=32, max_loras=3, num_pages=96, dtype="float32",
                            backend="reference", decode_lora_variants=False)
        return Engine(cfg, random_params(cfg, jnp.float32), ecfg)
    on_gpu = jax.default_backend() == "gpu"
    max_len = min(cfg.max_position_embeddings, 2048)
    ecfg = EngineConfig(max_batch_size=GPU_BATCH_BOUND if on_gpu else 8, batch_from_pool=on_gpu,
                        max_model_len=max_len, max_prefill_tokens=max_len, page_size=16, max_lora_rank=64,
                        max_loras=64, dtype="bfloat16" if on_gpu else "float32",
                        backend="pallas" if on_gpu else "reference", decode_lora_variants=on_gpu,
                        num_pages=None if on_gpu else 64)
    return Engine(cfg, random_params(cfg, jnp.bfloat16 if on_gpu else jnp.float32), ecfg)


def child(args) -> dict:
    """One process: compile the buckets (or the whole warm-up) under this process's XLA_FLAGS."""
    import jax

    from slora_jax.engine import compile_counter
    from slora_jax.engine.step_runner import pack_inputs

    if args.child == "warmup":
        compile_counter.enable_persistent_cache(args.cache_dir)
    phases: dict[str, float] = {}
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: phases.__setitem__(EVENTS[event], phases.get(EVENTS[event], 0.0) + secs)
        if event in EVENTS else None)
    t = time.monotonic()
    engine = engine_for(args.preset, args.engine)
    runner, pool = engine.runner, engine.pool
    out = {"setup_s": time.monotonic() - t, "pool_gib": pool.array.nbytes / 2**30, "steps": []}
    if args.child == "warmup":  # as the server starts: the persistent cache on, compile threads by its rule
        compile_counter.install()
        out["compile_workers"] = compile_counter.compile_workers()
        t = time.monotonic()
        pool.array = runner.warmup(engine.params, pool.array, pool.table, progress=False)
        out.update(warmup_s=time.monotonic() - t, **runner.warmup_stats)
        return out
    for spec in args.buckets.split(","):
        kind, n, *variant = spec.split(":")
        build = runner.build_prefill([], n_rows=int(n)) if kind == "prefill" else runner.build_decode([], n=int(n))
        packed, layout = pack_inputs(*build)
        fn = runner.step_fn(kind, variant[0] if variant else "all")
        phases.clear()
        t = time.monotonic()
        lowered = fn.lower(layout, engine.params, pool.array, pool.table, packed, runner._no_prev,
                           runner.penalty_state)
        lower_s = time.monotonic() - t
        t = time.monotonic()
        compiled = lowered.compile()
        row = {"step": spec, "lower_s": lower_s, "compile_s": time.monotonic() - t, **phases}
        m = compiled.memory_analysis()
        if m is not None:
            row.update(temp_bytes=int(m.temp_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes))
        times = []
        for _ in range(args.runs):  # through the jit call, as serving runs it (compiled above: no compile here)
            t = time.monotonic()
            step_out, runner.penalty_state, pool.array = fn(layout, engine.params, pool.array, pool.table, packed,
                                                            runner._no_prev, runner.penalty_state)
            step_out.tokens.block_until_ready()
            times.append(time.monotonic() - t)
        row["step_ms_median"] = 1e3 * statistics.median(times[1:] or times)
        out["steps"].append(row)
    return out


def run_child(args, name: str, flags: str, vmodule: bool) -> dict:
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"))
    env["XLA_FLAGS"] = " ".join(x for x in (os.environ.get("XLA_FLAGS", ""), flags) if x)
    if vmodule:
        env.update(TF_CPP_VMODULE="hlo_pass_pipeline=1", TF_CPP_MIN_LOG_LEVEL="0")
    cmd = [sys.executable, __file__, "--child", "warmup" if name.startswith("warmup") else "buckets", "--preset",
           args.preset, "--engine", args.engine, "--buckets", args.buckets, "--runs", str(args.runs),
           "--cache-dir", args.cache_dir]
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    result = {"flags": flags, "rc": proc.returncode, "wall_s": time.monotonic() - t}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if lines:
        result.update(json.loads(lines[-1][len("RESULT "):]))
    log = proc.stderr
    result["remat_warnings"] = log.count("hlo_rematerialization")
    remat = [x for x in log.splitlines() if "Can't reduce memory use" in x]
    result["remat_example"] = remat[0][-300:] if remat else None
    if vmodule:
        totals: dict[str, float] = {}
        for m in PASS_LINE.finditer(log):
            totals[m.group("name")] = totals.get(m.group("name"), 0.0) + int(m.group("us")) / 1e6
        result["pass_s_top"] = dict(sorted(totals.items(), key=lambda kv: -kv[1])[:20])
        result["pass_lines"] = sum(1 for x in log.splitlines() if "HLO pass" in x)
        result["pass_line_examples"] = [x[-200:] for x in log.splitlines() if "HLO pass" in x][:3]
    if proc.returncode != 0 or not lines:
        result["log_tail"] = log.splitlines()[-15:]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--engine", default="server", choices=["server", "suite"],
                    help="the server's default engine, or one as the tests build (use with --preset tiny)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    ap.add_argument("--buckets", default=DEFAULT_BUCKETS, help="KIND:N[:LORA],... (decode variants none/attn/all)")
    ap.add_argument("--runs", type=int, default=5, help="executions of each compiled step (the median is kept)")
    ap.add_argument("--warmup", action="store_true", help="also time the whole warm-up compiled ahead on threads")
    ap.add_argument("--warmup-flags", default="", help="XLA flags for the warm-up process (e.g. a winning variant)")
    ap.add_argument("--timeout-s", type=float, default=400.0)
    ap.add_argument("--cache-dir", default="/tmp/slora_compile_time_cache", help="the warm-up runs' compilation cache "
                    "(emptied first: the first warm-up is a cold start, the second a restart)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    try:  # not through jax: this process must leave the GPU's memory to its children
        device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        device = ""
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "device": device or "cpu",
              "jax_version": importlib.metadata.version("jax"), "git_commit": git_commit(), "preset": args.preset,
              "engine": args.engine,
              "cpu_count": os.cpu_count(), "env_xla_flags": os.environ.get("XLA_FLAGS", ""), "variants": {}}
    for name in args.variants.split(","):
        report["variants"][name] = run_child(args, name, VARIANTS[name], vmodule=name in ("baseline", "suite"))
        print(json.dumps({name: {k: v for k, v in report["variants"][name].items()
                                 if k not in ("pass_line_examples", "log_tail")}}), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    if args.warmup:
        shutil.rmtree(args.cache_dir, ignore_errors=True)
        for name in ("warmup_cold", "warmup_restart"):
            report[name] = run_child(args, name, args.warmup_flags, vmodule=False)
            print(json.dumps({name: report[name]}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
