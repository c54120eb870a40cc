"""Per-step host inputs travel as one int32 buffer; unpacked in the step they must equal what was built."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from slora_jax.engine.sampling import SamplingArrays
from slora_jax.engine.step_runner import pack_inputs, unpack_inputs
from slora_jax.model.paged import StepBatch


def _random_inputs(rng, rows=6, seqs=3, pages=5):
    def ints(*shape):
        return rng.integers(-(2**31), 2**31 - 1, size=shape, dtype=np.int64).astype(np.int32)

    batch = StepBatch(tokens=ints(rows), positions=ints(rows), kv_slots=ints(rows), row_slot=ints(rows),
                      page_table=ints(seqs, pages), context_lens=ints(seqs), q_starts=ints(seqs + 1),
                      logits_rows=ints(seqs), lora_tiles=ints(3, 4), attn_tiles=ints(7, 4))
    s = SamplingArrays(temperature=rng.standard_normal(seqs).astype(np.float32) * 1e3,
                       top_k=ints(seqs), top_p=rng.random(seqs).astype(np.float32),
                       seed=rng.integers(0, 2**32, size=seqs, dtype=np.uint64).astype(np.uint32),
                       seed_hi=rng.integers(0, 2**32, size=seqs, dtype=np.uint64).astype(np.uint32), counter=ints(seqs),
                       token_mask=ints(seqs, 4), penalty_row=ints(seqs),
                       presence=rng.standard_normal(seqs).astype(np.float32),
                       frequency=rng.standard_normal(seqs).astype(np.float32),
                       repetition=rng.random(seqs).astype(np.float32) + 0.5, prompt_len=ints(seqs),
                       bias_ids=ints(seqs, 3), bias_values=rng.standard_normal((seqs, 3)).astype(np.float32))
    return batch, s, ints(rows)


def test_pack_then_unpack_in_jit_is_exact():
    rng = np.random.default_rng()
    batch, s, token_src = _random_inputs(rng)
    packed, layout = pack_inputs(batch, s, token_src)
    assert packed.dtype == np.int32 and packed.ndim == 1
    got_batch, got_s, got_src = jax.jit(unpack_inputs, static_argnums=1)(packed, layout)
    for f in dataclasses.fields(StepBatch):
        np.testing.assert_array_equal(np.asarray(getattr(got_batch, f.name)), getattr(batch, f.name), f.name)
    for f in dataclasses.fields(SamplingArrays):
        want = getattr(s, f.name)
        got = np.asarray(getattr(got_s, f.name))
        assert got.dtype == want.dtype, f.name
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32), f.name)  # bit-exact
    np.testing.assert_array_equal(np.asarray(got_src), token_src)


def test_every_field_starts_256_bytes_aligned():
    """The Mosaic GPU custom call refuses an operand off a 256-byte boundary, and XLA passes a static slice of the
    packed parameter as a pointer into it: each field must start at a multiple of 64 int32s."""
    rng = np.random.default_rng()
    batch, s, token_src = _random_inputs(rng)
    packed, layout = pack_inputs(batch, s, token_src)
    values = [getattr(batch, f.name) for f in dataclasses.fields(StepBatch)]
    values += [getattr(s, f.name) for f in dataclasses.fields(SamplingArrays)] + [token_src]
    offset = 0
    for (name, shape, _), want in zip(layout, values, strict=True):
        size = int(np.prod(shape))
        np.testing.assert_array_equal(packed[offset:offset + size], want.view(np.int32).ravel(), name)
        offset += -(-size // 64) * 64
    assert offset == packed.size


def test_pack_refuses_a_field_it_cannot_carry():
    rng = np.random.default_rng()
    batch, s, token_src = _random_inputs(rng)
    bad = dataclasses.replace(s, temperature=s.temperature.astype(np.float64))
    try:
        pack_inputs(batch, bad, token_src)
    except TypeError as e:
        assert "temperature" in str(e)
    else:
        raise AssertionError("a float64 field must be refused")
