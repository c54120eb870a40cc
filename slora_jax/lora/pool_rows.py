"""Turn a host ``LoraAdapter`` into the vector rows and offset tables the unified pool stores (docs/DESIGN.md).

Per layer, an adapter is one virtual sequence of V-wide vectors (V = head_dim). For each adapted module, in
``MODULES`` order, it holds the A^T rows (``rank`` rows of ``d_in``) and then the B rows (``rank`` rows of
``d_out``), each row cut into whole vectors. Ranks are never padded, so a rank-4 module costs 4 rows, not max_rank.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pallas_kernels.lora_common import pack_offsets
from slora_jax.model.adapter_weights import LoraAdapter
from slora_jax.model.config import MODULE_INDEX, MODULES, ModelConfig


@dataclasses.dataclass
class AdapterRows:
    """An adapter laid out for the pool, still on the host.

    ``vectors[l, :layer_num_vectors[l]]`` is layer l's virtual vector sequence; the tail is zero. Tables are
    ``[L, len(MODULES)]``: ``rank`` (0 = module not adapted there), ``a_off`` / ``b_off`` (virtual vector index of
    row 0 chunk 0 of A^T / B; meaningless where rank is 0) and ``scale``.
    """

    name: str
    vectors: np.ndarray  # [L, num_vectors, V]
    rank: np.ndarray  # int32 [L, 7]
    a_off: np.ndarray  # int32 [L, 7]
    b_off: np.ndarray  # int32 [L, 7]
    scale: np.ndarray  # float32 [L, 7]
    layer_num_vectors: np.ndarray  # int64 [L]

    @property
    def num_vectors(self) -> int:
        """Vectors in the fullest layer: what decides the page count (same pages in every layer)."""
        return int(self.vectors.shape[1])

    @property
    def total_vectors(self) -> int:
        """Vectors actually used, summed over layers (for live-byte accounting)."""
        return int(self.layer_num_vectors.sum())

    @property
    def max_rank(self) -> int:
        return int(self.rank.max(initial=0))

    def pages_needed(self, page_rows: int) -> int:
        return math.ceil(self.num_vectors / page_rows)


def to_pool_rows(adapter: LoraAdapter, config: ModelConfig, dtype=np.float32) -> AdapterRows:
    """Lay out ``adapter`` for a model of shape ``config``; raises ValueError on shapes that do not fit."""
    n_layers, n_mod, vec = config.num_hidden_layers, len(MODULES), config.head_dim
    rank = np.zeros((n_layers, n_mod), np.int32)
    scale = np.zeros((n_layers, n_mod), np.float32)

    for (layer, module_name), mod in adapter.modules.items():
        if module_name not in MODULE_INDEX:
            raise ValueError(f"adapter {adapter.name!r}: unknown module {module_name!r} (expected one of {MODULES})")
        if not 0 <= layer < n_layers:
            raise ValueError(f"adapter {adapter.name!r}: layer {layer} out of range for a {n_layers}-layer model")
        d_in, d_out = config.module_dims(module_name)
        r = mod.rank
        if mod.a.shape != (d_in, r) or mod.b.shape != (r, d_out):
            raise ValueError(
                f"adapter {adapter.name!r} layer {layer} {module_name}: a {mod.a.shape} / b {mod.b.shape} do not "
                f"match [d_in={d_in}, r] / [r, d_out={d_out}]"
            )
        if d_in % vec or d_out % vec:
            raise ValueError(f"{module_name}: dims ({d_in}, {d_out}) are not multiples of head_dim {vec}")
        m = MODULE_INDEX[module_name]
        rank[layer, m] = r
        scale[layer, m] = mod.scale if r else 0.0

    # One packing rule shared with the kernels' helpers: MODULES order, A^T then B; absent modules take no space.
    a_off, b_off, layer_num_vectors = pack_offsets(rank, [config.module_dims(m) for m in MODULES], vec)
    if int(layer_num_vectors.max(initial=0)) > np.iinfo(np.int32).max:
        raise ValueError(f"adapter {adapter.name!r} is too large for int32 vector offsets")

    vectors = np.zeros((n_layers, int(layer_num_vectors.max(initial=0)), vec), dtype)
    for (layer, module_name), mod in adapter.modules.items():
        m = MODULE_INDEX[module_name]
        r = int(rank[layer, m])
        if not r:
            continue
        d_in, d_out = config.module_dims(module_name)
        # A^T row k chunk c sits at a_off + k*(d_in/V) + c: exactly a C-order reshape of A^T [r, d_in].
        a0, b0 = int(a_off[layer, m]), int(b_off[layer, m])
        vectors[layer, a0 : a0 + r * (d_in // vec)] = np.ascontiguousarray(mod.a.T).reshape(-1, vec)
        vectors[layer, b0 : b0 + r * (d_out // vec)] = np.asarray(mod.b).reshape(-1, vec)

    return AdapterRows(
        name=adapter.name,
        vectors=vectors,
        rank=rank,
        a_off=a_off,
        b_off=b_off,
        scale=scale,
        layer_num_vectors=layer_num_vectors,
    )
