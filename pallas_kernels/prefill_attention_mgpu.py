"""Causal prefill attention over the paged pool, lowered with Mosaic GPU (Hopper: TMA copies, wgmma, warp roles).

The contract is :func:`pallas_kernels.prefill_attention.paged_prefill_attention`'s (same arguments, same tile table,
same result: zeros for rows past ``q_starts[-1]``); this file only changes how the work is done, so that the faster
lowering can be chosen per shape (``pallas_kernels.backends``). It imports the Mosaic GPU Pallas module at import
time: import it lazily (``backends`` does) and check :func:`mosaic_prefill_unsupported` first.

How a program works. The grid is ``(query head, tile)`` over the tile table of the Triton kernel (``block_q`` 64 or 128
rows of one sequence); heads vary fastest, so the heads that share a KV head read its pages while they are in L2.
Each 64-row half of a tile belongs to one consumer warpgroup (wgmma's M); one more warpgroup only issues TMA copies:

* K/V arrive in blocks of ``block_k`` tokens, one TMA copy per page (the ``page_size`` rows of one KV head are
  contiguous in the pool), all copies of a block signalling one barrier; ``num_stages`` slots, each freed by both
  consumers. Copies of pages past the tile's last key use page index ``num_pages``, so junk page-table entries are
  never followed: TMA fills the out-of-bounds box with zeros, or, where Mosaic folds (layer, page) into one TMA index
  (a copy of rank > 5: head_dim 128 with more than one layer), reads the next layer's first page; either way finite
  keys that the causal mask hides, times zero probabilities.
* Consumers keep the online softmax in f32 registers in the log2 domain. Key blocks wholly at or below a warpgroup's
  first position skip the causal mask; blocks past its last position are not computed, but the warpgroup still waits
  for and frees them so the slots' barriers stay in step with the other consumer. With two consumers a rendezvous
  barrier makes their matmuls take turns with their softmax (the FlashAttention-3 schedule).
* q rows arrive by TMA. Into the tiled (8-row tiles, swizzled) shared memory that wgmma reads, TMA addresses a row as
  (row // 8, row % 8): a box that starts off a multiple of 8 runs past each 8-row tile and comes back with zeros in
  those rows (read as the cause of the first H200 run's 0.7 error: every failing case had a sequence starting off a
  multiple of 8, the one passing test none). Such warpgroups take their q through the untiled output buffer (any row
  can start a TMA box there), then registers, then the tile.
* The output leaves through TMA stores of 64, 32, ..., 1 rows chosen by the bits of the row count, so a tile never
  writes the rows of the next sequence that follow it in ``q``.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_cache import check_pool_layout
from pallas_kernels.prefill_attention import LOG2E, prefill_tile_map_device

WG_ROWS = 64  # query rows per consumer warpgroup (the M of one wgmma)
BLOCK_QS = (64, 128)  # rows per tile: one or two consumer warpgroups
HEAD_DIMS = (64, 128)
SWIZZLE_BYTES = 128
SMEM_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90
SEMANTICS = {"lane": "Lane", "warpgroup": "Warpgroup"}
Q_LOADS = ("auto", "staged", "direct")  # how q reaches its tile: per warpgroup by alignment, always staged, always TMA
TILE_ROWS = 8  # rows of one shared-memory tile: TMA into tiled memory needs row starts that are multiples of it
# Smallest page served. 8-token pages (with 64-key blocks) did not finish their first GPU test within the run's time
# limit (undiagnosed, maybe only slow); refused until benchmarks/mosaic_prefill_debug.py clears them on a GPU.
MIN_PAGE_SIZE = 16
_LOAD_TAKES_IDX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty  # jax < 0.11


def default_mosaic_tiles(head_dim: int, block_k: int | None = None, num_stages: int | None = None) -> tuple[int, int]:
    """``(block_k, num_stages)``: 128-key blocks, as many stages as fit next to a 128-row tile (2 for head_dim 128)."""
    block_k = block_k or 128
    if num_stages is None:
        num_stages = max(2, min(4, (SMEM_BYTES - _fixed_smem(128, head_dim, 2)) // (2 * block_k * head_dim * 2)))
    return block_k, num_stages


def _fixed_smem(block_q: int, head_dim: int, itemsize: int) -> int:
    return 2 * block_q * head_dim * itemsize + 4096  # q and output staging, barriers and slack


def mosaic_prefill_unsupported(q_shape, q_dtype, pool_shape, pool_dtype, *, page_size: int, num_kv_heads: int,
                               block_k: int = 128, num_stages: int = 2) -> str | None:
    """Why this kernel cannot serve these (static) shapes, or None. Platform and library checks are the caller's."""
    _, num_heads, head_dim = q_shape
    itemsize = jnp.dtype(pool_dtype).itemsize
    if jnp.dtype(pool_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"pool dtype {jnp.dtype(pool_dtype)} (wgmma here takes bf16/f16)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} not in {HEAD_DIMS}"
    if num_heads % num_kv_heads:
        return f"n_heads {num_heads} is not a multiple of n_kv {num_kv_heads}"
    if block_k % 64 or block_k > 256:
        return f"block_k {block_k} must be a multiple of 64, at most 256"
    if page_size < MIN_PAGE_SIZE or page_size & (page_size - 1) or (block_k % page_size and page_size % block_k):
        return (f"page_size {page_size} must be a power of two >= {MIN_PAGE_SIZE} that divides block_k {block_k} or "
                "is divided by it")
    if pool_shape[2] != 2 * num_kv_heads * page_size or pool_shape[3] != head_dim:
        return f"pool shape {tuple(pool_shape)} is not [L, NP, 2*n_kv*P, head_dim]"
    smem = _fixed_smem(128, head_dim, itemsize) + 2 * num_stages * block_k * head_dim * itemsize
    if num_stages < 2 or smem > SMEM_BYTES:
        return f"{num_stages} stages of {block_k} keys need {smem} bytes of shared memory (limit {SMEM_BYTES})"
    del q_dtype  # q is cast to the pool's dtype, as the Triton kernel does
    return None


def _wg_span(w, row_start, row_end, pos_start, block_k: int):
    """(rows, first position, keys, key blocks, unmasked key blocks) of consumer warpgroup ``w`` (traced ints)."""
    n_rows = jnp.minimum(jnp.maximum(row_end - row_start - WG_ROWS * w, 0), WG_ROWS)
    first_pos = pos_start + WG_ROWS * w
    kv_len = jnp.where(n_rows > 0, jnp.maximum(first_pos + n_rows, 0), 0)  # keys up to its last row's position
    steps = lax.div(kv_len + (block_k - 1), block_k)
    unmasked = jnp.minimum(lax.div(jnp.maximum(first_pos + 1, 0), block_k), steps)
    return n_rows, first_pos, kv_len, steps, unmasked


def _in_layout(x, layout, dims):
    """``x`` in a register layout (wgmma's); the CPU simulator has no layouts (nor layout_cast)."""
    return x if dims["interpret"] else plgpu.layout_cast(x, layout)


def _iota(shape, dimension: int, dims):
    if dims["interpret"]:
        return lax.broadcasted_iota(jnp.int32, shape, dimension)
    return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)


