"""What structured output costs a batch: decode throughput with 0%, 50% and 100% of the requests under a grammar.

    PYTHONPATH=. python benchmarks/structured_serving.py --out structured.json   # Llama-2-7B shapes, one GPU
    PYTHONPATH=. python benchmarks/structured_serving.py --tiny                  # CPU smoke run

A batch of requests (random 64-token prompts, 128 new tokens, no adapter) runs to the end for each grammar fraction.
Grammar rows follow the regex ``[a-z ]{400}`` (so they are cut by max_tokens like the others, rarely ended early).
A step with a grammar row waits for the previous step before it is dispatched (its mask needs the token still on the
device), so the whole batch loses the host/device overlap: the difference between the 0% and 50% rows is that
cost; ``mask_ms`` is the host time in ``prepare_grammar_rows`` per step (the wait for the previous step included).
The model's vocabulary (32000) is served by a byte-level BPE trained on the Python standard library (``--vocab``
of benchmarks/grammar_masks.py), so masks are computed over a realistic vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from common import git_commit  # noqa: E402
from grammar_masks import train_tokenizer  # noqa: E402
from serving import random_params  # noqa: E402

REGEX = "[a-z ]{400}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (reference backend)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--fractions", default="0,0.5,1")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import slora_jax.engine.engine as engine_module
    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    from slora_jax.engine.grammar import GrammarCompiler, GrammarSpec
    from slora_jax.engine.sampling import SamplingParams
    from slora_jax.model.config import ModelConfig
    from slora_jax.tools.synth import preset_config
    from slora_jax.tools.tokenizer import load_tokenizer, write_tokenizer

    cfg = ModelConfig.from_dict(preset_config("tiny" if args.tiny else "llama-2-7b"))
    with tempfile.TemporaryDirectory() as tmp:
        t = time.monotonic()
        path = write_tokenizer(tmp, cfg.vocab_size) if args.tiny else train_tokenizer(Path(tmp), cfg.vocab_size)
        tokenizer = load_tokenizer(path)
        print(f"tokenizer of {len(tokenizer)} tokens in {time.monotonic() - t:.0f} s", flush=True)
    batch = min(args.batch, 16) if args.tiny else args.batch
    if args.tiny:
        ecfg = EngineConfig(max_batch_size=16, max_prefill_tokens=1024, max_prefill_seqs=8, max_model_len=256,
                            page_size=16, max_lora_rank=8, max_loras=2, num_pages=512, dtype="float32",
                            backend="reference", min_prefill_bucket=512, min_decode_bucket=16,
                            decode_lora_variants=False)
        dtype = jnp.float32
    else:
        ecfg = EngineConfig(max_batch_size=batch, max_prefill_tokens=2048, max_prefill_seqs=16, max_model_len=512,
                            page_size=16, max_lora_rank=16, max_loras=8, pool_bytes=16 << 30, dtype="bfloat16",
                            backend="pallas", min_prefill_bucket=1024, min_decode_bucket=batch)
        dtype = jnp.bfloat16
    engine = Engine(cfg, random_params(cfg, dtype), ecfg)
    engine.warmup(progress=True)
    compiler = GrammarCompiler(tokenizer, cfg.vocab_size, cfg.eos_token_id)
    grammar = compiler.compile(GrammarSpec("regex", REGEX))  # every request forks it

    mask_s = []
    prepare = engine_module.prepare_grammar_rows

    def timed_prepare(seqs, previous):
        t0 = time.perf_counter()
        prepare(seqs, previous)
        mask_s.append(time.perf_counter() - t0)

    engine_module.prepare_grammar_rows = timed_prepare

    def run(fraction: float, seed: int) -> dict:
        rng = np.random.default_rng(seed)
        n_grammar = int(round(fraction * batch))
        sampling = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
        for i in range(batch):
            prompt = rng.integers(3, cfg.vocab_size, size=64).tolist()
            engine.add_request(prompt, None, sampling, grammar=grammar if i < n_grammar else None)
        mask_s.clear()
        for k in engine.time_in:
            engine.time_in[k] = 0.0
        steps, tokens, decode_s = 0, 0, []
        t0 = time.perf_counter()
        while engine.has_unfinished():
            ts = time.perf_counter()
            outs = engine.step()
            if engine.last_plan is not None and engine.last_plan.kind == "decode":
                decode_s.append(time.perf_counter() - ts)
            tokens += sum(len(o.new_token_ids) for o in outs)
            steps += 1
        wall = time.perf_counter() - t0
        for rid in list(engine.requests):
            engine.release(rid)
        return {"grammar_fraction": fraction, "grammar_rows": n_grammar, "tokens": tokens, "wall_s": wall,
                "tokens_per_s": tokens / wall, "steps": steps,
                "decode_step_ms_median": 1e3 * float(np.median(decode_s)) if decode_s else None,
                "mask_ms_per_step": 1e3 * float(np.mean(mask_s)) if mask_s else 0.0,
                "host_s": {k: round(v, 4) for k, v in engine.time_in.items()}}

    run(0.5, seed=99)  # untimed: first dispatches, llguidance's thread pool
    results = []
    for f in [float(x) for x in args.fractions.split(",")]:
        res = run(f, seed=1)
        results.append(res)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)
    assert engine.compiles_since_warmup() == 0, "compiled while serving"
    if args.out:
        Path(args.out).write_text(json.dumps({"commit": git_commit(), "device": jax.devices()[0].device_kind,
                                              "batch": batch, "new_tokens": args.new_tokens, "regex": REGEX,
                                              "results": results}, indent=2))


if __name__ == "__main__":
    main()
