"""Functional Llama: Flax linen modules applied with an explicit params pytree, layers run by ``lax.scan``.

The layer does not know where its KV cache lives or where adapter weights come from: both are supplied by a
``LayerOps`` object (attention + LoRA delta), so the same layer code runs the plain reference (dense cache, stacked
adapters) and the serving path (unified paged pool, Pallas kernels). ``state`` is whatever the ops keep per step
(a dense cache, or the pool) and travels in the scan carry so that updates happen in place under donation.
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import ModelConfig
from .rope import apply_rope, rope_cos_sin


class LayerOps(Protocol):
    def lora(self, x: jax.Array, y: jax.Array, modules: tuple[int, ...], layer: jax.Array, state: Any) -> jax.Array:
        """``y`` (the base output [T, sum(d_out)] of ``modules``, indices into MODULES) plus each row's LoRA delta."""

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array, state: Any) -> tuple[jax.Array, Any]:
        """Store k, v ([T, n_kv, hd], rotated) and attend q ([T, n_heads, hd]); returns ([T, n_heads, hd], state)."""

    # Ops whose ``rotates_in_attention`` is true get ``attend_unrotated(qkv, cos, sin, layer, state)`` instead: the
    # projection output as it is, rotated inside their attention kernel (one launch instead of three a layer).


def add_projection(ops: LayerOps, residual: jax.Array, x: jax.Array, y: jax.Array, modules: tuple[int, ...],
                   layer: jax.Array, state: Any) -> jax.Array:
    """``residual + y`` plus each row's LoRA delta of ``modules`` (o_proj, down_proj: ``y`` is the base ``x @ W``).

    Ops whose ``residual_first`` is true take the residual into the base output before the LoRA kernel adds its delta
    in place: XLA then fuses the add into the GEMM's epilogue (or split-K reduction) instead of launching it after the
    kernel, one launch fewer per projection (64 per 7B decode step at batch 64 and 256 on the H200; the launches, not
    the bytes, pace that step). Not under tensor parallelism, where ``y`` is a partial sum all-reduced inside
    ``ops.lora``. The reference keeps the plain order."""
    if getattr(ops, "residual_first", False):
        return ops.lora(x, residual + y, modules, layer, state)
    return residual + ops.lora(x, y, modules, layer, state)


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (weight.astype(jnp.float32) * xf).astype(x.dtype)


class Linear(nn.Module):
    """``x @ kernel`` with kernel [d_in, d_out] and float32 accumulation.

    ``narrow_out``: the dot itself returns ``x``'s dtype. For projections whose output goes to a LoRA kernel (q,k,v
    and gate,up): XLA cannot fuse the float32 -> bf16 convert into that custom call or into a cuBLAS GEMM, so it ran
    as a kernel of its own, 2 a layer, after the GEMM wrote float32 (benchmarks/NOTES.md, session 13's prefill
    profile). cuBLAS (compute type 32F) and Triton GEMMs accumulate bf16 dots in float32 either way, and round once.
    o and down narrow only from ``WIDE_ROWS`` rows (prefill steps): at decode batches XLA splits their contraction up
    to 8 ways and sums the split-K partial products in the output type (unless
    --xla_gpu_triton_gemm_disable_reduced_precision_reduction), where a prefill GEMM has no split-K to round. There
    the float32 output cost a convert kernel of its own before the residual add, 64 a 7B prefill step."""

    features: int
    narrow_out: bool = False

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(0.02), (x.shape[-1], self.features))
        out_dtype = x.dtype if self.narrow_out else jnp.float32
        return jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=out_dtype).astype(x.dtype)


# rows from which o and down narrow their GEMM output too (see Linear): prefill buckets from 512 tokens (the saturated
# S-LoRA trace's usual step); decode batches (256 rows by default) and short prefills, where XLA may split K, stay below
WIDE_ROWS = 512


