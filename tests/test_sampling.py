"""The in-step sampler: greedy rows, top-k / top-p filtering, temperature, per-request seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slora_jax.engine.sampling import (
    INT32_MAX,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidSampling,
    SamplingArrays,
    SamplingParams,
    sampling_arrays,
)
from slora_jax.engine.sampling import sample as _sample

sample = jax.jit(_sample)


def _arrays(params, seeds, counters, vocab=1000, masks=None):
    return SamplingArrays(**{k: jnp.asarray(v) for k, v in sampling_arrays(params, seeds, counters, len(params),
                                                                           vocab, masks).items()})


def _pack(allowed: np.ndarray) -> np.ndarray:
    """bool [V] -> packed int32 words, bit j of word w = token 32 * w + j (written independently of the sampler)."""
    words = np.zeros(-(-len(allowed) // 32), np.uint32)
    for t in np.flatnonzero(allowed):
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    rng = np.random.default_rng()
    logits = rng.standard_normal((4, 50)).astype(np.float32) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), None, SamplingParams(temperature=0.0)]
    out = np.asarray(sample(jnp.asarray(logits), _arrays(params, [1, 2, 0, 3], [0, 0, 0, 0])))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax() and out[3] == logits[3].argmax()


def test_top_k_and_top_p_never_leave_their_set():
    rng = np.random.default_rng()
    logits = rng.standard_normal((1, 40)).astype(np.float32) * 2
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.6)) + 1])
    top5 = set(order[:5])
    for seed in range(60):
        k = int(sample(jnp.asarray(logits), _arrays([SamplingParams(temperature=1.0, top_k=5)], [seed], [0]))[0])
        p = int(sample(jnp.asarray(logits), _arrays([SamplingParams(temperature=1.0, top_p=0.6)], [seed], [0]))[0])
        assert k in top5 and p in nucleus


def test_a_nan_logit_is_never_chosen_and_spoils_nothing_else():
    rng = np.random.default_rng()
    logits = rng.standard_normal((4, 30)).astype(np.float32) * 2
    bad = int(rng.integers(30))
    logits[:, bad] = np.nan
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=4), SamplingParams(temperature=0.8, top_p=0.7)]
    clean = np.where(np.isnan(logits), -np.inf, logits)
    for seed in range(20):
        out = np.asarray(sample(jnp.asarray(logits), _arrays(params, [seed] * 4, [0] * 4)))
        assert bad not in out
        assert out[0] == clean[0].argmax()
        assert out[2] in set(np.argsort(-clean[2])[:4])


def test_temperature_sampling_follows_the_softmax():
    logits = np.log(np.array([[0.5, 0.3, 0.2]], np.float32))
    draws = [int(sample(jnp.asarray(logits), _arrays([SamplingParams(temperature=1.0)], [7], [c]))[0])
             for c in range(600)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.07)


def test_same_seed_and_counter_repeat_and_counters_differ():
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.standard_normal((1, 1000)).astype(np.float32))
    p = [SamplingParams(temperature=1.0)]
    a = [int(sample(logits, _arrays(p, [42], [c]))[0]) for c in range(8)]
    b = [int(sample(logits, _arrays(p, [42], [c]))[0]) for c in range(8)]
    assert a == b and len(set(a)) > 1


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-3),
                                 dict(max_tokens=-1), dict(seed=-1), dict(stop=("",)), dict(temperature=float("nan")),
                                 dict(seed=2**63), dict(top_k=1.5), dict(top_k=True), dict(top_p=float("inf")),
                                 dict(stop=("s",) * (MAX_STOP_STRINGS + 1)),
                                 dict(stop=("s" * (MAX_STOP_STRING_CHARS + 1),)),
                                 dict(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1))),
                                 dict(stop_token_ids=(2**31,)), dict(stop_token_ids=(-1,)), dict(logprobs=21),
                                 dict(prompt_logprobs=-1), dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                                 dict(repetition_penalty=0.0), dict(logit_bias=((1, 0.5), (1, 0.5))),
                                 dict(logit_bias=((1, 101.0),)), dict(min_tokens=-1), dict(max_tokens=4, min_tokens=5)])
def test_invalid_sampling_values_are_rejected(bad):
    """Refused with the field that is wrong (the last one given: the others are valid), named in the message too."""
    with pytest.raises(InvalidSampling) as refused:
        SamplingParams(**bad).validate()
    assert refused.value.field == list(bad)[-1] and refused.value.field in str(refused.value)


@pytest.mark.parametrize("top_p", [1e-38, 1e-45, 5e-324, 1e-7])
def test_a_top_p_too_small_for_float32_is_greedy(top_p):
    """float32 flushes such a top_p to 0 on the device, which would keep no token and always yield token 0."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 64)).astype(np.float32) * 2
    logits[:, 0] = logits.min() - 5  # token 0 is the least likely: picking it would be the flush-to-zero bug
    params = [SamplingParams(temperature=1.0, top_p=top_p).validate()] * 2
    for seed in range(20):
        out = np.asarray(sample(jnp.asarray(logits), _arrays(params, [seed, seed + 100], [0, 3])))
        np.testing.assert_array_equal(out, logits.argmax(axis=-1))


