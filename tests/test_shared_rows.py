"""Decode rows of one adapter served by one LoRA program (``pallas-shared-rows``), end to end in the engine: the
scheduler puts each adapter's rows next to each other, the shared kernel runs, and the tokens are those of the jnp
reference backend. CPU: interpret mode, the tiny model (the kernel itself is checked in test_lora_fused)."""

from __future__ import annotations

import numpy as np

from pallas_kernels import lora_fused
from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams


def _engine(tiny_dir, adapter_dirs, backend):
    ecfg = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=8, max_model_len=48, page_size=4,
                        max_lora_rank=16, max_loras=4, num_pages=256, dtype="float32", backend=backend)
    engine = Engine.from_model_dir(tiny_dir, ecfg, progress=False)
    for name in ("r8-all7", "r4-qkvo", "r16-rslora"):
        engine.store.register(name, str(adapter_dirs[name]))
    return engine


def test_runs_of_one_adapter_decode_as_the_reference(tiny_dir, adapter_dirs, monkeypatch, rng):
    traced = []
    kernel = lora_fused._shared_kernel

    def counting(*args, **kw):
        traced.append(kw["g"].shared_rows)
        return kernel(*args, **kw)

    monkeypatch.setattr(lora_fused, "_shared_kernel", counting)
    # interleaved on purpose: the scheduler, not the caller, makes the runs
    adapters = ["r8-all7", "r4-qkvo", None, "r8-all7", "r16-rslora", "r8-all7", "r4-qkvo", "r8-all7"]
    prompts = [[int(t) for t in rng.integers(3, 200, size=rng.integers(3, 9))] for _ in adapters]
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    engine = _engine(tiny_dir, adapter_dirs, "pallas-shared-rows")
    try:
        ids = [engine.add_request(p, a, greedy) for p, a in zip(prompts, adapters, strict=True)]
        decode_slots = []
        while engine.has_unfinished():
            engine.step()
            plan = engine.last_plan
            if plan is not None and plan.kind == "decode":
                decode_slots.append([s.adapter_slot for s in plan.seqs])
        got = [engine.requests.pop(i).output_ids for i in ids]
    finally:
        engine.store.close()
    assert traced and set(traced) == {4}, traced
    assert decode_slots and all(s == sorted(s) for s in decode_slots), decode_slots
    assert max(np.unique(s, return_counts=True)[1].max() for s in decode_slots) == 4  # a run of 4 rows: one program

    reference = _engine(tiny_dir, adapter_dirs, "reference")
    try:
        want = reference.generate(prompts, adapters, greedy)
    finally:
        reference.store.close()
    assert got == want
    assert all(len(g) == 5 for g in got)
