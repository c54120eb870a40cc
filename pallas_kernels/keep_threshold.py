"""The top-k/top-p keep threshold of each row as one Pallas kernel: the search of ``vocab_select.keep_threshold``.

Why: written in jnp the search is 16 rounds of small reductions, and XLA makes 67 kernels of them at batch 64 (179 us
of GPU time and ~0.5 ms of the step's CUDA-graph launch on the H200, session 9's census) for every decode step,
whether a row filters or not. Here one program per row runs the whole search: the row's max and softmax mass, then
each round counts the entries and sums the mass above the round's pivots, a chunk of the row at a time (the row,
128 KB for 32000 logits, stays in L2 between passes).

The same arithmetic as the jnp search (float32 keys as uint32, ``PIVOTS`` + 1 = 4-way brackets, masses summed in
float32), so the kept set is the same but for sums that land within rounding of ``top_p``, where the summation order
differs. The bracket division is a shift: pivots + 1 must be a power of two. Lowered through Triton (``lowering``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.lowering import any_spec, is_pow2, load, pallas_call, store

CHUNK = 2048  # entries of a row read per loop step (a power of two)
_SIGN = np.uint32(0x80000000)
_LOW31 = np.int32(0x7FFFFFFF)
KEY_BELOW_NEG_INF = np.uint32(0x007FFFFE)  # float_key(-inf) - 1: the predicate is false below every key
KEY_POS_INF = np.uint32(0xFF800000)  # float_key(+inf): nothing lies above it, the predicate holds


def float_key(v: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-inf lowest, +inf highest)."""
    bits = lax.bitcast_convert_type(v, jnp.int32)
    return lax.bitcast_convert_type(jnp.where(bits < 0, bits ^ _LOW31, bits), jnp.uint32) ^ _SIGN


def key_value(key: jax.Array) -> jax.Array:
    """The inverse of :func:`float_key`."""
    bits = lax.bitcast_convert_type(key ^ _SIGN, jnp.int32)
    return lax.bitcast_convert_type(jnp.where(bits < 0, bits ^ _LOW31, bits), jnp.float32)


def search_rounds(pivots: int) -> int:
    """Rounds that narrow the first bracket (key(-inf) - 1, key(+inf)] to one key with ``pivots`` a round."""
    width, rounds = int(KEY_POS_INF) - int(KEY_BELOW_NEG_INF), 0
    while width > 1:
        width, rounds = -(-width // (pivots + 1)), rounds + 1
    return rounds


def _kernel(x_ref, k_ref, p_ref, out_ref, *, vocab: int, chunk: int, pivots: int, rounds: int):
    row = pl.program_id(0)
    n_chunks = -(-vocab // chunk)
    rows = jnp.full((chunk,), row, dtype=jnp.int32)
    shift = np.uint32((pivots + 1).bit_length() - 1)  # log2(pivots + 1)
    low_bits = np.uint32(pivots)  # the remainder's bits

    def chunk_at(c):
        cols = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        x = load(x_ref.at[rows, cols], mask=cols < vocab, other=-jnp.inf)
        return x + 0.0  # -0.0 -> +0.0: one key per value

    m = lax.fori_loop(0, n_chunks, lambda c, acc: jnp.maximum(acc, jnp.max(chunk_at(c))), jnp.float32(-jnp.inf))
    m = jnp.where(jnp.abs(m) < jnp.inf, m, 0.0)  # no NaN here: finite
    total = lax.fori_loop(0, n_chunks, lambda c, acc: acc + jnp.sum(jnp.exp(chunk_at(c) - m)), jnp.float32(0.0))
    k = k_ref[row]
    top_p = p_ref[row]
    budget = jnp.where(top_p >= 1.0, jnp.float32(jnp.inf), top_p * total)
    # pivots + 1 lanes (Triton's shapes are powers of two): the last is hi itself, where the predicate holds (forced,
    # so it never moves the bracket: the same search as pivots lanes)
    lanes = jnp.arange(1, pivots + 2, dtype=jnp.uint32)
    last = lanes == np.uint32(pivots + 1)

    def one_round(_, bracket):
        lo, hi = bracket
        width = hi - lo
        step = (width >> shift) + ((width & low_bits) != 0).astype(jnp.uint32)  # ceil(width / (pivots + 1))
        q = lo + jnp.minimum(step * lanes, width)  # [pivots + 1] keys, ascending
        t = key_value(q)

        def stats(c, acc):
            count, mass = acc
            x = chunk_at(c)
            above = x[None, :] > t[:, None]  # [pivots + 1, chunk]
            e = jnp.exp(x - m)[None, :]
            return (count + jnp.sum(above.astype(jnp.int32), axis=1),
                    mass + jnp.sum(jnp.where(above, e, 0.0), axis=1))

        count, mass = lax.fori_loop(0, n_chunks, stats, (jnp.zeros((pivots + 1,), jnp.int32),
                                                         jnp.zeros((pivots + 1,), jnp.float32)))
        ok = ((count < k) & (mass < budget)) | last  # False then True along the lanes (the predicate grows with x)
        return jnp.max(jnp.where(ok, lo, q)), jnp.min(jnp.where(ok, q, hi))

    _, hi = lax.fori_loop(0, rounds, one_round, (jnp.uint32(KEY_BELOW_NEG_INF), jnp.uint32(KEY_POS_INF)))
    store(out_ref.at[jnp.full((1,), row, dtype=jnp.int32)], jnp.full((1,), key_value(hi), jnp.float32))


@functools.partial(jax.jit, static_argnames=("pivots", "chunk", "interpret", "num_warps"))
def keep_threshold(x: jax.Array, k: jax.Array, top_p: jax.Array, *, pivots: int = 3, chunk: int = CHUNK,
                   interpret: bool | None = None, num_warps: int = 4) -> jax.Array:
    """θ [R, 1] with top-k/top-p keeping exactly ``x >= θ`` of each row of x [R, V] (float32, no NaN; -inf = not
    allowed); k [R] int32 in [1, V] (V = off), top_p [R] float32 in (0, 1] (1 = off). See
    ``slora_jax.engine.vocab_select.keep_threshold``, the jnp form and the reference of this one."""
    rows, vocab = x.shape
    if not is_pow2(pivots + 1) or not is_pow2(chunk):
        raise ValueError(f"pivots + 1 ({pivots + 1}) and chunk ({chunk}) must be powers of two")
    chunk = min(chunk, max(16, 1 << (vocab - 1).bit_length()))  # no wider than the row needs
    kernel = functools.partial(_kernel, vocab=vocab, chunk=chunk, pivots=pivots, rounds=search_rounds(pivots))
    theta = pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows,), jnp.float32), grid=(rows,), in_specs=[any_spec()] * 3,
        out_specs=any_spec(), interpret=interpret, num_warps=num_warps, name=f"keep_threshold_p{pivots}_c{chunk}",
    )(x.astype(jnp.float32), k.astype(jnp.int32), top_p.astype(jnp.float32))
    return theta[:, None]
