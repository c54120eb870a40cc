"""Token logprobs from the engine equal PEFT's log-softmax: generated tokens (greedy and sampled rows, mixed adapters)
and prompt tokens (echo), with the prefix cache on (an echo request must not reuse a cached prefix), max_tokens 0,
and no compile after warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import hf_logits

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.logprobs import TokenLogprob
from slora_jax.engine.sampling import MAX_LOGPROBS, SamplingParams

ECFG = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=4, max_model_len=64, page_size=4,
                    max_lora_rank=32, max_loras=4, num_pages=128, dtype="float32", backend="reference",
                    decode_lora_variants=False, prefix_cache=True)
ADAPTERS = ("r4-qkvo", "r8-all7", "patterns")


@pytest.fixture(scope="module")
def engine(tiny_dir, adapter_dirs):
    eng = Engine.from_model_dir(tiny_dir, ECFG, adapters={a: adapter_dirs[a] for a in ADAPTERS}, progress=False)
    eng.warmup(progress=False)
    return eng


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(logits).double(), dim=-1).numpy()


def _run(engine, requests):
    """requests: (prompt, adapter, SamplingParams). Returns per request (token ids, [TokenLogprob], prompt lps)."""
    got = {}
    ids = [engine.add_request(p, a, s) for p, a, s in requests]
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            ids_, lps, prompt = got.setdefault(out.request_id, ([], [], [None]))
            ids_.extend(out.new_token_ids)
            lps.extend(out.logprobs or [])
            if out.prompt_logprobs is not None:
                prompt[0] = out.prompt_logprobs
    return [(got[i][0], got[i][1], got[i][2][0]) for i in ids]


def _check(lp: TokenLogprob, ref_row: np.ndarray, token: int, n_top: int) -> None:
    """One position: the token's logprob and the top alternatives against the reference log-softmax row."""
    assert lp.token_id == token
    np.testing.assert_allclose(lp.logprob, ref_row[token], rtol=1e-4, atol=1e-6)
    assert len(lp.top) == n_top
    top_ids = [t for t, _ in lp.top]
    top_lps = np.array([v for _, v in lp.top])
    np.testing.assert_allclose(top_lps, ref_row[top_ids], rtol=1e-4, atol=1e-6)  # each is that token's logprob
    np.testing.assert_allclose(top_lps, np.sort(ref_row)[::-1][:n_top], rtol=1e-4, atol=1e-6)  # and the best ones
    assert list(top_lps) == sorted(top_lps, reverse=True)


def _prompt(rng, vocab, lo=4, hi=14):
    return [int(t) for t in rng.integers(3, vocab, size=int(rng.integers(lo, hi)))]


def test_generated_and_prompt_logprobs_equal_peft_for_mixed_adapters(engine, tiny_dir, adapter_dirs):
    """Greedy and sampled rows, base and three adapters, in one continuous batch; logprobs are the model's own
    (raw) distribution whatever the temperature, penalty or bias."""
    rng = np.random.default_rng()
    vocab = engine.cfg.vocab_size
    compiles = engine.compiles_since_warmup()
    adapters = [None, *ADAPTERS, "r8-all7", None]
    requests = []
    for i, a in enumerate(adapters):
        sp = dict(max_tokens=int(rng.integers(3, 7)), ignore_eos=True, logprobs=int(rng.integers(0, MAX_LOGPROBS + 1)))
        if i % 2:
            sp.update(temperature=0.8, seed=int(rng.integers(1 << 30)), top_k=20)
        else:
            sp.update(temperature=0.0)
        if i < 4:
            sp.update(prompt_logprobs=int(rng.integers(0, 6)))
        if i == 5:
            sp.update(presence_penalty=1.0, logit_bias=((5, 3.0),))  # processing does not change the logprobs
        requests.append((_prompt(rng, vocab), a, SamplingParams(**sp)))
    results = _run(engine, requests)
    for (prompt, adapter, sp), (out, lps, prompt_lps) in zip(requests, results, strict=True):
        ref = _log_softmax(hf_logits(tiny_dir, prompt + out, adapter_dirs[adapter] if adapter else None))
        assert len(out) == sp.max_tokens and len(lps) == len(out)
        for j, (tok, lp) in enumerate(zip(out, lps, strict=True)):
            _check(lp, ref[len(prompt) + j - 1], tok, sp.logprobs)
        if sp.prompt_logprobs is None:
            assert prompt_lps is None
            continue
        assert len(prompt_lps) == len(prompt) and prompt_lps[0] is None
        for i in range(1, len(prompt)):
            _check(prompt_lps[i], ref[i - 1], prompt[i], sp.prompt_logprobs)
    assert engine.compiles_since_warmup() == compiles


