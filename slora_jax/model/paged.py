"""The serving forward: KV cache and adapter weights both in the unified paged pool (docs/DESIGN.md).

``PagedOps`` plugs into the layer code of :mod:`slora_jax.model.llama`: attention writes K/V into the pool and reads
them back through page tables; the LoRA delta is gathered from adapter pages by the SGMV (prefill) / BGMV (decode)
kernels. Which implementation runs is the step's kernel backend (``PagedSpec.backend``, a name in
:mod:`pallas_kernels.backends`): this module only calls the backend's roles, so every backend serves the same forward.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from pallas_kernels.backends import KernelBackend, get_backend
from pallas_kernels.lora_common import AdapterTable
from pallas_kernels.lora_sgmv import SegmentTiles

from .config import MODULES, ModelConfig
from .llama import forward
from .tp_lora import tp_lora


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    """Array inputs of one prefill or decode step (all padded to a bucket by the engine).

    T token rows, B sequences. Decode: T == B, one token per sequence.
    """

    tokens: jax.Array  # int32[T]
    positions: jax.Array  # int32[T]
    kv_slots: jax.Array  # int32[T]   page * P + offset; -1 = padding
    row_slot: jax.Array  # int32[T]   adapter slot of each row; -1 = none
    page_table: jax.Array  # int32[B, max_pages]
    context_lens: jax.Array  # int32[B]   tokens in the cache after this step; 0 = padding sequence
    q_starts: jax.Array  # int32[B + 1] cumulative row starts (prefill)
    logits_rows: jax.Array  # int32[B]   the row whose logits each sequence needs
    lora_tiles: jax.Array  # int32[3, NT] (start, len, slot) SGMV tiles (prefill; unused in decode)
    attn_tiles: jax.Array  # int32[NTA, 4] prefill attention tile map (prefill; unused in decode)


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    """Static choices of a step (part of the jit cache key)."""

    mode: str  # "prefill" | "decode"
    backend: str = "pallas"  # a registered kernel backend name (pallas_kernels.backends.backend_names())
    page_size: int = 16
    max_rank: int = 16
    lora_block_t: int = 16
    attn_block_q: int = 16
    interpret: bool | None = None
    # projections (indices into MODULES) whose LoRA kernels run; a group none of whose modules is listed is skipped
    # (a batch whose adapters target only q,k,v,o launches no MLP LoRA kernels)
    lora_modules: tuple[int, ...] = tuple(range(len(MODULES)))
    # tensor parallelism (slora_jax.model.sharding): the step runs on one of tp_size devices inside a shard_map, on
    # the local config; tp_lora adds the all-reduces and the fully-sharded adapter partition
    tp_size: int = 1
    fully_sharded_loras: bool = False
    # decode on one device: q/k rotation and the KV write inside the attention kernel (``decode_attention_rope``),
    # two launches fewer a layer than rotating in XLA, scattering the KV and attending (False: those three steps).
    # The step runner sets it from EngineConfig.decode_rope_in_attention (off on CPU: slow in interpret mode)
    rope_in_attention: bool = True


@dataclasses.dataclass
class PagedOps:
    cfg: ModelConfig
    spec: PagedSpec
    batch: StepBatch
    table: AdapterTable
    kernels: KernelBackend

    @property
    def residual_first(self) -> bool:
        """The residual may join o/down's base output before the delta (llama.add_projection): not under TP."""
        return self.spec.tp_size == 1

    @property
    def rotates_in_attention(self) -> bool:
        """The layer hands ``attend_unrotated`` the raw qkv (decode on one device, unless the spec says no)."""
        return self.spec.mode == "decode" and self.spec.tp_size == 1 and self.spec.rope_in_attention

    def lora(self, x, y, modules, layer, pool):
        if self.spec.tp_size > 1:
            return tp_lora(self, x, y, modules, layer, pool)
        if not any(m in self.spec.lora_modules for m in modules):
            return y
        return self.shrink_expand(x, y, modules, layer, pool)

    def shrink_expand(self, x, y, modules, layer, pool):
        """``y`` plus each row's LoRA delta: decode runs the group as one call (``bgmv_lora``: one fused kernel, the
        rank-r intermediate never leaves the chip), prefill as shrink then expand."""
        if self.spec.mode == "decode":
            d_outs = tuple(self.cfg.module_dims(MODULES[m])[1] for m in modules)
            return self.kernels.bgmv_lora(x, y, pool, layer, self.batch.row_slot, self.table, modules,
                                          self.spec.max_rank, d_outs, interpret=self.spec.interpret)
        return self.expand(self.shrink(x, modules, layer, pool), y, modules, layer, pool)

    def shrink(self, x, modules, layer, pool):
        """Each row's ``x @ A`` for ``modules``: float32 [T, len(modules), max_rank]."""
        kernels, interpret, rank = self.kernels, self.spec.interpret, self.spec.max_rank
        if self.spec.mode == "decode":
            return kernels.bgmv_shrink(x, pool, layer, self.batch.row_slot, self.table, modules, rank,
                                       interpret=interpret)
        return kernels.sgmv_shrink(x, pool, layer, SegmentTiles(*self.batch.lora_tiles), self.table, modules, rank,
                                   self.spec.lora_block_t, interpret=interpret)

    def expand(self, y_small, y, modules, layer, pool, d_outs=None):
        """``y`` plus each row's ``scale * y_small @ B``; ``d_outs`` (static) defaults to the config's widths."""
        if d_outs is None:
            d_outs = tuple(self.cfg.module_dims(MODULES[m])[1] for m in modules)
        kernels, interpret = self.kernels, self.spec.interpret
        if self.spec.mode == "decode":
            return kernels.bgmv_expand(y_small, y, pool, layer, self.batch.row_slot, self.table, modules, d_outs,
                                       interpret=interpret)
        return kernels.sgmv_expand(y_small, y, pool, layer, SegmentTiles(*self.batch.lora_tiles), self.table,
                                   modules, d_outs, self.spec.lora_block_t, interpret=interpret)

    def attend(self, q, k, v, layer, pool):
        cfg, spec, b, kernels = self.cfg, self.spec, self.batch, self.kernels
        pool = kernels.write_kv(pool, layer, k, v, b.kv_slots, spec.page_size)
        common = dict(page_size=spec.page_size, num_kv_heads=cfg.num_key_value_heads,
                      sm_scale=1.0 / math.sqrt(cfg.head_dim), interpret=spec.interpret)
        if spec.mode == "decode":
            out = kernels.decode_attention(q, pool, layer, b.page_table, b.context_lens, **common)
        else:
            out = kernels.prefill_attention(q, pool, layer, b.page_table, b.q_starts, b.context_lens,
                                            tile_map=b.attn_tiles, block_q=spec.attn_block_q, **common)
        return out, pool

    def attend_unrotated(self, qkv, cos, sin, layer, pool):
        """Rotate q and k, write k and v into the pool and attend, in one kernel: qkv [T, q + 2 kv widths]."""
        cfg, spec, b = self.cfg, self.spec, self.batch
        out, pool = self.kernels.decode_attention_rope(
            qkv, cos, sin, pool, layer, b.page_table, b.context_lens, b.kv_slots, page_size=spec.page_size,
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
            sm_scale=1.0 / math.sqrt(cfg.head_dim), interpret=spec.interpret)
        return out, pool


def paged_forward(cfg: ModelConfig, spec: PagedSpec, params: dict, pool: jax.Array, table: AdapterTable,
                  batch: StepBatch) -> tuple[jax.Array, jax.Array]:
    """(logits float32[B, vocab] of each sequence's ``logits_rows`` row, updated pool)."""
    ops = PagedOps(cfg, spec, batch, table, get_backend(spec.backend))
    return forward(cfg, params, batch.tokens, batch.positions, ops, pool, batch.logits_rows)