@pytest.mark.parametrize("top_k", [2**31, 2**40, 2**63 - 1, 10**30])
def test_a_top_k_beyond_int32_means_off(top_k):
    """It used to overflow the int32 sampler input and fail the whole step; it keeps every token, like top_k=0."""
    arrays = sampling_arrays([SamplingParams(temperature=1.0, top_k=top_k).validate()], [7], [0], 1, 300)
    assert arrays["top_k"].dtype == np.int32 and arrays["top_k"][0] == INT32_MAX
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((1, 300)).astype(np.float32))
    off = [SamplingParams(temperature=1.0, top_k=0)]
    huge = [SamplingParams(temperature=1.0, top_k=top_k)]
    a = [int(sample(logits, _arrays(off, [5], [c]))[0]) for c in range(30)]
    b = [int(sample(logits, _arrays(huge, [5], [c]))[0]) for c in range(30)]
    assert a == b and len(set(a)) > 3


@pytest.mark.parametrize("vocab", [64, 77, 1000])
def test_a_token_mask_keeps_every_row_inside_its_allowed_set(vocab):
    """Greedy and sampled rows (with top-k / top-p) only ever pick allowed tokens, even when the best logits are all
    disallowed; an unmasked row beside them keeps its usual argmax; padding rows' masks allow everything."""
    rng = np.random.default_rng()
    logits = rng.standard_normal((4, vocab)).astype(np.float32) * 3
    allowed = [rng.random(vocab) < 0.2 for _ in range(3)]
    for a in allowed:
        a[rng.integers(vocab)] = True
    for i, a in enumerate(allowed):  # make the best tokens of each masked row disallowed
        logits[i, ~a] += 10
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=0.7, top_p=0.5), SamplingParams(temperature=0.0)]
    masks = [_pack(a) for a in allowed] + [None]
    arrays = sampling_arrays(params + [None], [1, 2, 3, 4, 0], [0] * 5, 5, vocab, masks)
    assert (arrays["token_mask"][3:] == -1).all()  # unconstrained and padding rows
    masked = np.where(np.stack(allowed), logits[:3], -np.inf)
    for seed in range(25):
        out = np.asarray(sample(jnp.asarray(logits), _arrays(params, [seed] * 4, [seed] * 4, vocab, masks)))
        for i in range(3):
            assert allowed[i][out[i]], (i, out[i])
        assert out[0] == masked[0].argmax()
        assert out[1] in set(np.argsort(-masked[1])[:3])
        assert out[3] == logits[3].argmax()


def test_a_mask_that_allows_nothing_leaves_the_row_unconstrained():
    rng = np.random.default_rng()
    logits = rng.standard_normal((1, 100)).astype(np.float32)
    out = sample(jnp.asarray(logits), _arrays([SamplingParams(temperature=0.0)], [0], [0], 100,
                                              [np.zeros(4, np.int32)]))
    assert int(out[0]) == logits[0].argmax()


@pytest.mark.parametrize("bad", [np.zeros(3, np.int32), np.zeros(4, np.int64), np.zeros(4, np.float32),
                                 np.zeros((2, 4), np.int32)])
def test_a_mask_of_the_wrong_shape_or_dtype_is_refused(bad):
    with pytest.raises(ValueError, match="token mask"):
        sampling_arrays([SamplingParams()], [0], [0], 1, 100, [bad])


def test_every_bit_of_a_64_bit_seed_counts():
    """Seeds that differ only above bit 31 draw different streams (they were once folded into 32 bits, so 1 and
    2**32 + 1 ... and any s and s ^ (t << 32) ^ t collided); a seed below 2**32 still draws PRNGKey(seed)'s stream."""
    rng = np.random.default_rng()
    vocab, steps = 400, 24
    logits = jnp.asarray(rng.standard_normal((1, vocab)).astype(np.float32))
    hot = [SamplingParams(temperature=1.5)]

    def stream(seed):
        return [int(sample(logits, _arrays(hot, [seed], [c], vocab))[0]) for c in range(steps)]

    low = int(rng.integers(1, 2**31))
    for other in (low + 2**32, low ^ (low << 32) ^ low, low + 2**62):  # the second folded to 0 * low: 0
        assert stream(low) != stream(other), other
    assert stream(2**32 + low) != stream(2**33 + low)
    # below 2**32 the key is PRNGKey(seed): a reference draw written against jax.random directly
    key = jax.random.fold_in(jax.random.PRNGKey(low), 5)
    want = int(jnp.argmax(logits[0] / 1.5 + jax.random.gumbel(key, (vocab,), jnp.float32)))
    assert int(sample(logits, _arrays(hot, [low], [5], vocab))[0]) == want
