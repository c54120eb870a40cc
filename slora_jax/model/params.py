"""Params pytree helpers: per-layer dicts stacked on a leading layer axis for ``lax.scan``."""

from __future__ import annotations

import numpy as np


def stack_layer_params(layers: list[dict]) -> dict:
    """[{name: {...: array}}] * L -> {name: {...: array[L, ...]}}; numpy stays on the host, device arrays on the
    device."""
    first = layers[0]
    if isinstance(first, dict):
        return {k: stack_layer_params([layer[k] for layer in layers]) for k in first}
    if isinstance(first, np.ndarray):
        return np.stack(layers, axis=0)
    import jax.numpy as jnp

    return jnp.stack(layers, axis=0)


def param_bytes(params) -> int:
    if isinstance(params, dict):
        return sum(param_bytes(v) for v in params.values())
    if isinstance(params, list | tuple):  # per-layer dicts of an unrolled loop
        return sum(param_bytes(v) for v in params)
    return int(params.size) * params.dtype.itemsize


def unstack_layer_params(stacked: dict) -> list[dict]:
    """{name: array[L, ...]} -> [{name: array[...]}] * L: one set of arrays per layer, for an unrolled layer loop
    (a scan slices the stacked weights every step, and XLA may copy each slice before its matmul)."""
    import jax

    leaves, treedef = jax.tree.flatten(stacked)
    num_layers = leaves[0].shape[0]
    return [jax.tree.unflatten(treedef, [leaf[i] for leaf in leaves]) for i in range(num_layers)]
