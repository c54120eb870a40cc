"""Where a registered adapter's weights come from: the source tier, never evicted.

A source answers two questions: ``rank_table`` (cheap, at register time: is this adapter servable, and how big is
it) and ``load_rows`` (the real read, on an IO thread: the adapter laid out as pool rows). Both raise
:class:`AdapterError` naming the adapter and the reason.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np

from slora_jax.lora.errors import rejecting
from slora_jax.lora.peft import check_peft_dir, load_peft_adapter
from slora_jax.lora.pool_rows import AdapterRows, check_adapter_modules, ranks_to_table, to_pool_rows
from slora_jax.model.adapter_weights import LoraAdapter
from slora_jax.model.config import ModelConfig

__all__ = ["AdapterSource", "InMemorySource", "PeftDirSource", "as_source"]


class AdapterSource(abc.ABC):
    """Where an adapter's weights come from. ``rank_table`` must be cheap (it runs at register time, on the engine
    thread); ``load_rows`` does the real work on an IO thread. Both raise :class:`AdapterError` for bad adapters."""

    @abc.abstractmethod
    def rank_table(self, name: str, model_cfg: ModelConfig, max_rank: int) -> np.ndarray:
        """Validate without reading weights; int32[L, len(MODULES)] ranks (0 = not adapted)."""

    @abc.abstractmethod
    def load_rows(self, name: str, model_cfg: ModelConfig, max_rank: int, dtype) -> AdapterRows:
        """The adapter laid out for the pool, vectors in ``dtype``."""


@dataclasses.dataclass(frozen=True)
class PeftDirSource(AdapterSource):
    """A PEFT LoRA dir (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``allowed_roots`` (resolved dirs; runtime loads): every file read must really be inside one of them, checked on
    each read, so a file swapped for a symlink after registration is refused too (:class:`AdapterNotAllowed`).
    """

    path: Path
    allowed_roots: tuple[Path, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))
        object.__setattr__(self, "allowed_roots", tuple(Path(root) for root in self.allowed_roots))

    def rank_table(self, name, model_cfg, max_rank):
        return ranks_to_table(check_peft_dir(self.path, model_cfg, name, max_rank, self.allowed_roots), model_cfg)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        # Through ``rejecting``: a failure's traceback then keeps neither the adapter read nor its rows alive.
        return rejecting(name, self._rows, name, model_cfg, max_rank, dtype)

    def _rows(self, name, model_cfg, max_rank, dtype) -> AdapterRows:
        # A bfloat16 pool takes BF16 files' bits as they are (no float32 round trip: the bulk of a read's time).
        keep_bf16 = np.dtype(dtype) == ml_dtypes.bfloat16
        adapter = load_peft_adapter(self.path, model_cfg, name, max_rank, self.allowed_roots, keep_bf16)
        return to_pool_rows(adapter, model_cfg, dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class InMemorySource(AdapterSource):
    """An already-built :class:`LoraAdapter` (tests, adapters made in-process); kept referenced as the source tier."""

    adapter: LoraAdapter

    def rank_table(self, name, model_cfg, max_rank):
        return ranks_to_table(check_adapter_modules(self.adapter, model_cfg, name, max_rank), model_cfg)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        # ``rejecting`` names the registered name (the adapter object's may differ) and drops the frames' arrays.
        rows = rejecting(name, to_pool_rows, self.adapter, model_cfg, dtype)
        rows.name = name
        return rows


def as_source(source) -> AdapterSource:
    """A path is a PEFT dir, a :class:`LoraAdapter` is in-memory; sources pass through."""
    if isinstance(source, AdapterSource):
        return source
    if isinstance(source, LoraAdapter):
        return InMemorySource(source)
    if isinstance(source, (str, Path)):
        return PeftDirSource(Path(source))
    raise TypeError(f"cannot make an adapter source from {type(source).__name__}")
