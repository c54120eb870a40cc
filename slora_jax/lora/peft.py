"""Read and validate a PEFT LoRA adapter dir (``adapter_config.json`` + ``adapter_model.safetensors``).

Everything that we cannot serve exactly is rejected here, at load, with the adapter's name and the reason, so a bad
adapter never reaches the GPU and never changes what other requests get.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..model.adapter_weights import LoraAdapter, LoraModule
from ..model.config import ATTN_MODULES, MODULES, ModelConfig, module_key

_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")
_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the reason."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"adapter {name!r}: {reason}")
        self.adapter = name
        self.reason = reason


def pattern_value(patterns: dict, key: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` rule: the value of the first pattern matching the end of ``key``
    (a ``module_key``), else ``default``."""
    for pat, value in patterns.items():
        if re.match(rf"(.*\.)?({pat})$", key):
            return value
    return default




def _targets(cfg: dict, name: str, num_layers: int) -> set[tuple[int, str]]:
    """(layer, module) pairs the config says are adapted, after target_modules and layers_to_transform."""
    target = cfg.get("target_modules")
    if target is None:
        raise AdapterError(name, "adapter_config.json has no target_modules")
    pairs = set()
    if isinstance(target, str):
        for layer in range(num_layers):
            for m in MODULES:
                if re.fullmatch(target, module_key(layer, m)):
                    pairs.add((layer, m))
        if not pairs:
            raise AdapterError(name, f"target_modules regex {target!r} matches no supported projection")
        return pairs
    target = list(target)
    for t in target:
        leaf = t.split(".")[-1]
        if leaf in _UNSUPPORTED_TARGETS:
            raise AdapterError(name, f"LoRA on {leaf} is not supported (only q,k,v,o,gate,up,down projections)")
        if leaf not in MODULES and t != "all-linear":
            raise AdapterError(name, f"unknown target module {t!r} (supported: {', '.join(MODULES)})")
    modules = set(MODULES) if "all-linear" in target else {t.split(".")[-1] for t in target}
    layers = cfg.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    layer_set = set(range(num_layers)) if not layers else set(layers)
    bad = [layer for layer in layer_set if not 0 <= layer < num_layers]
    if bad:
        raise AdapterError(name, f"layers_to_transform {bad} outside the model's {num_layers} layers")
    return {(layer, m) for layer in layer_set for m in modules}


