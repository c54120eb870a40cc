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

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.keep_threshold import KEY_BELOW_NEG_INF, KEY_POS_INF, key_value
from pallas_kernels.keep_threshold import keep_threshold as pallas_keep_threshold
from pallas_kernels.keep_threshold import search_rounds as key_search_rounds

CHUNK = 32  # top_k: vocabulary entries per chunk (V / CHUNK chunk maxima, then k * CHUNK candidates)
PIVOTS = 3  # keep_threshold: pivots per round (4-way search: 16 rounds over 2**32 keys)
# keep_threshold: how a round's reduction is written for XLA (all exact; which is fastest is a GPU measurement,
# benchmarks/sampler_cost.py --variants): "stacked" one reduction over [R, PIVOTS, V]; "siblings" one [R, V]
# reduction per pivot (XLA's multi-output fusion reads the row once for all); "stored" siblings reading a stored
# exp(x - max) instead of recomputing it in every round; "auto" siblings from SIBLINGS_FROM_ROWS rows up, else
# stacked (H200, 2026-12-01, pivots 3: stacked 64 / 288 / 566 us at 1 / 128 / 256 rows, siblings 103 / 224 / 367 us);
# "pallas" the whole search as one kernel (pallas_kernels/keep_threshold.py; PIVOTS + 1 a power of two), one launch
# instead of ~67: not the default until an H200 run times it (benchmarks/sampler_cost.py --variants pallas-p3; in
# the engine, SLORA_JAX_KEEP_THRESHOLD=pallas)
FORMS = ("auto", "stacked", "siblings", "stored", "pallas")
FORM = os.environ.get("SLORA_JAX_KEEP_THRESHOLD", "auto")
if FORM not in FORMS:
    raise ValueError(f"SLORA_JAX_KEEP_THRESHOLD={FORM!r}: one of {', '.join(FORMS)}")
SIBLINGS_FROM_ROWS = 128


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
    return key_search_rounds(pivots)


def keep_threshold(x: jax.Array, k: jax.Array, top_p: jax.Array, pivots: int | None = None,
                   form: str | None = None) -> jax.Array:
    """θ [R, 1] such that top-k/top-p keep exactly ``x >= θ`` of each row of x [R, V] (float32, no NaN; -inf = not
    allowed), as sorting would: the k largest (k [R] int32 in [1, V]; V = off) and the smallest most-likely prefix
    whose mass before its last token is below ``top_p`` ([R] float32 in (0, 1]; 1 = off), ties by value kept.

    The kept set is ``{x : count(> x) < k and mass(> x) < top_p}`` (``mass`` from the softmax of the row): the k-th
    largest value is the smallest with fewer than k above it, the top-p cut the smallest with less than top_p mass
    above it. The predicate only grows with x, so its smallest passing float32 key is found by a P-ary search: a fixed
    number of rounds (:func:`search_rounds`), each one reduction over the row (count and mass at ``pivots`` keys).
    Masses are float32 sums (a row whose cumulative mass lands within float rounding of top_p may keep one token more
    or less than a sort summing in another order would). ``pivots``/``form`` None: :data:`PIVOTS`/:data:`FORM`, read
    when traced."""
    pivots, form = pivots or PIVOTS, form or FORM
    if form == "auto":  # the row count is static: one form per compiled bucket
        form = "siblings" if x.shape[0] >= SIBLINGS_FROM_ROWS else "stacked"
    if form == "pallas":
        return pallas_keep_threshold(x, k, top_p, pivots=pivots)
    x = x + 0.0  # -0.0 -> +0.0: the same value, one key
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(x - m)
    if form == "stored":
        e = jax.lax.optimization_barrier(e)  # written once, read by every round
    budget = jnp.where(top_p >= 1.0, jnp.inf, top_p * jnp.sum(e, axis=-1))  # mass(> t) < top_p, in units of e
    k = k.astype(jnp.int32)
    lo = jnp.full(k.shape, KEY_BELOW_NEG_INF)  # predicate false (below every key)
    hi = jnp.full(k.shape, KEY_POS_INF)  # predicate true (nothing above +inf)
    for _ in range(search_rounds(pivots)):
        width = hi - lo
        step = width // np.uint32(pivots + 1) + (width % np.uint32(pivots + 1) != 0)  # ceil, without overflow
        q = lo[:, None] + jnp.minimum(step[:, None] * np.arange(1, pivots + 1, dtype=np.uint32), width[:, None])
        count, mass = _count_and_mass_above(x, e, key_value(q), form)
        ok = (count < k[:, None]) & (mass < budget[:, None])  # [R, pivots]: False then True (monotone)
        lo, hi = jnp.max(jnp.where(ok, lo[:, None], q), axis=-1), jnp.min(jnp.where(ok, q, hi[:, None]), axis=-1)
    return key_value(hi)[:, None]


def _count_and_mass_above(x, e, t, form: str):
    """int32 and float32 [R, P]: how many of each row's x lie above each of its P values t [R, P], and their e."""
    if form == "stacked":
        above = x[:, None, :] > t[:, :, None]  # [R, P, V], fused into the reduction
        return jax.lax.reduce((above.astype(jnp.int32), jnp.where(above, e[:, None, :], 0.0)),
                              (np.int32(0), np.float32(0.0)), _add_pairs, (2,))
    if form not in ("siblings", "stored"):
        raise ValueError(f"unknown keep_threshold form {form!r}")
    stats = []
    for j in range(t.shape[1]):
        above = x > t[:, j:j + 1]
        stats.append(jax.lax.reduce((above.astype(jnp.int32), jnp.where(above, e, 0.0)),
                                    (np.int32(0), np.float32(0.0)), _add_pairs, (1,)))
    return jnp.stack([c for c, _ in stats], axis=-1), jnp.stack([w for _, w in stats], axis=-1)


def _add_pairs(a, b):
    return a[0] + b[0], a[1] + b[1]
