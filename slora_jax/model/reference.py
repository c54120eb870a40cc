"""The plain-jnp reference path: dense per-row KV cache and stacked (rank-padded) adapters.

Obviously correct rather than fast: every serving path (paged pool, Pallas kernels) is checked against this, and this
is checked against HF transformers + PEFT. Each row of a batch names its own adapter (-1 = base model only).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .adapter_weights import LoraAdapter
from .config import MODULES, ModelConfig
from .llama import forward


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StackedAdapters:
    """Adapters padded to one rank and stacked: a[m] [N, L, d_in, R], b[m] [N, L, R, d_out], scale [N, L, 7]."""

    a: tuple[jax.Array, ...]
    b: tuple[jax.Array, ...]
    scale: jax.Array


def stack_adapters(cfg: ModelConfig, adapters: list[LoraAdapter], dtype=jnp.float32) -> StackedAdapters:
    n, layers = max(len(adapters), 1), cfg.num_hidden_layers
    rank = max([ad.max_rank for ad in adapters] + [1])
    a_all, b_all = [], []
    scale = np.zeros((n, layers, len(MODULES)), np.float32)
    for m, name in enumerate(MODULES):
        d_in, d_out = cfg.module_dims(name)
        a = np.zeros((n, layers, d_in, rank), np.float32)
        b = np.zeros((n, layers, rank, d_out), np.float32)
        for i, ad in enumerate(adapters):
            for layer in range(layers):
                mod = ad.modules.get((layer, name))
                if mod is not None:
                    a[i, layer, :, : mod.rank] = mod.a
                    b[i, layer, : mod.rank, :] = mod.b
                    scale[i, layer, m] = mod.scale
        a_all.append(jnp.asarray(a, dtype))
        b_all.append(jnp.asarray(b, dtype))
    return StackedAdapters(tuple(a_all), tuple(b_all), jnp.asarray(scale))


@dataclasses.dataclass
class ReferenceOps:
    """LayerOps over a dense cache ``(k [L, B, S, n_kv, hd], v)`` and stacked adapters.

    Tokens are laid out as [B, C] flattened (C = tokens per row this step); ``positions`` [B, C] gives each token's
    position; a position >= S marks padding (its K/V write is dropped).
    """

    cfg: ModelConfig
    adapters: StackedAdapters | None
    row_adapter: jax.Array  # int32 [B] (-1 = none)
    positions: jax.Array  # int32 [B, C]

    def lora(self, x, y, modules, layer, state):
        if self.adapters is None:
            return y
        b, c = self.positions.shape
        idx = jnp.repeat(self.row_adapter, c)
        safe = jnp.maximum(idx, 0)
        outs = []
        for m in modules:
            a = self.adapters.a[m][safe, layer]  # [T, d_in, R]
            bm = self.adapters.b[m][safe, layer]  # [T, R, d_out]
            s = self.adapters.scale[safe, layer, m] * (idx >= 0)
            shrunk = jnp.einsum("ti,tir->tr", x.astype(jnp.float32), a.astype(jnp.float32))
            outs.append(jnp.einsum("tr,tro->to", shrunk, bm.astype(jnp.float32)) * s[:, None])
        return (y.astype(jnp.float32) + jnp.concatenate(outs, axis=1)).astype(y.dtype)

    def attend(self, q, k, v, layer, state):
        k_cache, v_cache = state
        b, c = self.positions.shape
        s_max = k_cache.shape[2]
        nq, nkv, hd = q.shape[1], k.shape[1], k.shape[2]
        rows = jnp.repeat(jnp.arange(b), c)
        pos = self.positions.reshape(-1)
        k_cache = k_cache.at[layer, rows, pos].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[layer, rows, pos].set(v.astype(v_cache.dtype), mode="drop")
        keys = k_cache[layer].astype(jnp.float32)  # [B, S, nkv, hd]
        vals = v_cache[layer].astype(jnp.float32)
        group = nq // nkv
        qf = q.astype(jnp.float32).reshape(b, c, nkv, group, hd)
        scores = jnp.einsum("bckgd,bskd->bckgs", qf, keys) / np.sqrt(hd)
        visible = jnp.arange(s_max)[None, None, :] <= self.positions[:, :, None]  # [B, C, S]
        scores = jnp.where(visible[:, :, None, None, :], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = jnp.where(jnp.isnan(probs), 0.0, probs)
        out = jnp.einsum("bckgs,bskd->bckgd", probs, vals).reshape(b * c, nq, hd)
        return out.astype(q.dtype), (k_cache, v_cache)


def empty_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> tuple[jax.Array, jax.Array]:
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


@functools.partial(jax.jit, static_argnums=0)
def reference_step(cfg, params, adapters, row_adapter, tokens, positions, cache, logits_rows):
    """One forward over tokens [B, C] at positions [B, C]; logits of the flat rows ``logits_rows``."""
    ops = ReferenceOps(cfg, adapters, row_adapter, positions)
    return forward(cfg, params, tokens.reshape(-1), positions.reshape(-1), ops, cache, logits_rows)


def reference_logits(cfg: ModelConfig, params: dict, adapters: StackedAdapters | None, prompts: list[list[int]],
                     row_adapter: list[int]) -> list[np.ndarray]:
    """Logits [len, vocab] of every position of every prompt, each row with its own adapter."""
    b, pmax = len(prompts), max(len(p) for p in prompts)
    tokens, positions = _pad(prompts, pmax)
    cache = empty_cache(cfg, b, pmax, params["embed"].dtype)
    logits, _ = reference_step(cfg, params, adapters, jnp.asarray(row_adapter, jnp.int32), tokens, positions, cache,
                               None)
    logits = np.asarray(logits).reshape(b, pmax, -1)
    return [logits[i, : len(p)] for i, p in enumerate(prompts)]


def reference_generate(cfg: ModelConfig, params: dict, adapters: StackedAdapters | None, prompts: list[list[int]],
                       row_adapter: list[int], max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding of ``max_new_tokens`` for every row (no stopping at EOS)."""
    b, pmax = len(prompts), max(len(p) for p in prompts)
    lens = np.array([len(p) for p in prompts])
    s_max = pmax + max_new_tokens
    tokens, positions = _pad(prompts, s_max, width=pmax)
    ra = jnp.asarray(row_adapter, jnp.int32)
    cache = empty_cache(cfg, b, s_max, params["embed"].dtype)
    last = jnp.asarray(np.arange(b) * pmax + lens - 1, jnp.int32)
    logits, cache = reference_step(cfg, params, adapters, ra, tokens, positions, cache, last)
    out = [[] for _ in range(b)]
    nxt = np.asarray(jnp.argmax(logits, axis=-1))
    for step in range(max_new_tokens):
        for i in range(b):
            out[i].append(int(nxt[i]))
        if step == max_new_tokens - 1:
            break
        pos = jnp.asarray((lens + step)[:, None], jnp.int32)
        logits, cache = reference_step(cfg, params, adapters, ra, jnp.asarray(nxt[:, None], jnp.int32), pos, cache,
                                       jnp.arange(b, dtype=jnp.int32))
        nxt = np.asarray(jnp.argmax(logits, axis=-1))
    return out


def _pad(prompts: list[list[int]], pad_pos: int, width: int | None = None) -> tuple[jax.Array, jax.Array]:
    width = width or max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), width), np.int32)
    positions = np.full((len(prompts), width), pad_pos, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
        positions[i, : len(p)] = np.arange(len(p))
    return jnp.asarray(tokens), jnp.asarray(positions)
