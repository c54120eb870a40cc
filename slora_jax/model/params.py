"""Params pytree helpers: per-layer dicts stacked on a leading layer axis for ``lax.scan``."""

from __future__ import annotations

import numpy as np


def stack_layer_params(layers: list[dict]) -> dict:
    """[{name: {...: array}}] * L -> {name: {...: array[L, ...]}}."""
    first = layers[0]
    if isinstance(first, dict):
        return {k: stack_layer_params([layer[k] for layer in layers]) for k in first}
    return np.stack(layers, axis=0)


def param_bytes(params) -> int:
    if isinstance(params, dict):
        return sum(param_bytes(v) for v in params.values())
    return int(params.size) * params.dtype.itemsize
