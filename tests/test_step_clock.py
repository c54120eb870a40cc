"""The engine thread's clock (``engine/step_clock.py``): host seconds per phase and, per kind of step read back,
the steps, the wait for the device and the steps the device had finished before the host asked."""

from __future__ import annotations

import math

import numpy as np

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams
from slora_jax.engine.step_clock import HOST_BOUND_WAIT_S, StepClock


def test_record_splits_the_wait_by_the_kind_read_back():
    clock = StepClock()
    clock.record((1.0, 2.0, 0.5, HOST_BOUND_WAIT_S / 2, 0.25), "prefill")  # the device was done: host-bound
    clock.record((1.0, 2.0, 0.5, 0.010, 0.25), "decode")
    clock.record((1.0, 2.0, 0.5, 0.020, 0.25), "decode")
    clock.record((1.0, 2.0, 0.5, 0.0, 0.25), None)  # the first step: nothing read back
    assert clock.by_kind["prefill"] == {"steps": 1, "wait_s": HOST_BOUND_WAIT_S / 2, "host_bound": 1}
    assert clock.by_kind["decode"]["steps"] == 2 and clock.by_kind["decode"]["host_bound"] == 0
    assert math.isclose(clock.by_kind["decode"]["wait_s"], 0.030)
    assert clock.total["dispatch"] == 8.0 and math.isclose(clock.total["wait"], 0.030 + HOST_BOUND_WAIT_S / 2)
    assert clock.last.wait == 0.0 and clock.last.append == 0.25


def test_every_step_is_read_back_once_under_its_kind(tiny_dir, adapter_dirs):
    ecfg = EngineConfig(max_batch_size=4, max_prefill_tokens=64, max_prefill_seqs=2, max_model_len=64, page_size=4,
                        max_lora_rank=32, max_loras=3, num_pages=96, dtype="float32", backend="reference")
    engine = Engine.from_model_dir(tiny_dir, ecfg, adapters=adapter_dirs, progress=False)
    rng = np.random.default_rng()
    names = [*adapter_dirs, None]
    prompts = [[int(t) for t in rng.integers(3, engine.cfg.vocab_size, size=int(rng.integers(3, 12)))]
               for _ in range(5)]
    engine.generate(prompts, adapters=[names[i % len(names)] for i in range(5)],
                    sampling=SamplingParams(temperature=0.0, max_tokens=int(rng.integers(4, 9)), ignore_eos=True))
    kinds = engine.stats()["steps_by_kind"]
    assert kinds["prefill"]["steps"] >= 3 and kinds["decode"]["steps"] >= 3  # 5 prompts, 2 a prefill step
    assert kinds["prefill"]["steps"] + kinds["decode"]["steps"] == engine.num_steps
    assert math.isclose(kinds["prefill"]["wait_s"] + kinds["decode"]["wait_s"], engine.time_in["wait"])
    assert all(0 <= k["host_bound"] <= k["steps"] for k in kinds.values())
