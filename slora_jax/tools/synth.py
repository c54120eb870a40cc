"""Write random-weight models as real HF checkpoint dirs and random PEFT LoRA adapter dirs (numpy + safetensors).

Tests, the demo and the benchmarks use these instead of downloads. The files are exactly what HF transformers and
PEFT write, so the real loading code is what gets exercised.

    python -m slora_jax.tools.synth model --preset tiny --out /tmp/tiny
    python -m slora_jax.tools.synth adapters --model /tmp/tiny --out /tmp/adapters -n 8 --ranks 4,8,16
"""

from __future__ import annotations

import argparse
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ..model.config import MODULES, ModelConfig, module_key

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def preset_config(name: str) -> dict:
    path = CONFIG_DIR / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
        raise ValueError(f"unknown preset {name!r}; known: {known}")
    with open(path) as f:
        return json.load(f)


PARALLEL_MIN_VALUES = 1 << 28  # models above this many weights are drawn on threads (a 7B model: minutes -> seconds)


def random_hf_tensors(cfg: ModelConfig, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """HF-named random weights scaled so activations stay O(1) and logits are peaked (no greedy ties). Small models
    draw every tensor from one generator in order (the values tests were written against); large ones draw each
    tensor from its own generator (seeded by ``seed`` and its index) on several threads, numpy drawing without the
    GIL, each in float32 then cast."""
    specs = {"model.embed_tokens.weight": ((cfg.vocab_size, cfg.hidden_size), "embed"),
             "model.norm.weight": ((cfg.hidden_size,), "norm")}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for m in MODULES:
            d_in, d_out = cfg.module_dims(m)
            specs[f"{module_key(i, m)}.weight"] = ((d_out, d_in), "lin")
        specs[p + "input_layernorm.weight"] = ((cfg.hidden_size,), "norm")
        specs[p + "post_attention_layernorm.weight"] = ((cfg.hidden_size,), "norm")
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = ((cfg.vocab_size, cfg.hidden_size), "head")
    dtype = np.dtype(dtype)

    def draw(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32)
        if kind == "norm":
            return (1.0 + 0.1 * x).astype(dtype)
        if kind == "embed":
            return x.astype(dtype)
        x = (x / math.sqrt(shape[1])).astype(dtype)
        return (x * 2.0).astype(dtype) if kind == "head" else x

    if sum(math.prod(shape) for shape, _ in specs.values()) < PARALLEL_MIN_VALUES:
        rng = np.random.default_rng(seed)
        return {name: draw(rng, shape, kind) for name, (shape, kind) in specs.items()}
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as threads:
        futures = {name: threads.submit(draw, np.random.default_rng([seed, k]), shape, kind)
                   for k, (name, (shape, kind)) in enumerate(specs.items())}
        return {name: f.result() for name, f in futures.items()}


def write_model(out: str | Path, preset: str | dict = "tiny", seed: int = 0, dtype=np.float32,
                shard_bytes: int | None = None) -> Path:
    """A random model as an HF dir: config.json + model.safetensors (or shards with an index when large)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = preset_config(preset) if isinstance(preset, str) else dict(preset)
    dtype = np_dtype(dtype)
    hf_cfg["torch_dtype"] = dtype.name
    cfg = ModelConfig.from_dict(hf_cfg)
    tensors = random_hf_tensors(cfg, seed, dtype)
    with open(out / "config.json", "w") as f:
        json.dump(hf_cfg, f, indent=2)
    total = sum(v.nbytes for v in tensors.values())
    if shard_bytes is None or total <= shard_bytes:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for k, v in tensors.items():
        if size and size + v.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    with open(out / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return out


def np_dtype(name) -> np.dtype:
    """numpy dtype of a name HF configs use; bfloat16 through ml_dtypes (safetensors writes it as BF16)."""
    if str(name) == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def write_adapter(out: str | Path, model: ModelConfig, rank: int = 8, alpha: float | None = None,
                  targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"), seed: int = 0,
                  use_rslora: bool = False, rank_pattern: dict | None = None, alpha_pattern: dict | None = None,
                  layers_to_transform: list[int] | None = None, strength: float = 0.3,
                  extra_config: dict | None = None, dtype=np.float32) -> Path:
    """A random PEFT LoRA dir (B non-zero, unlike PEFT's init, so the adapter changes the output)."""
    from ..lora.peft import pattern_value  # the same pattern rules the reader uses

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    alpha = float(2 * rank if alpha is None else alpha)
    rank_pattern, alpha_pattern = rank_pattern or {}, alpha_pattern or {}
    layers = layers_to_transform if layers_to_transform is not None else range(model.num_hidden_layers)
    tensors = {}
    for layer in layers:
        for m in targets:
            key = module_key(layer, m)
            r = int(pattern_value(rank_pattern, key, rank))
            a_ = float(pattern_value(alpha_pattern, key, alpha))
            scale = a_ / math.sqrt(r) if use_rslora else a_ / r
            d_in, d_out = model.module_dims(m)
            a = rng.standard_normal((r, d_in), dtype=np.float32) / math.sqrt(d_in)
            b = rng.standard_normal((d_out, r), dtype=np.float32) * (strength / (math.sqrt(r) * scale))
            tensors[f"base_model.model.{key}.lora_A.weight"] = a.astype(np_dtype(dtype))
            tensors[f"base_model.model.{key}.lora_B.weight"] = b.astype(np_dtype(dtype))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model.name, "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": list(targets), "bias": "none",
        "use_rslora": use_rslora, "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "layers_to_transform": layers_to_transform,
        "modules_to_save": None, "init_lora_weights": True,
    }
    config.update(extra_config or {})
    with open(out / "adapter_config.json", "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def write_adapters(out_dir: str | Path, model: ModelConfig, n: int, ranks: list[int], seed: int = 0,
                   targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"), dtype=np.float32,
                   distinct: int | None = None) -> list[Path]:
    """``n`` adapters named adapter-0000.. with ranks taken round-robin from ``ranks``. With ``distinct``, only that
    many get their own weights and the rest hard-link the same files (2000 rank-8 adapters of a 7B model would take
    34 GB of disk; the server still reads each dir as its own adapter)."""
    out_dir = Path(out_dir)
    k = n if distinct is None else max(1, min(distinct, n))
    paths = [write_adapter(out_dir / f"adapter-{i:04d}", model, rank=ranks[i % len(ranks)], targets=targets,
                           seed=seed * 100003 + i, dtype=dtype) for i in range(k)]
    for i in range(k, n):
        src, dst = paths[i % k], out_dir / f"adapter-{i:04d}"
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if not (dst / f.name).exists():
                os.link(f, dst / f.name)
        paths.append(dst)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m slora_jax.tools.synth", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pm = sub.add_parser("model", help="write a random HF model dir")
    pm.add_argument("--preset", default="tiny")
    pm.add_argument("--out", required=True)
    pm.add_argument("--seed", type=int, default=0)
    pm.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    pm.add_argument("--shard-gb", type=float, default=4.0)
    pa = sub.add_parser("adapters", help="write random PEFT adapter dirs for a model dir")
    pa.add_argument("--model", required=True)
    pa.add_argument("--out", required=True)
    pa.add_argument("-n", type=int, default=4)
    pa.add_argument("--ranks", default="8")
    pa.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    pa.add_argument("--seed", type=int, default=0)
    pa.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    pa.add_argument("--distinct", type=int, default=None,
                    help="write only this many distinct adapters; the rest hard-link their files (saves disk)")
    args = p.parse_args(argv)
    if args.cmd == "model":
        path = write_model(args.out, args.preset, args.seed, np_dtype(args.dtype), int(args.shard_gb * 2**30))
        print(f"wrote {path}")
    else:
        cfg = ModelConfig.from_model_dir(args.model)
        paths = write_adapters(args.out, cfg, args.n, [int(r) for r in args.ranks.split(",")], args.seed,
                               tuple(args.targets.split(",")), np_dtype(args.dtype), args.distinct)
        print(f"wrote {len(paths)} adapters under {args.out}")


if __name__ == "__main__":
    main()
