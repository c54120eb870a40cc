"""Does a compiled step update the pool in place? Lists every op that produces a pool-shaped buffer.

    PYTHONPATH=. python benchmarks/memcheck.py [reference|pallas] [preset] [num_pages]

A step that copies the pool needs twice its memory and a full pass over it per copy: the pool must stay in place.
"""

from __future__ import annotations

import collections
import sys

import jax

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.step_runner import StepItem, pack_inputs
from slora_jax.model.config import ModelConfig
from slora_jax.model.llama import init_params
from slora_jax.tools.synth import preset_config


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "pallas"
    preset = sys.argv[2] if len(sys.argv) > 2 else "tiny"
    num_pages = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
    cfg = ModelConfig.from_dict(preset_config(preset))
    tiny = preset == "tiny"
    tiles = {} if tiny else dict(lora_block_t=64, attn_block_q=128)
    ecfg = EngineConfig(max_batch_size=16, max_prefill_tokens=256 if not tiny else 64, max_prefill_seqs=4,
                        max_model_len=256 if not tiny else 64, page_size=16, max_lora_rank=16, max_loras=4,
                        num_pages=num_pages, dtype="float32" if tiny else "bfloat16", backend=backend,
                        min_decode_bucket=16, min_prefill_bucket=64, **tiles)
    if tiny:
        params = init_params(cfg, jax.random.PRNGKey(0))
    else:
        from serving import random_params

        params = random_params(cfg, jax.numpy.bfloat16)
    eng = Engine(cfg, params, ecfg)
    dt = "f32" if tiny else "bf16"
    shape = f"{dt}[{','.join(map(str, eng.pool.array.shape))}]"
    item = StepItem([5, 6, 7], 0, [1], -1, None, 0, 0)
    for kind in ("decode", "prefill"):
        build = eng.runner.build_decode if kind == "decode" else eng.runner.build_prefill
        packed, layout = pack_inputs(*build([item]))
        comp = eng.runner.step_fn(kind).lower(layout, eng.params, eng.pool.array, eng.pool.table, packed,
                                              eng.runner._no_prev, eng.runner.penalty_state).compile()
        ma = comp.memory_analysis()
        ops = collections.Counter()
        for line in comp.as_text().split("\n"):
            if "=" in line and line.split("=", 1)[1].strip().startswith(shape):
                rhs = line.split("=", 1)[1].strip()[len(shape):].lstrip("{0123456789,}").strip()
                op = rhs.split("(")[0]
                ops[op] += 1
                if "copy" in op or "custom" in op:
                    print("  ", line.strip()[:240])
        print(f"{backend} {preset} {kind}: pool {eng.pool.array.nbytes / 2**20:.1f} MiB, temp "
              f"{ma.temp_size_in_bytes / 2**20:.1f} MiB, alias {ma.alias_size_in_bytes / 2**20:.1f} MiB; "
              f"pool-shaped ops {dict(ops)}", flush=True)


if __name__ == "__main__":
    main()