class DecoderLayer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, cos, sin, layer, ops: LayerOps, state):
        cfg = self.cfg
        t = x.shape[0]
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = RMSNorm(cfg.rms_norm_eps, name="input_layernorm")(x)
        qkv = ops.lora(h, Linear(cfg.q_width + 2 * cfg.kv_width, True, name="qkv_proj")(h), (0, 1, 2), layer, state)
        if getattr(ops, "rotates_in_attention", False):
            attn, state = ops.attend_unrotated(qkv, cos, sin, layer, state)
        else:
            q = qkv[:, : cfg.q_width].reshape(t, nq, hd)
            k = qkv[:, cfg.q_width : cfg.q_width + cfg.kv_width].reshape(t, nkv, hd)
            v = qkv[:, cfg.q_width + cfg.kv_width :].reshape(t, nkv, hd)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            attn, state = ops.attend(q, k, v, layer, state)
        attn = attn.reshape(t, cfg.q_width).astype(x.dtype)
        wide = t >= WIDE_ROWS
        x = add_projection(ops, x, attn, Linear(cfg.hidden_size, wide, name="o_proj")(attn), (3,), layer, state)
        h = RMSNorm(cfg.rms_norm_eps, name="post_attention_layernorm")(x)
        gu = ops.lora(h, Linear(2 * cfg.intermediate_size, True, name="gate_up_proj")(h), (4, 5), layer, state)
        gate, up = gu[:, : cfg.intermediate_size], gu[:, cfg.intermediate_size :]
        act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
        x = add_projection(ops, x, act, Linear(cfg.hidden_size, wide, name="down_proj")(act), (6,), layer, state)
        return x, state


def forward(cfg: ModelConfig, params: dict, tokens: jax.Array, positions: jax.Array, ops: LayerOps, state: Any,
            logits_rows: jax.Array | None = None) -> tuple[jax.Array, Any]:
    """Run the model over a flat batch of tokens.

    ``params["layers"]`` is either stacked ({name: array[L, ...]}, run by ``lax.scan``: one compile of the layer
    whatever the depth) or a list of per-layer dicts (unrolled: longer compiles, no per-step slicing of weights).

    tokens, positions: int32 [T]. ``logits_rows`` (int32 [R]) selects the rows whose logits are computed (e.g. the
    last token of each prompt); None computes all. Returns (logits float32 [R or T, vocab], state).
    """
    dtype = params["embed"].dtype
    x = params["embed"][tokens].astype(dtype)
    cos, sin = rope_cos_sin(cfg, positions)
    layer_module = DecoderLayer(cfg)

    def body(carry, layer_in):
        x, state = carry
        layer_params, layer = layer_in
        x, state = layer_module.apply({"params": layer_params}, x, cos, sin, layer, ops, state)
        return (x, state), None

    if isinstance(params["layers"], list | tuple):  # one set of arrays per layer: unrolled, nothing sliced
        for i, layer_params in enumerate(params["layers"]):
            (x, state), _ = body((x, state), (layer_params, jnp.int32(i)))
    else:
        layer_ids = jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)
        (x, state), _ = jax.lax.scan(body, (x, state), (params["layers"], layer_ids))
    if logits_rows is not None:
        x = x[logits_rows]
    x = RMSNorm(cfg.rms_norm_eps).apply({"params": params["norm"]}, x)
    logits = jnp.dot(x, params["lm_head"].astype(x.dtype), preferred_element_type=jnp.float32)
    return logits, state


class PassThroughOps:
    """LayerOps with no LoRA and no cache: attention returns v (its heads repeated for GQA). Enough to create a
    layer's params, or to look at the layer's own computation (its dots) alone."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def lora(self, x, y, *a):
        return y

    def attend(self, q, k, v, layer, state):
        return jnp.repeat(v, self.cfg.num_attention_heads // self.cfg.num_key_value_heads, axis=1), state


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params in our layout (for tests that need no checkpoint)."""
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    embed = jax.random.normal(k_embed, (cfg.vocab_size, cfg.hidden_size), dtype) * 0.5

    def one(k):
        x = jnp.zeros((1, cfg.hidden_size), dtype)
        cos, sin = rope_cos_sin(cfg, jnp.zeros((1,), jnp.int32))
        return DecoderLayer(cfg).init(k, x, cos, sin, 0, PassThroughOps(cfg), None)["params"]

    layers = jax.vmap(one)(jax.random.split(k_layers, cfg.num_hidden_layers))
    lm_head = embed.T if cfg.tie_word_embeddings else jax.random.normal(k_head, (cfg.hidden_size, cfg.vocab_size))
    lm_head = lm_head * (1.0 if cfg.tie_word_embeddings else 0.05)
    return {"embed": embed, "layers": layers, "norm": {"weight": jnp.ones((cfg.hidden_size,), dtype)},
            "lm_head": lm_head.astype(dtype)}
