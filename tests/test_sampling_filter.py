"""The sort-free top-k/top-p filter and top-k (``vocab_select.py``) against a plain numpy reference that sorts:
the kept set and its renormalized probabilities per row, for mixed per-row settings in one batch (flat rows whose cut
lies deep in the vocabulary, ties, masks, -inf and NaN logits, top_k=1, top_p=1, greedy), the sampled tokens (the
same Gumbel noise as before, so the same tokens; and their frequencies), logprob top ids, and no compile per batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slora_jax.engine import compile_counter, vocab_select
from slora_jax.engine.logprobs import packed_logprobs
from slora_jax.engine.sampling import TOP_P_FLOOR, SamplingArrays, SamplingParams, kept_logits, sample, sampling_arrays

MARGIN = 1e-5  # float32 mass sums vs float64: a top-p cut this close to a cumulative mass may go either way

kept_jit = jax.jit(kept_logits)
sample_jit = jax.jit(sample)


def _pack(allowed: np.ndarray) -> np.ndarray:
    words = np.zeros(-(-len(allowed) // 32), np.uint32)
    for t in np.flatnonzero(allowed):
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words


def _ref_scaled(logits: np.ndarray, allowed: np.ndarray | None, temperature: float) -> np.ndarray:
    x = np.where(np.isnan(logits), -np.inf, logits).astype(np.float32)
    if allowed is not None and allowed.any():
        x = np.where(allowed, x, -np.inf).astype(np.float32)
    return x / np.float32(max(temperature, 1e-6))  # XLA may multiply by 1 / T: exact only for powers of 2


def _ref_kept(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """bool [V]: sort descending; keep the top_k largest and the shortest prefix whose mass before its last token is
    below top_p; a token is kept iff its value reaches both cuts (ties kept together) and is not -inf."""
    s = np.sort(scaled.astype(np.float64))[::-1]
    k = len(s) if top_k <= 0 else min(top_k, len(s))
    probs = np.exp(s - s[0])
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    p_cut = s[before < top_p].min() if top_p < 1.0 else -np.inf
    return (scaled >= max(s[k - 1], p_cut)) & (scaled > -np.inf)  # -inf: not allowed, never sampled


def _ref_bounds(scaled, top_k, top_p):
    """(kept set with top_p a hair lower, with it a hair higher): the device's set lies between."""
    if top_p >= 1.0:
        kept = _ref_kept(scaled, top_k, 1.0)
        return kept, kept
    return _ref_kept(scaled, top_k, max(top_p - MARGIN, 1e-12)), _ref_kept(scaled, top_k, top_p + MARGIN)


