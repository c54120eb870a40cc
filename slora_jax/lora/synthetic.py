"""Synthetic adapters: distinct random adapters from a seed, for tests and for benchmarks with thousands of adapters
that would not fit on disk.

They are read-only windows of a shared bank of random normals (one bank per dtype and size), so making one costs no
random draws and no copy (Llama-2-7B rank 64 on all 7 projections is 305 MiB of bf16). Distinct seeds pick distinct
windows. Every layer has the same targets, hence the same vector count: one strided view covers all.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

import numpy as np

from pallas_kernels.lora_common import pack_offsets
from slora_jax.lora.errors import AdapterError
from slora_jax.lora.pool_rows import AdapterRows, adapter_from_rows, layout_key, ranks_to_table
from slora_jax.lora.sources import AdapterSource
from slora_jax.model.adapter_weights import LoraAdapter
from slora_jax.model.config import ATTN_MODULES, MODULE_INDEX, MODULES, ModelConfig

__all__ = ["SyntheticAdapterSource", "synthetic_adapter"]

_BANK_SEED = 0x5EED_10A
_MIN_BANK = 1 << 23
_banks: dict[tuple[str, int], np.ndarray] = {}
_banks_lock = threading.Lock()


def _random_bank(dtype: np.dtype, length: int) -> np.ndarray:
    key = (dtype.name, length)
    with _banks_lock:
        bank = _banks.get(key)
        if bank is None:
            rng = np.random.default_rng(_BANK_SEED)
            bank = rng.standard_normal(length, dtype=np.float32).astype(dtype)
            bank.flags.writeable = False
            _banks[key] = bank
        return bank


@dataclasses.dataclass(frozen=True, eq=False)
class SyntheticAdapterSource(AdapterSource):
    """Distinct random adapters from a seed, made straight in pool-row layout. Same (model shape, rank, targets,
    seed, dtype) -> same weights.

    A and B are unit normal; ``scale = strength / sqrt(rank * d_in)`` so the delta is about ``strength`` times the
    input's RMS, whatever the shapes. The rows are a view of a shared bank (no memory of their own) unless
    ``materialize``; the host budget counts their full size either way, so host-tier behaviour is as with real ones.
    """

    model_cfg: ModelConfig
    rank: int
    targets: tuple[str, ...] = ATTN_MODULES
    seed: int = 0
    strength: float = 0.3
    materialize: bool = False  # own a copy of the rows (real host memory per adapter) instead of a view of the bank

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))

    def rank_table(self, name, model_cfg, max_rank):
        if layout_key(self.model_cfg) != layout_key(model_cfg):
            raise AdapterError(name, "synthetic source was made for a model of a different shape")
        unknown = [t for t in self.targets if t not in MODULE_INDEX]
        if unknown:
            raise AdapterError(name, f"unknown target module(s) {unknown} (supported: {', '.join(MODULES)})")
        if not 1 <= self.rank <= max_rank:
            raise AdapterError(name, f"rank {self.rank} is outside 1..{max_rank}")
        layers = range(model_cfg.num_hidden_layers)
        return ranks_to_table({(layer, t): self.rank for layer in layers for t in self.targets}, model_cfg)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        dtype = np.dtype(dtype)
        rank = self.rank_table(name, model_cfg, max_rank)
        vec = model_cfg.head_dim
        a_off, b_off, per_layer = pack_offsets(rank, [model_cfg.module_dims(m) for m in MODULES], vec)
        n_vectors = int(per_layer.max(initial=0))
        count, n_layers = n_vectors * vec, len(per_layer)
        bank = _random_bank(dtype, max(_MIN_BANK, 1 << (2 * count - 1).bit_length()))
        # Layer l is the window at base + l * step: a strided view, so making an adapter costs no copy at all.
        rng = np.random.default_rng(self.seed)
        step = int(rng.integers(1, (bank.size - count) // max(n_layers - 1, 1) + 1))
        base = int(rng.integers(0, bank.size - count - (n_layers - 1) * step + 1))
        vectors = np.lib.stride_tricks.as_strided(bank[base:], shape=(n_layers, n_vectors, vec),
                                                  strides=(step * dtype.itemsize, vec * dtype.itemsize, dtype.itemsize),
                                                  writeable=False)
        if self.materialize:
            vectors = vectors.copy()
        d_in = np.array([model_cfg.module_dims(m)[0] for m in MODULES], np.float32)
        scale = np.where(rank > 0, self.strength / np.sqrt(np.maximum(rank, 1) * d_in), 0).astype(np.float32)
        return AdapterRows(name=name, vectors=vectors, rank=rank, a_off=a_off, b_off=b_off, scale=scale,
                           layer_num_vectors=per_layer)

    def adapter(self, name: str, dtype=np.float32) -> LoraAdapter:
        """The same weights as a float32 :class:`LoraAdapter` (values rounded through ``dtype``), for checks."""
        rows = self.load_rows(name, self.model_cfg, max(self.rank, 1), dtype)
        return adapter_from_rows(rows, self.model_cfg)


def synthetic_adapter(cfg: ModelConfig, name: str, rank: int, targets: Iterable[str] = ATTN_MODULES, seed: int = 0,
                      strength: float = 0.3) -> LoraAdapter:
    """A random :class:`LoraAdapter` equal to what ``SyntheticAdapterSource(cfg, rank, targets, seed)`` serves."""
    return SyntheticAdapterSource(cfg, rank, tuple(targets), seed, strength).adapter(name)
