"""Where does a decode step's time go? One Llama-2-7B decode step at a set batch and context, timed and profiled.

    PYTHONPATH=.:benchmarks python benchmarks/decode_profile.py --batch 64 --ctx 448 --layer-loop scan
    PYTHONPATH=.:benchmarks python benchmarks/decode_profile.py --tiny      # CPU smoke run

Times the engine's jitted decode step (pool donated, batch already on the device, calls chained as in serving)
with and without LoRA, prints the step's floor (weights + KV + adapter rows over the copy bandwidth, the weights'
share no less than the GEMMs' FLOPs over the measured matmul rate: it binds from ~150 rows) and, from a
``jax.profiler`` trace, the device time per kernel grouped into GEMMs, our Pallas kernels, XLA fusions and copies.
One variant per process, because XLA flags are read once: run it once per ``--layer-loop`` / ``--xla-flag``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import shutil
import tempfile
import time
import zlib

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from common import device_ceilings, git_commit  # noqa: E402

CATEGORIES = (  # first match wins; names are lower-cased kernel names from the device trace
    ("lora", r"bgmv|sgmv|shrink|expand"),
    ("attention", r"paged|decode_attn|attention|write_kv|combine"),
    ("gemm", r"gemm|cublas|cutlass|xmma|nvjet|matmul|dot"),
    ("copy", r"copy|memcpy|memset|dynamic.slice|dynamic_update"),
    ("fusion", r"fusion|reduce|concatenate|transpose|slice|select|gather|scatter"),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, low):
            return cat
    return "other"


def device_kernels(trace_dir: str) -> list[tuple[str, float]]:
    """(kernel name, duration us) of every event on the GPU planes of the newest trace under ``trace_dir``."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        return []
    out, seen = [], []
    for plane in ProfileData.from_file(files[-1]).planes:
        seen.append(f"{plane.name}: {[line.name for line in plane.lines][:12]}")
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():  # kernel lines are per stream; skip XLA-op / module summary lines
                continue
            out.extend((ev.name, ev.duration_ns / 1e3) for ev in line.events)
    if not out:
        print("no GPU kernels in the trace; planes seen:\n  " + "\n  ".join(seen))
    return out


NO_KERNELS = dict(device_us_per_step={}, kernels_per_step=0.0, top_kernels=[])  # a run with no device trace


def kernel_profile(step, calls: int = 5, top: int = 25) -> dict:
    """Trace ``calls`` runs of ``step`` (a function returning a JAX array; run once first, untraced) and sum its GPU
    kernels per call: ``device_us_per_step`` by category, ``kernels_per_step`` and the ``top`` kernels as (name,
    count, us). Empty figures where the trace holds no GPU kernels."""
    import jax

    trace_dir = tempfile.mkdtemp(prefix="step_prof_")
    step().block_until_ready()
    jax.profiler.start_trace(trace_dir)
    for _ in range(calls):
        out = step()
    out.block_until_ready()
    jax.profiler.stop_trace()
    kernels = device_kernels(trace_dir)
    shutil.rmtree(trace_dir, ignore_errors=True)
    n = calls if kernels else 1
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for name, us in kernels:
        per_name[name][0] += 1
        per_name[name][1] += us
    per_cat = collections.Counter()
    for name, (_, us) in per_name.items():
        per_cat[category(name)] += us
    return dict(device_us_per_step={k: round(v / n, 1) for k, v in per_cat.most_common()},
                kernels_per_step=round(len(kernels) / n, 1),
                top_kernels=[(name[:90], c // n, round(us / n, 1)) for name, (c, us) in
                             sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]])


