"""Scheduling policies under load on one GPU: early abort vs FCFS, per-tenant fairness, the prefix cache.

    PYTHONPATH=. python benchmarks/policies.py --out policies.json --plot policies.png   # Llama-2-7B shapes
    PYTHONPATH=. python benchmarks/policies.py --tiny                                    # CPU smoke run

One engine (Llama-2-7B shapes, random weights, S1 adapters: rank 8 on q,k,v,o) runs every trace; between traces the
scheduler is reconfigured (``Engine.reconfigure_scheduling``), so the compiled steps are shared and nothing compiles.

1. SLO attainment and mean first-token latency against request rate (0.5x-2x of a measured saturation rate), FCFS
   against ``slo`` with early abort. Attainment counts every request of the trace (unserved ones miss); "of admitted"
   counts only requests that were not aborted.
2. Two tenants, one sending 10x the other's rate, the sum at 1.5x saturation: the light tenant's mean first-token
   latency under FCFS and VTC, against its latency when it sends alone.
3. Each adapter's requests (1.5x the saturation rate, but short: 8-64 new prompt tokens, 8-128 output) share a
   512-token system prompt: throughput and first-token latency with and without the
   prefix cache.
Traces are short (arrivals for ``--seconds``, then at most ``--drain-s`` more) to fit a device lease.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import time
import zlib

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from common import git_commit  # noqa: E402
from serving import ATTN, random_params  # noqa: E402
from workload import make_trace  # noqa: E402


@dataclasses.dataclass
class Outcome:
    arrival: float
    tenant: str | None = None
    first: float | None = None
    end: float | None = None
    reason: str | None = None
    kind: str | None = None


def replay(engine, trace, adapters, vocab, *, seconds_cap, slo_s=None, tenants=None, prompts=None, seed=1):
    """Replay ``trace`` in real time; returns per-request outcomes and the elapsed time. ``tenants[i]`` names request
    i's tenant; ``prompts[i]`` replaces its random prompt."""
    import numpy as np

    from slora_jax.engine.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    outcomes, pending, t0 = [], list(enumerate(trace)), time.monotonic()

    def on_output(out, o):
        now = time.monotonic() - t0
        if out.new_token_ids and o.first is None:
            o.first = now
        if out.finished:
            o.end, o.reason, o.kind = now, out.finish_reason, out.error_kind

    while pending or engine.has_unfinished():
        now = time.monotonic() - t0
        if now > seconds_cap:
            break
        while pending and pending[0][1].arrival <= now:
            i, r = pending.pop(0)
            o = Outcome(r.arrival, tenants[i] if tenants else None)
            prompt = prompts[i] if prompts else rng.integers(3, vocab, size=r.prompt_len).tolist()
            engine.add_request(prompt, adapters[r.adapter],
                               SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True),
                               on_output=lambda out, o=o: on_output(out, o), tenant=o.tenant, first_token_slo_s=slo_s)
            outcomes.append(o)
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, min(pending[0][1].arrival - now, 0.02)))
    elapsed = time.monotonic() - t0
    for rid in [r for r, s in engine.requests.items()]:  # cut by the cap: end what is left, pages back
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    engine.requests.clear()
    return outcomes, elapsed


