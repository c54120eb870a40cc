"""The engine end to end on CPU: continuous batching over many adapters equals HF PEFT, request by request."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hf_reference import hf_generate

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams
from slora_jax.model.adapter_weights import LoraAdapter

GREEDY = dict(temperature=0.0, ignore_eos=True)

# A pool small enough that adapters are evicted and reloaded: 3 adapter slots for 6 adapters.
SMALL = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=4, max_model_len=64, page_size=4,
                     max_lora_rank=32, max_loras=3, num_pages=96, dtype="float32", backend="pallas")


@pytest.fixture(scope="module")
def engine(tiny_dir, adapter_dirs):
    eng = Engine.from_model_dir(tiny_dir, SMALL, adapters=adapter_dirs, progress=False)
    eng.warmup(progress=False)
    return eng


def _prompt(rng, vocab, lo=3, hi=20):
    return [int(t) for t in rng.integers(3, vocab, size=int(rng.integers(lo, hi)))]


def test_staggered_mixed_adapters_with_eviction_match_peft(engine, tiny_dir, adapter_dirs):
    rng = np.random.default_rng()
    names = list(adapter_dirs) + [None, None]
    start_compiles = engine.compiles_since_warmup()
    evictions0 = engine.store.stats()["evictions"]
    requests, done = {}, {}
    plan = [(step, names[i % len(names)], _prompt(rng, engine.cfg.vocab_size), int(rng.integers(8, 24)))
            for i, step in enumerate(sorted(rng.integers(0, 12, size=14)))]
    step = 0
    while plan or engine.has_unfinished():
        while plan and plan[0][0] <= step:
            _, adapter, prompt, n = plan.pop(0)
            rid = engine.add_request(prompt, adapter, SamplingParams(max_tokens=n, **GREEDY))
            requests[rid] = (adapter, prompt, n)
        for out in engine.step():
            assert out.error is None, out.error
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    assert engine.store.stats()["evictions"] > evictions0, "the pool should have forced adapter evictions"
    assert engine.compiles_since_warmup() == start_compiles
    for rid, (adapter, prompt, n) in requests.items():
        expected = hf_generate(tiny_dir, prompt, n, adapter_dirs[adapter] if adapter else None)
        assert done[rid] == expected, (adapter, rid)
    assert engine.pool.stats()["pages_kv"] == 0


@pytest.mark.parametrize("adapters, variant", [
    (["r4-qkvo", "r32-qv", None], "attn"),  # attention-only adapters: no MLP LoRA kernels
    ([None, None], "none"),  # base model only: no LoRA kernels at all
    (["r4-qkvo", "patterns", None], "all"),  # one adapter with down_proj: every kernel
])
def test_decode_runs_the_smallest_lora_variant_covering_its_batch(engine, tiny_dir, adapter_dirs, adapters, variant):
    rng = np.random.default_rng()
    seen = []
    decode = engine.runner.decode

    def spy(*args, lora="all", **kw):
        seen.append(lora)
        return decode(*args, lora=lora, **kw)

    engine.runner.decode = spy
    try:
        prompts = [_prompt(rng, engine.cfg.vocab_size) for _ in adapters]
        outs = engine.generate(prompts, adapters, SamplingParams(max_tokens=6, **GREEDY))
    finally:
        del engine.runner.decode
    assert seen and set(seen) == {variant}
    for adapter, prompt, ours in zip(adapters, prompts, outs, strict=True):
        assert ours == hf_generate(tiny_dir, prompt, 6, adapter_dirs[adapter] if adapter else None), adapter


def test_lora_variant_is_the_smallest_cover():
    from slora_jax.engine.step_runner import lora_variant
    from slora_jax.model.config import MODULES

    def mask(*names):
        return np.array([m in names for m in MODULES])

    assert lora_variant(mask()) == "none"
    assert lora_variant(mask("q_proj", "v_proj")) == "attn"
    assert lora_variant(mask("q_proj", "k_proj", "v_proj", "o_proj")) == "attn"
    assert lora_variant(mask("up_proj")) == "all"
    assert lora_variant(mask("q_proj", "down_proj")) == "all"


def test_200_mixed_requests_compile_nothing_after_warmup(engine):
    rng = np.random.default_rng()
    before = engine.compiles_since_warmup()
    names = list(engine.store.names()) + [None]
    prompts = [_prompt(rng, engine.cfg.vocab_size, 1, 40) for _ in range(200)]
    adapters = [names[int(i)] for i in rng.integers(0, len(names), size=200)]
    samplings = [SamplingParams(max_tokens=int(rng.integers(1, 8)), temperature=float(rng.choice([0.0, 0.8])),
                                top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])), seed=i)
                 for i in range(200)]
    outs = engine.generate(prompts, adapters, samplings)
    assert all(1 <= len(o) <= s.max_tokens for o, s in zip(outs, samplings, strict=True))
    assert engine.compiles_since_warmup() == before == 0


def test_abort_frees_pages_and_pins(engine):
    start = engine.pool.stats()
    rng = np.random.default_rng()
    ids = [engine.add_request(_prompt(rng, engine.cfg.vocab_size), name, SamplingParams(max_tokens=30, **GREEDY))
           for name in list(engine.store.names())[:3] + [None]]
    for _ in range(3):
        engine.step()
    assert engine.pool.stats()["pages_kv"] > 0
    for rid in ids:
        assert engine.abort(rid)
    assert not engine.has_unfinished()
    after = engine.pool.stats()
    assert after["pages_kv"] == start["pages_kv"] == 0
    assert engine.store.stats()["pinned"] == 0
    assert after["pages_free"] + after["pages_adapter"] == start["pages_free"] + start["pages_adapter"]


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(engine):
    rng = np.random.default_rng()
    prompt = _prompt(rng, engine.cfg.vocab_size)
    sampled = SamplingParams(max_tokens=12, temperature=1.5, seed=1234, ignore_eos=True)
    a, b = engine.generate([prompt, prompt], ["r8-all7", "r8-all7"], sampled)
    assert a == b
    other = engine.generate([prompt], ["r8-all7"], SamplingParams(max_tokens=12, temperature=1.5, seed=99,
                                                                   ignore_eos=True))[0]
    assert other != a
    greedy = engine.generate([prompt], ["r8-all7"], SamplingParams(max_tokens=12, **GREEDY))[0]
    top1 = engine.generate([prompt], ["r8-all7"], SamplingParams(max_tokens=12, temperature=2.0, top_k=1, seed=5,
                                                                  ignore_eos=True))[0]
    assert top1 == greedy


def test_stop_token_ids_end_the_request(engine):
    rng = np.random.default_rng()
    prompt = _prompt(rng, engine.cfg.vocab_size)
    free = engine.generate([prompt], [None], SamplingParams(max_tokens=10, **GREEDY))[0]
    stopped = engine.generate([prompt], [None], SamplingParams(max_tokens=10, stop_token_ids=(free[4],), **GREEDY))[0]
    assert stopped == free[: free.index(free[4]) + 1]


def test_unknown_adapter_and_bad_requests_are_rejected(engine):
    with pytest.raises(KeyError):
        engine.add_request([5, 6], "no-such-adapter")
    with pytest.raises(ValueError):
        engine.add_request([], None)
    with pytest.raises(ValueError):
        engine.add_request([5] * 60, None, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError):
        engine.add_request([5, 6], None, SamplingParams(top_p=0.0))


def test_in_memory_adapter_source(engine, tiny_dir, adapter_dirs):
    from slora_jax.lora.peft import load_peft_adapter

    adapter = load_peft_adapter(adapter_dirs["r32-qv"], engine.cfg)
    engine.store.register("in-memory", LoraAdapter("in-memory", adapter.modules))
    rng = np.random.default_rng()
    prompt = _prompt(rng, engine.cfg.vocab_size)
    ours = engine.generate([prompt], ["in-memory"], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert ours == hf_generate(tiny_dir, prompt, 8, adapter_dirs["r32-qv"])


def test_preemption_by_recompute_matches_peft(tiny_dir, adapter_dirs):
    """KV pages for ~2 full sequences while 6 run: the newest are preempted and recomputed, outputs unchanged."""
    ecfg = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=8, max_model_len=64, page_size=4,
                        max_lora_rank=32, max_loras=2, num_pages=44, dtype="float32", backend="reference")
    eng = Engine.from_model_dir(tiny_dir, ecfg, adapters={"r4": adapter_dirs["r4-qkvo"]}, progress=False)
    rng = np.random.default_rng()
    jobs = [(["r4", None][i % 2], _prompt(rng, eng.cfg.vocab_size, 6, 14)) for i in range(6)]
    outs = eng.generate([p for _, p in jobs], [a for a, _ in jobs], SamplingParams(max_tokens=28, **GREEDY))
    assert eng.scheduler.num_preemptions > 0
    for (adapter, prompt), ours in zip(jobs, outs, strict=True):
        assert ours == hf_generate(tiny_dir, prompt, 28, adapter_dirs["r4-qkvo"] if adapter else None)
    assert eng.pool.stats()["pages_kv"] == 0


def test_unrolled_layer_loop_gives_the_same_tokens(tiny_dir, adapter_dirs):
    """layer_loop="unroll" (per-layer weights) serves exactly what the scanned stack serves."""
    base = EngineConfig(max_batch_size=4, max_prefill_tokens=64, max_prefill_seqs=4, max_model_len=64, page_size=4,
                        max_lora_rank=32, max_loras=2, num_pages=256, dtype="float32", backend="reference")
    rng = np.random.default_rng()
    prompts = [_prompt(rng, 512) for _ in range(3)]
    adapters = ["r8-all7", None, "r4-qkvo"]
    outs = []
    for loop in ("scan", "unroll"):
        eng = Engine.from_model_dir(tiny_dir, dataclasses.replace(base, layer_loop=loop),
                                    adapters={k: adapter_dirs[k] for k in ("r8-all7", "r4-qkvo")}, progress=False)
        outs.append(eng.generate(prompts, adapters, SamplingParams(max_tokens=10, **GREEDY)))
    assert outs[0] == outs[1]


def test_decode_with_rope_and_kv_write_in_the_attention_kernel_matches_peft(tiny_dir, adapter_dirs):
    """The GPU default (``decode_rope_in_attention``): decode's attention kernel rotates q and k and writes the new
    K/V itself. Off by default here (interpret mode copies the aliased pool every grid step), so switched on: greedy
    tokens of two sequences, one with an adapter, equal HF PEFT's."""
    ecfg = dataclasses.replace(SMALL, decode_rope_in_attention=True, max_loras=1, decode_lora_variants=False)
    eng = Engine.from_model_dir(tiny_dir, ecfg, adapters={"r8-all7": adapter_dirs["r8-all7"]}, progress=False)
    assert eng.runner.decode_spec.rope_in_attention
    rng = np.random.default_rng()
    prompts, n = [_prompt(rng, eng.cfg.vocab_size) for _ in range(2)], 10
    got = eng.generate(prompts, ["r8-all7", None], SamplingParams(max_tokens=n, **GREEDY))
    assert got[0] == hf_generate(tiny_dir, prompts[0], n, adapter_dirs["r8-all7"])
    assert got[1] == hf_generate(tiny_dir, prompts[1], n, None)


