"""Presence / frequency / repetition penalties, logit_bias and min_tokens equal a plain numpy reference of the
OpenAI / vLLM definitions: in the step's state updates alone, and end to end through the engine against HF logits."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import hf_logits

from slora_jax.engine import penalties
from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import MAX_LOGIT_BIAS, SamplingArrays, SamplingParams, allowed_tokens, sampling_arrays
from slora_jax.model.paged import StepBatch


def reference_logits(logits, prompt, generated, sp: SamplingParams) -> np.ndarray:
    """The definitions, written out: logit_bias added; tokens of the prompt or the output divided by the repetition
    penalty where positive, multiplied where not; then minus frequency * count and presence * (count > 0) over the
    generated tokens."""
    out = np.array(logits, np.float64)
    for token, bias in sp.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(generated):
        r = sp.repetition_penalty
        out[token] = out[token] / r if out[token] > 0 else out[token] * r
    for token, count in collections.Counter(generated).items():
        out[token] -= sp.frequency_penalty * count + sp.presence_penalty
    return out


def _random_params(rng, vocab) -> SamplingParams:
    bias_ids = rng.choice(vocab, size=int(rng.integers(0, 6)), replace=False)
    return SamplingParams(presence_penalty=float(rng.uniform(-2, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
                          repetition_penalty=float(rng.uniform(0.5, 2.0)),
                          logit_bias=tuple((int(t), float(rng.uniform(-100, 100))) for t in bias_ids)).validate()


def _prefill(state, params, histories, rows, vocab):
    """One prefill step's state update for sequences (prompt, generated so far) at penalty rows ``rows``."""
    n_seqs = len(params) + 1  # one padding sequence row
    tokens = [t for p, g in histories for t in p + g]
    positions = [i for p, g in histories for i in range(len(p) + len(g))]
    n_rows = len(tokens) + 3  # padding token rows
    q_starts = np.cumsum([0] + [len(p) + len(g) for p, g in histories] + [0]).astype(np.int32)
    zeros = np.zeros(n_rows, np.int32)
    batch = StepBatch(tokens=np.array(tokens + [0] * 3, np.int32), positions=np.array(positions + [0] * 3, np.int32),
                      kv_slots=zeros, row_slot=zeros, page_table=np.zeros((n_seqs, 1), np.int32),
                      context_lens=np.zeros(n_seqs, np.int32), q_starts=q_starts,
                      logits_rows=np.zeros(n_seqs, np.int32), lora_tiles=np.zeros((3, 1), np.int32),
                      attn_tiles=np.zeros((1, 4), np.int32))
    s = _arrays(params, rows, vocab, [len(p) for p, _ in histories] + [0], MAX_LOGIT_BIAS, n_seqs)
    return jax.jit(penalties.refill)(state, s, jax.tree.map(jnp.asarray, batch))


def _arrays(params, rows, vocab, prompt_lens=None, bias_entries=0, n=None):
    n = n or len(params)
    pad = n - len(params)
    a = sampling_arrays(list(params) + [None] * pad, [0] * n, [0] * n, n, vocab,
                        penalty_rows=list(rows) + [-1] * pad, prompt_lens=prompt_lens, bias_entries=bias_entries)
    return SamplingArrays(**{k: jnp.asarray(v) for k, v in a.items()})


def test_step_state_equals_the_reference_through_prefill_and_decode():
    rng = np.random.default_rng()
    vocab, n_state = 96, 6
    state = penalties.PenaltyState.zeros(n_state, vocab)
    # an earlier request at row 4 that later steps must leave alone
    other = _random_params(rng, vocab)
    other_hist = ([int(t) for t in rng.integers(0, vocab, 7)], [])
    state = _prefill(state, [other], [other_hist], [4], vocab)
    params = [_random_params(rng, vocab) for _ in range(3)] + [SamplingParams()]
    # prompts drawn from a small range so tokens repeat; the second is a recompute (generated tokens in its rows)
    histories = [([int(t) for t in rng.integers(0, 20, int(rng.integers(3, 9)))],
                  [int(t) for t in rng.integers(0, 20, 5)] if i == 1 else []) for i in range(4)]
    rows = [2, 0, 5, -1]  # the last asks for nothing
    state = _prefill(state, params, histories, rows, vocab)
    everyone = params + [other]
    hist = [(list(p), list(g)) for p, g in histories] + [other_hist]
    all_rows = rows + [4]
    for _step in range(4):  # sample, count, apply again: the decode steps' view
        logits = rng.standard_normal((len(everyone), vocab)).astype(np.float32) * 4
        s = _arrays(everyone, all_rows, vocab)
        got = np.asarray(jax.jit(penalties.apply)(jnp.asarray(logits), s, state))
        for i, (sp, (prompt, generated)) in enumerate(zip(everyone, hist, strict=True)):
            want = logits[i] if all_rows[i] < 0 else reference_logits(logits[i], prompt, generated, sp)
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-4)
        sampled = rng.integers(0, 20, len(everyone)).astype(np.int32)
        state = jax.jit(penalties.count_sampled)(state, s, jnp.asarray(sampled))
        for i, t in enumerate(sampled):
            hist[i][1].append(int(t))
    assert (np.asarray(state.counts)[[1, 3]] == 0).all()  # rows nobody holds stay empty


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    rng = np.random.default_rng()
    vocab = 200
    drawn = [int(t) for t in rng.choice(vocab, 4, replace=False)]
    stop, eos = tuple(drawn[:3]), (drawn[3],)  # EOS apart from the stop ids: the ignore_eos row tells them apart
    sp = SamplingParams(min_tokens=4, stop_token_ids=stop, max_tokens=10)
    params = [sp, sp, dataclasses.replace(sp, ignore_eos=True), SamplingParams(stop_token_ids=stop)]
    a = sampling_arrays(params, [0] * 4, [3, 4, 0, 0], 4, vocab, eos_ids=eos)
    allowed = np.asarray(allowed_tokens(jnp.asarray(a["token_mask"]), vocab))
    assert not allowed[0][list(stop + eos)].any() and allowed[0].sum() == vocab - len(set(stop + eos))
    assert allowed[1].all() and allowed[3].all()  # reached / no min_tokens
    assert not allowed[2][list(stop)].any() and allowed[2][eos[0]]  # ignore_eos: EOS is an ordinary token
    # a caller's mask that allows only the stop tokens wins over min_tokens (never an empty mask)
    only_stop = np.zeros(-(-vocab // 32), np.uint32)
    for t in stop:
        only_stop[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    a = sampling_arrays([sp], [0], [0], 1, vocab, masks=[only_stop], eos_ids=eos)
    assert np.array_equal(a["token_mask"][0].view(np.uint32), only_stop)


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                                 dict(repetition_penalty=0.0), dict(repetition_penalty=float("nan")),
                                 dict(logit_bias=((1, 101.0),)), dict(logit_bias=((1, 1.0), (1, 2.0))),
                                 dict(logit_bias=((-1, 1.0),)),
                                 dict(logit_bias=tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1))),
                                 dict(min_tokens=-1), dict(min_tokens=5, max_tokens=4), dict(logprobs=21),
                                 dict(prompt_logprobs=-1), dict(logprobs=True), dict(max_tokens=-1)])