def _batch(rng, vocab: int, rows: int):
    """Logits, masks and SamplingParams for ``rows`` rows of mixed kinds and settings, fresh per call."""
    logits, masks, params = [], [], []
    for i in range(rows):
        kind = ("peaked", "flat", "ties", "masked", "inf_nan")[i % 5]
        row = rng.standard_normal(vocab).astype(np.float32) * rng.uniform(1.0, 4.0)
        mask = None
        if kind == "flat":  # top-p cuts thousands of tokens deep
            row = rng.standard_normal(vocab).astype(np.float32) * 0.05
        elif kind == "ties":
            row = np.round(row * 2) / 2
        elif kind == "masked":
            mask = rng.random(vocab) < 0.3
            row[~mask] += 6  # the best tokens are not allowed
        elif kind == "inf_nan":
            row[rng.integers(vocab, size=vocab // 10)] = -np.inf
            row[rng.integers(vocab, size=3)] = np.nan
        logits.append(row)
        masks.append(mask)
        params.append(SamplingParams(
            temperature=float(rng.choice([0.0625, 0.5, 1.0, 2.0])),  # powers of 2: x / T is exact however computed
            top_k=int(rng.choice([0, 1, 3, 40, 700, vocab - 1, vocab, 2**31])),
            top_p=float(rng.choice([TOP_P_FLOOR, 0.2, 0.7, 0.95, 0.999, 1.0]))).validate())
    return np.stack(logits), masks, params


def _arrays(params, masks, vocab, seeds=None, counters=None):
    n = len(params)
    seeds = list(range(n)) if seeds is None else seeds
    packed = [None if m is None else _pack(m) for m in masks]
    raw = sampling_arrays(params, seeds, counters or [0] * n, n, vocab, packed)
    return SamplingArrays(**{k: jnp.asarray(v) for k, v in raw.items()})


@pytest.mark.parametrize("vocab", [300, 4099])
def test_kept_set_and_renormalized_probabilities_match_a_sort(vocab):
    rng = np.random.default_rng()
    exact_rows = 0
    for _ in range(3):
        logits, masks, params = _batch(rng, vocab, 20)
        kept = np.asarray(kept_jit(jnp.asarray(logits), _arrays(params, masks, vocab)))
        for i, p in enumerate(params):
            scaled = _ref_scaled(logits[i], masks[i], p.temperature)
            lo, hi = _ref_bounds(scaled, min(p.top_k, 2**31 - 1), max(p.top_p, TOP_P_FLOOR))
            got = np.isfinite(kept[i])
            assert (lo <= got).all() and (got <= hi).all(), (i, p, got.sum(), lo.sum(), hi.sum())
            np.testing.assert_array_equal(kept[i][got], scaled[got])  # kept tokens keep their scaled logits
            if (lo == hi).all():
                exact_rows += 1
                ref = np.exp(scaled[got].astype(np.float64) - scaled[got].max())
                dev = np.exp(kept[i][got].astype(np.float64) - kept[i][got].max())
                np.testing.assert_allclose(dev / dev.sum(), ref / ref.sum(), rtol=1e-6)
    assert exact_rows >= 50  # the margin decided almost no row


@pytest.mark.parametrize(("form", "pivots"), [("stacked", 1), ("stacked", 3), ("siblings", 7), ("stored", 3),
                                              ("auto", 3)])
def test_keep_threshold_is_exact_for_any_search_width(form, pivots):
    """Deep cuts (flat rows, large top_k), ties, -inf, many zeros of both signs. (θ itself may be a denormal below a
    zero where the compiler flushes denormals: the same kept set.)"""
    rng = np.random.default_rng()
    rows, vocab = 12, 2000
    x = rng.standard_normal((rows, vocab)).astype(np.float32) * rng.uniform(0.01, 5, (rows, 1)).astype(np.float32)
    x[::3] = np.round(x[::3] * 4) / 4
    x[1, rng.integers(vocab, size=300)] = -np.inf
    k = rng.choice([1, 2, 19, 1500, vocab], rows).astype(np.int32)
    top_p = rng.choice([1e-6, 0.3, 0.9, 0.99, 1.0], rows).astype(np.float32)
    fn = jax.jit(lambda a, b, c: vocab_select.keep_threshold(a, b, c, pivots, form))
    theta = np.asarray(fn(jnp.asarray(x), jnp.asarray(k), jnp.asarray(top_p)))[:, 0]
    for i in range(rows):
        lo, hi = _ref_bounds(x[i], int(k[i]), float(top_p[i]))
        got = (x[i] >= theta[i]) & (x[i] > -np.inf)
        assert (lo <= got).all() and (got <= hi).all(), (i, k[i], top_p[i], got.sum(), lo.sum(), hi.sum())
        assert got[np.argmax(x[i])]  # the top token always


def test_auto_form_is_siblings_from_its_row_count_up(monkeypatch):
    """"auto" (the default) traces the stacked form below SIBLINGS_FROM_ROWS rows and the siblings form from there
    up (lowered to a threshold of 8 here): the same jaxpr as the form asked for by name."""
    monkeypatch.setattr(vocab_select, "SIBLINGS_FROM_ROWS", 8)
    rng = np.random.default_rng()
    for rows, want in ((7, "stacked"), (8, "siblings"), (12, "siblings")):
        args = (jnp.asarray(rng.standard_normal((rows, 300)), jnp.float32),
                jnp.asarray(rng.integers(1, 300, rows), jnp.int32),
                jnp.asarray(rng.uniform(0.1, 1.0, rows), jnp.float32))
        text = {form: str(jax.make_jaxpr(lambda a, b, c, f=form: vocab_select.keep_threshold(a, b, c, 3, f))(*args))
                for form in ("auto", "stacked", "siblings")}
        assert text["stacked"] != text["siblings"]
        assert text["auto"] == text[want], rows


def test_sampled_tokens_are_the_sort_based_samplers():
    """Same Gumbel noise per (seed, counter) as before: argmax over the reference kept set plus that noise. Greedy
    rows take the argmax of the allowed logits."""
    rng = np.random.default_rng()
    vocab = 1000
    logits, masks, params = _batch(rng, vocab, 30)
    params[0] = SamplingParams(temperature=0.0)
    seeds, counters = [int(s) for s in rng.integers(0, 2**31, 30)], [int(c) for c in rng.integers(0, 99, 30)]
    out = np.asarray(sample_jit(jnp.asarray(logits), _arrays(params, masks, vocab, seeds, counters)))
    checked = 0
    for i, p in enumerate(params):
        scaled = _ref_scaled(logits[i], masks[i], p.temperature)
        if p.temperature == 0:
            assert out[i] == np.argmax(_ref_scaled(logits[i], masks[i], 1.0))
            continue
        lo, hi = _ref_bounds(scaled, min(p.top_k, 2**31 - 1), max(p.top_p, TOP_P_FLOOR))
        if not (lo == hi).all():
            continue
        key = jax.random.fold_in(jax.random.PRNGKey(np.uint32(seeds[i])), counters[i])
        gumbel = np.asarray(jax.random.gumbel(key, (vocab,), jnp.float32))
        assert out[i] == np.argmax(np.where(lo, scaled, -np.inf) + gumbel), i
        checked += 1
    assert checked >= 20


def _chi2_limit(df: int, z: float = 4.75) -> float:
    """The chi-square quantile at about 1 - 1e-6 (Wilson-Hilferty)."""
    h = 2.0 / (9 * df)
    return df * (1 - h + z * np.sqrt(h)) ** 3


def test_sampled_frequencies_follow_the_renormalized_kept_probabilities():
    rng = np.random.default_rng()
    vocab, n = 64, 6000
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    for _ in range(100):  # a row whose top-p set is 1-2 tokens tests too little: draw again
        row = rng.standard_normal(vocab).astype(np.float32) * 2.5
        scaled = _ref_scaled(row, None, params.temperature)
        kept = _ref_kept(scaled, params.top_k, params.top_p)
        if kept.sum() >= 3:
            break
    assert kept.sum() >= 3, "no row in 100 draws kept 3 tokens"
    probs = np.where(kept, np.exp(scaled.astype(np.float64) - scaled.max()), 0.0)
    probs /= probs.sum()
    seeds = [int(s) for s in rng.integers(0, 2**31, n)]
    out = np.asarray(sample_jit(jnp.asarray(np.tile(row, (n, 1))), _arrays([params] * n, [None] * n, vocab, seeds)))
    counts = np.bincount(out, minlength=vocab)
    assert counts[~kept].sum() == 0
    expected = probs[kept] * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < _chi2_limit(int(kept.sum()) - 1), (chi2, counts[kept], expected)
    uniform = np.full(int(kept.sum()), n / kept.sum())  # the test's power: a wrong weighting is caught
    assert float(((counts[kept] - uniform) ** 2 / uniform).sum()) > _chi2_limit(int(kept.sum()) - 1)


@pytest.mark.parametrize("vocab", [1000, 4099, 32000])
def test_top_k_matches_a_stable_sort(vocab):
    rng = np.random.default_rng()
    x = rng.standard_normal((6, vocab)).astype(np.float32)
    x[1] = np.round(x[1] * 3)  # many ties: lower ids first
    x[2, rng.integers(vocab, size=vocab // 2)] = -np.inf
    x[3, :] = -np.inf
    x[3, rng.integers(vocab, size=5)] = 1.0  # fewer finite entries than k
    x[4, :64] = 7.0  # the whole top in two chunks
    values, ids = jax.jit(lambda a: vocab_select.top_k(a, 20))(jnp.asarray(x))
    for i in range(len(x)):
        order = np.lexsort((np.arange(vocab), -x[i].astype(np.float64)))[:20]
        np.testing.assert_array_equal(np.asarray(ids[i]), order)
        np.testing.assert_array_equal(np.asarray(values[i]), x[i][order])


def test_packed_logprobs_top_ids_and_values():
    rng = np.random.default_rng()
    vocab = 5000
    logits = np.round(rng.standard_normal((5, vocab)).astype(np.float32) * 4) / 2  # ties among the top
    logits[2, 7] = np.nan
    targets = rng.integers(vocab, size=5)
    targets[2] = 8
    packed = np.asarray(jax.jit(packed_logprobs)(jnp.asarray(logits), jnp.asarray(targets, jnp.int32)))
    clean = np.where(np.isnan(logits), -np.inf, logits).astype(np.float64)
    logp = clean - clean.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    for i in range(5):
        order = np.lexsort((np.arange(vocab), -clean[i]))[:20]
        np.testing.assert_array_equal(packed[i, 1:21], order)
        np.testing.assert_allclose(packed[i, 21:41].view(np.float32), logp[i][order], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(packed[i, 0].view(np.float32), logp[i][targets[i]], rtol=1e-5, atol=1e-5)


def test_new_settings_do_not_compile_again():
    """Every setting is an array of a fixed shape: a batch with other temperatures, top_k, top_p and masks reuses the
    compiled sampler."""
    compile_counter.install()
    rng = np.random.default_rng()
    vocab = 512
    logits, masks, params = _batch(rng, vocab, 10)
    fn = jax.jit(sample)
    fn(jnp.asarray(logits), _arrays(params, masks, vocab)).block_until_ready()
    before = compile_counter.compile_count()
    for _ in range(3):
        logits, masks, params = _batch(rng, vocab, 10)
        fn(jnp.asarray(logits), _arrays(params, masks, vocab)).block_until_ready()
    assert compile_counter.compile_count() == before