def print_kernel_profile(prof: dict, top: int) -> None:
    """The short table of :func:`kernel_profile`'s figures (nothing when the trace had no kernels)."""
    if not prof.get("kernels_per_step"):
        return
    by_kind = prof["device_us_per_step"]
    print(f"   device busy {sum(by_kind.values()) / 1e3:.2f} ms/step in {prof['kernels_per_step']:.0f} kernels; by "
          "kind (us/step): " + ", ".join(f"{k} {v:.0f}" for k, v in by_kind.items()))
    for name, count, us in prof["top_kernels"][:top]:
        print(f"   {us:9.1f} us  {count:4d}x  {category(name):9s} {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=448, help="tokens in the cache of every sequence")
    ap.add_argument("--adapters", type=int, default=32, help="distinct adapters in the batch (0 = base only)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=0,
                    help="decode bucket the batch runs in (0: the engine's, >= the GPU's min_decode_bucket)")
    ap.add_argument("--all7", action="store_true", help="adapters on all 7 projections (default q,k,v,o)")
    ap.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unroll"])
    ap.add_argument("--xla-flag", action="append", default=[])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--unfused-rope", action="store_true",
                    help="rotate q, k in XLA and scatter the KV before attending (decode_rope_in_attention "
                         "off), the path before session 17")
    ap.add_argument("--top", type=int, default=25, help="kernels listed (by device time) in the table and the JSON")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None, help="append one JSON line here")
    args = ap.parse_args()
    if args.xla_flag:
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *args.xla_flag]).strip()
    probe = {} if args.tiny else device_ceilings(matmul_n=8192)
    bw, mm = probe.get("copy_gbps", float("nan")), probe.get("matmul_tflops", float("nan"))

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.backends import default_tiles
    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    from slora_jax.engine.sampling import SamplingParams
    from slora_jax.engine.scheduler import pages_for
    from slora_jax.engine.step_runner import StepItem, lora_variant, pack_inputs
    from slora_jax.lora.synthetic import SyntheticAdapterSource
    from slora_jax.model.config import ATTN_MODULES, MODULES, ModelConfig
    from slora_jax.model.llama import init_params
    from slora_jax.model.params import param_bytes
    from slora_jax.tools.synth import preset_config

    cfg = ModelConfig.from_dict(preset_config("tiny" if args.tiny else "llama-2-7b"))
    gpu_tiles = default_tiles("pallas", "gpu")  # the GPU tiles even with --tiny: the profile is of the GPU setup
    kv_token_bytes = 2 * cfg.num_hidden_layers * cfg.kv_width * 2  # K and V of every layer, bf16
    # the pool holds every sequence's context (B=256 at 448 tokens needs ~60 GB of KV), and never less than 24 GiB
    kv_need = args.batch * (args.ctx + 16) * kv_token_bytes
    pool_bytes = (256 << 20) if args.tiny else max(24 << 30, int(kv_need * 1.05) + (2 << 30))
    ecfg = EngineConfig(max_batch_size=args.batch, max_prefill_tokens=2048, max_prefill_seqs=16,
                        max_model_len=max(1024, args.ctx + 16), page_size=16, max_lora_rank=64,
                        max_loras=max(args.adapters, 1), pool_bytes=pool_bytes,
                        dtype="float32" if args.tiny else "bfloat16", backend="pallas",
                        min_decode_bucket=args.bucket or max(args.batch, gpu_tiles["min_decode_bucket"]),
                        lora_block_t=gpu_tiles["lora_block_t"], attn_block_q=gpu_tiles["attn_block_q"],
                        layer_loop=args.layer_loop, decode_rope_in_attention=not args.unfused_rope)
    if args.tiny:
        params = init_params(cfg, jax.random.PRNGKey(0))
    else:
        from serving import random_params

        params = random_params(cfg, jnp.bfloat16)
    weight_bytes = param_bytes(params) - params["embed"].nbytes
    eng = Engine(cfg, params, ecfg)
    del params
    targets = tuple(MODULES) if args.all7 else tuple(ATTN_MODULES)
    slots = []
    for i in range(args.adapters):
        name = f"a{i}"
        eng.store.register(name, SyntheticAdapterSource(cfg, args.rank, targets, seed=zlib.crc32(name.encode())))
        slots.append(eng.store.acquire(name))
    rng = np.random.default_rng(0)
    items = []
    for i in range(args.batch):
        pages = eng.pool.alloc_kv_pages(pages_for(args.ctx + 1, ecfg.page_size))
        items.append(StepItem([int(rng.integers(3, cfg.vocab_size))], args.ctx, pages,
                              slots[i % len(slots)] if slots else -1, SamplingParams(temperature=0.0), 0, 0))
    batch, s, token_src = eng.runner.build_decode(items)
    packed, layout = pack_inputs(batch, s, token_src)
    packed = jnp.asarray(packed)  # on the device once: times the step alone
    prev = jnp.zeros(eng.runner.out_rows, jnp.int32)
    runner = eng.runner

    state = {"pool": eng.pool.array}
    variant = lora_variant(eng.pool.slot_modules[slots].any(axis=0))  # what the engine would run

    def full(variant=variant):
        out, runner.penalty_state, state["pool"] = runner.step_fn("decode", variant)(
            layout, eng.params, state["pool"], eng.pool.table, packed, prev, runner.penalty_state)
        return out.tokens

    def timed(fn, iters):
        fn().block_until_ready()  # compile + first run
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn()
        out.block_until_ready()
        return (time.perf_counter() - t0) / iters * 1e3

    t_compile = time.perf_counter()
    comp = runner.step_fn("decode", variant).lower(layout, eng.params, state["pool"], eng.pool.table, packed,
                                                   prev, runner.penalty_state).compile()
    t_compile = time.perf_counter() - t_compile
    mem = comp.memory_analysis()
    temp_mib = mem.temp_size_in_bytes / 2**20 if mem is not None else float("nan")
    full_ms = timed(full, args.iters)
    base_ms = timed(lambda: full("none"), args.iters)  # the step with no LoRA kernels
    full_ms2 = timed(full, args.iters)  # again, after the other variant: checks the number is stable
    all_ms = timed(lambda: full("all"), args.iters)  # every LoRA kernel launched, as before variants existed

    def as_engine(iters):
        """As the engine calls it: the batch built and packed in numpy every step (a fresh input buffer), the input
        tokens taken from the previous step's output on the device. Returns (ms per step, median host ms inside
        the call)."""
        tok = full()
        tok.block_until_ready()
        calls = []
        t0 = time.perf_counter()
        for _ in range(iters):
            tc = time.perf_counter()
            tok, state["pool"] = runner.decode(eng.params, state["pool"], eng.pool.table,
                                               [dataclasses.replace(it, token_src=i) for i, it in enumerate(items)],
                                               tok, lora=variant)
            calls.append(time.perf_counter() - tc)
        tok.block_until_ready()
        return (time.perf_counter() - t0) / iters * 1e3, float(np.median(calls)) * 1e3

    as_engine(2)  # its first call compiles (a layout of its own): 6 s, which read as ~200 ms a step over 30 steps
    engine_ms, dispatch_ms = as_engine(args.iters)

    prof = NO_KERNELS if args.tiny else kernel_profile(full, top=args.top)  # the trace needs a GPU

    lora_bytes = 0
    if args.adapters:
        dims = sum(sum(cfg.module_dims(m)) for m in targets)
        lora_bytes = args.adapters * args.rank * dims * cfg.num_hidden_layers * 2
    kv_bytes = args.batch * (args.ctx + 1) * kv_token_bytes
    bytes_ms = (weight_bytes + kv_bytes + lora_bytes) / (bw * 1e9) * 1e3 if bw == bw else float("nan")
    # the GEMMs read each weight once and do 2 x batch FLOPs per weight: past ~150 rows the matmul rate bounds them
    matmul_ms = args.batch * weight_bytes / (mm * 1e12) * 1e3 if mm == mm else float("nan")
    weights_ms = weight_bytes / (bw * 1e9) * 1e3 if bw == bw else float("nan")
    floor_ms = bytes_ms + max(0.0, matmul_ms - weights_ms) if matmul_ms == matmul_ms else bytes_ms
    row = dict(label=args.label or f"{args.layer_loop} {' '.join(args.xla_flag)}".strip(),
               rope_in_attention=not args.unfused_rope, device=jax.devices()[0]
               .device_kind, jax=jax.__version__, commit=git_commit(), batch=args.batch,
               bucket=len(token_src), ctx=args.ctx,
               adapters=args.adapters, rank=args.rank, targets=len(targets), layer_loop=args.layer_loop,
               xla_flags=os.environ.get("XLA_FLAGS", ""), compile_s=round(t_compile, 1), temp_mib=round(temp_mib, 1),
               variant=variant, step_ms=round(full_ms, 3), step_ms_again=round(full_ms2, 3),
               all_lora_kernels_ms=round(all_ms, 3), no_lora_ms=round(base_ms, 3),
               as_engine_ms=round(engine_ms, 3), as_engine_dispatch_ms=round(dispatch_ms, 3),
               floor_ms=round(floor_ms, 3), x_floor=round(full_ms / floor_ms, 2) if floor_ms == floor_ms else None,
               floor_bytes_ms=round(bytes_ms, 3), floor_matmul_ms=round(matmul_ms, 3), matmul_tflops=mm, copy_gbps=bw,
               weight_gb=weight_bytes / 1e9, kv_gb=kv_bytes / 1e9, lora_gb=lora_bytes / 1e9,
               **prof)
    print(f"\n== {row['label']}: B={args.batch} in {row['bucket']} rows, step ({variant}) {full_ms:.2f} ms "
          f"(again {full_ms2:.2f}), with every LoRA kernel "
          f"{all_ms:.2f} ms, without LoRA {base_ms:.2f} ms, floor "
          f"{floor_ms:.2f} ms -> x{row['x_floor']}; compile {t_compile:.0f} s, temp {temp_mib:.0f} MiB\n"
          f"   as the engine calls it (numpy batch, tokens from the last step): {engine_ms:.2f} ms per step, "
          f"{dispatch_ms:.2f} ms of it inside the call (median)")
    print_kernel_profile(prof, args.top)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
