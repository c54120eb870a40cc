"""Stream an HF safetensors checkpoint onto the devices one tensor at a time, each device getting only its slices.

The host holds the tensors of two layers at most (the one being placed and the next, read ahead) in the
checkpoint's dtype plus one device's slice in the serving dtype: tensors are read with plain file reads at their
header offsets (no memory map, so the process's resident memory does not grow with the file), the next layer's on a
reading thread while this one is placed, sliced per device (:mod:`slora_jax.model.sharding`: fused kernels in
device-major column order), cast, copied to their device as HF lays them out ([d_out, d_in]) and transposed there
(a host transpose ran at ~1 GB/s a thread and held a 7B load to ~0.8 GB/s on the H200), and assembled with
``jax.make_array_from_single_device_arrays``. Stacked layers (``lax.scan``) are filled one layer at a time in place
on the devices. A 70B checkpoint (138 GB) loads with ~3.5 GB of host memory (two layers), ~6 GB while the untied
embedding and lm_head are placed with layer 0 read ahead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from .checkpoint_shapes import check_checkpoint_shapes
from .config import MODULES, ModelConfig, module_key
from .llama import init_params
from .loader import shard_files
from .sharding import TensorParallel, fused_widths, param_spec, param_specs

SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
MAX_HEADER_BYTES = 100 << 20


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one checkpoint tensor's bytes are: ``[start, end)`` of ``path``."""

    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file (its JSON header: u64 little-endian length, then the header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {n} bytes is implausibly large")
        header = json.loads(f.read(n))
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {meta['dtype']}; supported: "
                             f"{', '.join(SAFETENSORS_DTYPES)}")
        begin, end = meta["data_offsets"]
        dtype = np.dtype(SAFETENSORS_DTYPES[meta["dtype"]])
        shape = tuple(int(d) for d in meta["shape"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape} {dtype}")
        out[name] = TensorEntry(path, dtype, shape, 8 + n + begin, 8 + n + end)
    return out


def index_checkpoint(model_dir: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint (single file or shards with an index), by HF name."""
    entries: dict[str, TensorEntry] = {}
    for path in shard_files(Path(model_dir)):
        entries.update(read_header(path))
    return entries


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """One tensor in the checkpoint's dtype, read into a fresh buffer of exactly its size."""
    buf = np.empty(entry.end - entry.start, np.uint8)
    with open(entry.path, "rb") as f:
        f.seek(entry.start)
        if f.readinto(buf) != buf.size:
            raise ValueError(f"{entry.path}: file ends inside a tensor")
    return buf.view(entry.dtype).reshape(entry.shape)


class _Placer:
    """Builds device arrays from host parts, one device's slice at a time."""

    def __init__(self, cfg: ModelConfig, dtype, tp: TensorParallel | None):
        self.cfg, self.dtype, self.tp = cfg, np.dtype(dtype), tp
        self.n = tp.size if tp is not None else 1
        self.devices = tp.devices if tp is not None else [jax.devices()[0]]

    def sharding(self, name: str | None, ndim: int, transposed: bool = False):
        """The param's sharding; ``transposed``: of a kernel in HF layout ([d_out, d_in]) before its transpose."""
        if self.tp is None:
            return SingleDeviceSharding(self.devices[0])
        spec = tuple(param_spec(name, ndim))
        spec = spec + (None,) * (ndim - len(spec))
        return NamedSharding(self.tp.mesh, P(*(spec[::-1] if transposed else spec)))

    def cast(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=self.dtype)  # a copy only when the dtype or the layout differs

    def place(self, name: str | None, full_shape: tuple[int, ...], local: Callable[[int], np.ndarray]) -> jax.Array:
        """``local(d)``: device d's slice (host, any dtype) of a param of ``full_shape``; replicated params get
        the same slice everywhere."""
        return self._assemble(full_shape, self.sharding(name, len(full_shape)),
                              lambda d, device: jax.device_put(self.cast(local(d)), device))

    def place_kernel(self, name: str | None, full_shape: tuple[int, int],
                     parts_of: Callable[[int], list[np.ndarray]]) -> jax.Array:
        """A [d_in, d_out] kernel of ``full_shape`` from device d's HF parts ``parts_of(d)`` ([rows, d_in] each,
        stacked along d_out in order): cast and copied as they are, transposed on the device."""

        def local(d: int, device) -> jax.Array:
            parts = parts_of(d)
            rows = self.cast(parts[0]) if len(parts) == 1 else np.concatenate(parts, axis=0, dtype=self.dtype,
                                                                              casting="unsafe")
            return jax.device_put(rows, device)

        hf = self._assemble(full_shape[::-1], self.sharding(name, 2, transposed=True), local)
        return _transposer(self.sharding(name, 2))(hf).block_until_ready()

    def _assemble(self, shape: tuple[int, ...], sharding, local: Callable) -> jax.Array:
        """``local(d, device)`` -> device d's array; one device at a time, each finished before the next."""
        if self.tp is None:
            return local(0, self.devices[0]).block_until_ready()
        arrays = [local(d, device).block_until_ready() for d, device in enumerate(self.devices)]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


@functools.cache
def _transposer(sharding) -> Callable:
    """``x.T`` into ``sharding`` on the devices that hold ``x`` (each transposes its own block: a kernel sharded on
    d_out in HF layout is sharded on d_out after it too); one compile per kernel shape."""
    return jax.jit(_transpose, out_shardings=sharding)


def _transpose(x: jax.Array) -> jax.Array:
    return x.T


class _ReadAhead:
    """Checkpoint tensors by name, read on a thread ahead of their use (:meth:`prefetch`), else when asked."""

    def __init__(self, entries: dict[str, TensorEntry], bar: tqdm):
        self.entries, self.bar = entries, bar
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="load-read")
        self._ahead: dict[str, Future] = {}

    def prefetch(self, names: list[str]) -> None:
        for name in names:
            if name in self.entries and name not in self._ahead:
                self._ahead[name] = self._thread.submit(read_tensor, self.entries[name])

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.entries:
            raise KeyError(f"checkpoint is missing tensor {name!r}")
        future = self._ahead.pop(name, None)
        x = future.result() if future is not None else read_tensor(self.entries[name])
        self.bar.update(x.nbytes)
        return x

    def close(self) -> None:
        for future in self._ahead.values():
            future.cancel()
        self._ahead.clear()  # a failed load's traceback must not keep a layer of tensors alive
        self._thread.shutdown(wait=True)


def layer_tensor_names(i: int) -> list[str]:
    """The HF names of layer ``i``'s tensors, in the order :func:`_layer_params` reads them."""
    p = f"model.layers.{i}."
    return ([p + "input_layernorm.weight"] + [f"{module_key(i, m)}.weight" for m in MODULES[:4]]
            + [p + "post_attention_layernorm.weight"] + [f"{module_key(i, m)}.weight" for m in MODULES[4:]])


def _block(x: np.ndarray, axis: int, d: int, n: int) -> np.ndarray:
    """Device d's block of ``x`` along ``axis`` (a view: no copy)."""
    size = x.shape[axis] // n
    return x[(slice(None),) * axis + (slice(d * size, (d + 1) * size),)] if n > 1 else x


def _outer_params(cfg: ModelConfig, read: Callable[[str], np.ndarray], placer: _Placer):
    """(embed, lm_head, final norm) on the devices, replicated; lm_head [hidden, vocab] (the embedding's transpose
    when tied)."""
    embed_hf = read("model.embed_tokens.weight")
    embed = placer.place(None, embed_hf.shape, lambda d: embed_hf)
    head_hf = embed_hf if cfg.tie_word_embeddings else read("lm_head.weight")
    lm_head = placer.place_kernel(None, head_hf.shape[::-1], lambda d: [head_hf])  # replicated
    norm = read("model.norm.weight")
    return embed, lm_head, placer.place(None, norm.shape, lambda d: norm)


def _layer_params(cfg: ModelConfig, i: int, read: Callable[[str], np.ndarray], placer: _Placer) -> dict:
    """Layer ``i`` in our layout on the devices (HF kernels are [d_out, d_in]; ours [d_in, d_out])."""
    n, p = placer.n, f"model.layers.{i}."

    def vector(key):
        x = read(p + key)
        return {"weight": placer.place(None, x.shape, lambda d: x)}

    def column(name, modules):
        parts = [read(f"{module_key(i, m)}.weight") for m in modules]  # [d_out, d_in] each
        shape = (cfg.hidden_size, sum(fused_widths(cfg, name)))  # device-major columns (sharding.py)
        return {"kernel": placer.place_kernel(name, shape, lambda d: [_block(w, 0, d, n) for w in parts])}

    def row(name, module):
        w = read(f"{module_key(i, module)}.weight")  # [d_out = hidden, d_in]
        return {"kernel": placer.place_kernel(name, w.shape[::-1], lambda d: [_block(w, 1, d, n)])}

    out = {"input_layernorm": vector("input_layernorm.weight")}
    out["qkv_proj"] = column("qkv_proj", MODULES[:3])
    out["o_proj"] = row("o_proj", "o_proj")
    out["post_attention_layernorm"] = vector("post_attention_layernorm.weight")
    out["gate_up_proj"] = column("gate_up_proj", MODULES[4:6])
    out["down_proj"] = row("down_proj", "down_proj")
    return out


def _set_layer(stacked: jax.Array, i: jax.Array, value: jax.Array) -> jax.Array:
    """``stacked.at[i].set(value)`` on the raw bits: XLA on CPU computes a bf16 update in float32 over the whole
    stack (two full copies); an update of unsigned ints of the same width is done in place."""
    bits = jnp.dtype(f"uint{8 * stacked.dtype.itemsize}")
    out = jax.lax.dynamic_update_index_in_dim(jax.lax.bitcast_convert_type(stacked, bits),
                                              jax.lax.bitcast_convert_type(value, bits), i, 0)
    return jax.lax.bitcast_convert_type(out, stacked.dtype)


@functools.cache
def _layer_setter(sharding) -> Callable:
    """:func:`_set_layer` in place (donated), keeping the stack's sharding; one compile per param shape."""
    return jax.jit(_set_layer, donate_argnums=0, out_shardings=sharding)


def stream_params(model_dir: str | Path, dtype=jnp.bfloat16, *, tp: TensorParallel | None = None,
                  stacked: bool = True, progress: bool = True) -> tuple[ModelConfig, dict]:
    """(config, params) of the HF checkpoint in ``model_dir``, cast to ``dtype`` and placed: on ``tp``'s mesh in the
    tensor-parallel layout (``TensorParallel.place_params`` takes them as they are), else on the default device.
    ``stacked``: layers as one {name: array[L, ...]} dict (``lax.scan``), else a list of per-layer dicts."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_model_dir(model_dir)
    entries = index_checkpoint(model_dir)
    check_checkpoint_shapes(cfg, {name: e.shape for name, e in entries.items()})
    placer = _Placer(cfg, dtype, tp)
    total = sum(e.end - e.start for e in entries.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {model_dir.name}", disable=not progress)
    read = _ReadAhead(entries, bar)
    try:
        # stacked layers: zeros on the devices first (each param's sharding), filled one layer at a time in place
        stack = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding),
                             param_shapes(cfg, dtype, tp, stacked=True)["layers"]) if stacked else None
        read.prefetch(layer_tensor_names(0))
        embed, lm_head, norm = _outer_params(cfg, read, placer)
        layers = []
        for i in range(cfg.num_hidden_layers):
            read.prefetch(layer_tensor_names(i + 1) if i + 1 < cfg.num_hidden_layers else [])
            layer = _layer_params(cfg, i, read, placer)
            if stacked:
                index = jnp.int32(i)
                stack = jax.tree.map(lambda s, a, index=index: _layer_setter(s.sharding)(s, index, a), stack, layer)
                jax.block_until_ready(stack)  # the layer's arrays are freed now, not after the host has read ahead
            else:
                layers.append(layer)
            del layer
        params = {"embed": embed, "layers": stack if stacked else layers, "norm": {"weight": norm}, "lm_head": lm_head}
    finally:
        read.close()
    bar.close()
    if tp is not None and not tp.is_placed(params):  # place_params would take them for the standard layout
        raise RuntimeError("streamed params did not land with the tensor-parallel shardings")
    return cfg, params


def param_shapes(cfg: ModelConfig, dtype, tp: TensorParallel | None, stacked: bool):
    """Every param as a ``jax.ShapeDtypeStruct`` in ``dtype`` with its target sharding (no memory allocated)."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), shapes)
    if not stacked:
        layer = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), shapes["layers"])
        shapes = dict(shapes, layers=[layer] * cfg.num_hidden_layers)
    if tp is None:
        sharding = SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)
    return jax.tree.map(lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(tp.mesh, spec)),
                        shapes, param_specs(shapes))
