"""The step's input at one device address per size (engine/stable_inputs.py): each put holds exactly its values in
the same buffer, and an engine serving through it gives the same tokens as one without it, compiling nothing after
warm-up and leaving the warm-up's ahead/run compile counts as they were."""

from __future__ import annotations

import numpy as np
from store_helpers import logged_rng
from test_parallel_warmup import ECFG, _requests, _serve

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.stable_inputs import StableInputs


def test_each_put_holds_its_values_at_one_address_per_size():
    rng = logged_rng("stable inputs")
    stable = StableInputs()
    stable.prepare([5, 9, 5])
    addresses = {}
    for _ in range(6):
        n = int(rng.choice([5, 9]))
        host = rng.integers(-2**31, 2**31 - 1, n, dtype=np.int64).astype(np.int32)
        got = stable.put(host)
        assert got.dtype == np.int32 and np.array_equal(np.asarray(got), host)
        addresses.setdefault(n, set()).add(got.unsafe_buffer_pointer())
    assert all(len(a) == 1 for a in addresses.values()), addresses


def test_an_engine_on_stable_inputs_serves_the_same_tokens(tiny_dir, tiny_cfg, adapter_dirs):
    rng = logged_rng("stable inputs engine")
    requests = _requests(rng, tiny_cfg.vocab_size, "r8-all7")
    served, stats = {}, {}
    for stable in (False, True):
        ecfg = EngineConfig(**ECFG, decode_lora_variants=False, stable_step_inputs=stable)
        engine = Engine.from_model_dir(tiny_dir, ecfg, adapters={"r8-all7": adapter_dirs["r8-all7"]}, progress=False)
        assert (engine.runner._stable is not None) == stable  # noqa: SLF001 - the switch reached the runner
        engine.warmup(progress=False)
        stats[stable] = {k: v for k, v in engine.runner.warmup_stats.items() if k != "run_cache_hits"}
        served[stable] = _serve(engine, requests)
        assert engine.compiles_since_warmup() == 0
    assert served[True] == served[False] and all(tokens for tokens, _ in served[True])
    assert stats[True]["run_compiles"] == stats[False]["run_compiles"], stats
