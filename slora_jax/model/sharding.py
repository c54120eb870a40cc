"""Tensor parallelism on one host: a ``Mesh`` with a ``tp`` axis, the Megatron partition of the base weights, the
adapter partition of both LoRA modes, and the ``shard_map`` that runs a whole step on every device.

Inside the step every op is local: each device runs the ordinary model on a *local* config (``local_config``: its
n_heads / N query heads, n_kv / N KV heads, intermediate / N MLP columns, the full hidden size), and the only
collectives are the ones :mod:`slora_jax.model.tp_lora` writes. Base weights (docs/DESIGN.md, "Tensor parallelism"):

* q, k, v and gate, up split by output columns; the fused ``qkv_proj`` / ``gate_up_proj`` kernels are stored with
  their columns in device-major order (device d's q, k, v columns side by side), so a plain split of the last axis
  hands each device exactly the fused kernel of its local config;
* o and down split by input rows (their outputs are partial sums, all-reduced once each per layer);
* embedding, norms and lm_head replicated: every device computes the same logits and samples the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import MODULES, ModelConfig

TP_AXIS = "tp"
COLUMN_SPLIT = ("qkv_proj", "gate_up_proj")  # fused kernels split by output columns
ROW_SPLIT = ("o_proj", "down_proj")  # kernels split by input rows (outputs are partial sums)
ROW_MODULES = (MODULES.index("o_proj"), MODULES.index("down_proj"))  # LoRA modules whose input is split
# the pool [L, pages, page_rows, N * V]: each device holds the V-wide vectors of its own KV heads and adapter shares
POOL_SPEC = P(None, None, None, TP_AXIS)


def split_problems(cfg: ModelConfig, n: int) -> list[str]:
    """What of ``cfg`` cannot be split over ``n`` devices (empty: it can)."""
    problems = []
    if cfg.num_attention_heads % n:
        problems.append(f"{cfg.num_attention_heads} attention heads do not split into {n} equal groups")
    if cfg.num_key_value_heads % n:
        problems.append(f"{cfg.num_key_value_heads} KV heads do not split into {n} equal groups (KV heads are not "
                        "replicated)")
    if cfg.intermediate_size % n or (cfg.intermediate_size // n) % cfg.head_dim:
        problems.append(f"intermediate size {cfg.intermediate_size} / {n} is not a multiple of head_dim "
                        f"{cfg.head_dim} (the pool stores whole head_dim-wide vectors)")
    return problems


def check_split(cfg: ModelConfig, n: int) -> None:
    """ValueError naming everything of ``cfg`` that cannot be split over ``n`` devices."""
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {n}")
    problems = split_problems(cfg, n)
    if problems:
        raise ValueError(f"model {cfg.name!r} cannot run with tensor_parallel_size={n}: " + "; ".join(problems))


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model one device runs: its share of the heads and MLP columns, the full hidden size."""
    check_split(cfg, n)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // n,
                               num_key_value_heads=cfg.num_key_value_heads // n,
                               intermediate_size=cfg.intermediate_size // n)


