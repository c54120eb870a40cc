"""Rotary position embeddings exactly as HF Llama applies them (rotate-half, optional llama3 scaling)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import rope_reference

from .config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float64 inverse frequencies, llama3-scaled when the config asks."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def rope_cos_sin(cfg: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin of shape [T, head_dim] (float32) for integer positions [T]."""
    inv = jnp.asarray(inv_frequencies(cfg), dtype=jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inv[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x: [T, heads, head_dim]; rotate-half convention; computed in float32. The same function as the decode
    kernel's reference (``pallas_kernels.paged_attention.rope_reference``), which the kernel's rotation matches."""
    return rope_reference(x, cos, sin)
