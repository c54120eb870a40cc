"""n samples of one prompt (engine/forks.py): one prefill whose full prompt pages the samples share, a seed stream per
sample, room counted once, everything freed at the end; checked against separate requests and HF PEFT."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hf_reference import hf_generate

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine, QueueFull
from slora_jax.engine.forks import MAX_SAMPLES, add_samples, group_pages, sample_ids, sample_seed
from slora_jax.engine.sampling import SamplingParams
from slora_jax.engine.scheduler import RequestRejected

P = 4
BASE = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=4, max_model_len=64, page_size=P,
                    max_lora_rank=32, max_loras=3, num_pages=96, dtype="float32", backend="reference",
                    decode_lora_variants=False, max_waiting=64)
ADAPTERS = ("r4-qkvo", "r8-all7")


@pytest.fixture(scope="module")
def engine(tiny_dir, adapter_dirs):
    eng = Engine.from_model_dir(tiny_dir, BASE, adapters={k: adapter_dirs[k] for k in ADAPTERS}, progress=False)
    eng.warmup(progress=False)
    return eng


@pytest.fixture(params=["off", "on"])
def engines(engine, request):
    """The engine without and with the prefix cache (the samples share through the one that is there)."""
    engine.reconfigure_scheduling(prefix_cache=request.param == "on")
    yield {request.param: engine}
    for rid in list(engine.requests):  # a failed test may leave requests behind
        engine.abort(rid)
        engine.release(rid)
    while engine.has_unfinished():
        engine.step()
    engine.reconfigure_scheduling(prefix_cache=False)


class PrefillTokens:
    """Counts the tokens the engine's prefill steps compute (wraps the step runner's prefill)."""

    def __init__(self, engine):
        self.engine, self.tokens, self.inner = engine, 0, engine.runner.prefill

    def __enter__(self):
        def counting(params, pool, table, items):
            self.tokens += sum(len(it.tokens) for it in items)
            return self.inner(params, pool, table, items)
        self.engine.runner.prefill = counting
        return self

    def __exit__(self, *exc):
        self.engine.runner.prefill = self.inner


def _drain(engine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    max_running = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
        max_running = max(max_running, len(engine.scheduler.running))
    done["__max_running__"] = [max_running]
    return done


def _samples(engine, n, prompt, adapter, sampling) -> list[list[int]]:
    ids = add_samples(engine, n, prompt, adapter, sampling)
    done = _drain(engine)
    for rid in ids:
        engine.release(rid)
    return [done[rid] for rid in ids]


def _prompt(rng, engine, n_tokens):
    return [int(t) for t in rng.integers(3, engine.cfg.vocab_size, size=n_tokens)]


def _assert_all_freed(engine):
    engine.pool.allocator.check_invariants()
    assert engine.pool.stats()["pages_kv"] == (engine.scheduler.prefix_cache.num_pages
                                               if engine.scheduler.prefix_cache else 0)
    assert engine.scheduler.fork_pages.num_pages == 0
    assert not engine.requests


def test_greedy_samples_share_one_prefill_and_equal_peft(engines, tiny_dir, adapter_dirs):
    (eng,) = engines.values()
    rng = np.random.default_rng()
    compiles = eng.compiles_since_warmup()
    n, n_prompt = 5, 4 * P + int(rng.integers(1, P))  # 4 full pages and a partial one
    prompt = _prompt(rng, eng, n_prompt)
    adapter = ADAPTERS[int(rng.integers(len(ADAPTERS)))]
    with PrefillTokens(eng) as counted:
        outs = _samples(eng, n, prompt, adapter, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    expected = hf_generate(tiny_dir, prompt, 7, adapter_dirs[adapter])
    assert outs == [expected] * n
    # the prompt once, then each other sample only its tail past the 4 shared full pages
    assert counted.tokens == n_prompt + (n - 1) * (n_prompt - 4 * P)
    assert eng.compiles_since_warmup() == compiles
    _assert_all_freed(eng)


def test_stats_count_the_shared_prompt_pages_once(engines):
    """``Engine.stats()`` (the server's /metrics, the Ray router's load) while samples share their prompt's full
    pages: each shared page's tokens count once. Summed per sample they once exceeded the KV pages and it raised."""
    (eng,) = engines.values()
    rng = np.random.default_rng()
    n, n_prompt = 4, 4 * P + int(rng.integers(1, P))  # 4 full pages shared, a partial one each
    ids = add_samples(eng, n, _prompt(rng, eng, n_prompt), "r8-all7",
                      SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, seed=int(rng.integers(2**62))))
    checked = 0
    while eng.has_unfinished():
        eng.step()
        running = eng.scheduler.running
        live = eng.stats()["pool"]["kv_tokens_live"]
        if len(running) > 1 and all(s.num_cached >= 4 * P for s in running):
            assert live == 4 * P + sum(s.num_cached - 4 * P for s in running)
            checked += 1
    assert checked >= 2
    for rid in ids:
        eng.release(rid)
    _assert_all_freed(eng)


def test_seeded_samples_are_reproducible_and_each_its_own_stream(engine):
    eng = engine
    rng = np.random.default_rng()
    prompt = _prompt(rng, eng, int(rng.integers(P + 1, 5 * P)))
    seed = int(rng.integers(2**62))
    sp = SamplingParams(max_tokens=10, temperature=1.5, ignore_eos=True, seed=seed)
    compiles = eng.compiles_since_warmup()
    first = _samples(eng, 4, prompt, "r8-all7", sp)
    assert _samples(eng, 4, prompt, "r8-all7", sp) == first  # the same seed: the same samples
    assert len({tuple(o) for o in first}) == 4, "each sample should draw its own tokens"
    # sample i is what one request with seed sample_seed(seed, i) gets (sample 0: the request's seed itself)
    for i in (0, 3):
        alone = _samples(eng, 1, prompt, "r8-all7", dataclasses.replace(sp, seed=sample_seed(seed, i)))
        assert alone == [first[i]]
    other = _samples(eng, 4, prompt, "r8-all7", dataclasses.replace(sp, seed=seed + 1))
    assert other != first
    assert eng.compiles_since_warmup() == compiles
    _assert_all_freed(eng)