def test_echo_skips_the_prefix_cache_and_max_tokens_zero_returns_only_the_prompt(engine, tiny_dir, adapter_dirs):
    rng = np.random.default_rng()
    prompt = _prompt(rng, engine.cfg.vocab_size, 13, 20)  # 3+ full pages of 4 tokens
    compiles = engine.compiles_since_warmup()
    _run(engine, [(prompt, "r8-all7", SamplingParams(max_tokens=2, temperature=0.0))])  # fills the cache
    hits = engine.stats()["prefix_cache"]["hit_pages"]
    [(out, lps, prompt_lps)] = _run(engine, [(prompt, "r8-all7", SamplingParams(max_tokens=0, prompt_logprobs=3))])
    assert out == [] and lps == []
    assert engine.stats()["prefix_cache"]["hit_pages"] == hits  # computed every prompt token itself
    ref = _log_softmax(hf_logits(tiny_dir, prompt, adapter_dirs["r8-all7"]))
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    for i in range(1, len(prompt)):
        _check(prompt_lps[i], ref[i - 1], prompt[i], 3)
    # without echo, the same prompt does hit the cache (the cache is there to be bypassed)
    _run(engine, [(prompt, "r8-all7", SamplingParams(max_tokens=1, logprobs=2))])
    assert engine.stats()["prefix_cache"]["hit_pages"] > hits
    assert engine.compiles_since_warmup() == compiles
    assert engine.pool.stats()["pages_kv"] == engine.scheduler.prefix_cache.num_pages


def test_logprobs_survive_preemption_and_recompute(tiny_dir, adapter_dirs):
    """A pool so small that sequences are preempted and recomputed: prompt logprobs come once, generated ones for
    every token, all equal to PEFT's."""
    import dataclasses

    ecfg = dataclasses.replace(ECFG, num_pages=30, prefix_cache=False, max_model_len=48)
    eng = Engine.from_model_dir(tiny_dir, ecfg, adapters={"r4-qkvo": adapter_dirs["r4-qkvo"]}, progress=False)
    eng.warmup(progress=False)
    rng = np.random.default_rng()
    requests = [(_prompt(rng, eng.cfg.vocab_size, 8, 12), a,
                 SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1))
                for a in ("r4-qkvo", None, "r4-qkvo", None, "r4-qkvo")]
    results = _run(eng, requests)
    assert eng.stats()["preemptions"] > 0
    for (prompt, adapter, sp), (out, lps, prompt_lps) in zip(requests, results, strict=True):
        ref = _log_softmax(hf_logits(tiny_dir, prompt + out, adapter_dirs[adapter] if adapter else None))
        assert len(lps) == len(out) == sp.max_tokens
        for j, (tok, lp) in enumerate(zip(out, lps, strict=True)):
            _check(lp, ref[len(prompt) + j - 1], tok, 2)
        for i in range(1, len(prompt)):
            _check(prompt_lps[i], ref[i - 1], prompt[i], 1)
    assert eng.compiles_since_warmup() == 0


@pytest.mark.parametrize("vocab", [7, 300])
def test_packed_rows_read_back_as_numpy_log_softmax(vocab):
    """The step's packed layout, read on the host: the chosen token's logprob and the best ones, a vocabulary
    smaller than the top list included (its missing entries are never reported)."""
    import jax
    import jax.numpy as jnp

    from slora_jax.engine.logprobs import packed_logprobs, read_row

    rng = np.random.default_rng()
    logits = (rng.standard_normal((5, vocab)) * 3).astype(np.float32)
    targets = rng.integers(0, vocab, 5).astype(np.int32)
    packed = np.asarray(jax.jit(packed_logprobs)(jnp.asarray(logits), jnp.asarray(targets)))
    ref = _log_softmax(logits)
    for i in range(5):
        n_top = int(rng.integers(0, MAX_LOGPROBS + 1))
        _check(read_row(packed[i], int(targets[i]), n_top), ref[i], int(targets[i]), min(n_top, vocab))