def test_a_lone_sequence_in_a_padded_decode_bucket_matches_peft(tiny_dir, adapter_dirs):
    """The GPU default decodes one sequence in a 4-row step (``min_decode_bucket``): the three padding rows carry no
    context and no adapter, and must change nothing of the real row's tokens."""
    ecfg = dataclasses.replace(SMALL, min_decode_bucket=4, max_loras=1, decode_lora_variants=False)
    eng = Engine.from_model_dir(tiny_dir, ecfg, adapters={"r8-all7": adapter_dirs["r8-all7"]}, progress=False)
    assert eng.runner.ecfg.decode_buckets[0] == 4
    rng = np.random.default_rng()
    prompt, n = _prompt(rng, eng.cfg.vocab_size), 12
    got = eng.generate([prompt], ["r8-all7"], SamplingParams(max_tokens=n, **GREEDY))[0]
    assert got == hf_generate(tiny_dir, prompt, n, adapter_dirs["r8-all7"])


def test_midpoint_buckets_pad_less_and_match_peft(tiny_dir, adapter_dirs):
    """Buckets at 3/2 of a power of two (the GPU default from 512 prefill rows and 128 decode rows, here from 32 and
    4): four prompts of 9-11 tokens prefill in a 48-row step and five sequences decode in 6-row steps, not 64 and 8;
    the tiles of a step that is not a power of two, and its padding rows, change nothing of the tokens. Tiles set
    (16 rows) so that the GPU suite runs the same 48-row step."""
    ecfg = dataclasses.replace(SMALL, prefill_mid_buckets_from=32, decode_mid_buckets_from=4, min_prefill_bucket=16,
                               min_decode_bucket=1, lora_block_t=16, attn_block_q=16, decode_lora_variants=False)
    names = list(adapter_dirs)[:2]
    eng = Engine.from_model_dir(tiny_dir, ecfg, adapters={n: adapter_dirs[n] for n in names}, progress=False)
    assert eng.runner.ecfg.prefill_buckets == (16, 32, 48, 64) and eng.runner.ecfg.decode_buckets == (1, 2, 4, 6, 8)
    rows = {"prefill": [], "decode": []}
    for kind in rows:
        build = getattr(eng.runner, f"build_{kind}")

        def spy(items, *a, _build=build, _kind=kind, **kw):
            out = _build(items, *a, **kw)
            rows[_kind].append(int(out[0].tokens.shape[0]))
            return out
        setattr(eng.runner, f"build_{kind}", spy)
    rng = np.random.default_rng()
    prompts, n = [_prompt(rng, eng.cfg.vocab_size, 9, 12) for _ in range(5)], 8
    adapters = [names[0], None, names[1], names[0], None]
    got = eng.generate(prompts, adapters, SamplingParams(max_tokens=n, **GREEDY))
    assert 48 in rows["prefill"] and 6 in rows["decode"], rows
    for prompt, adapter, ours in zip(prompts, adapters, got, strict=True):
        assert ours == hf_generate(tiny_dir, prompt, n, adapter_dirs[adapter] if adapter else None), adapter
