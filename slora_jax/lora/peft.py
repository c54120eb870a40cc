"""Read and validate a PEFT LoRA dir (``adapter_config.json`` + ``adapter_model.safetensors``).

Adapter files are untrusted: everything that we cannot serve exactly, and everything malformed, is rejected here,
at load, with the adapter's name and the reason, so a bad adapter never reaches the GPU and never changes what
other requests get. The config's rules live in ``peft_config``, its patterns in ``patterns`` (RE2: linear time),
the weights file's checks in ``weights_file``; this module puts them together. ``AdapterError``, ``pattern_value``,
``peft_ranks``, ``read_adapter_config`` and ``peft_weights_path`` are re-exported from here, where callers have
always found them.
"""

from __future__ import annotations

from pathlib import Path

from slora_jax.lora.errors import AdapterError, AdapterNotAllowed, rejecting
from slora_jax.lora.patterns import pattern_value
from slora_jax.lora.peft_config import peft_ranks, peft_scales, read_adapter_config
from slora_jax.lora.weights_file import peft_weights_path, read_lora_weights
from slora_jax.model.adapter_weights import LoraAdapter, LoraModule
from slora_jax.model.config import ModelConfig

__all__ = ["AdapterError", "AdapterNotAllowed", "check_peft_dir", "load_peft_adapter", "pattern_value", "peft_ranks",
           "peft_weights_path", "read_adapter_config"]


def check_peft_dir(path: str | Path, model: ModelConfig, name: str, max_rank: int | None,
                   roots: tuple[Path, ...] = ()) -> dict[tuple[int, str], int]:
    """The cheap register-time check: the whole config (ranks, scales, patterns) and that the weights file exists,
    without reading it. ``{(layer, module): rank}``."""

    def check() -> dict[tuple[int, str], int]:
        cfg = read_adapter_config(Path(path), name, roots)
        ranks = peft_ranks(cfg, name, model, max_rank)
        peft_scales(cfg, name, ranks)
        peft_weights_path(Path(path), name)
        return ranks

    return rejecting(name, check)


def _load(path: Path, model: ModelConfig, name: str, max_rank: int | None, roots: tuple[Path, ...]) -> LoraAdapter:
    cfg = read_adapter_config(path, name, roots)
    ranks = peft_ranks(cfg, name, model, max_rank)
    scales = peft_scales(cfg, name, ranks)
    weights = read_lora_weights(path, name, model, ranks, roots)
    modules = {pair: LoraModule(a=a, b=b, scale=scales[pair]) for pair, (a, b) in weights.items()}
    return LoraAdapter(name=name, modules=modules)


def load_peft_adapter(path: str | Path, model: ModelConfig, name: str | None = None,
                      max_rank: int | None = None, roots: tuple[Path, ...] = ()) -> LoraAdapter:
    """Read, validate and convert a PEFT LoRA dir into a :class:`LoraAdapter` (float32 numpy weights).

    ``roots``: the directories the files must really be in (runtime loads); :class:`AdapterNotAllowed` otherwise.
    Any failure is an :class:`AdapterError` whose traceback holds none of the weights read so far.
    """
    path = Path(path)
    name = name or path.name
    return rejecting(name, _load, path, model, name, max_rank, tuple(roots))