def block_scores(q_slot, k_slot, sched, dims):
    """q @ k.T in f32 [WG_ROWS, block_k]; with two consumers the turn passes while the matmul runs."""
    if dims["interpret"]:  # the simulator's wgmma takes neither transposed refs nor register operands
        if sched is not None:
            _rendezvous(sched)
        return jnp.dot(q_slot[...], k_slot[...].T, preferred_element_type=jnp.float32)

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_slot, plgpu.transpose_ref(k_slot, (1, 0)))
        if sched is not None:
            _rendezvous(sched)  # the other consumer's softmax runs while this matmul does
        return acc_ref[...]

    return pl.run_scoped(qk, plgpu.ACC((WG_ROWS, k_slot.shape[0]), jnp.float32))


def block_accumulate(acc, probs, v_slot, dims):
    """acc + probs @ v (probs in registers, v in shared memory)."""
    if dims["interpret"]:
        return acc + jnp.dot(probs, v_slot[...], preferred_element_type=jnp.float32)

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, probs, v_slot)

    return pl.run_state(pv)(plgpu.ACC.init(acc))


def load_q_rows(src, q_slot, stage, barrier, row0, dims):
    """Copy ``src`` (WG_ROWS q rows from global row ``row0``) into the tiled ``q_slot``, ready for wgmma.

    "direct": one TMA into the tile, right only when ``row0`` is a multiple of TILE_ROWS (module docstring).
    "staged": TMA into the untiled ``stage`` ([WG_ROWS, head_dim], any start row), then registers, then the tile,
    fenced for wgmma's (async proxy) reads. "auto": direct where aligned, else staged, decided per warpgroup.
    """
    def direct():
        plgpu.copy_gmem_to_smem(src, q_slot, barrier)
        plgpu.barrier_wait(barrier)

    def staged():
        plgpu.copy_gmem_to_smem(src, stage, barrier)
        plgpu.barrier_wait(barrier)
        q_slot[...] = _load_wgmma_layout(stage, dims)
        plgpu.commit_smem()

    mode = dims["q_load"]
    if mode == "direct":
        direct()
    elif mode == "staged":
        staged()
    else:
        aligned = lax.rem(row0, jnp.array(TILE_ROWS, row0.dtype)) == 0
        pl.when(aligned)(direct)
        pl.when(jnp.logical_not(aligned))(staged)


