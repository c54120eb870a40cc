"""Load an HF Llama checkpoint dir (safetensors, single or sharded) into our params pytree."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from tqdm import tqdm

from .checkpoint_shapes import check_checkpoint_shapes
from .config import MODULES, ModelConfig, module_key
from .params import stack_layer_params


def shard_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (one, or the shards its index names)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def read_hf_tensors(model_dir: str | Path, progress: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint as float32 numpy, keyed by its HF name."""
    tensors: dict[str, np.ndarray] = {}
    files = shard_files(Path(model_dir))
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            keys = list(f.keys())
            for key in tqdm(keys, desc=f"loading {path.name}", disable=not progress or len(keys) < 64, leave=False):
                tensors[key] = f.get_tensor(key)
    return tensors


def load_params(model_dir: str | Path, dtype=jnp.bfloat16, progress: bool = True,
                stacked: bool = True) -> tuple[ModelConfig, dict]:
    """(config, params) for the model in ``model_dir``; weights cast to ``dtype``. ``stacked``: layers as one
    {name: array[L, ...]} dict (for ``lax.scan``), else a list of per-layer dicts (an unrolled loop), made straight
    from the host copy so the device never holds both layouts."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_model_dir(model_dir)
    hf = read_hf_tensors(model_dir, progress=progress)
    return cfg, params_from_hf(cfg, hf, dtype, stacked=stacked)


def params_from_hf(cfg: ModelConfig, hf: dict[str, np.ndarray], dtype, stacked: bool = True) -> dict:
    """Map HF names to our layout: kernels are [d_in, d_out]; q,k,v and gate,up fused."""
    check_checkpoint_shapes(cfg, {name: x.shape for name, x in hf.items()})

    def take(name: str) -> np.ndarray:
        if name not in hf:
            raise KeyError(f"checkpoint is missing tensor {name!r}")
        return np.asarray(hf[name], dtype=np.float32)

    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w = {m: take(f"{module_key(i, m)}.weight").T for m in MODULES}
        qkv = np.concatenate([w["q_proj"], w["k_proj"], w["v_proj"]], axis=1)
        gate_up = np.concatenate([w["gate_proj"], w["up_proj"]], axis=1)
        layers.append({
            "input_layernorm": {"weight": take(p + "input_layernorm.weight")},
            "qkv_proj": {"kernel": qkv},
            "o_proj": {"kernel": w["o_proj"]},
            "post_attention_layernorm": {"weight": take(p + "post_attention_layernorm.weight")},
            "gate_up_proj": {"kernel": gate_up},
            "down_proj": {"kernel": w["down_proj"]},
        })
    embed = take("model.embed_tokens.weight")
    if cfg.tie_word_embeddings:
        lm_head = embed.T
    else:
        lm_head = take("lm_head.weight").T
    params = {
        "embed": embed,
        "layers": stack_layer_params(layers) if stacked else layers,
        "norm": {"weight": take("model.norm.weight")},
        "lm_head": lm_head,
    }
    return _cast(params, dtype)


def _cast(tree, dtype):
    if isinstance(tree, dict):
        return {k: _cast(v, dtype) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_cast(v, dtype) for v in tree]
    return jnp.asarray(tree, dtype=dtype)
