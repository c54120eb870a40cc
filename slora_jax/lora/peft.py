"""Read and validate a PEFT LoRA dir (``adapter_config.json`` + ``adapter_model.safetensors``).

Adapter files are untrusted: everything that we cannot serve exactly, and everything malformed, is rejected here,
at load, with the adapter's name and the reason, so a bad adapter never reaches the GPU and never changes what
other requests get. The config's rules live in ``peft_config``, its patterns in ``patterns`` (RE2: linear time),
the weights file's checks in ``weights_file``; this module puts them together. ``AdapterError``, ``pattern_value``,
``peft_ranks``, ``read_adapter_config`` and ``peft_weights_path`` are re-exported from here, where callers have
always found them.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from slora_jax.lora.errors import AdapterError, AdapterNotAllowed, rejecting
from slora_jax.lora.patterns import pattern_value
from slora_jax.lora.peft_config import parse_config, peft_ranks, peft_scales, read_adapter_config, read_config_bytes
from slora_jax.lora.weights_file import peft_weights_path, read_lora_weights
from slora_jax.model.adapter_weights import LoraAdapter, LoraModule
from slora_jax.model.config import MODULE_INDEX, MODULES, ModelConfig

__all__ = ["AdapterError", "AdapterNotAllowed", "check_peft_dir", "load_peft_adapter", "pattern_value", "peft_ranks",
           "peft_weights_path", "read_adapter_config"]


class _RulesCache:
    """The ranks and scales of configs already checked, by (sha256 of the file, layer count, max rank): what a config
    says is a function of exactly these, so a load after its register-time check (perhaps inline on the engine
    thread) does not match its patterns again. Compact tables, at most ``size`` configs, thread-safe."""

    def __init__(self, size: int = 1024):
        self.size, self._lock = size, threading.Lock()
        self._tables: OrderedDict[tuple, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def get(self, key: tuple) -> tuple[dict, dict] | None:
        with self._lock:
            tables = self._tables.get(key)
            if tables is not None:
                self._tables.move_to_end(key)
        if tables is None:
            return None
        ranks, scales = tables
        pairs = [(int(layer), MODULES[m]) for layer, m in zip(*np.nonzero(ranks), strict=True)]
        return ({p: int(ranks[p[0], MODULE_INDEX[p[1]]]) for p in pairs},
                {p: float(scales[p[0], MODULE_INDEX[p[1]]]) for p in pairs})

    def put(self, key: tuple, ranks: dict, scales: dict) -> None:
        rank_table, scale_table = np.zeros((key[1], len(MODULES)), np.int32), np.zeros((key[1], len(MODULES)))
        for (layer, module), r in ranks.items():
            rank_table[layer, MODULE_INDEX[module]] = r
            scale_table[layer, MODULE_INDEX[module]] = scales[(layer, module)]
        with self._lock:
            self._tables[key] = (rank_table, scale_table)
            while len(self._tables) > self.size:
                self._tables.popitem(last=False)


_checked_configs = _RulesCache()


def _config_rules(path: Path, model: ModelConfig, name: str, max_rank: int | None,
                  roots: tuple[Path, ...]) -> tuple[dict[tuple[int, str], int], dict[tuple[int, str], float]]:
    """``(ranks, scales)`` of ``path``'s config, every rule checked (or found already checked in the cache)."""
    raw = read_config_bytes(path, name, roots)
    key = (hashlib.sha256(raw).digest(), model.num_hidden_layers, max_rank)
    cached = _checked_configs.get(key)
    if cached is not None:
        return cached
    cfg = parse_config(raw, name)
    ranks = peft_ranks(cfg, name, model, max_rank)
    scales = peft_scales(cfg, name, ranks)
    _checked_configs.put(key, ranks, scales)
    return ranks, scales


def check_peft_dir(path: str | Path, model: ModelConfig, name: str, max_rank: int | None,
                   roots: tuple[Path, ...] = ()) -> dict[tuple[int, str], int]:
    """The cheap register-time check: the whole config (ranks, scales, patterns) and that the weights file exists,
    without reading it. ``{(layer, module): rank}``."""

    def check() -> dict[tuple[int, str], int]:
        ranks, _ = _config_rules(Path(path), model, name, max_rank, tuple(roots))
        peft_weights_path(Path(path), name)
        return ranks

    return rejecting(name, check)


def _load(path: Path, model: ModelConfig, name: str, max_rank: int | None, roots: tuple[Path, ...],
          keep_bf16: bool) -> LoraAdapter:
    ranks, scales = _config_rules(path, model, name, max_rank, roots)
    weights = read_lora_weights(path, name, model, ranks, roots, keep_bf16)
    modules = {pair: LoraModule(a=a, b=b, scale=scales[pair]) for pair, (a, b) in weights.items()}
    return LoraAdapter(name=name, modules=modules)


def load_peft_adapter(path: str | Path, model: ModelConfig, name: str | None = None,
                      max_rank: int | None = None, roots: tuple[Path, ...] = (), keep_bf16: bool = False,
                      ) -> LoraAdapter:
    """Read, validate and convert a PEFT LoRA dir into a :class:`LoraAdapter` (float32 numpy weights; with
    ``keep_bf16``, BF16 tensors stay bfloat16, for a bfloat16 pool).

    ``roots``: the directories the files must really be in (runtime loads); :class:`AdapterNotAllowed` otherwise.
    Any failure is an :class:`AdapterError` whose traceback holds none of the weights read so far.
    """
    path = Path(path)
    name = name or path.name
    return rejecting(name, _load, path, model, name, max_rank, tuple(roots), keep_bf16)