def _check_config(cfg: dict, name: str, max_rank: int | None) -> None:
    if cfg.get("peft_type", "LORA").upper() != "LORA":
        raise AdapterError(name, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise AdapterError(name, "DoRA (use_dora) is not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(name, f"bias={cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise AdapterError(name, f"modules_to_save {cfg['modules_to_save']} is not supported")
    if cfg.get("trainable_token_indices"):
        raise AdapterError(name, "trainable_token_indices is not supported")
    if cfg.get("target_parameters"):
        raise AdapterError(name, "target_parameters is not supported")
    ranks = [cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()]
    if max_rank is not None and max(ranks) > max_rank:
        raise AdapterError(name, f"rank {max(ranks)} is above the configured maximum {max_rank}")


def peft_ranks(cfg: dict, name: str, model: ModelConfig, max_rank: int | None) -> dict[tuple[int, str], int]:
    """The rank of every (layer, module) an ``adapter_config.json`` adapts, after checking everything about it we
    cannot serve. The one place PEFT's rank rules live (``r``, ``rank_pattern``, ``target_modules``,
    ``layers_to_transform``), so a cheap check at register time and the full load never disagree."""
    try:
        _check_config(cfg, name, max_rank)
        pairs = _targets(cfg, name, model.num_hidden_layers)
        r_default, pattern = cfg.get("r", 8), cfg.get("rank_pattern") or {}
        ranks = {}
        for layer, module in sorted(pairs):
            key = module_key(layer, module)
            r = pattern_value(pattern, key, r_default)
            if not isinstance(r, int) or isinstance(r, bool) or r < 1:
                raise AdapterError(name, f"{key} has rank {r!r}; ranks must be ints >= 1")
            if max_rank is not None and r > max_rank:
                raise AdapterError(name, f"{key} has rank {r}, above the configured maximum {max_rank}")
            ranks[(layer, module)] = r
    except AdapterError:
        raise
    except Exception as e:  # malformed values (wrong types) in an otherwise valid JSON object
        raise AdapterError(name, f"invalid adapter_config.json: {type(e).__name__}: {e}") from None
    return ranks


def read_adapter_config(path: Path, name: str) -> dict:
    cfg_path = path / "adapter_config.json"
    if not path.is_dir():
        raise AdapterError(name, f"{path} is not a directory")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise AdapterError(name, f"missing {cfg_path.name} in {path}") from None
    except (OSError, ValueError) as e:
        raise AdapterError(name, f"unreadable {cfg_path.name}: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(name, f"{cfg_path.name} is not a JSON object")
    return cfg


def peft_weights_path(path: Path, name: str) -> Path:
    """``path``'s ``adapter_model.safetensors``; raises if there is none (cheap: no read)."""
    st = path / "adapter_model.safetensors"
    if not st.is_file():
        extra = " (adapter_model.bin is not read: convert it to safetensors)" if (path / "adapter_model.bin").exists() \
            else ""
        raise AdapterError(name, f"missing adapter_model.safetensors in {path}{extra}")
    return st


def _read_tensors(path: Path, name: str) -> dict[str, np.ndarray]:
    st = peft_weights_path(path, name)
    try:
        with safe_open(str(st), framework="numpy") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for corrupt files
        raise AdapterError(name, f"unreadable adapter_model.safetensors: {e}") from None


def load_peft_adapter(path: str | Path, model: ModelConfig, name: str | None = None,
                      max_rank: int | None = None) -> LoraAdapter:
    """Read, validate and convert a PEFT LoRA dir into a :class:`LoraAdapter` (float32 numpy weights)."""
    path = Path(path)
    name = name or path.name
    cfg = read_adapter_config(path, name)
    ranks = peft_ranks(cfg, name, model, max_rank)
    expected = set(ranks)
    tensors = _read_tensors(path, name)

    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY_RE.match(key)
        if match is None:
            if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
                raise AdapterError(name, f"LoRA on embeddings or lm_head is not supported ({key})")
            if "magnitude" in key:
                raise AdapterError(name, f"DoRA weights are not supported ({key})")
            raise AdapterError(name, f"unexpected tensor {key!r}")
        layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in MODULES or (parent == "self_attn") != (module in ATTN_MODULES):
            raise AdapterError(name, f"unknown target module in tensor {key!r}")
        if layer >= model.num_hidden_layers:
            raise AdapterError(name, f"tensor {key!r} is for layer {layer}; the model has {model.num_hidden_layers}")
        found.setdefault((layer, module), {})[which] = value

    missing = sorted(expected - set(found))
    if missing:
        raise AdapterError(name, f"no weights for targeted module(s) {[module_key(*m) for m in missing[:3]]}")
    unexpected = sorted(set(found) - expected)
    if unexpected:
        names = [module_key(*m) for m in unexpected[:3]]
        raise AdapterError(name, f"weights for module(s) not in target_modules: {names}")

    alpha_default, alpha_pattern = cfg.get("lora_alpha", 8), cfg.get("alpha_pattern") or {}
    modules: dict[tuple[int, str], LoraModule] = {}
    for (layer, module), pair in sorted(found.items()):
        key = module_key(layer, module)
        if set(pair) != {"A", "B"}:
            raise AdapterError(name, f"{key} has lora_{'A' if 'A' not in pair else 'B'} missing")
        a_t, b_t = pair["A"], pair["B"]  # [r, d_in], [d_out, r]
        d_in, d_out = model.module_dims(module)
        r = ranks[(layer, module)]
        if a_t.ndim != 2 or b_t.ndim != 2 or a_t.shape != (r, d_in) or b_t.shape != (d_out, r):
            raise AdapterError(
                name, f"{key}: lora_A {tuple(a_t.shape)} / lora_B {tuple(b_t.shape)} do not match the base model "
                f"(expected ({r}, {d_in}) / ({d_out}, {r}))")
        a = np.asarray(a_t, np.float32)
        b = np.asarray(b_t, np.float32)
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise AdapterError(name, f"{key} has non-finite weights (NaN or inf)")
        alpha = float(pattern_value(alpha_pattern, key, alpha_default))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        modules[(layer, module)] = LoraModule(a=np.ascontiguousarray(a.T), b=np.ascontiguousarray(b.T), scale=scale)
    return LoraAdapter(name=name, modules=modules)
