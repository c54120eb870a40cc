"""Where does a prefill step's time go? One Llama-2-7B prefill step of the size serving runs at saturation, timed
against its floor and profiled kernel by kernel.

    PYTHONPATH=.:benchmarks python benchmarks/prefill_profile.py --segments 2:256,1:2048 --out prefill.jsonl
    PYTHONPATH=.:benchmarks python benchmarks/prefill_profile.py --tiny --segments 2:16    # CPU smoke run

Why (benchmarks/NOTES.md, session 13): at S1 n=2000 saturation the prefill steps are 37% of the trace at ~1.8x their
matmul floor, and a prefill step admits ~2 prompts of ~257 tokens. Each ``--segments N:T`` case is one step of N
prompts of T tokens (each on its own adapter, rank 8 q,k,v,o unless told), timed as one jitted call (pool donated,
batch on the device) with and without LoRA, beside its floor: max(weights over the copy bandwidth, 2 x tokens x
matmul parameters over the bf16 matmul rate, both measured here with torch). The device trace groups its kernels
into GEMMs, LoRA, attention, fusions and copies (``decode_profile.py``'s categories).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import time
import zlib

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from common import device_ceilings, git_commit  # noqa: E402
from decode_profile import NO_KERNELS, kernel_profile, print_kernel_profile  # noqa: E402


def parse_segments(text: str) -> list[tuple[int, int]]:
    """``"2:256,1:2048"`` -> [(2, 256), (1, 2048)]: cases of N prompts of T tokens."""
    cases = []
    for part in text.split(","):
        n, t = part.split(":")
        if int(n) < 1 or int(t) < 1:
            raise ValueError(f"bad case {part!r}: N and T must be >= 1")
        cases.append((int(n), int(t)))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--segments", default="2:256,4:256,1:512,1:2048")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--all7", action="store_true", help="adapters on all 7 projections (default q,k,v,o)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="append one JSON line per case here")
    ap.add_argument("--top", type=int, default=15, help="kernels kept by name in the JSON (costliest first)")
    ap.add_argument("--backend", default="pallas",
                    help="kernel backend (pallas: Mosaic GPU prefill attention from 2048 rows on Hopper; "
                         "pallas-triton: Triton always)")
    args = ap.parse_args()
    cases = parse_segments(args.segments)
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
    from slora_jax.engine.step_runner import StepItem, pack_inputs
    from slora_jax.lora.synthetic import SyntheticAdapterSource
    from slora_jax.model.config import ATTN_MODULES, MODULES, ModelConfig
    from slora_jax.model.llama import init_params
    from slora_jax.model.params import param_bytes
    from slora_jax.tools.synth import preset_config

    cfg = ModelConfig.from_dict(preset_config("tiny" if args.tiny else "llama-2-7b"))
    buckets = sorted(1 << max(4, (n * t - 1).bit_length()) for n, t in cases)  # each case's rows, a power of 2
    buckets[-1] = max(buckets[-1], 64)  # max_model_len (= the largest bucket) must hold a prompt and a few tokens
    gpu_tiles = default_tiles("pallas", "gpu")
    ecfg = EngineConfig(max_batch_size=16, max_prefill_tokens=buckets[-1], min_prefill_bucket=buckets[0],
                        max_prefill_seqs=16,
                        max_model_len=buckets[-1], page_size=16, max_lora_rank=64,
                        max_loras=16, pool_bytes=(256 << 20) if args.tiny else (24 << 30),
                        dtype="float32" if args.tiny else "bfloat16", backend=args.backend,
                        lora_block_t=gpu_tiles["lora_block_t"], attn_block_q=gpu_tiles["attn_block_q"])
    if args.tiny:
        params = init_params(cfg, jax.random.PRNGKey(0))
    else:
        from serving import random_params

        params = random_params(cfg, jnp.bfloat16)
    weight_bytes = param_bytes(params) - params["embed"].nbytes
    matmul_params = (weight_bytes - params["lm_head"].nbytes) // 2 if "lm_head" in params else weight_bytes // 2
    eng = Engine(cfg, params, ecfg)
    del params
    targets = tuple(MODULES) if args.all7 else tuple(ATTN_MODULES)
    slots = []
    for i in range(max(n for n, _ in cases)):
        name = f"a{i}"
        eng.store.register(name, SyntheticAdapterSource(cfg, args.rank, targets, seed=zlib.crc32(name.encode())))
        slots.append(eng.store.acquire(name))
    runner, rng = eng.runner, np.random.default_rng(0)
    state = {"pool": eng.pool.array}
    prev = jnp.zeros(runner.out_rows, jnp.int32)  # a prefill takes no token from a previous step

    for n_seqs, n_tok in cases:
        items, held = [], []
        for i in range(n_seqs):
            pages = eng.pool.alloc_kv_pages(pages_for(n_tok, ecfg.page_size))
            held.extend(pages)
            items.append(StepItem(rng.integers(3, cfg.vocab_size, n_tok).tolist(), 0, pages, slots[i],
                                  SamplingParams(temperature=0.0), 0, 0))
        base_items = [StepItem(it.tokens, 0, it.pages, -1, it.sampling, 0, 0) for it in items]

        def prepared(its):
            batch, s = runner.build_prefill(its)
            packed, layout = pack_inputs(batch, s)
            return jnp.asarray(packed), layout, int(batch.tokens.shape[0])

        packed, layout, n_rows = prepared(items)
        packed_base, layout_base, _ = prepared(base_items)

        def run(p, lay):
            out, runner.penalty_state, state["pool"] = runner.step_fn("prefill")(
                lay, eng.params, state["pool"], eng.pool.table, p, prev, runner.penalty_state)
            return out.tokens

        def timed(p, lay):
            run(p, lay).block_until_ready()  # compile (once per bucket) and a first run
            t0 = time.perf_counter()
            for _ in range(args.iters):
                out = run(p, lay)
            out.block_until_ready()
            return (time.perf_counter() - t0) / args.iters * 1e3

        lora_ms, base_ms = timed(packed, layout), timed(packed_base, layout_base)
        prof = (NO_KERNELS if args.tiny  # kernels: GPU only
                else kernel_profile(functools.partial(run, packed, layout), top=args.top))
        tokens = n_seqs * n_tok
        mem_ms = weight_bytes / (bw * 1e9) * 1e3
        mm_ms = 2 * tokens * matmul_params / (mm * 1e12) * 1e3
        floor_ms = max(mem_ms, mm_ms)
        row = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), case=f"{n_seqs}x{n_tok}",
                   tokens=tokens, rows=n_rows,
                   device=jax.devices()[0].device_kind, jax=jax.__version__, commit=git_commit(), backend=args.backend,
                   xla_flags=os.environ.get("XLA_FLAGS", ""), rank=args.rank,
                   targets=len(targets), step_ms=round(lora_ms, 3), no_lora_ms=round(base_ms, 3),
                   lora_share=round(lora_ms / base_ms - 1, 3), floor_ms=round(floor_ms, 3),
                   floor_weights_ms=round(mem_ms, 3), floor_matmul_ms=round(mm_ms, 3),
                   x_floor=round(lora_ms / floor_ms, 2) if floor_ms == floor_ms else None, copy_gbps=bw,
                   matmul_tflops=mm, **prof)
        print(f"\n== {row['case']} ({tokens} tokens): step {lora_ms:.2f} ms, without LoRA {base_ms:.2f} ms "
              f"(LoRA +{100 * row['lora_share']:.0f}%), floor {floor_ms:.2f} ms (weights {mem_ms:.2f}, matmul "
              f"{mm_ms:.2f}) -> x{row['x_floor']}")
        print_kernel_profile(prof, 8)
        eng.pool.free_kv_pages(held)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