def test_invalid_penalty_and_logprob_values_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()


ECFG = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=4, max_model_len=64, page_size=4,
                    max_lora_rank=32, max_loras=4, num_pages=128, dtype="float32", backend="reference",
                    decode_lora_variants=False, prefix_cache=True)


@pytest.fixture(scope="module")
def engine(tiny_dir, adapter_dirs):
    eng = Engine.from_model_dir(tiny_dir, ECFG, adapters={a: adapter_dirs[a] for a in ("r4-qkvo", "r8-all7")},
                                progress=False)
    eng.warmup(progress=False)
    return eng


def _greedy_reference(tiny_dir, adapter_dir, prompt, sp: SamplingParams, eos: tuple[int, ...]) -> list[int]:
    """Greedy decoding from HF logits with the numpy definitions applied (and min_tokens' masking)."""
    out: list[int] = []
    while len(out) < sp.max_tokens:
        logits = reference_logits(hf_logits(tiny_dir, prompt + out, adapter_dir)[-1], prompt, out, sp)
        if len(out) < sp.min_tokens:
            logits[list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos))] = -np.inf
        out.append(int(np.argmax(logits)))
        if out[-1] in sp.stop_token_ids or (not sp.ignore_eos and out[-1] in eos):
            break
    return out


def test_engine_penalties_equal_the_reference_and_change_the_output(engine, tiny_dir, adapter_dirs):
    """Greedy generation with penalties and biases (rows with and without them in one batch, a prompt prefix in the
    prefix cache) equals greedy decoding of HF's logits after the reference definitions; no compile."""
    rng = np.random.default_rng()
    vocab, eos = engine.cfg.vocab_size, tuple(engine.cfg.eos_token_id)
    compiles = engine.compiles_since_warmup()
    shared = [int(t) for t in rng.integers(3, 40, 9)]  # repeats inside; cached after the first request
    requests = []
    for i, adapter in enumerate(["r4-qkvo", None, "r8-all7", "r4-qkvo", None]):
        prompt = shared + [int(t) for t in rng.integers(3, 40, int(rng.integers(2, 6)))]
        sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        if i != 1:
            sp = dataclasses.replace(_random_params(rng, vocab), max_tokens=10, temperature=0.0, ignore_eos=True)
        if i == 0:  # one output surely changed (random penalties near 0 may change none): a +100 bias on a token
            forced = int(rng.choice(np.setdiff1d(np.arange(3, vocab), [t for t, _ in sp.logit_bias])))
            sp = dataclasses.replace(sp, logit_bias=(*sp.logit_bias, (forced, 100.0)))
        requests.append((prompt, adapter, sp))
    ids = [engine.add_request(p, a, s) for p, a, s in requests]
    got = collections.defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id].extend(out.new_token_ids)
    changed = 0
    for rid, (prompt, adapter, sp) in zip(ids, requests, strict=True):
        adir = adapter_dirs[adapter] if adapter else None
        want = _greedy_reference(tiny_dir, adir, prompt, sp, eos)
        assert got[rid] == want, (adapter, sp)
        plain = _greedy_reference(tiny_dir, adir, prompt, dataclasses.replace(sp, presence_penalty=0.0,
                                  frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=()), eos)
        changed += plain != want
    assert changed >= 1, "the penalties and biases should have changed an output"
    assert engine.compiles_since_warmup() == compiles


def test_min_tokens_holds_back_a_strongly_biased_eos(engine, tiny_dir):
    eos = engine.cfg.eos_token_id[0]
    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(3, engine.cfg.vocab_size, 6)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, min_tokens=5, logit_bias=((eos, 100.0),))
    [out] = engine.generate([prompt], [None], sp)
    assert out == _greedy_reference(tiny_dir, None, prompt, sp, (eos,))
    assert len(out) == 6 and out[-1] == eos and eos not in out[:-1]
    assert engine.compiles_since_warmup() == 0
