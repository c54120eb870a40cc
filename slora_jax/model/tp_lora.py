"""The LoRA delta and the layer's all-reduces when a step runs on one device of a tensor-parallel mesh.

Called by ``PagedOps.lora`` inside the step's ``shard_map`` (:mod:`slora_jax.model.sharding`), with ``x`` and the base
output ``y`` already local: column-split groups (q,k,v / gate,up) get the replicated input and produce this device's
columns; row-split modules (o, down) get this device's input slice and produce a partial sum, all-reduced here.

* Default mode: each device's adapter share (A whole / B split for columns, A split / B whole for rows) makes the
  delta with no communication; a row module's partial delta joins the base partial sum before its one all-reduce.
  Collectives per layer: 2 all-reduces of [T, hidden] (after o and after down), as without adapters.
* Fully sharded (``--fully-sharded-loras``): every A split by input rows and every B by output columns. The rank-r
  shrink results are partial sums, all-reduced ([T, modules, max_rank] float32, one per projection group); a row
  module's B writes this device's hidden columns into the base partial sum before the base all-reduce, so its
  output needs no collective of its own. Collectives per layer: the 2 base all-reduces plus one small all-reduce per
  projection group whose LoRA runs (q,k,v; o; gate,up; down: up to 4).
"""

from __future__ import annotations

import jax
from jax import lax

from .sharding import ROW_MODULES, TP_AXIS


def tp_lora(ops, x: jax.Array, y: jax.Array, modules: tuple[int, ...], layer, pool) -> jax.Array:
    """``y`` plus each row's LoRA delta for ``modules`` on this device, all-reduced where the partition needs it.

    ``ops`` is the step's ``PagedOps``: its ``shrink_expand`` / ``shrink`` / ``expand`` run the backend's kernels on
    local shapes (the config is the device's local one)."""
    spec = ops.spec
    row = modules[0] in ROW_MODULES
    active = any(m in spec.lora_modules for m in modules)
    if not active:
        return lax.psum(y, TP_AXIS) if row else y
    if not spec.fully_sharded_loras:  # local shapes, no collective inside: the single-device path (fused decode)
        y = ops.shrink_expand(x, y, modules, layer, pool)
        return lax.psum(y, TP_AXIS) if row else y
    n, me = spec.tp_size, lax.axis_index(TP_AXIS)
    if row:  # x is this device's input slice; B holds this device's columns of the hidden output
        y_small = lax.psum(ops.shrink(x, modules, layer, pool), TP_AXIS)
        width = y.shape[1] // n
        part = lax.dynamic_slice_in_dim(y, me * width, width, axis=1)
        part = ops.expand(y_small, part, modules, layer, pool, d_outs=(width,))
        return lax.psum(lax.dynamic_update_slice_in_dim(y, part, me * width, axis=1), TP_AXIS)
    width = x.shape[1] // n  # replicated input: A holds the rows of this device's input slice
    x_part = lax.dynamic_slice_in_dim(x, me * width, width, axis=1)
    y_small = lax.psum(ops.shrink(x_part, modules, layer, pool), TP_AXIS)
    return ops.expand(y_small, y, modules, layer, pool)
