"""The persistent compilation cache: a second process with the same engine shapes loads its compiled steps from disk
instead of compiling them (a server restart skips its warm-up compiles)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys, time
    from slora_jax.engine import compile_counter
    compile_counter.enable_persistent_cache(sys.argv[2])
    import jax
    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    backend = "pallas" if jax.default_backend() == "gpu" else "reference"  # on a GPU: Triton kernels cached too
    ecfg = EngineConfig(max_batch_size=2, max_prefill_tokens=32, max_prefill_seqs=2, max_model_len=32, page_size=4,
                        max_lora_rank=8, max_loras=2, num_pages=64, dtype="float32", backend=backend,
                        min_prefill_bucket=32, decode_lora_variants=False)
    engine = Engine.from_model_dir(sys.argv[1], ecfg, progress=False)
    compiles, hits, t = compile_counter.compile_count(), compile_counter.cache_hits(), time.monotonic()
    engine.warmup(progress=False)
    print(json.dumps({"compiles": compile_counter.compile_count() - compiles,
                      "hits": compile_counter.cache_hits() - hits, "seconds": time.monotonic() - t}))
""")


def _warm(tiny_dir, cache_dir) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_dir), str(cache_dir)], capture_output=True,
                         text=True, env=dict(os.environ), timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_restart_loads_its_warmup_compiles_from_the_cache(tiny_dir, tmp_path):
    cold = _warm(tiny_dir, tmp_path / "xla")
    assert cold["compiles"] > 0 and cold["hits"] == 0
    assert any((tmp_path / "xla").iterdir()), "the cold start wrote nothing to the cache"
    warm = _warm(tiny_dir, tmp_path / "xla")
    assert warm["compiles"] == cold["compiles"] and warm["hits"] == warm["compiles"], (cold, warm)
