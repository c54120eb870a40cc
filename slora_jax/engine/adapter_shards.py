"""An adapter's pool rows cut into each device's share, for a pool sharded over a tensor-parallel mesh.

A sharded pool is ``[L, pages, page_rows, N * V]``: device d holds the V-wide slice ``d`` of every pool row, i.e. its
own KV heads and its own share of every adapter (``slora_jax.model.sharding.lora_dims``). Sharded rows keep the
``AdapterRows`` shape with vectors ``N * V`` wide: vector j of a sharded row is device 0's local vector j, then
device 1's, and so on. Every device's share of every module has the same size, so the ranks, offsets and page ids are
the same on every device and the allocator, adapter store, table and kernels do not know about the mesh.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.lora_common import pack_offsets
from slora_jax.lora.pool_rows import AdapterRows
from slora_jax.model.config import MODULES, ModelConfig
from slora_jax.model.sharding import TensorParallel


class AdapterShards:
    """Where each device's share of an adapter sits in its pool (the identity without tensor parallelism)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        self.cfg, self.n, self.vec = cfg, (tp.size if tp is not None else 1), cfg.head_dim
        self.dims = tuple(tp.lora_dims(m) if tp is not None else cfg.module_dims(m) for m in MODULES)
        # vectors one unit of rank costs each device, per module (A^T row + B row)
        self.vectors_per_rank = np.array([(a + b) // self.vec for a, b in self.dims], np.int64)

    def max_vectors(self, max_rank: int) -> int:
        """Worst-case vectors of one adapter in one layer on each device: all modules adapted at ``max_rank``."""
        return int(max_rank * self.vectors_per_rank.sum())

    def shard_rows(self, rows: AdapterRows) -> AdapterRows:
        """Rows laid out for the whole model (``to_pool_rows``) -> sharded rows (returned as they are at N = 1)."""
        if self.n == 1:
            return rows
        n, vec = self.n, self.vec
        if rows.vectors.shape[2] != vec:
            raise ValueError(f"adapter {rows.name!r}: vectors {rows.vectors.shape} are not [L, n, {vec}] rows of the "
                             "whole model")
        a_off, b_off, layer_vectors = pack_offsets(rows.rank, self.dims, vec)
        out = np.zeros((rows.vectors.shape[0], int(layer_vectors.max(initial=0)), n * vec), rows.vectors.dtype)
        for layer, m in zip(*np.nonzero(rows.rank), strict=True):
            r = int(rows.rank[layer, m])
            (d_in, d_out), (loc_in, loc_out) = self.cfg.module_dims(MODULES[m]), self.dims[m]
            for src, dst, width, local in ((rows.a_off, a_off, d_in, loc_in), (rows.b_off, b_off, d_out, loc_out)):
                s0, d0 = int(src[layer, m]), int(dst[layer, m])
                mat = rows.vectors[layer, s0: s0 + r * (width // vec)].reshape(r, width // vec, vec)
                out[layer, d0: d0 + r * (local // vec)] = self._split(mat, local // vec)
        return AdapterRows(name=rows.name, vectors=out, rank=rows.rank, a_off=a_off, b_off=b_off, scale=rows.scale,
                           layer_num_vectors=layer_vectors)

    def _split(self, mat: np.ndarray, local_chunks: int) -> np.ndarray:
        """[r, chunks, V] rows -> [r * local_chunks, N * V] sharded vectors: whole rows on every device when
        ``local_chunks == chunks``, else device d gets chunks ``d * local_chunks ..``."""
        r, chunks, vec = mat.shape
        if local_chunks == chunks:  # replicated
            return np.tile(mat.reshape(r * chunks, vec), (1, self.n))
        parts = mat.reshape(r, self.n, local_chunks, vec).transpose(0, 2, 1, 3)
        return parts.reshape(r * local_chunks, self.n * vec)