def _load_wgmma_layout(ref, dims):
    """The whole of an untiled shared-memory ref, in registers in wgmma's layout."""
    if dims["interpret"]:
        return ref[...]
    idx = ((),) if _LOAD_TAKES_IDX else ()
    return plgpu.load(ref, *idx, layout=plgpu.Layout.WGMMA, optimized=False)


def _rendezvous(barrier):
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


def _store_rows(o_slot, o_ref, row0, head, n_rows):
    """TMA-store the first ``n_rows`` (traced, <= WG_ROWS) rows of ``o_slot`` to ``o_ref[row0:, head]``: one store per
    set bit of ``n_rows``, largest first (TMA boxes have static shapes)."""
    offset = 0  # a Python int: a concrete jnp scalar as a slice start does not lower
    size = WG_ROWS
    while size >= 1:
        @pl.when(lax.bitwise_and(n_rows, size) != 0)
        def _store(offset=offset, size=size):
            plgpu.copy_smem_to_gmem(o_slot.at[pl.ds(offset, size)], o_ref.at[pl.ds(row0 + offset, size), head])

        offset = offset + lax.bitwise_and(n_rows, size)
        size //= 2


def _consumer(w, tile, head, refs, scratch, *, dims):
    """Consumer warpgroup ``w``: its 64 rows of the tile against every key block its rows can see."""
    tile_ref, q_ref, o_ref = refs["tile"], refs["q"], refs["out"]
    (q_smem, k_smem, v_smem, o_smem), (q_ready, k_ready, v_ready), (k_free, v_free), sched = scratch
    block_k, stages, dtype = dims["block_k"], dims["stages"], dims["dtype"]
    scale_log2 = dims["scale_log2"]
    if dims["cwgs"] == 2:
        plgpu.set_max_registers(232, action="increase")
    row_start, row_end, pos_start = tile_ref[tile, 1], tile_ref[tile, 2], tile_ref[tile, 3]
    n_rows, first_pos, _, steps, unmasked = _wg_span(w, row_start, row_end, pos_start, block_k)
    total, _ = _total_steps(row_start, row_end, pos_start, dims)
    row0 = row_start + WG_ROWS * w
    q_slot = q_smem.at[w]

    @pl.when(steps > 0)
    def _load_q():  # the output staging buffer is free until the end: it stages misaligned q rows
        load_q_rows(q_ref.at[pl.ds(row0, WG_ROWS), head], q_slot, o_smem.at[w], q_ready.at[w], row0, dims)

    def step(s, carry, masked: bool):
        acc, m_prev, l_prev = carry
        slot = lax.rem(s, jnp.array(stages, s.dtype))
        plgpu.barrier_wait(k_ready.at[slot])
        scores = block_scores(q_slot, k_smem.at[slot], sched, dims)
        plgpu.barrier_arrive(k_free.at[slot])
        if masked:
            rows = _iota((WG_ROWS, block_k), 0, dims)
            cols = _iota((WG_ROWS, block_k), 1, dims)
            scores = jnp.where(cols + s * block_k <= rows + first_pos, scores, -jnp.inf)
        m_new = jnp.maximum(m_prev, scores.max(axis=1) * scale_log2)
        alpha = jnp.exp2(m_prev - m_new)
        probs = jnp.exp2(scores * scale_log2 - lax.broadcast_in_dim(m_new, scores.shape, [0]))
        l_new = l_prev * alpha + probs.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        probs = probs.astype(dtype)
        if sched is not None:
            plgpu.barrier_arrive(sched)  # softmax done
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(sched)  # the tensor cores are free
        else:
            plgpu.barrier_wait(v_ready.at[slot])

        acc = block_accumulate(acc, probs, v_smem.at[slot], dims)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l_new

    def skip(s, carry):
        """A block past this warpgroup's keys: free its slot in step with the other consumer, compute nothing."""
        slot = lax.rem(s, jnp.array(stages, s.dtype))
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        if sched is not None:
            _rendezvous(sched)
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        if sched is not None:
            _rendezvous(sched)
        return carry

    carry = (_in_layout(jnp.zeros((WG_ROWS, dims["head_dim"]), jnp.float32), plgpu.Layout.WGMMA, dims),
             _in_layout(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1), dims),
             _in_layout(jnp.zeros((WG_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1), dims))
    if sched is not None:
        pl.when(w == 1)(lambda: _rendezvous(sched))  # consumer 1 starts one turn behind consumer 0
    carry = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), carry)
    acc, _, denom = lax.fori_loop(unmasked, steps, functools.partial(step, masked=True), carry)
    lax.fori_loop(steps, total, skip, jnp.int32(0))
    if sched is not None:
        pl.when(w == 0)(lambda: _rendezvous(sched))

    denom = jnp.where(denom > 0, denom, 1.0)  # rows that see no keys (padding tiles) store zeros
    out = acc / lax.broadcast_in_dim(denom, acc.shape, [0])
    o_slot = o_smem.at[w]
    o_slot[...] = out.astype(dtype)
    plgpu.commit_smem()
    _store_rows(o_slot, o_ref, row0, head, n_rows)
    plgpu.wait_smem_to_gmem(0)  # the stores finish before the block exits