def summarize(outcomes, elapsed, slo_s, tenant=None):
    import numpy as np

    mine = [o for o in outcomes if tenant is None or o.tenant == tenant]
    served = [o for o in mine if o.first is not None]
    within = [o for o in served if o.first - o.arrival <= slo_s]
    aborted = [o for o in mine if o.kind == "deadline"]
    admitted = len(mine) - len(aborted)
    done = [o for o in mine if o.reason in ("length", "stop")]
    return {
        "requests": len(mine), "served": len(served), "finished": len(done), "aborted_deadline": len(aborted),
        "throughput_req_s": len(done) / elapsed if elapsed else 0.0,
        "slo_attainment": len(within) / max(len(mine), 1),
        "slo_attainment_of_admitted": len(within) / max(admitted, 1),
        "within_slo": len(within),
        "mean_first_token_s": float(np.mean([o.first - o.arrival for o in served])) if served else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, help="PNG with the three panels")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (reference backend)")
    ap.add_argument("--pool-gb", type=float, default=64.0)
    ap.add_argument("--n-adapters", type=int, default=2000)
    ap.add_argument("--saturation", type=float, default=None, help="req/s; default: measured in a short burst")
    ap.add_argument("--rates", default="0.5,1,1.5,2", help="multiples of saturation for the SLO sweep")
    ap.add_argument("--slo-s", type=float, default=2.0, help="first-token deadline of the SLO sweep")
    ap.add_argument("--seconds", type=float, default=12.0, help="arrivals per trace")
    ap.add_argument("--drain-s", type=float, default=4.0, help="time allowed after the last arrival")
    ap.add_argument("--only", default="slo,tenants,prefix")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    from slora_jax.lora.synthetic import SyntheticAdapterSource
    from slora_jax.model.config import ModelConfig
    from slora_jax.tools.synth import preset_config

    cfg = ModelConfig.from_dict(preset_config("tiny" if args.tiny else "llama-2-7b"))
    if args.tiny:
        ecfg = EngineConfig(max_batch_size=16, max_prefill_tokens=1024, max_prefill_seqs=8, max_model_len=1024,
                            page_size=16, max_lora_rank=16, max_loras=32, num_pages=2048, dtype="float32",
                            backend="reference", min_prefill_bucket=64, decode_lora_variants=False)
        in_range, out_range, dtype, system_len = (8, 64), (8, 32), jnp.float32, 128
    else:
        ecfg = EngineConfig(max_batch_size=128, max_prefill_tokens=2048, max_prefill_seqs=16, max_model_len=1024,
                            page_size=16, max_lora_rank=16, max_loras=128, pool_bytes=int(args.pool_gb * 2**30),
                            dtype="bfloat16", backend="pallas", min_prefill_bucket=256, min_decode_bucket=16,
                            host_budget_bytes=64 << 30)
        in_range, out_range, dtype, system_len = (8, 512), (8, 512), jnp.bfloat16, 512
    engine = Engine(cfg, random_params(cfg, dtype), ecfg)
    t = time.monotonic()
    engine.warmup(progress=True)
    warm_s = time.monotonic() - t
    n = args.n_adapters if not args.tiny else 50
    names = [f"ad-{i}" for i in range(n)]
    for name in names:
        engine.register_adapter(name, SyntheticAdapterSource(cfg, 8, ATTN, seed=zlib.crc32(name.encode())))
    cap = args.seconds + args.drain_s
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "device": jax.devices()[0].device_kind,
              "jax_version": jax.__version__, "git_commit": git_commit(),
              "model": "tiny" if args.tiny else "llama-2-7b (random weights)",
              "engine": vars(engine.ecfg) | {}, "warmup_s": warm_s, "n_adapters": n, "slo_s": args.slo_s}
    only = set(args.only.split(","))

    sat = args.saturation
    if sat is None:  # a burst: everything arrives at once; finished requests per second is the saturation rate
        burst = make_trace(n, 1000.0, int(30 * (1 if args.tiny else 12)), in_range=in_range, out_range=out_range,
                           seed=3)
        outs, el = replay(engine, burst, names, cfg.vocab_size, seconds_cap=4 * cap)
        sat = summarize(outs, el, args.slo_s)["throughput_req_s"]
    report["saturation_req_s"] = sat
    print(f"saturation {sat:.2f} req/s", flush=True)

    if "slo" in only:
        rows = []
        for x in [float(v) for v in args.rates.split(",")]:
            trace = make_trace(n, x * sat, max(int(x * sat * args.seconds), 4), in_range=in_range,
                               out_range=out_range, seed=11)
            for policy, abort in (("fcfs", False), ("slo", True)):
                engine.reconfigure_scheduling(scheduling_policy=policy, early_abort=abort)
                outs, el = replay(engine, trace, names, cfg.vocab_size, seconds_cap=cap, slo_s=args.slo_s)
                row = {"rate_x": x, "rate": x * sat, "policy": policy, "early_abort": abort,
                       **summarize(outs, el, args.slo_s)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        report["slo_sweep"] = rows
        engine.reconfigure_scheduling(scheduling_policy="fcfs", early_abort=False)

    if "tenants" in only:
        rows = []
        total = 1.5 * sat
        heavy = make_trace(n, total * 10 / 11, max(int(total * 10 / 11 * args.seconds), 10), in_range=in_range,
                           out_range=out_range, seed=21)
        light = make_trace(n, total / 11, max(int(total / 11 * args.seconds), 4), in_range=in_range,
                           out_range=out_range, seed=22)
        both = sorted([(r, "heavy") for r in heavy] + [(r, "light") for r in light], key=lambda p: p[0].arrival)
        for label, policy, trace, tenants in (
                ("light alone", "fcfs", light, ["light"] * len(light)),
                ("both, fcfs", "fcfs", [r for r, _ in both], [t for _, t in both]),
                ("both, vtc", "vtc", [r for r, _ in both], [t for _, t in both])):
            engine.reconfigure_scheduling(scheduling_policy=policy)
            outs, el = replay(engine, trace, names, cfg.vocab_size, seconds_cap=cap, tenants=tenants)
            row = {"run": label, "policy": policy, "light": summarize(outs, el, args.slo_s, "light"),
                   "heavy": summarize(outs, el, args.slo_s, "heavy")}
            rows.append(row)
            print(json.dumps(row), flush=True)
        report["tenants"] = rows
        engine.reconfigure_scheduling(scheduling_policy="fcfs")

    if "prefix" in only:
        rows = []
        rng = np.random.default_rng(5)
        k = min(n, 20)  # adapters with a system prompt each
        systems = [rng.integers(3, cfg.vocab_size, size=system_len).tolist() for _ in range(k)]
        short = (8, 64) if not args.tiny else (4, 16)
        trace = make_trace(k, 1.5 * sat, max(int(1.5 * sat * args.seconds), 4), in_range=short,
                           out_range=(8, 128) if not args.tiny else (4, 16), seed=31)
        prompts = [systems[r.adapter] + rng.integers(3, cfg.vocab_size, size=r.prompt_len).tolist() for r in trace]
        for cache in (False, True):
            engine.reconfigure_scheduling(prefix_cache=cache)
            outs, el = replay(engine, trace, names[:k], cfg.vocab_size, seconds_cap=cap, prompts=prompts)
            row = {"prefix_cache": cache, **summarize(outs, el, args.slo_s),
                   "cache": engine.stats()["prefix_cache"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        report["prefix"] = rows
        engine.reconfigure_scheduling(prefix_cache=False)

    report["compiles_after_warmup"] = engine.compiles_since_warmup()
    print(f"compiles after warm-up: {report['compiles_after_warmup']}")
    for row in report.get("slo_sweep", []):
        print(f"{row['rate_x']:4.1f}x {row['policy']:5s} attainment {row['slo_attainment']:.2f} "
              f"(of admitted {row['slo_attainment_of_admitted']:.2f}) within {row['within_slo']:4d} "
              f"ttft {row['mean_first_token_s']:.3f} s aborted {row['aborted_deadline']}")
    for row in report.get("tenants", []):
        print(f"{row['run']:12s} light ttft {row['light']['mean_first_token_s']:.3f} s  "
              f"heavy ttft {row['heavy']['mean_first_token_s']:.3f} s")
    for row in report.get("prefix", []):
        print(f"prefix cache {row['prefix_cache']!s:5s} ttft {row['mean_first_token_s']:.3f} s "
              f"{row['throughput_req_s']:.2f} req/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if args.plot:
        plot(report, args.plot)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    sweep = report.get("slo_sweep", [])
    for policy, style in (("fcfs", "o-"), ("slo", "s-")):
        rows = [r for r in sweep if r["policy"] == policy]
        if rows:
            label = "FCFS" if policy == "fcfs" else "early abort (EDF)"
            axes[0].plot([r["rate_x"] for r in rows], [r["slo_attainment"] for r in rows], style, label=label)
            if policy == "slo":
                axes[0].plot([r["rate_x"] for r in rows], [r["slo_attainment_of_admitted"] for r in rows], "s--",
                             label="early abort, of admitted")
    axes[0].set(xlabel="request rate / saturation", ylabel=f"first token within {report['slo_s']} s",
                title="SLO attainment", ylim=(0, 1.05))
    axes[0].legend()
    tenants = report.get("tenants", [])
    if tenants:
        axes[1].bar([r["run"] for r in tenants], [r["light"]["mean_first_token_s"] for r in tenants])
        axes[1].set(ylabel="light tenant mean TTFT (s)", title="Two tenants, 10:1")
    prefix = report.get("prefix", [])
    if prefix:
        axes[2].bar(["no cache", "prefix cache"], [r["mean_first_token_s"] for r in prefix])
        axes[2].set(ylabel="mean TTFT (s)", title="Shared 512-token system prompts")
    fig.suptitle(f"{report['device']}, jax {report['jax_version']}, {report['n_adapters']} adapters")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
