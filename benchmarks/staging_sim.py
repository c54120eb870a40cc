"""Do pool loads use adapter pages staged on IO threads? Saturation on CPU: tiny model, 400 S2 adapters (ranks
64/32/16/8), 300 requests arriving at once.

    PYTHONPATH=.:benchmarks python benchmarks/staging_sim.py

Prints the store's counts (loads, staged_loads, staged_dropped) and the engine thread's time per step phase. A load
that finds no staged pages copies the adapter on the engine thread: on the H200 that was 9 s of a 42 s trace at
2000 rank-64 adapters (benchmarks/NOTES.md, serving v3). Needs no GPU: the counts do not depend on the device.
"""

from __future__ import annotations

import time
import zlib

import jax
import numpy as np
from workload import make_trace

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams
from slora_jax.lora.synthetic import SyntheticAdapterSource
from slora_jax.model.config import ATTN_MODULES, ModelConfig
from slora_jax.model.llama import init_params
from slora_jax.tools.synth import preset_config


def main(n_adapters: int = 400, n_requests: int = 300) -> None:
    cfg = ModelConfig.from_dict(preset_config("tiny"))
    ecfg = EngineConfig(max_batch_size=16, max_prefill_tokens=1024, max_prefill_seqs=8, max_model_len=1024,
                        page_size=16, max_lora_rank=64, max_loras=32, num_pages=1024, dtype="float32",
                        backend="reference", min_prefill_bucket=64)
    engine = Engine(cfg, init_params(cfg, jax.random.PRNGKey(0)), ecfg)
    engine.warmup(progress=False)
    names = [f"a{i}" for i in range(n_adapters)]
    ranks = (64, 32, 16, 8)
    for i, name in enumerate(names):
        engine.store.register(name, SyntheticAdapterSource(cfg, ranks[i % len(ranks)], ATTN_MODULES,
                                                           seed=zlib.crc32(name.encode())))
    trace = make_trace(n_adapters, 1000.0, n_requests, alpha=1.0, cv=1.0, in_range=(8, 64), out_range=(8, 64), seed=0)
    rng = np.random.default_rng(1)
    for r in trace:
        engine.add_request(rng.integers(3, cfg.vocab_size, size=r.prompt_len).tolist(), names[r.adapter],
                           SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
    t = time.monotonic()
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    store = stats["adapters"]
    print(f"{time.monotonic() - t:.1f} s: loads {store['loads']}, staged_loads {store['staged_loads']}, prefetch_loads "
          f"{store['prefetch_loads']}, evictions {store['evictions']}, staged_dropped {store['staged_dropped']}; "
          "engine-thread seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in stats["step_seconds"].items()))


if __name__ == "__main__":
    main()
