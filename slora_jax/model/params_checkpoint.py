"""Converted params (our layout, serving dtype, tensor-parallel placement) saved with orbax-checkpoint, so a restart
restores each device's shards directly instead of converting the HF checkpoint again.

A converted checkpoint lives in ``DIR/<key>`` (``tp2-bfloat16-unroll``: TP size, dtype, layer layout), with a
``slora_meta.json`` written after orbax has finished: it holds the model's config, and a restore happens only when
config and key both match, so a stale or half-written directory is converted again, never served. Loading from the
HF dir stays the default (``load_serving_params`` without ``converted_dir``).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jax.numpy as jnp

from .config import ModelConfig
from .sharding import TensorParallel
from .streaming_loader import param_shapes, stream_params

log = logging.getLogger(__name__)
FORMAT = 1
META = "slora_meta.json"


def checkpoint_key(tp: TensorParallel | None, dtype, stacked: bool) -> str:
    return f"tp{tp.size if tp is not None else 1}-{jnp.dtype(dtype).name}-{'scan' if stacked else 'unroll'}"


def _meta(cfg: ModelConfig, key: str) -> dict:
    return {"format": FORMAT, "key": key, "config": cfg.to_hf_dict()}


def save_params(directory: str | Path, cfg: ModelConfig, params: dict, key: str) -> None:
    import orbax.checkpoint as ocp  # slow import: only when asked

    directory = Path(directory).absolute()
    if directory.exists():
        shutil.rmtree(directory)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "params", params)
    checkpointer.wait_until_finished()
    (directory / META).write_text(json.dumps(_meta(cfg, key)))


def restore_params(directory: str | Path, cfg: ModelConfig, key: str, target) -> dict | None:
    """The params saved in ``directory`` for this config and key, each device reading its shards; None if there is
    no complete checkpoint for them there."""
    directory = Path(directory).absolute()
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, ValueError):
        return None
    if meta != json.loads(json.dumps(_meta(cfg, key))):
        log.warning("converted params in %s are for another model or layout; converting again", directory)
        return None
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(directory / "params", target)


def load_serving_params(model_dir: str | Path, dtype, *, tp: TensorParallel | int | None = None, stacked: bool = True,
                        progress: bool = True, converted_dir: str | Path | None = None) -> tuple[ModelConfig, dict]:
    """(config, params) placed for serving: restored from ``converted_dir`` when it holds them for this model, TP
    size, dtype and layout; else streamed from the HF dir (``stream_params``) and, with ``converted_dir``, saved
    there for the next start. ``tp``: a placement, or a tensor-parallel size (the LoRA mode does not change params)."""
    cfg = ModelConfig.from_model_dir(model_dir)
    if isinstance(tp, int):
        tp = TensorParallel.maybe(cfg, tp)
    key = checkpoint_key(tp, dtype, stacked)
    if converted_dir is not None:
        params = restore_params(Path(converted_dir) / key, cfg, key, param_shapes(cfg, dtype, tp, stacked))
        if params is not None:
            log.info("restored converted params from %s", Path(converted_dir) / key)
            return cfg, params
    cfg, params = stream_params(model_dir, dtype, tp=tp, stacked=stacked, progress=progress)
    if converted_dir is not None:
        save_params(Path(converted_dir) / key, cfg, params, key)
        log.info("saved converted params to %s", Path(converted_dir) / key)
    return cfg, params

