"""Adapter mixes: several registered adapters, each with a weight, served as one virtual adapter.

The mix of parts ``(adapter_i, w_i)`` is PEFT's ``add_weighted_adapter(..., combination_type="cat")``: per adapted
(layer, projection), its A is the parts' A side by side and its B the parts' B stacked, each part's B times
``w_i * scale_i`` (the part's own alpha/r or alpha/sqrt(r) there), and the mix's own scale is 1, so

    delta(x) = sum_i w_i * scale_i * (x @ A_i) @ B_i       (over the parts that adapt that projection there)

Its rank is the sum of those parts' ranks, so the same kernels run it with no new shape. A mix depends on neither the
order its parts are given in nor the order of its rank rows; PEFT's result does where its combined adapter copies the
first part's config (rsLoRA, layers_to_transform: see docs/DESIGN.md), and equals this one when the first part uses
neither.

A mix is a new *source* (:class:`MixSource`): registered like any adapter under a stable name derived from its sorted
parts and weights (:func:`mix_name`), its rows built on an IO thread from the parts' host rows, then cached in the host
tier and the pool like any adapter's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from slora_jax.lora.errors import AdapterError, rejecting
from slora_jax.lora.pool_rows import AdapterRows, adapter_from_rows, to_pool_rows
from slora_jax.lora.sources import AdapterSource
from slora_jax.model.adapter_weights import LoraAdapter, LoraModule
from slora_jax.model.config import MODULES, ModelConfig

__all__ = ["MAX_MIX_PARTS", "MAX_MIX_WEIGHT", "MIX_PREFIX", "MixParts", "MixSource", "canonical_parts", "mix_adapter",
           "mix_name"]

MIX_PREFIX = "mix:"
MAX_MIX_PARTS = 8  # the rank is the sum of the parts' ranks: more parts than this would rarely fit anyway
MAX_MIX_WEIGHT = 100.0  # |weight| above this is a mistake rather than a mix (its update would swamp the base model)

MixParts = tuple[tuple[str, float], ...]  # (adapter name, weight), sorted by name


def canonical_parts(parts: Mapping[str, float], max_parts: int = MAX_MIX_PARTS) -> MixParts:
    """``parts`` sorted by name after checking them: 1..``max_parts`` parts, each weight a finite number, not zero,
    at most :data:`MAX_MIX_WEIGHT` in magnitude (negative weights subtract a part, as PEFT allows). Raises
    ValueError with a message a client can act on."""
    if not isinstance(parts, Mapping) or not parts:
        raise ValueError("adapters must name at least one adapter with its weight")
    if len(parts) > max_parts:
        raise ValueError(f"adapters names {len(parts)} adapters; a mix has at most {max_parts}")
    out = []
    for name, weight in parts.items():
        if not isinstance(name, str) or not name:
            raise ValueError("adapters: every adapter name must be a non-empty string")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"adapters: the weight of {name[:100]!r} must be a number")
        weight = float(weight)
        if not math.isfinite(weight) or weight == 0 or abs(weight) > MAX_MIX_WEIGHT:
            raise ValueError(f"adapters: the weight of {name[:100]!r} is {weight}; weights must be finite, non-zero "
                             f"and at most {MAX_MIX_WEIGHT:g} in magnitude")
        out.append((name, weight))
    return tuple(sorted(out))


def mix_name(parts: MixParts) -> str:
    """The stable name of a mix: the same parts and weights (in any order) always give the same name, so a repeated
    mix reuses the adapter registered for it; 64 bits of SHA-256 over the exact weights."""
    canon = json.dumps([[name, float(weight).hex()] for name, weight in sorted(parts)])
    return MIX_PREFIX + hashlib.sha256(canon.encode()).hexdigest()[:16]


def mix_adapter(parts: Sequence[tuple[LoraAdapter, float]], name: str) -> LoraAdapter:
    """PEFT's ``cat`` combination of ``(adapter, weight)`` pairs (see the module docstring), float32."""
    keys = sorted(set().union(*(adapter.modules for adapter, _ in parts)))
    modules = {}
    for key in keys:
        present = [(adapter.modules[key], weight) for adapter, weight in parts if key in adapter.modules]
        a = np.concatenate([np.asarray(m.a, np.float32) for m, _ in present], axis=1)
        b = np.concatenate([np.asarray(m.b, np.float32) * np.float32(weight * m.scale) for m, weight in present])
        modules[key] = LoraModule(a=a, b=b, scale=1.0)
    return LoraAdapter(name=name, modules=modules)


def _describe(parts: MixParts) -> str:
    return ", ".join(f"{name[:100]!r}={weight:g}" for name, weight in parts)


@dataclasses.dataclass(frozen=True, eq=False)
class MixSource(AdapterSource):
    """A mix of registered adapters. ``part_ranks(name)`` gives a part's rank table (cheap, from its registration)
    and ``part_rows(name)`` its host rows (blocking: a read on this thread if needed); both raise the part's
    :class:`AdapterError`. The parts must not be mixes themselves."""

    parts: MixParts
    part_ranks: Callable[[str], np.ndarray]
    part_rows: Callable[[str], AdapterRows]

    def rank_table(self, name, model_cfg, max_rank):
        tables = [self._of_part(self.part_ranks, part, name) for part, _ in self.parts]
        total = np.sum(tables, axis=0, dtype=np.int64)
        if int(total.max(initial=0)) > max_rank:
            layer, m = np.unravel_index(int(total.argmax()), total.shape)
            ranks = " + ".join(f"{int(t[layer, m])} ({part[:100]!r})" for t, (part, _) in zip(tables, self.parts,
                                                                                                strict=True))
            raise AdapterError(name, f"the mix of {_describe(self.parts)} has rank {int(total[layer, m])} at layer "
                                     f"{layer} {MODULES[m]} ({ranks}), above this server's maximum LoRA rank "
                                     f"{max_rank}")
        return total.astype(np.int32)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        rows = rejecting(name, self._rows, name, model_cfg, dtype)
        rows.name = name
        return rows

    def _rows(self, name: str, model_cfg: ModelConfig, dtype) -> AdapterRows:
        parts = []
        for part, weight in self.parts:
            rows = self._of_part(self.part_rows, part, name)
            if rows.vectors.shape[2] != model_cfg.head_dim:  # a tensor-parallel pool's host rows are per device
                raise AdapterError(name, f"its part {part[:100]!r} has host rows {rows.vectors.shape[2]} wide, not "
                                         f"the model's {model_cfg.head_dim}: mixes need whole-model rows")
            parts.append((adapter_from_rows(rows, model_cfg), weight))
        return to_pool_rows(mix_adapter(parts, name), model_cfg, dtype)

    @staticmethod
    def _of_part(fn, part: str, name: str):
        """``fn(part)``; its failure raised as the mix's, naming the part."""
        try:
            return fn(part)
        except AdapterError as e:
            raise AdapterError(name, f"its part {part[:100]!r}: {e.reason}", e.retry_after_s) from None