def _total_steps(row_start, row_end, pos_start, dims):
    """(key blocks the producer loads for a tile, keys it may read): the most any of its consumers needs."""
    spans = [_wg_span(w, row_start, row_end, pos_start, dims["block_k"]) for w in range(dims["cwgs"])]
    total, kv_end = spans[0][3], spans[0][2]
    for span in spans[1:]:
        total, kv_end = jnp.maximum(total, span[3]), jnp.maximum(kv_end, span[2])
    return total, kv_end


def _producer(tile, head, refs, scratch, *, dims):
    """The copy warpgroup: K and V blocks of the tile's sequence, page by page, into the slots as they free up."""
    tile_ref, pool_ref, layer_ref, table_ref = refs["tile"], refs["pool"], refs["layer"], refs["table"]
    (_, k_smem, v_smem, _), (_, k_ready, v_ready), (k_free, v_free), _ = scratch
    block_k, stages, page_size = dims["block_k"], dims["stages"], dims["page_size"]
    if dims["cwgs"] == 2:
        plgpu.set_max_registers(40, action="decrease")
    seq, row_start, row_end, pos_start = (tile_ref[tile, i] for i in range(4))
    total, kv_end = _total_steps(row_start, row_end, pos_start, dims)
    kv_head = lax.div(head, jnp.array(dims["group"], head.dtype))
    layer = layer_ref[0]
    chunk = min(page_size, block_k)  # tokens per copy
    max_pages = table_ref.shape[1]

    def fill(s, slot, buf, ready, head_row0):
        for c in range(block_k // chunk):
            tok = s * block_k + c * chunk
            page = table_ref[seq, jnp.minimum(lax.div(tok, page_size), max_pages - 1)]
            page = jnp.where(tok < kv_end, page, dims["num_pages"])  # past the keys: out of bounds, zero-filled
            in_page = 0 if page_size <= block_k else lax.rem(tok, page_size)
            plgpu.copy_gmem_to_smem(pool_ref.at[layer, page, pl.ds(head_row0 + in_page, chunk)],
                                    buf.at[slot, pl.ds(c * chunk, chunk)], ready.at[slot])

    k_row0 = kv_head * page_size
    v_row0 = (dims["num_kv_heads"] + kv_head) * page_size
    for i in range(stages):
        @pl.when(i < total)
        def _prologue(i=i):
            fill(i, i, k_smem, k_ready, k_row0)
            fill(i, i, v_smem, v_ready, v_row0)

    def refill(s, carry):
        slot = lax.rem(s, jnp.array(stages, s.dtype))
        plgpu.barrier_wait(k_free.at[slot])
        fill(s, slot, k_smem, k_ready, k_row0)
        plgpu.barrier_wait(v_free.at[slot])
        fill(s, slot, v_smem, v_ready, v_row0)
        return carry

    lax.fori_loop(stages, total, refill, jnp.int32(0))

    def drain(s, carry):
        """Wait for the last blocks to be freed too: every phase of a barrier gets observed (the simulator checks)."""
        slot = lax.rem(s, jnp.array(stages, s.dtype))
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])
        return carry

    lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, jnp.int32(0))


