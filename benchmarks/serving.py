"""S-LoRA serving workload on one GPU: throughput, latency, SLO attainment and decode-step roofline.

    PYTHONPATH=. python benchmarks/serving.py --out serving.json          # Llama-2-7B shapes, random weights
    PYTHONPATH=. python benchmarks/serving.py --tiny                       # CPU smoke run
    PYTHONPATH=. python benchmarks/serving.py --only S1-qkvo-n5-sat --no-latency --logprobs off,5   # logprobs cost

One engine (compiled once, max rank 64) runs a list of traces back to back, each with its own fresh set of
synthetic adapters: S1 (rank 8) and S2 (ranks 64/32/16/8 round-robin), LoRA on q,k,v,o (as S-LoRA) or all 7
projections, n adapters, request rate R, power-law popularity (alpha), Gamma arrivals (cv), lengths U[8, 512],
ignore_eos. Saturation traces send requests faster than the engine serves them; latency traces use a set rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import time
import zlib

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from common import device_ceilings, git_commit  # noqa: E402
from workload import make_trace  # noqa: E402

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL7 = ATTN + ("gate_proj", "up_proj", "down_proj")


def copy_bandwidth_gbs() -> tuple[float, str]:
    """Device copy bandwidth (read + write) from torch in a subprocess before JAX takes the GPU."""
    probe = device_ceilings()
    return probe.get("copy_gbps", float("nan")), probe.get("copy_source", probe.get("error", "unavailable"))


def random_params(cfg, dtype, seed=0):
    """Random bf16 params in our layout, made on the device (no checkpoint: 13 GB would take minutes to write)."""
    import jax
    import jax.numpy as jnp

    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
    L, H, I = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size  # noqa: E741

    def lin(shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[-2])).astype(dtype)

    layers = {
        "input_layernorm": {"weight": jnp.ones((L, H), dtype)},
        "qkv_proj": {"kernel": lin((L, H, cfg.q_width + 2 * cfg.kv_width))},
        "o_proj": {"kernel": lin((L, cfg.q_width, H))},
        "post_attention_layernorm": {"weight": jnp.ones((L, H), dtype)},
        "gate_up_proj": {"kernel": lin((L, H, 2 * I))},
        "down_proj": {"kernel": lin((L, I, H))},
    }
    return {"embed": jax.random.normal(next(keys), (cfg.vocab_size, H), dtype), "layers": layers,
            "norm": {"weight": jnp.ones((H,), dtype)}, "lm_head": lin((H, cfg.vocab_size))}


def run_trace(engine, name, trace, adapter_names, vocab, budget_end, slo_s=6.0, logprobs=None):
    """Replay ``trace`` in real time against the engine; per-request and per-step records. ``logprobs``: every
    request asks for its tokens' logprobs and this many top alternatives (None: no logprobs)."""
    from slora_jax.engine.sampling import SamplingParams

    rng = __import__("numpy").random.default_rng(1)
    store_before = engine.store.stats()
    pending = list(trace)
    info = {}
    steps = []
    t0 = time.monotonic()

    def on_output(out, rid_info):
        now = time.monotonic() - t0
        if out.new_token_ids and rid_info["first"] is None:
            rid_info["first"] = now
        rid_info["tokens"] += len(out.new_token_ids)
        if out.finished:
            rid_info["end"] = now
            rid_info["reason"] = out.finish_reason

    while pending or engine.has_unfinished():
        now = time.monotonic() - t0
        if time.monotonic() > budget_end:
            break
        while pending and pending[0].arrival <= now:
            r = pending.pop(0)
            d = {"arrival": r.arrival, "first": None, "end": None, "tokens": 0, "out": r.output_len}
            prompt = rng.integers(3, vocab, size=r.prompt_len).tolist()
            engine.add_request(prompt, adapter_names[r.adapter],
                               SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True,
                                              logprobs=logprobs),
                               on_output=lambda out, d=d: on_output(out, d))
            info[id(d)] = d
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(pending[0].arrival - now, 0.05)) if pending else 0)
            continue
        ts = time.monotonic()
        engine.step()
        te = time.monotonic()
        plan = engine.last_plan
        if plan is not None:
            steps.append({"t": te - ts, "kind": plan.kind, "batch": len(plan.seqs),
                          "ctx": sum(s.num_tokens for s in plan.seqs),
                          "adapters": len({s.adapter for s in plan.seqs if s.adapter}),
                          **{f"host_{k}": v for k, v in engine.clock.last._asdict().items()}})
    elapsed = time.monotonic() - t0
    store_after = engine.store.stats()
    done = [d for d in info.values() if d["end"] is not None]
    n = len(done)
    toks = sum(d["tokens"] for d in done)
    res = {
        "trace": name, "requests": len(trace), "finished": n, "elapsed_s": elapsed,
        "throughput_req_s": n / elapsed if elapsed else 0.0, "throughput_tok_s": toks / elapsed if elapsed else 0.0,
        "mean_latency_s": sum(d["end"] - d["arrival"] for d in done) / max(n, 1),
        "mean_first_token_s": sum(d["first"] - d["arrival"] for d in done) / max(n, 1),
        "slo_attainment": sum((d["first"] - d["arrival"]) <= slo_s for d in done) / max(len(info), 1),
        "cut_by_budget": bool(pending or engine.has_unfinished()),
        "store": {k: store_after[k] - store_before[k] for k in ("hits", "misses", "loads", "prefetch_loads",
                                                                 "staged_loads", "evictions", "host_loads")},
    }
    for kind in ("prefill", "decode"):  # where the engine thread's time went, per step kind (seconds in total)
        ks = [s for s in steps if s["kind"] == kind]
        res[f"{kind}_steps"] = len(ks)
        res[f"{kind}_host_s"] = {k[5:]: round(sum(s[k] for s in ks), 3) for k in (ks[0] if ks else {})
                                 if k.startswith("host_")}
    return res, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (reference backend)")
    ap.add_argument("--budget-s", type=float, default=470.0, help="stop starting traces after this")
    ap.add_argument("--requests", type=int, default=256, help="requests per saturation trace")
    ap.add_argument("--pool-gb", type=float, default=48.0)
    ap.add_argument("--ns", default="5,100,1000,2000")
    ap.add_argument("--ns2", default=None, help="n for the S2 and all-7 traces (default: first and last of --ns)")
    ap.add_argument("--only", default=None, help="regex: run only the saturation traces whose name matches")
    ap.add_argument("--latency-s", type=float, default=40.0, help="length of the set-rate latency trace")
    ap.add_argument("--no-latency", action="store_true", help="skip the set-rate latency trace")
    ap.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unroll"])
    ap.add_argument("--logprobs", default="off",
                    help="comma list of 'off' or top-logprob counts: each saturation trace runs once per setting, "
                         "every request asking for that many (e.g. off,5: the cost of logprobs)")
    ap.add_argument("--xla-flag", action="append", default=[],
                    help="extra XLA flag for this run, e.g. --xla-flag=--xla_gpu_enable_dynamic_slice_fusion=true")
    ap.add_argument("--compilation-cache", default=None,
                    help="JAX's persistent compilation cache in this dir (the server's default; warm-up may then "
                         "compile its buckets in parallel)")
    args = ap.parse_args()
    if args.xla_flag:  # before JAX creates its backend
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *args.xla_flag]).strip()
    t_start = time.monotonic()
    bw, bw_how = (float("nan"), "cpu") if args.tiny else copy_bandwidth_gbs()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    from slora_jax.lora.synthetic import SyntheticAdapterSource
    from slora_jax.model.config import ModelConfig
    from slora_jax.model.params import param_bytes
    from slora_jax.tools.synth import preset_config

    cfg = ModelConfig.from_dict(preset_config("tiny" if args.tiny else "llama-2-7b"))
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    if args.tiny:
        ecfg = EngineConfig(max_batch_size=16, max_prefill_tokens=1024, max_prefill_seqs=8, max_model_len=1024,
                            page_size=16, max_lora_rank=64, max_loras=32, num_pages=2048, dtype="float32",
                            backend="reference", min_prefill_bucket=64)
        ns, n_req, in_range = [5, 50], 24, (8, 64)
    else:
        ecfg = EngineConfig(max_batch_size=128, max_prefill_tokens=2048, max_prefill_seqs=16, max_model_len=1024,
                            page_size=16, max_lora_rank=64, max_loras=128, pool_bytes=int(args.pool_gb * 2**30),
                            dtype="bfloat16", backend="pallas", min_prefill_bucket=256, min_decode_bucket=16,
                            lora_block_t=64, attn_block_q=128, host_budget_bytes=64 << 30)
        ns, n_req, in_range = [int(x) for x in args.ns.split(",")], args.requests, (8, 512)
    ecfg = dataclasses.replace(ecfg, layer_loop=args.layer_loop)
    params = random_params(cfg, dtype)
    weight_bytes = param_bytes(params) - params["embed"].nbytes  # read every decode step (the embedding is gathered)
    if args.compilation_cache:
        from slora_jax.engine import compile_counter
        compile_counter.enable_persistent_cache(args.compilation_cache)
    engine = Engine(cfg, params, ecfg)
    del params  # the engine holds what it needs (an unrolled loop keeps per-layer copies)
    t = time.monotonic()
    engine.warmup(progress=True)
    warm_s = time.monotonic() - t
    warm_compiles = engine.stats()["compiles"]
    print(f"device {jax.devices()[0].device_kind}  jax {jax.__version__}  copy {bw:.0f} GB/s  warm-up {warm_s:.0f} s "
          f"({warm_compiles} compiles)  pool {engine.pool.stats()['num_pages']} pages", flush=True)

    kv_token_bytes = 2 * cfg.num_hidden_layers * cfg.kv_width * 2

    def adapter_bytes(rank, targets):
        return rank * cfg.num_hidden_layers * sum(sum(cfg.module_dims(m)) for m in targets) * 2

    plans = []  # (name, setting, n, targets, rate, num_requests)
    for n in ns:
        plans.append((f"S1-qkvo-n{n}-sat", "S1", n, ATTN, 1000.0, n_req))
    ns2 = [int(x) for x in args.ns2.split(",")] if args.ns2 and not args.tiny else sorted({ns[0], ns[-1]})
    for n in ns2:
        plans.append((f"S2-qkvo-n{n}-sat", "S2", n, ATTN, 1000.0, n_req))
    plans.append((f"S1-all7-n{ns2[-1]}-sat", "S1", ns2[-1], ALL7, 1000.0, n_req))
    if args.only:
        plans = [p for p in plans if re.search(args.only, p[0])]
    lp_settings = [None if v.strip() == "off" else int(v) for v in args.logprobs.split(",")]
    if lp_settings != [None]:  # each trace once per setting, named by it
        plans = [(f"{p[0]}-lp{'off' if lp is None else lp}", *p[1:], lp) for p in plans for lp in lp_settings]
    else:
        plans = [(*p, None) for p in plans]
    results, all_steps = [], []
    budget_end = t_start + args.budget_s
    # an untimed trace first, so one-time costs (first dispatches, allocator growth, IO threads) hit no measurement
    warm_names = [f"warm-{i}" for i in range(4)]
    for an in warm_names:
        engine.store.register(an, SyntheticAdapterSource(cfg, 8, ATTN, seed=zlib.crc32(an.encode())))
    run_trace(engine, "warm", make_trace(4, 1000.0, 16, in_range=in_range, out_range=in_range, seed=7), warm_names,
              cfg.vocab_size, budget_end)
    sat_rate = None
    for name, setting, n, targets, rate, num, logprobs in plans:
        if time.monotonic() > budget_end - 20:
            print(f"skip {name}: budget", flush=True)
            continue
        ranks = [8] if setting == "S1" else [64, 32, 16, 8]
        names = []
        for i in range(n):
            an = f"{name}-{i}"
            source = SyntheticAdapterSource(cfg, ranks[i % len(ranks)], targets, seed=zlib.crc32(an.encode()))
            engine.store.register(an, source)
            names.append(an)
        trace = make_trace(n, rate, num, alpha=1.0, cv=1.0, in_range=in_range, out_range=in_range,
                           seed=0)  # the same lengths and arrivals for every n: only adapters differ
        res, steps = run_trace(engine, name, trace, names, cfg.vocab_size, budget_end, logprobs=logprobs)
        mean_rank = float(np.mean(ranks))
        dec = [s for s in steps if s["batch"] >= (64 if not args.tiny else 4) and s["kind"] == "decode"]
        if dec:
            roof = [(weight_bytes + s["ctx"] * kv_token_bytes + s["adapters"] * adapter_bytes(mean_rank, targets))
                    / (bw * 1e9) for s in dec]
            res["decode_steps_batch_ge_64"] = len(dec)
            res["decode_step_ms_median"] = float(np.median([s["t"] for s in dec]) * 1e3)
            res["decode_roofline_ms_median"] = float(np.median(roof) * 1e3)
            res["decode_over_roofline"] = float(np.median([s["t"] / r for s, r in zip(dec, roof, strict=True)]))
        res.update(setting=setting, n_adapters=n, targets=len(targets), rate=rate, logprobs=logprobs)
        results.append(res)
        all_steps.append({"trace": name, "steps": steps[:4000]})
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)
        if name.startswith("S1-qkvo") and n == ns[0]:
            sat_rate = res["throughput_req_s"]
    # latency / SLO at a set rate: 70% of the n=5 saturation throughput, with the most adapters
    if sat_rate and not args.no_latency and time.monotonic() < budget_end - 30:
        rate = 0.7 * sat_rate
        n = ns[-1]
        name = f"S1-qkvo-n{n}-R{rate:.1f}"
        names = [f"{name}-{i}" for i in range(n)]
        for an in names:
            engine.store.register(an, SyntheticAdapterSource(cfg, 8, ATTN, seed=zlib.crc32(an.encode())))
        trace = make_trace(n, rate, max(int(rate * args.latency_s), 20), alpha=1.0, cv=1.0, in_range=in_range,
                           out_range=in_range, seed=99)
        res, _ = run_trace(engine, name, trace, names, cfg.vocab_size, budget_end + 50)
        res.update(setting="S1", n_adapters=n, targets=4, rate=rate)
        results.append(res)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(), "device": jax.devices()[0].device_kind,
        "jax_version": jax.__version__, "git_commit": git_commit(), "copy_bandwidth_gbs": bw, "copy_how": bw_how,
        "model": "tiny" if args.tiny else "llama-2-7b (random weights)", "engine": vars(ecfg) | {},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "warmup_s": warm_s, "warmup_compiles": warm_compiles,
        "compiles_after_warmup": engine.compiles_since_warmup(), "results": results,
    }
    nan = float("nan")
    print(f"\ncompiles after warm-up: {report['compiles_after_warmup']}")
    print(f"{'trace':26s} {'fin':>5s} {'req/s':>7s} {'tok/s':>8s} {'lat s':>7s} {'ttft s':>7s} {'SLO':>5s} "
          f"{'dec ms':>7s} {'roof ms':>7s} {'x roof':>6s}")
    for r in results:
        print(f"{r['trace']:26s} {r['finished']:5d} {r['throughput_req_s']:7.2f} {r['throughput_tok_s']:8.0f} "
              f"{r['mean_latency_s']:7.2f} {r['mean_first_token_s']:7.2f} {r['slo_attainment']:5.2f} "
              f"{r.get('decode_step_ms_median', nan):7.2f} {r.get('decode_roofline_ms_median', nan):7.2f} "
              f"{r.get('decode_over_roofline', nan):6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report | {"steps": all_steps}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
