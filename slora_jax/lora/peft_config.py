"""``adapter_config.json`` as untrusted input, and PEFT's rules for what it adapts.

The file is read within a size limit, must be UTF-8 JSON holding an object, and every field we act on is checked for
type and range before use, so a malformed config is an :class:`AdapterError` with the field and the reason, never an
exception from deep inside. The rules themselves follow PEFT's ``LoraModel``: which (layer, module) pairs are
adapted (``target_modules``, ``exclude_modules``, ``layers_to_transform``, ``layers_pattern``) at which rank
(``r``, ``rank_pattern``) and scale (``lora_alpha``, ``alpha_pattern``, ``use_rslora``). ``peft_ranks`` and
``peft_scales`` are the one place those rules live, so the cheap check at register time and the full load agree.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from slora_jax.lora.adapter_files import open_adapter_file, read_bounded
from slora_jax.lora.errors import RETRY_AFTER_S, AdapterError, rejecting
from slora_jax.lora.patterns import PatternTable, compile_pattern, layer_index, layers_pattern_regex
from slora_jax.model.config import MODULES, ModelConfig, module_key

__all__ = ["CONFIG_NAME", "MAX_CONFIG_BYTES", "max_pattern_entries", "parse_config", "peft_ranks", "peft_scales",
           "read_adapter_config", "read_config_bytes"]

CONFIG_NAME = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")
_NOT_LINEAR = ("model", "layers", "self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "norm",
               "rotary_emb", "act_fn")  # a Llama's other modules
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# Features that change what the adapter computes; each must be absent, null, false or empty.
_UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA (use_dora)", "lora_bias": "a bias on lora_B (lora_bias)", "use_qalora": "QA-LoRA (use_qalora)",
    "modules_to_save": "modules_to_save", "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters", "layer_replication": "layer_replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)", "arrow_config": "Arrow routing",
    "monteclora_config": "MonteCLoRA", "kasa_config": "KaSA", "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "velora_config": "VeLoRA",
}
_BOOL_FIELDS = ("use_rslora", "use_dora", "fan_in_fan_out", "inference_mode", "lora_bias", "use_qalora")
_TEXT_FIELDS = ("task_type", "base_model_name_or_path", "revision")


def max_pattern_entries(num_layers: int) -> int:
    """Entries allowed in ``rank_pattern`` / ``alpha_pattern``: one per module of the model, twice over, and at
    least 256 (bounds the matching work: entries x modules)."""
    return max(256, 2 * num_layers * len(MODULES))


def read_adapter_config(path: Path, name: str, roots: tuple[Path, ...] = ()) -> dict:
    """The JSON object in ``path/adapter_config.json`` (at most :data:`MAX_CONFIG_BYTES`, UTF-8). With ``roots``,
    the file must really be inside one of them (:class:`AdapterNotAllowed` otherwise)."""
    return parse_config(read_config_bytes(path, name, roots), name)


def read_config_bytes(path: Path, name: str, roots: tuple[Path, ...] = ()) -> bytes:
    """The raw bytes of ``path/adapter_config.json``, within :data:`MAX_CONFIG_BYTES`."""
    path = Path(path)
    # may pass, as a missing file may: a deploy swapping the directory (a registration's failure stands all the same)
    try:
        is_dir = path.is_dir()
    except OSError as e:
        raise AdapterError(name, f"cannot read {path}: {e.strerror}", RETRY_AFTER_S) from None
    if not is_dir:
        raise AdapterError(name, f"{path} is not a directory", RETRY_AFTER_S)
    with open_adapter_file(path / CONFIG_NAME, name, roots) as file:
        return read_bounded(file, name, CONFIG_NAME, MAX_CONFIG_BYTES)


def parse_config(raw: bytes, name: str) -> dict:
    """``raw`` as a UTF-8 JSON object, or :class:`AdapterError` with the reason."""
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise AdapterError(name, f"unreadable {CONFIG_NAME}: not UTF-8 text") from None
    except RecursionError:
        raise AdapterError(name, f"unreadable {CONFIG_NAME}: nested too deeply") from None
    except ValueError as e:
        raise AdapterError(name, f"unreadable {CONFIG_NAME}: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(name, f"{CONFIG_NAME} is not a JSON object")
    return cfg


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _show(value) -> str:
    """A value for a message, cut short (configs are untrusted and may be huge)."""
    text = repr(value) if not _is_int(value) or abs(value) < 10**30 else f"an integer of {len(str(value))} digits"
    return text if len(text) <= 80 else text[:77] + "..."


def _check_rank(name: str, where: str, r, max_rank: int | None) -> int:
    if not _is_int(r) or r < 1:
        raise AdapterError(name, f"{where} is {_show(r)}; ranks must be ints >= 1")
    if max_rank is not None and r > max_rank:
        raise AdapterError(name, f"rank {r} ({where}) is above the configured maximum {max_rank}")
    return r


def _check_alpha(name: str, where: str, alpha) -> float:
    if not _is_number(alpha):
        raise AdapterError(name, f"{where} is {_show(alpha)}; it must be a number")
    if abs(alpha) > _FLOAT32_MAX or not math.isfinite(alpha):  # (a huge int fails the first test, never converted)
        raise AdapterError(name, f"{where} is {_show(alpha)}; it must be finite and within float32's range")
    return float(alpha)


def _check_flags(cfg: dict, name: str) -> None:
    peft_type = cfg.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise AdapterError(name, f"peft_type {peft_type!r} is not LORA")
    for key in _BOOL_FIELDS:
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise AdapterError(name, f"{key} is {_show(cfg[key])}; it must be true or false")
    for key in _TEXT_FIELDS:
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            raise AdapterError(name, f"{key} is {_show(cfg[key])}; it must be a string")
    for key, what in _UNSUPPORTED_FEATURES.items():
        value = cfg.get(key)  # absent: null, false or empty (0 == False in Python, but 0 is not absent)
        if not (value is None or value is False or (isinstance(value, list | dict | str) and not value)):
            raise AdapterError(name, f"{what} is not supported" if key != "modules_to_save"
                               else f"modules_to_save {_show(cfg[key])} is not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise AdapterError(name, f"bias={_show(cfg.get('bias'))} is not supported (only 'none')")
    dropout = cfg.get("lora_dropout")
    if dropout is not None and not (_is_number(dropout) and 0 <= dropout <= 1):
        raise AdapterError(name, f"lora_dropout is {_show(dropout)}; it must be a number in [0, 1]")


def _pattern_dict(cfg: dict, name: str, field: str, num_layers: int) -> dict:
    patterns = cfg.get(field)
    if patterns is None:
        return {}
    if not isinstance(patterns, dict):
        raise AdapterError(name, f"{field} must be an object mapping module patterns to values, not "
                                 f"{type(patterns).__name__}")
    limit = max_pattern_entries(num_layers)
    if len(patterns) > limit:
        raise AdapterError(name, f"{field} has {len(patterns)} entries (the limit is {limit})")
    return patterns


def _string_list(name: str, field: str, value, limit: int) -> list[str]:
    if not isinstance(value, list) or not value:
        raise AdapterError(name, f"{field} must be a string or a non-empty list of strings, not {_show(value)}")
    if len(value) > limit:
        raise AdapterError(name, f"{field} has {len(value)} entries (the limit is {limit})")
    for item in value:
        if not isinstance(item, str) or not item:
            raise AdapterError(name, f"{field} entry {_show(item)} is not a non-empty string")
    return value


class _Targets:
    """PEFT's ``check_target_module_exists`` for one config: which module names it adapts."""

    def __init__(self, cfg: dict, name: str, num_layers: int):
        limit = num_layers * len(MODULES) + 64
        target = cfg.get("target_modules")
        if target is None:
            raise AdapterError(name, f"{CONFIG_NAME} has no target_modules")
        self.all_linear = isinstance(target, str) and target.lower() == "all-linear"
        self.regex = None
        if isinstance(target, str) and not self.all_linear:
            self.regex = compile_pattern(name, "target_modules", target)
        elif not self.all_linear:
            target = _string_list(name, "target_modules", target, limit)
            for t in target:
                leaf = t.split(".")[-1]
                if leaf in _UNSUPPORTED_TARGETS:
                    raise AdapterError(name, f"LoRA on {leaf} is not supported (only q,k,v,o,gate,up,down "
                                             "projections)")
                if leaf in _NOT_LINEAR:  # PEFT refuses these too: they are not nn.Linear modules of a Llama
                    raise AdapterError(name, f"target module {_show(t)} is not a linear projection (supported: "
                                             f"{', '.join(MODULES)})")
                # any other name a Llama does not have matches nothing, as in PEFT (a generic list such as
                # ["q_proj", "v_proj", "query_key_value", "dense"] adapts q and v); none matching is refused below
            self.all_linear = "all-linear" in target
        self.names = set() if self.all_linear or self.regex is not None else set(target)

        exclude = cfg.get("exclude_modules")
        self.exclude_regex, self.exclude = None, set()
        if isinstance(exclude, str) and exclude:
            self.exclude_regex = compile_pattern(name, "exclude_modules", exclude)
        elif exclude not in (None, [], ""):
            self.exclude = set(_string_list(name, "exclude_modules", exclude, limit))

        layers, pattern = cfg.get("layers_to_transform"), cfg.get("layers_pattern")
        if isinstance(target, str) and (layers is not None or pattern is not None):  # as PEFT's LoraConfig
            raise AdapterError(name, "layers_to_transform and layers_pattern cannot be used with a string "
                                     "target_modules")
        if pattern and layers is None:
            raise AdapterError(name, "layers_pattern needs layers_to_transform")
        if _is_int(layers):
            layers = [layers]
        if layers is not None and not (isinstance(layers, list) and all(_is_int(x) for x in layers)):
            raise AdapterError(name, f"layers_to_transform must be an int or a list of ints, not {_show(layers)}")
        bad = sorted({x for x in layers or () if not 0 <= x < num_layers})
        if bad:
            raise AdapterError(name, f"layers_to_transform {bad[:5]} outside the model's {num_layers} layers")
        self.layers = set(layers) if layers else None  # PEFT: an empty list means every layer

        if isinstance(pattern, str):
            pattern = [pattern] if pattern else []
        elif pattern not in (None, []):  # 0 or false is malformed, not absent
            pattern = _string_list(name, "layers_pattern", pattern, 64)
        self.layer_patterns = [layers_pattern_regex(name, p) for p in pattern or []]

    def adapts(self, key: str) -> bool:
        if self.exclude_regex is not None and self.exclude_regex.fullmatch(key):
            return False
        if key in self.exclude or any(key.endswith(f".{e}") for e in self.exclude):
            return False
        if self.all_linear:
            found = True
        elif self.regex is not None:
            return self.regex.fullmatch(key) is not None
        elif key in self.names:
            return True  # PEFT: a module named in full is adapted whatever layers_to_transform says
        else:
            found = any(key.endswith(f".{t}") for t in self.names)
        if found and self.layers is not None:
            found = layer_index(key, self.layer_patterns) in self.layers
        return found


