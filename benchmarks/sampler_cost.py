"""What the step's tail costs on the device: the sampler, penalties and logprobs over [B, V] logits.

    PYTHONPATH=. python benchmarks/sampler_cost.py --out results.json       # GPU: ~1 minute
    PYTHONPATH=. python benchmarks/sampler_cost.py --batches 4 --iters 3    # CPU smoke run

Every decode step runs, after the lm_head: penalties (``penalties.apply`` / ``count_sampled``: a gather of each
row's state, even for rows without penalties), the sampler (``sampling.sample``: mask, a full-vocabulary sort for
top-p, Gumbel-max) and ``logprobs.packed_logprobs`` (log-softmax, top-20), branch-free, whether or not a request
asked. This times each part alone and together, N iterations inside one jitted loop (dispatch not timed), against
the bytes each must read over the copy bandwidth, and as a share of a decode step (``--step-ms``, the measured
serving step). Correctness first: the packed logprobs against numpy's log-softmax, greedy rows against argmax.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_ceilings, git_commit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64,128,256")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--step-ms", type=float, default=13.6, help="a decode step to compare with (S1, batch 128, v4)")
    ap.add_argument("--copy-gbs", type=float, default=None,
                    help="copy bandwidth for the floors (default: measured by torch in a child, before jax starts)")
    ap.add_argument("--out")
    args = ap.parse_args()
    copy_source = "--copy-gbs"
    if args.copy_gbs is None:  # measured before this process imports jax (which would claim the GPU)
        ceilings = device_ceilings()
        args.copy_gbs, copy_source = ceilings.get("copy_gbps"), ceilings.get("copy_source", ceilings.get("error"))
        if not args.copy_gbs:
            args.copy_gbs, copy_source = 4270.0, f"assumed (H200 torch copy; probe: {copy_source})"

    import jax
    import jax.numpy as jnp

    from slora_jax.engine import penalties
    from slora_jax.engine.logprobs import PACKED_WIDTH, packed_logprobs
    from slora_jax.engine.sampling import SamplingArrays, SamplingParams, sample, sampling_arrays

    V = args.vocab
    rng = np.random.default_rng()
    rows_out = []
    for B in [int(b) for b in args.batches.split(",")]:
        params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, top_p=0.9 if i % 3 else 1.0,
                                 presence_penalty=0.5 if i % 4 == 0 else 0.0) for i in range(B)]
        arrays = sampling_arrays(params, [int(x) for x in rng.integers(0, 2**31, B)], [3] * B, B, V,
                                 penalty_rows=[i if i % 4 == 0 else -1 for i in range(B)])
        s = SamplingArrays(**{k: jnp.asarray(v) for k, v in arrays.items()})
        state = penalties.PenaltyState.zeros(B, V)
        logits = jnp.asarray(rng.standard_normal((B, V), dtype=np.float32) * 4)

        # correctness: packed logprobs vs numpy, greedy rows vs argmax
        lg = np.asarray(logits, np.float64)
        ref = lg - (lg.max(-1, keepdims=True) + np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)))
        tok = sample(penalties.apply(logits, s, state), s)
        packed = np.asarray(packed_logprobs(logits, tok))
        assert packed.shape == (B, PACKED_WIDTH)
        chosen = packed[:, 0].view(np.float32)
        err = float(np.max(np.abs(chosen - ref[np.arange(B), np.asarray(tok)])))
        top_ids = packed[:, 1:1 + (PACKED_WIDTH - 1) // 2]
        assert np.array_equal(top_ids[:, 0], lg.argmax(-1)), "top-1 id is not the argmax"
        greedy = np.asarray(arrays["temperature"]) == 0
        pen = np.asarray(arrays["penalty_row"]) >= 0
        plain = greedy & ~pen  # penalties start at zero counts, but the test keeps to the plainest rows
        assert np.array_equal(np.asarray(tok)[plain], lg.argmax(-1)[plain]), "greedy rows differ from argmax"
        assert err < 1e-4, f"chosen logprob off by {err}"

        def loop(body):
            # logits, sampler inputs and state are arguments (as constants XLA would fold the work away); each
            # iteration depends on the last through a [B, V] add, so nothing is hoisted out of the loop
            def run(lg0, s_in, st_in):
                def it(i, carry):
                    acc, lg = carry
                    out = body(lg, s_in, st_in)
                    return acc + out.sum().astype(jnp.float32), lg + (out.sum() * 0).astype(lg.dtype)
                return jax.lax.fori_loop(0, args.iters, it, (jnp.float32(0), lg0))[0]
            return jax.jit(run)

        parts = {
            "empty": (lambda lg, s, st: lg[:, 0], 0),
            "sample": (lambda lg, s, st: sample(lg, s), B * V * 4 + B * V // 8),
            "penalties+sample": (lambda lg, s, st: sample(penalties.apply(lg, s, st), s), B * V * 13),
            "logprobs": (lambda lg, s, st: packed_logprobs(lg, lg[:, 0].astype(jnp.int32) % V), B * V * 4),
            "all (step tail)": (lambda lg, s, st: packed_logprobs(lg, sample(penalties.apply(lg, s, st), s)),
                                B * V * 17),
        }
        times = {}
        for name, (fn, _) in parts.items():
            f = loop(fn)
            f(logits, s, state).block_until_ready()
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                f(logits, s, state).block_until_ready()
                best = min(best, (time.perf_counter() - t0) / args.iters)
            times[name] = best
        for name, (_, nbytes) in parts.items():
            us = max(times[name] - times["empty"], 0.0) * 1e6 if name != "empty" else times[name] * 1e6
            floor = nbytes / (args.copy_gbs * 1e9) * 1e6
            rows_out.append({"batch": B, "part": name, "us": us, "floor_us": floor, "bytes": nbytes,
                             "pct_of_step": us / (args.step_ms * 1e3) * 100, "logprob_err": err})
            print(f"B={B:4d} {name:18s} {us:9.1f} us  floor {floor:7.1f} us  {us / (args.step_ms * 1e3) * 100:5.2f}%"
                  f" of a {args.step_ms} ms step", flush=True)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "device": jax.devices()[0].device_kind,
              "jax_version": jax.__version__, "git_commit": git_commit(), "vocab": V, "iters": args.iters,
              "step_ms": args.step_ms, "copy_gbs": args.copy_gbs, "copy_source": copy_source, "rows": rows_out}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