def test_sample_seeds_are_distinct_and_in_range():
    rng = np.random.default_rng()
    for seed in [0, 2**63 - 1, *(int(s) for s in rng.integers(2**62, size=20))]:
        seeds = [sample_seed(seed, i) for i in range(MAX_SAMPLES)]
        assert seeds[0] == seed and len(set(seeds)) == MAX_SAMPLES
        assert all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(7, 1) != sample_seed(8, 0) and sample_seed(7, 2) != sample_seed(8, 1)  # not seed + i


def test_admission_counts_shared_pages_once(tiny_dir, adapter_dirs):
    """A pool that holds the n samples together only if their shared prompt pages are counted once."""
    rng = np.random.default_rng()
    n, n_prompt, max_tokens = 4, 10 * P + 1, 3
    pages = group_pages(n_prompt, max_tokens, n, P)  # 11 for the first, 1 more for each other (10 shared)
    assert pages == 11 + 3 * 1
    adapter_pages = 7  # r4-qkvo on the tiny model
    eng = Engine.from_model_dir(tiny_dir, dataclasses.replace(BASE, num_pages=pages + adapter_pages),
                                adapters={"r4-qkvo": adapter_dirs["r4-qkvo"]}, progress=False)
    assert eng.store.adapter_pages("r4-qkvo") == adapter_pages
    prompt = _prompt(rng, eng, n_prompt)
    ids = add_samples(eng, n, prompt, "r4-qkvo", SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True))
    done = _drain(eng)
    assert done["__max_running__"] == [n]  # all samples ran together
    assert eng.stats()["preemptions"] == 0
    assert len({tuple(done[rid]) for rid in ids}) == 1
    for rid in ids:
        eng.release(rid)
    _assert_all_freed(eng)
    # one more token each no longer fits together: refused up front, naming n
    with pytest.raises(RequestRejected) as e:
        add_samples(eng, n, prompt, "r4-qkvo", SamplingParams(max_tokens=max_tokens + P))
    assert e.value.param == "n"
    # max_tokens=None: as many as fit for all n together
    ids = add_samples(eng, n, prompt, "r4-qkvo", SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    assert all(eng.requests[rid].sampling.max_tokens == 3 for rid in ids)
    _drain(eng)
    for rid in ids:
        eng.release(rid)
    _assert_all_freed(eng)


@pytest.mark.parametrize("n", [0, -1, MAX_SAMPLES + 1, True, 2.0, "2", None])
def test_bad_n_is_refused_naming_n(engine, n):
    eng = engine
    with pytest.raises(RequestRejected) as e:
        add_samples(eng, n, [5, 6, 7], None, SamplingParams(max_tokens=2))
    assert e.value.param == "n" and "n must be" in str(e.value)
    assert not eng.requests


def test_samples_are_queued_all_or_none(engine):
    eng = engine
    cfg = eng.ecfg
    eng.ecfg = dataclasses.replace(cfg, max_waiting=3)
    try:
        with pytest.raises(QueueFull):
            add_samples(eng, 5, [5, 6, 7, 8, 9], None, SamplingParams(max_tokens=2))
        assert not eng.requests and not eng.scheduler.waiting
        eng.add_request([1, 2], None, SamplingParams(max_tokens=1), request_id=sample_ids("dup", 2)[1])
        with pytest.raises(ValueError, match="already in use"):  # a sample's id is taken: the others go back too
            add_samples(eng, 2, [5, 6, 7], None, SamplingParams(max_tokens=2), request_id="dup")
        assert list(eng.requests) == ["dup#1"]
        eng.abort("dup#1")
        eng.release("dup#1")
    finally:
        eng.ecfg = cfg
    assert eng.add_request([4, 5], None, SamplingParams(max_tokens=1))  # still serving
    _drain(eng)
    for rid in list(eng.requests):
        eng.release(rid)
    _assert_all_freed(eng)


def test_prompt_only_samples_each_get_the_prompt_logprobs(engine):
    """max_tokens 0 with prompt logprobs (echo scoring) and n > 1: no token, each sample its prompt's logprobs."""
    eng = engine
    rng = np.random.default_rng()
    prompt = _prompt(rng, eng, 3 * P + 1)
    ids = add_samples(eng, 3, prompt, "r4-qkvo", SamplingParams(max_tokens=0, prompt_logprobs=2))
    got: dict[str, list] = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.error is None and out.new_token_ids == []
            if out.prompt_logprobs is not None:
                got[out.request_id] = out.prompt_logprobs
    assert sorted(got) == sorted(ids)
    first = got[ids[0]]
    assert len(first) == len(prompt) and first[0] is None
    for rid in ids[1:]:
        assert got[rid][0] is None
        np.testing.assert_allclose([lp.logprob for lp in got[rid][1:]], [lp.logprob for lp in first[1:]], atol=1e-5)
    for rid in ids:
        eng.release(rid)
    _assert_all_freed(eng)


def test_aborting_samples_midway_frees_everything(engine):
    eng = engine
    rng = np.random.default_rng()
    prompt = _prompt(rng, eng, 3 * P + 2)
    ids = add_samples(eng, 3, prompt, "r4-qkvo", SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.scheduler.fork_pages.num_pages == 3  # the prompt's full pages, held by the running samples
    for rid in ids:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    for rid in ids:
        eng.release(rid)
    _assert_all_freed(eng)