def _kernel(tile_ref, q_ref, pool_ref, layer_ref, table_ref, o_ref, *, dims):
    """One (query head, tile): shared memory and barriers for all warpgroups, then each takes its role."""
    refs = dict(tile=tile_ref, q=q_ref, pool=pool_ref, layer=layer_ref, table=table_ref, out=o_ref)
    cwgs, stages, block_k, head_dim, dtype = (dims[k] for k in ("cwgs", "stages", "block_k", "head_dim", "dtype"))
    tiled = (plgpu.TilingTransform((8, SWIZZLE_BYTES // jnp.dtype(dtype).itemsize)),
             plgpu.SwizzleTransform(SWIZZLE_BYTES))
    buffers = (plgpu.SMEM((cwgs, WG_ROWS, head_dim), dtype, transforms=tiled),
               plgpu.SMEM((stages, block_k, head_dim), dtype, transforms=tiled),
               plgpu.SMEM((stages, block_k, head_dim), dtype, transforms=tiled),
               plgpu.SMEM((cwgs, WG_ROWS, head_dim), dtype))  # output staging: untiled, so any row can start a store
    copies = block_k // min(dims["page_size"], block_k)
    ready = (plgpu.Barrier(num_barriers=cwgs), plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
             plgpu.Barrier(num_arrivals=copies, num_barriers=stages))
    free = (plgpu.Barrier(num_arrivals=cwgs, num_barriers=stages),) * 2
    sched = plgpu.Barrier(num_arrivals=2) if cwgs == 2 and dims["schedule_barrier"] else None

    def body(*scratch):
        wg = lax.axis_index("wg")
        tile = lax.axis_index("tiles")
        head = lax.axis_index("heads")
        pl.when(wg < cwgs)(lambda: _consumer(wg, tile, head, refs, scratch, dims=dims))
        pl.when(wg == cwgs)(lambda: _producer(tile, head, refs, scratch, dims=dims))

    pl.run_scoped(body, buffers, ready, free, sched, collective_axes="wg")


@functools.partial(jax.jit, static_argnames=("page_size", "num_kv_heads", "sm_scale", "block_q", "block_k",
                                             "interpret", "num_stages", "schedule_barrier", "semantics", "q_load"))
def paged_prefill_attention_mosaic(q: jax.Array, pool: jax.Array, layer: jax.Array, page_table: jax.Array,
                                   q_starts: jax.Array, context_lens: jax.Array, *, page_size: int, num_kv_heads: int,
                                   sm_scale: float, block_q: int = 128, block_k: int | None = None,
                                   tile_map: jax.Array | None = None, interpret=None, num_stages: int | None = None,
                                   schedule_barrier: bool = True, semantics: str = "lane", q_load: str = "auto"
                                   ) -> jax.Array:
    """Same arguments and result as the Triton ``paged_prefill_attention`` (q: [T, n_heads, hd] -> same shape).

    ``block_q`` 64 or 128 uses ``tile_map`` as given (host or device, built with that block_q); any other block_q
    (the CPU engine's 16) gets a 128-row table computed on device. ``interpret``: None/False run compiled; a Mosaic GPU
    interpret-params object runs the kernel on the CPU simulator (tests). ``semantics``: "lane" (default) or
    "warpgroup", Mosaic GPU's two lowerings. ``q_load``: see :func:`load_q_rows` ("direct" is wrong for tiles that
    start off a multiple of 8 rows; the debug script uses it to show that). Raises ValueError for shapes
    :func:`mosaic_prefill_unsupported` refuses.
    """
    block_k, num_stages = default_mosaic_tiles(q.shape[2], block_k, num_stages)
    reason = mosaic_prefill_unsupported(q.shape, q.dtype, pool.shape, pool.dtype, page_size=page_size,
                                        num_kv_heads=num_kv_heads, block_k=block_k, num_stages=num_stages)
    if q_load not in Q_LOADS:
        reason = f"q_load {q_load!r} not in {Q_LOADS}"
    if reason:
        raise ValueError(f"Mosaic prefill attention: {reason}")
    check_pool_layout(pool, num_kv_heads, page_size, q.shape[2])
    num_rows, num_heads, head_dim = q.shape
    if block_q not in BLOCK_QS:
        block_q, tile_map = 128, None
    if tile_map is None:
        tile_map = prefill_tile_map_device(q_starts, context_lens, num_rows, block_q)
    # TMA into tiled shared memory wants the row count a multiple of 8, and a box of 64 rows must fit the array
    padded_rows = max(-(-num_rows // 8) * 8, block_q)
    simulated = interpret not in (None, False)
    if simulated:  # the simulator refuses out-of-bounds boxes that TMA fills with zeros: give it the zeros
        padded_rows = num_rows + WG_ROWS
        pool = jnp.pad(pool, ((0, 0), (0, 1), (0, 0), (0, 0)))  # page num_pages reads as zeros
    q_in = jnp.pad(q.astype(pool.dtype), ((0, padded_rows - num_rows), (0, 0), (0, 0)))
    dims = dict(cwgs=block_q // WG_ROWS, stages=num_stages, block_k=block_k, head_dim=head_dim, dtype=pool.dtype,
                page_size=page_size, num_kv_heads=num_kv_heads, num_pages=pool.shape[1] - simulated,
                group=num_heads // num_kv_heads, scale_log2=float(sm_scale) * LOG2E,
                schedule_barrier=schedule_barrier, interpret=simulated, q_load=q_load)
    params = plgpu.CompilerParams(approx_math=True,
                                  lowering_semantics=getattr(plgpu.LoweringSemantics, SEMANTICS[semantics]))
    extra = dict(interpret=interpret) if simulated else {}
    def paged_prefill_mosaic(*refs):  # the kernel's name in profiles (jax names it after the body's __name__)
        _kernel(*refs, dims=dims)

    out = plgpu.kernel(
        paged_prefill_mosaic,
        out_type=jax.ShapeDtypeStruct((padded_rows, num_heads, head_dim), pool.dtype),
        grid=(num_heads, tile_map.shape[0]), grid_names=("heads", "tiles"),
        num_threads=dims["cwgs"] + 1, thread_name="wg", compiler_params=params, **extra,
    )(tile_map.astype(jnp.int32), q_in, pool, jnp.asarray(layer, jnp.int32).reshape(1), page_table.astype(jnp.int32))
    return out[:num_rows].astype(q.dtype)
