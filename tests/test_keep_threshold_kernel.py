"""The keep-threshold search as one Pallas kernel (pallas_kernels/keep_threshold.py) against a sort in float64
(test_sampling_filter's reference: the kept set with top_p a hair lower and a hair higher bound the kernel's), and
against the jnp search it replaces: rows of mixed kinds, several chunks a row with a ragged last one, every pivot
count the kernel takes. Interpret mode on CPU (tiny rows), and lowered to Triton for CUDA there too (the Triton
lowering's own checks); compiled on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda
from test_sampling_filter import _arrays, _batch, _ref_bounds

from pallas_kernels.keep_threshold import KEY_BELOW_NEG_INF, KEY_POS_INF, float_key, keep_threshold, key_value
from slora_jax.engine import vocab_select
from slora_jax.engine.sampling import sample

gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def _rows(rng, rows: int, vocab: int):
    """Rows of mixed kinds (peaked, flat, tied, -inf-heavy, signed zeros), with k and top_p from off to deep cuts."""
    x = rng.standard_normal((rows, vocab)).astype(np.float32) * rng.uniform(0.01, 5, (rows, 1)).astype(np.float32)
    x[::4] = np.round(x[::4] * 4) / 4  # ties
    x[1::4, rng.integers(vocab, size=vocab // 3)] = -np.inf
    x[2::4, rng.integers(vocab, size=vocab // 5)] = rng.choice([0.0, -0.0], size=vocab // 5)
    k = rng.choice([1, 2, 7, vocab // 2, vocab], rows).astype(np.int32)
    top_p = rng.choice([1e-6, 0.3, 0.9, 0.99, 1.0], rows).astype(np.float32)
    return x, k, top_p


def _check(x, k, top_p, theta):
    assert theta.shape == (len(x), 1) and theta.dtype == np.float32
    for i in range(len(x)):
        lo, hi = _ref_bounds(x[i], int(k[i]), float(top_p[i]))
        got = (x[i] >= theta[i, 0]) & (x[i] > -np.inf)
        assert (lo <= got).all() and (got <= hi).all(), (i, k[i], top_p[i], got.sum(), lo.sum(), hi.sum())
        assert got[np.argmax(x[i])]  # the top token always


@pytest.mark.parametrize(("pivots", "chunk", "vocab"), [(3, 64, 300), (1, 128, 200), (7, 16, 100)])
def test_kernel_keeps_what_a_sort_keeps(pivots, chunk, vocab):
    rng = np.random.default_rng()
    x, k, top_p = _rows(rng, 8, vocab)
    theta = np.asarray(keep_threshold(jnp.asarray(x), jnp.asarray(k), jnp.asarray(top_p), pivots=pivots,
                                      chunk=chunk, interpret=True))
    _check(x, k, top_p, theta)
    jnp_theta = np.asarray(jax.jit(lambda a, b, c: vocab_select.keep_threshold(a, b, c, pivots, "stacked"))(
        jnp.asarray(x), jnp.asarray(k), jnp.asarray(top_p)))
    same = (x >= theta) == (x >= jnp_theta)  # the same kept set but where a mass sum lands within rounding of top_p
    assert same.all(axis=1).sum() >= len(x) - 1, np.flatnonzero(~same.all(axis=1))


def test_keys_keep_the_order_of_floats_and_the_bracket_constants_are_theirs():
    rng = np.random.default_rng()
    x = np.concatenate([rng.standard_normal(500).astype(np.float32) * rng.choice([1e-30, 1.0, 1e30], 500),
                        np.array([-np.inf, np.inf, 0.0, -0.0, np.finfo(np.float32).tiny])]).astype(np.float32)
    keys = np.asarray(float_key(jnp.asarray(x)))
    np.testing.assert_array_equal(np.asarray(key_value(jnp.asarray(keys))), x)
    x = x + np.float32(0.0)  # -0.0 -> +0.0, as the searches do: then keys order as the values
    keys = np.asarray(float_key(jnp.asarray(x))).astype(np.int64)
    order = np.argsort(x, kind="stable")
    assert (np.diff(keys[order]) >= 0).all() and (np.diff(keys[order]) > 0).sum() == len(np.unique(x)) - 1
    assert int(float_key(jnp.float32(-jnp.inf))) - 1 == int(KEY_BELOW_NEG_INF)
    assert int(float_key(jnp.float32(jnp.inf))) == int(KEY_POS_INF)


def test_the_pallas_form_is_the_kernel_and_rejects_odd_pivots():
    rng = np.random.default_rng()
    x, k, top_p = _rows(rng, 4, 64)
    args = (jnp.asarray(x), jnp.asarray(k), jnp.asarray(top_p))
    via_form = np.asarray(jax.jit(lambda a, b, c: vocab_select.keep_threshold(a, b, c, 3, "pallas"))(*args))
    np.testing.assert_array_equal(via_form, np.asarray(keep_threshold(*args, pivots=3, interpret=True)))
    with pytest.raises(ValueError, match="powers of two"):
        keep_threshold(*args, pivots=2)


def test_the_sampler_on_the_kernel_samples_what_it_samples_on_the_jnp_search(monkeypatch):
    """The whole sampler (temperature, masks, top-k/top-p, Gumbel noise) with the kernel as its threshold search:
    the same tokens for the same seeds."""
    rng = np.random.default_rng()
    logits, masks, params = _batch(rng, 300, 10)
    args = (jnp.asarray(logits), _arrays(params, masks, 300, [int(s) for s in rng.integers(0, 2**31, 10)]))
    want = np.asarray(jax.jit(sample)(*args))
    monkeypatch.setattr(vocab_select, "FORM", "pallas")  # read when traced: a fresh jit
    got = np.asarray(jax.jit(lambda lg, sa: sample(lg, sa))(*args))
    assert (got == want).sum() >= len(want) - 1, (got, want)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled and run on a GPU below")
@pytest.mark.parametrize(("rows", "vocab", "pivots"), [(1, 32000, 3), (256, 32000, 3), (64, 128256, 7)])
def test_the_kernel_lowers_to_triton_for_a_gpu(rows, vocab, pivots):
    """Lowered for CUDA here, on the CPU (jaxlib carries Triton's dialects): every primitive has its Triton rule and
    every block shape is a power of two, as the Triton lowering demands and interpret mode does not check."""
    shapes = (jax.ShapeDtypeStruct((rows, vocab), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.int32),
              jax.ShapeDtypeStruct((rows,), jnp.float32))
    text = lower_for_cuda(lambda a, b, c: keep_threshold(a, b, c, pivots=pivots, interpret=False), *shapes).as_text()
    assert "__gpu$xla.gpu.triton" in text and f"keep_threshold_p{pivots}_c2048" in text


@gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_compiled_kernel_keeps_what_a_sort_keeps(rows):
    rng = np.random.default_rng()
    x, k, top_p = _rows(rng, rows, 32000)
    theta = np.asarray(keep_threshold(jnp.asarray(x), jnp.asarray(k), jnp.asarray(top_p)))
    _check(x[:16], k[:16], top_p[:16], theta[:16])  # the float64 reference sorts: 16 rows say enough
    jnp_theta = np.asarray(jax.jit(lambda a, b, c: vocab_select.keep_threshold(a, b, c, 3, "stacked"))(
        jnp.asarray(x), jnp.asarray(k), jnp.asarray(top_p)))
    assert ((x >= theta) == (x >= jnp_theta)).all(axis=1).mean() >= 0.95
