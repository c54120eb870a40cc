"""Selections over the vocabulary without a full-vocabulary sort: the exact top-k of each row, and the logit threshold
of top-k/top-p filtering.

Why: on GPU, XLA sorts a [B, 32000] array with a bitonic network of many global passes (0.74 ms at batch 256 on an
H200), and ``lax.top_k`` with k above its small-k kernel falls back to that sort. Both jobs here touch each logit a
fixed number of times, with fixed shapes (no compile per batch content) and no branch (no host round trip):

* :func:`top_k`: the k rows' best chunks (by chunk maximum) hold the k best values, so only k chunks are searched.
* :func:`keep_threshold`: the kept set of top-k/top-p is ``{x : P(x)}`` for a predicate ``P`` that is monotone in x,
  so its smallest member is found by a P-ary search over the 2**32 float32 bit patterns, each round a few masked
  reductions over the vocabulary. Exact: the same kept set as the sort, ties included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CHUNK = 32  # top_k: vocabulary entries per chunk (V / CHUNK chunk maxima, then k * CHUNK candidates)
PIVOTS = 3  # keep_threshold: pivots per round (4-way search: 16 rounds over 2**32 keys)
_SIGN = np.uint32(0x80000000)
_LOW31 = np.int32(0x7FFFFFFF)
_FULL_WIDTH = 0xFF000002  # key(+inf) - (key(-inf) - 1): the search's first bracket


def top_k(x: jax.Array, k: int, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)`` for x [R, V] (no NaN), the same values and ids, ties to the lower id, without sorting V.

    Exact: an entry in the top k lies in a chunk whose maximum is at least that entry; were its chunk not among the
    k chunks with the largest maxima (ties to the lower chunk), those k maxima plus this entry would be k + 1 entries
    at least as large, and an entry tied with the k-th value in a chunk left out has a higher id than enough tied
    entries in the chunks kept. The kept chunks are gathered in vocabulary order, so the final ``lax.top_k`` over
    k * chunk entries breaks ties by id as the full one does."""
    rows, vocab = x.shape
    chunks = -(-vocab // chunk)
    if chunks <= 2 * k:  # small vocabularies: the plain top_k is as cheap
        return jax.lax.top_k(x, k)
    padded = jnp.pad(x, ((0, 0), (0, chunks * chunk - vocab)), constant_values=-jnp.inf)  # after every real id
    tiles = padded.reshape(rows, chunks, chunk)
    _, best = jax.lax.top_k(jnp.max(tiles, axis=-1), k)
    best = jnp.sort(best, axis=-1)  # vocabulary order
    cand = jnp.take_along_axis(tiles, best[:, :, None], axis=1).reshape(rows, k * chunk)
    values, pos = jax.lax.top_k(cand, k)
    ids = jnp.take_along_axis(best, pos // chunk, axis=-1) * chunk + pos % chunk
    return values, ids.astype(jnp.int32)


def search_rounds(pivots: int = PIVOTS) -> int:
    """Rounds of :func:`keep_threshold` that narrow any bracket of float32 keys down to one key."""
    width, rounds = _FULL_WIDTH, 0
    while width > 1:
        width, rounds = -(-width // (pivots + 1)), rounds + 1
    return rounds


def keep_threshold(x: jax.Array, k: jax.Array, top_p: jax.Array, pivots: int | None = None) -> jax.Array:
    """θ [R, 1] such that top-k/top-p keep exactly ``x >= θ`` of each row of x [R, V] (float32, no NaN; -inf = not
    allowed), as sorting would: the k largest (k [R] int32 in [1, V]; V = off) and the smallest most-likely prefix
    whose mass before its last token is below ``top_p`` ([R] float32 in (0, 1]; 1 = off), ties by value kept.

    The kept set is ``{x : count(> x) < k and mass(> x) < top_p}`` (``mass`` from the softmax of the row): the k-th
    largest value is the smallest with fewer than k above it, the top-p cut the smallest with less than top_p mass
    above it. The predicate only grows with x, so its smallest passing float32 key is found by a P-ary search, a fixed
    number of rounds of 2 * ``pivots`` masked reductions. Masses are float32 sums (a row whose cumulative mass lands
    within float rounding of top_p may keep one token more or less than a sort in another order would).
    ``pivots`` None: :data:`PIVOTS`, read when traced."""
    pivots = pivots or PIVOTS
    x = x + 0.0  # -0.0 -> +0.0: the same value, one key
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(x - m)
    budget = jnp.where(top_p >= 1.0, jnp.inf, top_p * jnp.sum(e, axis=-1))  # mass(> t) < top_p, in units of e
    k = k.astype(jnp.int32)
    lo = jnp.full(k.shape, _key(jnp.float32(-jnp.inf)) - 1)  # predicate false (below every key)
    hi = jnp.full(k.shape, _key(jnp.float32(jnp.inf)))  # predicate true (nothing above +inf)
    for _ in range(search_rounds(pivots)):
        width = hi - lo
        step = width // np.uint32(pivots + 1) + (width % np.uint32(pivots + 1) != 0)  # ceil, without overflow
        new_lo, new_hi = lo, hi
        for j in range(1, pivots + 1):
            q = lo + jnp.minimum(step * np.uint32(j), width)
            above = x > _value(q)[:, None]
            ok = (jnp.sum(above, axis=-1, dtype=jnp.int32) < k) & (jnp.sum(jnp.where(above, e, 0.0), axis=-1) < budget)
            new_hi = jnp.where(ok, jnp.minimum(new_hi, q), new_hi)
            new_lo = jnp.where(ok, new_lo, jnp.maximum(new_lo, q))
        lo, hi = new_lo, new_hi
    return _value(hi)[:, None]


def _key(v: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-inf lowest, +inf highest)."""
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.where(bits < 0, bits ^ _LOW31, bits), jnp.uint32) ^ _SIGN


def _value(key: jax.Array) -> jax.Array:
    """The inverse of :func:`_key`."""
    bits = jax.lax.bitcast_convert_type(key ^ _SIGN, jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.where(bits < 0, bits ^ _LOW31, bits), jnp.float32)