def lora_dims(cfg: ModelConfig, n: int, fully_sharded: bool, module: str) -> tuple[int, int]:
    """(d_in, d_out) of one module's adapter matrices as each device holds them: A is [d_in, r], B is [r, d_out].

    Default mode (no added collectives): column-split modules keep A whole and split B by output columns; row-split
    modules split A by input rows and keep B whole. Fully sharded (S-LoRA's partition, input-dim variant): every A is
    split by input rows and every B by output columns, so each device holds exactly 1 / N of every adapter.
    """
    d_in, d_out = cfg.module_dims(module)
    if fully_sharded:
        return d_in // n, d_out // n
    row = MODULES.index(module) in ROW_MODULES
    return (d_in // n, d_out) if row else (d_in, d_out // n)


def fused_column_order(widths: Sequence[int], n: int) -> np.ndarray:
    """Column permutation of a fused kernel (parts of ``widths`` side by side) into device-major order: device d's
    slice of every part, then device d + 1's. ``kernel[..., order]`` is the tensor-parallel layout."""
    starts = np.cumsum([0, *widths[:-1]])
    return np.concatenate([np.arange(s + d * (w // n), s + (d + 1) * (w // n))
                           for d in range(n) for s, w in zip(starts, widths, strict=True)])


def fused_widths(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    return (cfg.q_width, cfg.kv_width, cfg.kv_width) if name == "qkv_proj" else (cfg.intermediate_size,) * 2


def _param_name(path) -> str | None:
    """The projection a param leaf belongs to (``qkv_proj`` ...), from its pytree path; None for others."""
    for entry in path:
        key = getattr(entry, "key", None)
        if key in COLUMN_SPLIT or key in ROW_SPLIT:
            return key
    return None


def param_spec(name: str | None, ndim: int) -> P:
    """PartitionSpec of one param: kernels are [..., d_in, d_out] (a leading layer axis when stacked)."""
    lead = (None,) * (ndim - 2)
    if name in COLUMN_SPLIT:
        return P(*lead, None, TP_AXIS)
    if name in ROW_SPLIT:
        return P(*lead, TP_AXIS, None)
    return P()


def param_specs(params) -> object:
    """A pytree of PartitionSpecs matching ``params`` (stacked or per-layer; arrays or tracers)."""
    return jax.tree_util.tree_map_with_path(lambda path, leaf: param_spec(_param_name(path), leaf.ndim), params)


@dataclasses.dataclass(frozen=True, eq=False)
class TensorParallel:
    """A tensor-parallel placement: ``size`` devices on the ``tp`` axis of ``mesh``, and the LoRA mode."""

    cfg: ModelConfig  # the whole model's config
    mesh: Mesh
    fully_sharded_loras: bool = False

    @classmethod
    def create(cls, cfg: ModelConfig, size: int, fully_sharded_loras: bool = False,
               devices: Sequence | None = None) -> TensorParallel:
        """Check that ``cfg`` splits over ``size`` devices and that they exist; raises ValueError saying what does
        not. ``devices`` defaults to the first ``size`` of ``jax.devices()``."""
        check_split(cfg, size)
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} devices; jax sees {len(devices)} "
                             f"({jax.default_backend()})")
        return cls(cfg, Mesh(np.asarray(devices[:size]), (TP_AXIS,)), bool(fully_sharded_loras))

    @classmethod
    def maybe(cls, cfg: ModelConfig, size: int, fully_sharded_loras: bool = False) -> TensorParallel | None:
        """:meth:`create` for ``size`` > 1; None (one device, no mesh) for 1."""
        if size == 1:
            return None
        return cls.create(cfg, size, fully_sharded_loras)

    @property
    def size(self) -> int:
        return int(self.mesh.shape[TP_AXIS])

    @functools.cached_property
    def local_cfg(self) -> ModelConfig:
        return local_config(self.cfg, self.size)

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return self.sharding(P())

    @property
    def pool_sharding(self) -> NamedSharding:
        return self.sharding(POOL_SPEC)

    def lora_dims(self, module: str) -> tuple[int, int]:
        return lora_dims(self.cfg, self.size, self.fully_sharded_loras, module)

    # ---- params ---------------------------------------------------------------------------------------------

    def to_tp_layout(self, name: str, kernel):
        """A fused kernel in standard column order -> device-major order (identity for other params)."""
        if name not in COLUMN_SPLIT or self.size == 1:
            return kernel
        return kernel[..., fused_column_order(fused_widths(self.cfg, name), self.size)]

    def place_params(self, params: dict) -> dict:
        """Params in our standard layout (host or single-device arrays) -> the tensor-parallel layout on the mesh.

        Params already on this mesh with the partition's shardings (the streaming loader's output) are taken as they
        are: their fused kernels are already in device-major order.
        """
        if self.is_placed(params):
            return params

        def place(path, leaf):  # one leaf at a time through host memory (numpy: no compiles)
            name = _param_name(path)
            leaf = self.to_tp_layout(name, np.asarray(leaf))
            return jax.device_put(leaf, self.sharding(param_spec(name, leaf.ndim)))

        return jax.tree_util.tree_map_with_path(place, params)

    def is_placed(self, params: dict) -> bool:
        specs = param_specs(params)
        leaves, spec_leaves = jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        return all(isinstance(a, jax.Array) and a.sharding.is_equivalent_to(self.sharding(s), a.ndim)
                   for a, s in zip(leaves, spec_leaves, strict=True))

    def zeros(self, shape, dtype, spec: P | None = None) -> jax.Array:
        return jnp.zeros(shape, dtype, device=self.sharding(P() if spec is None else spec))

    # ---- the step -------------------------------------------------------------------------------------------

    def wrap_step(self, fn: Callable) -> Callable:
        """``fn(layout, params, pool, table, *inputs) -> (*outputs, pool)`` run by every device inside one
        ``shard_map``: params by :func:`param_specs`, the pool by :data:`POOL_SPEC`, everything else replicated.
        ``layout`` is static (jit it with ``static_argnums=0``). ``check_vma=False``: Pallas calls (interpret mode
        on CPU included) carry no varying-axis annotations, and the outputs other than the pool are identical on
        every device by construction (replicated logits, same sampler inputs)."""
        mesh = self.mesh

        def stepped(layout, params, pool, table, *inputs):
            def body(params, pool, table, *inputs):
                *outputs, new_pool = fn(layout, params, pool, table, *inputs)
                return tuple(outputs), new_pool

            in_specs = (param_specs(params), POOL_SPEC, P(), *([P()] * len(inputs)))
            outputs, new_pool = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(), POOL_SPEC),
                                              check_vma=False)(params, pool, table, *inputs)
            return (*outputs, new_pool)

        return stepped

    def local_fn(self, fn: Callable, in_specs, out_specs) -> Callable:
        """``fn`` on every device's local blocks (no collectives): for pool updates such as page scatters."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def step_parts(tp: TensorParallel | None, cfg: ModelConfig) -> tuple[ModelConfig, dict, Callable]:
    """(the config each device's step runs, the ``PagedSpec`` fields, the step wrapper) for a step on ``tp``; without
    tensor parallelism: the whole config, no fields, no wrapper."""
    if tp is None:
        return cfg, {}, lambda fn: fn
    return tp.local_cfg, dict(tp_size=tp.size, fully_sharded_loras=tp.fully_sharded_loras), tp.wrap_step
