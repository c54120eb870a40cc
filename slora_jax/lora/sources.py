"""Where a registered adapter's weights come from: the source tier, never evicted.

A source answers two questions: ``rank_table`` (cheap, at register time: is this adapter servable, and how big is
it) and ``load_rows`` (the real read, on an IO thread: the adapter laid out as pool rows). Both raise
:class:`AdapterError` naming the adapter and the reason.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path

import numpy as np

from slora_jax.lora.peft import AdapterError, load_peft_adapter, peft_ranks, peft_weights_path, read_adapter_config
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
    """A PEFT LoRA dir (``adapter_config.json`` + ``adapter_model.safetensors``)."""

    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    def rank_table(self, name, model_cfg, max_rank):
        ranks = peft_ranks(read_adapter_config(self.path, name), name, model_cfg, max_rank)
        peft_weights_path(self.path, name)
        return ranks_to_table(ranks, model_cfg)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        adapter = load_peft_adapter(self.path, model_cfg, name, max_rank)
        return to_pool_rows(adapter, model_cfg, dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class InMemorySource(AdapterSource):
    """An already-built :class:`LoraAdapter` (tests, adapters made in-process); kept referenced as the source tier."""

    adapter: LoraAdapter

    def rank_table(self, name, model_cfg, max_rank):
        return ranks_to_table(check_adapter_modules(self.adapter, model_cfg, name, max_rank), model_cfg)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        for (layer, module), mod in self.adapter.modules.items():
            if not (np.isfinite(mod.a).all() and np.isfinite(mod.b).all()):
                raise AdapterError(name, f"layer {layer} {module} has non-finite weights (NaN or inf)")
        try:
            rows = to_pool_rows(self.adapter, model_cfg, dtype)
        except AdapterError as e:  # names the adapter object, which may differ from the registered name
            raise AdapterError(name, e.reason) from None
        except ValueError as e:
            raise AdapterError(name, str(e)) from None
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
