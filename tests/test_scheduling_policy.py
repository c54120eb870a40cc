"""A scheduling policy is one class plus one config value, and everything that asks "who is next" follows it:
admission, and the adapter prefetch for the head of the queue."""

from __future__ import annotations

import numpy as np
import pytest

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.policies import FCFS, POLICIES, Policy, PolicyContext, make_policy, register_policy
from slora_jax.engine.sampling import SamplingParams


@register_policy("test-shortest-prompt-first")
class ShortestPromptFirst(Policy):
    """Reorders admission: shortest prompt first (ties by arrival)."""

    def order(self, waiting):
        return iter(sorted(waiting, key=lambda s: len(s.prompt_ids)))


CFG = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=1, max_model_len=64, page_size=4,
                   max_lora_rank=32, max_loras=3, num_pages=96, dtype="float32", backend="reference",
                   scheduling_policy="test-shortest-prompt-first")
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def test_registry_makes_known_policies_and_names_the_known_ones():
    ctx = PolicyContext(CFG)
    assert isinstance(make_policy("fcfs", ctx), FCFS)
    assert isinstance(make_policy("test-shortest-prompt-first", ctx), ShortestPromptFirst)
    with pytest.raises(ValueError, match="fcfs"):
        make_policy("no-such-policy", ctx)
    with pytest.raises(ValueError, match="already registered"):
        register_policy("fcfs")(FCFS)
    assert "fcfs" in POLICIES


def test_policy_orders_admission_and_prefetch(tiny_dir, adapter_dirs):
    engine = Engine.from_model_dir(tiny_dir, CFG, adapters=adapter_dirs, progress=False)
    assert isinstance(engine.scheduler.policy, ShortestPromptFirst)
    rng = np.random.default_rng()
    adapters = ["r4-qkvo", "r8-all7", "r32-qv", "patterns"]
    lengths = [17, 5, 11, 8]  # arrival order; the policy wants 5, 8, 11, 17
    prefetched: list[list[str]] = []
    prefetch = engine.store.prefetch

    def spy(names, **kw):
        names = list(names)
        prefetched.append(names)
        return prefetch(names, **kw)

    engine.store.prefetch = spy
    ids = [engine.add_request([int(t) for t in rng.integers(3, engine.cfg.vocab_size, size=n)], a, GREEDY)
           for n, a in zip(lengths, adapters, strict=True)]
    by_id = dict(zip(ids, zip(lengths, adapters, strict=True), strict=True))
    want = sorted(zip(lengths, adapters, strict=True))

    # prefetch (one head slot: max_prefill_seqs=1) always asked for the policy's head, not the oldest request
    assert prefetched[-1] == [want[0][1]]
    admitted = []
    while engine.has_unfinished():
        prefetched.clear()
        engine.step()
        plan = engine.last_plan
        if plan is not None and plan.kind == "prefill":
            admitted += [by_id[s.request_id] for s in plan.seqs]
            waiting = sorted((len(s.prompt_ids), s.adapter) for s in engine.scheduler.waiting)
            if waiting:  # after this dispatch, prefetch prepared the new head in the policy's order
                assert prefetched and prefetched[-1] == [waiting[0][1]]
    assert admitted == want
    del engine.store.prefetch
