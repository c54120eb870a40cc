"""What the step's tail costs on the device: the sampler, penalties and logprobs over [B, V] logits, the current
implementation beside the one before 2026-12-01 (which sorted the whole vocabulary).

    PYTHONPATH=. python benchmarks/sampler_cost.py --out results.json                       # GPU: about a minute
    PYTHONPATH=. python benchmarks/sampler_cost.py --variants siblings-p3,stored-p3,stacked-p7 --out r.json
    PYTHONPATH=. python benchmarks/sampler_cost.py --batches 4 --iters 3                       # CPU smoke run

Every decode step runs, after the lm_head: penalties (``penalties.apply`` / ``count_sampled``: a gather of each
row's state, even for rows without penalties), the sampler (``sampling.sample``: mask, the top-k/top-p threshold,
Gumbel-max) and ``logprobs.packed_logprobs`` (log-softmax, top-20), branch-free, whether or not a request asked.
``--impl old`` is a frozen copy of the sort-based sampler and logprobs (threshold from ``jnp.sort`` of the vocabulary,
``lax.top_k(20)``, which is a sort on GPU); ``new`` is the code in ``slora_jax/engine`` (``vocab_select.py``);
``new FORM-pN`` the same written another way (``--variants``: ``vocab_select.FORM``, N pivots a search round).
This times each part alone and together, N iterations inside one jitted loop (dispatch not timed), against the bytes
each must read over the copy bandwidth, and as a share of a decode step (``--step-ms``, the measured serving step).
Correctness first: the packed logprobs against numpy's log-softmax, greedy rows against argmax, and old against new
(same Gumbel noise: the same tokens unless a row's top-p cut lands within float rounding; the same top-20 ids).
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


def old_sample(logits, s):
    """The sampler as of 2026-11-30 (commit ed06749): the top-p threshold from a sort of the whole vocabulary."""
    import jax
    import jax.numpy as jnp

    from slora_jax.engine.sampling import allowed_tokens

    logits = logits.astype(jnp.float32)
    logits = jnp.where(jnp.isnan(logits), -jnp.inf, logits)
    allowed = allowed_tokens(s.token_mask, logits.shape[-1])
    allowed = allowed | ~jnp.any(allowed, axis=-1, keepdims=True)
    logits = jnp.where(allowed, logits, -jnp.inf)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    cum = jnp.cumsum(probs_sorted, axis=-1)
    keep_sorted = ((cum - probs_sorted) < s.top_p[:, None]) | (s.top_p[:, None] >= 1.0)
    p_cut = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    masked = jnp.where(scaled >= jnp.maximum(kth, p_cut), scaled, -jnp.inf)
    keys = jax.vmap(lambda seed, c: jax.random.fold_in(jax.random.PRNGKey(seed), c))(s.seed, s.counter)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)
    sampled = jnp.argmax(masked + gumbel, axis=-1).astype(jnp.int32)
    return jnp.where(s.temperature > 0, sampled, greedy)


def old_packed_logprobs(logits, targets):
    """``packed_logprobs`` as of 2026-11-30: ``lax.top_k`` over the whole vocabulary."""
    import jax
    import jax.numpy as jnp

    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(jnp.where(jnp.isnan(logits), -jnp.inf, logits), axis=-1)
    chosen = jnp.take_along_axis(logp, targets[:, None].astype(jnp.int32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(logp, 20)
    bits = jax.lax.bitcast_convert_type
    return jnp.concatenate([bits(chosen, jnp.int32), top_ids.astype(jnp.int32), bits(top_lp, jnp.int32)], axis=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64,128,256")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--step-ms", type=float, default=13.6, help="a decode step to compare with (S1, batch 128, v4)")
    ap.add_argument("--copy-gbs", type=float, default=None,
                    help="copy bandwidth for the floors (default: measured by torch in a child, before jax starts)")
    ap.add_argument("--impl", default="old,new", help="old (sort-based, before 2026-12-01), new, or both")
    ap.add_argument("--variants", default="",
                    help="also time the new sampler as FORM-pN (vocab_select.FORM, N pivots a round), comma-separated, "
                         "e.g. stacked-p1,siblings-p3,stored-p3,stacked-p7")
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

    from slora_jax.engine import penalties, vocab_select
    from slora_jax.engine.logprobs import PACKED_WIDTH, packed_logprobs
    from slora_jax.engine.sampling import SamplingArrays, SamplingParams, sample, sampling_arrays

    def variant(name):
        form, pivots = name.rsplit("-p", 1)

        def fn(lg, s):
            default = vocab_select.FORM, vocab_select.PIVOTS  # read when traced
            vocab_select.FORM, vocab_select.PIVOTS = form, int(pivots)
            try:
                return sample(lg, s)
            finally:
                vocab_select.FORM, vocab_select.PIVOTS = default
        return fn

    impls = {"old": (old_sample, old_packed_logprobs), "new": (sample, packed_logprobs)}
    impls = {name: impls[name] for name in args.impl.split(",")}
    impls.update({f"new {v}": (variant(v), None) for v in args.variants.split(",") if v})

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
        tok = jax.jit(lambda lg, s, st: sample(penalties.apply(lg, s, st), s))(logits, s, state)
        packed = np.asarray(jax.jit(packed_logprobs)(logits, tok))
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
        old_tok = np.asarray(jax.jit(lambda lg, s, st: old_sample(penalties.apply(lg, s, st), s))(logits, s, state))
        tokens_differ = int((old_tok != np.asarray(tok)).sum())  # 0 unless a top-p cut is within float rounding
        old_ids = np.asarray(jax.jit(old_packed_logprobs)(logits, tok))[:, 1:1 + (PACKED_WIDTH - 1) // 2]
        assert np.array_equal(old_ids, top_ids), "top-20 ids differ from lax.top_k's"
        print(f"B={B:4d} check: tokens differing old vs new {tokens_differ}/{B}, top-20 ids equal", flush=True)

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

        parts = {"empty": (lambda lg, s, st: lg[:, 0], 0)}
        for name, (samp, lp) in impls.items():
            parts[f"{name} sample"] = (lambda lg, s, st, f=samp: f(lg, s), B * V * 4 + B * V // 8)
            if lp is None:
                continue
            if name == "new":
                parts[f"{name} penalties+sample"] = (lambda lg, s, st, f=samp: f(penalties.apply(lg, s, st), s),
                                                     B * V * 13)
            parts[f"{name} logprobs"] = (lambda lg, s, st, f=lp: f(lg, lg[:, 0].astype(jnp.int32) % V), B * V * 4)
            parts[f"{name} all (step tail)"] = (
                lambda lg, s, st, f=samp, g=lp: g(lg, f(penalties.apply(lg, s, st), s)), B * V * 17)
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
                             "pct_of_step": us / (args.step_ms * 1e3) * 100, "logprob_err": err,
                             "tokens_differ_old_new": tokens_differ})
            print(f"B={B:4d} {name:24s} {us:9.1f} us  floor {floor:7.1f} us  {us / (args.step_ms * 1e3) * 100:5.2f}%"
                  f" of a {args.step_ms} ms step", flush=True)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "device": jax.devices()[0].device_kind,
              "jax_version": jax.__version__, "git_commit": git_commit(), "vocab": V, "iters": args.iters,
              "step_ms": args.step_ms, "copy_gbs": args.copy_gbs, "copy_source": copy_source,
              "form": vocab_select.FORM, "pivots": vocab_select.PIVOTS, "search_rounds": vocab_select.search_rounds(),
              "rows": rows_out}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