def peft_ranks(cfg: dict, name: str, model: ModelConfig, max_rank: int | None) -> dict[tuple[int, str], int]:
    """The rank of every (layer, module) an ``adapter_config.json`` adapts, after checking every field we use (and
    every feature we cannot serve). Raises :class:`AdapterError` naming the field and the reason."""
    return rejecting(name, _ranks, cfg, name, model, max_rank)


def _ranks(cfg: dict, name: str, model: ModelConfig, max_rank: int | None) -> dict[tuple[int, str], int]:
    if not isinstance(cfg, dict):
        raise AdapterError(name, f"{CONFIG_NAME} is not a JSON object")
    _check_flags(cfg, name)
    num_layers = model.num_hidden_layers
    r_default = _check_rank(name, "r", cfg.get("r", 8), max_rank)
    rank_pattern = _pattern_dict(cfg, name, "rank_pattern", num_layers)
    for key, r in rank_pattern.items():
        _check_rank(name, f"rank_pattern[{str(key)[:80]!r}]", r, max_rank)
    alpha_pattern = _pattern_dict(cfg, name, "alpha_pattern", num_layers)
    _check_alpha(name, "lora_alpha", cfg.get("lora_alpha", 8))
    for key, alpha in alpha_pattern.items():
        _check_alpha(name, f"alpha_pattern[{str(key)[:80]!r}]", alpha)
    PatternTable(name, "alpha_pattern", alpha_pattern)  # compiles (so checks) every key

    targets = _Targets(cfg, name, num_layers)
    table = PatternTable(name, "rank_pattern", rank_pattern)
    ranks = {}
    for layer in range(num_layers):
        for module in MODULES:
            key = module_key(layer, module)
            if targets.adapts(key):
                ranks[(layer, module)] = table.value(key, r_default)
    if not ranks:
        raise AdapterError(name, f"target_modules {_show(cfg.get('target_modules'))} matches no supported "
                                 "projection of this model")
    return ranks


def peft_scales(cfg: dict, name: str, ranks: dict[tuple[int, str], int]) -> dict[tuple[int, str], float]:
    """PEFT's scale of each adapted module: ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``; alpha from
    ``alpha_pattern`` (first matching key) else ``lora_alpha``. Call after :func:`peft_ranks` checked ``cfg``."""
    alpha_default = _check_alpha(name, "lora_alpha", cfg.get("lora_alpha", 8))
    table = PatternTable(name, "alpha_pattern", cfg.get("alpha_pattern") or {})
    rslora = bool(cfg.get("use_rslora"))
    scales = {}
    for (layer, module), r in ranks.items():
        alpha = float(table.value(module_key(layer, module), alpha_default))
        scales[(layer, module)] = alpha / math.sqrt(r) if rslora else alpha / r
    return scales

