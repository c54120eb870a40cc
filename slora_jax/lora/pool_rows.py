"""Turn a host ``LoraAdapter`` into the vector rows and offset tables the unified pool stores (docs/DESIGN.md), and
back; plus the shape checks and per-module rank tables that layout relies on.

Per layer, an adapter is one virtual sequence of V-wide vectors (V = head_dim). For each adapted module, in
``MODULES`` order, it holds the A^T rows (``rank`` rows of ``d_in``) and then the B rows (``rank`` rows of
``d_out``), each row cut into whole vectors. Ranks are never padded, so a rank-4 module costs 4 rows, not max_rank.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from pallas_kernels.lora_common import pack_offsets
from slora_jax.lora.errors import AdapterError
from slora_jax.model.adapter_weights import LoraAdapter, LoraModule
from slora_jax.model.config import MODULE_INDEX, MODULES, ModelConfig

_FLOAT32_MAX = float(np.finfo(np.float32).max)  # the scale table's dtype


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

    @property
    def nbytes(self) -> int:
        """Host bytes held, tables included (what a host-memory budget counts)."""
        return sum(a.nbytes for a in (self.vectors, self.rank, self.a_off, self.b_off, self.scale,
                                      self.layer_num_vectors))


def layout_key(config: ModelConfig) -> tuple:
    """Two configs with equal keys lay adapters out identically (same module dims, layers and vector width)."""
    return tuple(config.module_dims(m) for m in MODULES) + (config.num_hidden_layers, config.head_dim)


def ranks_to_table(ranks: dict[tuple[int, str], int], config: ModelConfig) -> np.ndarray:
    """``{(layer, module): rank}`` as the int32 ``[L, len(MODULES)]`` table the pool uses (0 = not adapted)."""
    table = np.zeros((config.num_hidden_layers, len(MODULES)), np.int32)
    for (layer, module), r in ranks.items():
        table[layer, MODULE_INDEX[module]] = r
    return table


def check_adapter_modules(adapter: LoraAdapter, config: ModelConfig, name: str | None = None,
                          max_rank: int | None = None) -> dict[tuple[int, str], int]:
    """``{(layer, module): rank}`` of an in-memory adapter after checking what is cheap to check (module names,
    layers, shapes, ranks up to ``max_rank``, finite scales; not the weights). Raises :class:`AdapterError` naming
    ``name`` (default: the adapter's)."""
    name = adapter.name if name is None else name
    ranks = {}
    for (layer, module), mod in adapter.modules.items():
        if module not in MODULE_INDEX:
            raise AdapterError(name, f"unknown module {module!r} (supported: {', '.join(MODULES)})")
        if not 0 <= layer < config.num_hidden_layers:
            raise AdapterError(name, f"layer {layer} outside the model's {config.num_hidden_layers} layers")
        d_in, d_out = config.module_dims(module)
        r = mod.a.shape[1] if mod.a.ndim == 2 else -1
        if mod.a.shape != (d_in, r) or mod.b.shape != (r, d_out):
            raise AdapterError(name, f"layer {layer} {module}: a {mod.a.shape} / b {mod.b.shape} do not match "
                                     f"[d_in={d_in}, r] / [r, d_out={d_out}]")
        if max_rank is not None and r > max_rank:
            raise AdapterError(name, f"layer {layer} {module} has rank {r}, above the maximum {max_rank}")
        if not math.isfinite(mod.scale):
            raise AdapterError(name, f"layer {layer} {module} has a non-finite scale {mod.scale}")
        ranks[(layer, module)] = r
    return ranks


def _peak_abs(x: np.ndarray) -> float:
    """The largest ``|x|`` (NaN if any is NaN). bfloat16 from its bits, with no float copy: for finite values the
    order of ``bits & 0x7FFF`` is the order of magnitudes, and every NaN sorts above inf."""
    if x.dtype == ml_dtypes.bfloat16:
        if not x.size:
            return 0.0
        return float(np.uint16((x.view(np.uint16) & 0x7FFF).max()).view(ml_dtypes.bfloat16))
    return float(np.abs(x).max(initial=0))


def check_weight_values(adapter: LoraAdapter, dtype, name: str | None = None) -> None:
    """Refuse weights a pool of ``dtype`` cannot serve: non-finite ones, ones beyond the dtype's largest value
    (bf16 ~3.39e38, float16 65504), and modules whose update could overflow it.

    The update of a module is ``scale * (x @ a) @ b``; each of its entries is at most ``gain * max|x|`` with
    ``gain = |scale| * max column sum of |a| * max column sum of |b|``. We require ``gain <= sqrt(max of dtype)``
    (1.8e19 for bf16 and float32, 256 for float16), so inputs up to that size cannot overflow it. Trained adapters
    sit far below (a rank-64 Llama-7B adapter: ~10); weights of 1e20, or a huge scale, do not, and used to make
    every token of the adapter's requests non-finite (served as token 0 forever). The column sums are taken only
    when the bound from the peaks (``rows * peak`` per column) does not already settle it: one pass per tensor.
    """
    name = adapter.name if name is None else name
    dtype = np.dtype(dtype)
    limit = float(ml_dtypes.finfo(dtype).max)
    for (layer, module), mod in adapter.modules.items():
        where = f"layer {layer} {module}"
        if not math.isfinite(mod.scale) or abs(mod.scale) > _FLOAT32_MAX:
            raise AdapterError(name, f"{where} has scale {mod.scale}; it must be finite within float32's range")
        peak_a, peak_b = _peak_abs(mod.a), _peak_abs(mod.b)
        if not (math.isfinite(peak_a) and math.isfinite(peak_b)):
            raise AdapterError(name, f"{where} has non-finite weights (NaN or inf)")
        peak = max(peak_a, peak_b)
        if peak > limit:
            raise AdapterError(name, f"{where} has weights up to {peak:.4g}, beyond {dtype.name}'s largest value "
                                     f"{limit:.4g}")
        if abs(mod.scale) * (mod.a.shape[0] * peak_a) * (mod.b.shape[0] * peak_b) <= math.sqrt(limit):
            continue
        gain = (abs(mod.scale) * float(np.abs(mod.a).sum(axis=0, dtype=np.float64).max(initial=0))
                * float(np.abs(mod.b).sum(axis=0, dtype=np.float64).max(initial=0)))
        if gain > math.sqrt(limit):
            raise AdapterError(name, f"{where}: its update can reach {gain:.4g} times the input's largest entry, "
                                     f"above the limit {math.sqrt(limit):.4g} for {dtype.name} (its values overflow)")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> the bits of bfloat16, rounded to nearest even: what ``x.astype(bfloat16)`` gives for every value
    that is not NaN, at half the time of ml_dtypes' cast (the bulk of laying out a read adapter)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


def to_pool_rows(adapter: LoraAdapter, config: ModelConfig, dtype=np.float32) -> AdapterRows:
    """Lay out ``adapter`` for a model of shape ``config``; raises ValueError (:class:`AdapterError` for the checks of
    :func:`check_adapter_modules` and :func:`check_weight_values`) on shapes or values that do not fit."""
    n_layers, n_mod, vec = config.num_hidden_layers, len(MODULES), config.head_dim
    rank = ranks_to_table(check_adapter_modules(adapter, config), config)
    check_weight_values(adapter, dtype)
    scale = np.zeros((n_layers, n_mod), np.float32)
    for (layer, module_name), mod in adapter.modules.items():
        d_in, d_out = config.module_dims(module_name)
        if d_in % vec or d_out % vec:
            raise ValueError(f"{module_name}: dims ({d_in}, {d_out}) are not multiples of head_dim {vec}")
        m = MODULE_INDEX[module_name]
        scale[layer, m] = mod.scale if rank[layer, m] else 0.0

    # One packing rule shared with the kernels' helpers: MODULES order, A^T then B; absent modules take no space.
    a_off, b_off, layer_num_vectors = pack_offsets(rank, [config.module_dims(m) for m in MODULES], vec)
    if int(layer_num_vectors.max(initial=0)) > np.iinfo(np.int32).max:
        raise ValueError(f"adapter {adapter.name!r} is too large for int32 vector offsets")

    vectors = np.zeros((n_layers, int(layer_num_vectors.max(initial=0)), vec), dtype)
    bf16 = vectors.dtype == ml_dtypes.bfloat16  # written as bits (check_weight_values has refused NaN)
    out = vectors.view(np.uint16) if bf16 else vectors

    def put(x: np.ndarray) -> np.ndarray:
        if not bf16:
            return x
        return x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else bf16_bits(x)  # bf16 weights: as they are
    for (layer, module_name), mod in adapter.modules.items():
        m = MODULE_INDEX[module_name]
        r = int(rank[layer, m])
        if not r:
            continue
        d_in, d_out = config.module_dims(module_name)
        # A^T row k chunk c sits at a_off + k*(d_in/V) + c: exactly a C-order reshape of A^T [r, d_in].
        a0, b0 = int(a_off[layer, m]), int(b_off[layer, m])
        out[layer, a0 : a0 + r * (d_in // vec)] = put(np.ascontiguousarray(mod.a.T).reshape(-1, vec))
        out[layer, b0 : b0 + r * (d_out // vec)] = put(np.asarray(mod.b).reshape(-1, vec))

    return AdapterRows(
        name=adapter.name,
        vectors=vectors,
        rank=rank,
        a_off=a_off,
        b_off=b_off,
        scale=scale,
        layer_num_vectors=layer_num_vectors,
    )


def adapter_from_rows(rows: AdapterRows, config: ModelConfig) -> LoraAdapter:
    """Inverse of :func:`to_pool_rows`: float32 ``a [d_in, r]`` / ``b [r, d_out]`` per adapted module."""
    vec = config.head_dim
    modules = {}
    for layer, m in zip(*np.nonzero(rows.rank), strict=True):
        module = MODULES[m]
        r, (d_in, d_out) = int(rows.rank[layer, m]), config.module_dims(module)
        a0, b0 = int(rows.a_off[layer, m]), int(rows.b_off[layer, m])
        a_t = rows.vectors[layer, a0 : a0 + r * (d_in // vec)].reshape(r, d_in)
        b = rows.vectors[layer, b0 : b0 + r * (d_out // vec)].reshape(r, d_out)
        modules[(int(layer), module)] = LoraModule(a=np.ascontiguousarray(a_t.T, np.float32),
                                                   b=np.asarray(b, np.float32), scale=float(rows.scale[layer, m]))
    return LoraAdapter(name=rows.name, modules=modules)
