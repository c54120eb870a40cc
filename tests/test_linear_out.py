"""q,k,v and gate,up GEMMs return the activations' dtype from the dot itself (no float32 output and separate convert
kernel before the LoRA kernel); the result must still be the float32-accumulated product, rounded once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slora_jax.model.config import ModelConfig
from slora_jax.model.llama import WIDE_ROWS, DecoderLayer, Linear, PassThroughOps
from slora_jax.model.rope import rope_cos_sin


def _dot_out_dtypes(fn, *args) -> list:
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [eqn.outvars[0].aval.dtype for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "dot_general"]


@pytest.mark.parametrize("narrow", [False, True])
def test_a_narrow_linear_rounds_the_float32_product_once(narrow):
    rng = np.random.default_rng()
    d_in, d_out = 1024, 384  # a long contraction: bf16 accumulation would be far off
    x = jnp.asarray(rng.standard_normal((48, d_in)), jnp.bfloat16)
    layer = Linear(d_out, narrow)
    params = layer.init(jax.random.PRNGKey(int(rng.integers(1 << 30))), x)
    kernel = np.asarray(params["params"]["kernel"].astype(jnp.bfloat16), np.float64)
    out = layer.apply(params, x)
    assert out.dtype == jnp.bfloat16
    assert _dot_out_dtypes(layer.apply, params, x) == [jnp.bfloat16 if narrow else jnp.float32]
    xs = np.asarray(x, np.float64)
    exact = xs @ kernel
    # one bf16 ulp at each value (8 bits of mantissa with the implicit one), plus what a float32 sum may lose over
    # d_in terms (sums near zero by cancellation have ulps far below that); bf16 accumulation would lose ~2^-8 of
    # the magnitudes' sum instead, 2^13 times more
    allowed = np.abs(exact) * 2.0 ** -8 + d_in * 2.0 ** -24 * (np.abs(xs) @ np.abs(kernel))
    err = np.abs(np.asarray(out, np.float64) - exact)
    assert (err <= allowed).all(), (err / allowed).max()


def test_float32_activations_keep_float32_dots():
    x = jnp.asarray(np.random.default_rng().standard_normal((8, 64)), jnp.float32)
    layer = Linear(32, True)
    params = layer.init(jax.random.PRNGKey(0), x)
    assert _dot_out_dtypes(layer.apply, params, x) == [jnp.float32]


@pytest.mark.parametrize("rows, o_down_dtype", [(WIDE_ROWS // 2, jnp.float32), (WIDE_ROWS, jnp.bfloat16)])
def test_o_and_down_narrow_only_at_prefill_widths(rows, o_down_dtype):
    """Decode-sized batches keep float32 o/down dots (split-K partials would be summed in bf16); from WIDE_ROWS
    rows every projection returns bf16 from the dot, and the layer's output stays within bf16 rounding of the
    float32 route."""
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((rows, cfg.hidden_size)), jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, 64, rows), jnp.int32)
    cos, sin = rope_cos_sin(cfg, positions)
    ops, layer = PassThroughOps(cfg), DecoderLayer(cfg)
    params = layer.init(jax.random.PRNGKey(int(rng.integers(1 << 30))), x, cos, sin, 0, ops, None)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)

    def run(p, x):
        return layer.apply(p, x, cos, sin, 0, ops, None)[0]

    # q,k,v | o | gate,up | down, in program order
    assert _dot_out_dtypes(run, params, x) == [jnp.bfloat16, o_down_dtype, jnp.bfloat16, o_down_dtype]
    out = np.asarray(run(params, x), np.float64)
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(run(jax.tree.map(lambda p: p.astype(jnp.float32), params), x.astype(jnp.float32)),
                         np.float64)
    scale = np.abs(ref).max()
    assert np.isfinite(out).all() and np.abs(out - ref).max() <= 0.05 * scale, np.abs(out - ref).max() / scale
