"""The Mosaic GPU prefill attention kernel against the jnp reference, on the GPU and on Mosaic GPU's CPU simulator.

* ``gpu`` tests run the compiled kernel on a Hopper GPU: ragged batches with prior cache, empty and one-token sequences
  and padding rows, MHA and GQA, head_dim 64/128, one or two consumer warpgroups, with and without the turn-taking
  barrier, through the kernel and through the backend role. The output buffer is poisoned best-effort: a NaN array of
  its size is freed just before the call, so the allocator tends to hand the kernel that memory. A kernel that
  deadlocks cannot be interrupted, so each gpu test runs under a watchdog (``hang_guard``) that names the test on the
  real stderr, and past GPU_TEST_TIMEOUT_S dumps the stacks and ends the run. Finer steps, each with its own
  timeout: ``benchmarks/mosaic_prefill_debug.py``.
* The CPU tests lower the kernel for CUDA (Pallas -> Mosaic GPU IR: shapes, transforms, barriers, TMA slices) and
  run it on Mosaic GPU's simulator (``InterpretGPUParams``), which executes the warpgroups as threads with real
  barriers and copies. The simulator lacks wgmma on transposed refs and register operands, so there the two matmuls
  are jnp dots; everything else (pipeline, page addressing, masks, softmax, row ladder) is the compiled code path.
  The simulator needs more host threads than a 2-core box gives by default: conftest forces 4 host devices.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention_kernels import assert_close, build_cache, prefill_reference

from pallas_kernels import backends
from pallas_kernels.prefill_attention import prefill_tile_map

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu", reason="jax without the Mosaic GPU lowering")
mgpu_kernel = pytest.importorskip("pallas_kernels.prefill_attention_mgpu")
try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # the simulator (jax-private path)
except ImportError:  # pragma: no cover - depends on the jax build
    InterpretGPUParams = None

ON_GPU = jax.default_backend() == "gpu"
ON_HOPPER = ON_GPU and backends.mosaic_prefill_platform()
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (sm_90) with Mosaic GPU")
needs_simulator = pytest.mark.skipif(ON_GPU or InterpretGPUParams is None,
                                     reason="Mosaic GPU CPU simulator unavailable (or on GPU: the gpu tests cover it)")


def ragged_case(rng, *, num_kv_heads, num_heads, head_dim, page_size, n_new, prior, pad_rows, dtype=jnp.bfloat16):
    """(args, kwargs, q_starts) for a batch with ``prior`` cached tokens and ``n_new`` new ones per sequence."""
    n_new, prior = np.asarray(n_new), np.asarray(prior)
    lens = (n_new + prior).astype(np.int32)
    cache = build_cache(rng, lens, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                        prior_lens=prior, dtype=dtype)
    q_starts = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    num_rows = int(q_starts[-1]) + pad_rows
    q = jnp.asarray(rng.standard_normal((num_rows, num_heads, head_dim)), dtype)
    args = (q, cache.pool, jnp.int32(cache.layer), jnp.asarray(cache.page_table), jnp.asarray(q_starts),
            jnp.asarray(lens))
    kw = dict(page_size=page_size, num_kv_heads=num_kv_heads, sm_scale=head_dim**-0.5)
    return args, kw, q_starts


def check(out, args, kw, q_starts, tol):
    want = prefill_reference(*args, **kw)
    assert_close(out, want, tol)
    np.testing.assert_array_equal(np.asarray(out[int(q_starts[-1]):], np.float32), 0.0)  # padding rows: zeros


def poisoned(fn, shape, dtype):
    """Call ``fn`` right after freeing a NaN array of the output's size (the allocator tends to reuse it)."""
    junk = jnp.full(shape, jnp.nan, dtype)
    junk.block_until_ready()
    del junk
    return jax.block_until_ready(fn())


# ------------------------------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("block_q,schedule_barrier", [(128, True), (64, True), (128, False)])
def test_lowers_for_cuda_on_any_host(block_q, schedule_barrier):
    """Pallas lowers the kernel to a Mosaic GPU custom call for sm_90 without a GPU (SASS is compiled on-device)."""
    q = jax.ShapeDtypeStruct((300, 8, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((2, 40, 2 * 2 * 16, 128), jnp.bfloat16)
    avals = (q, pool, jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((3, 20), jnp.int32),
             jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((3,), jnp.int32))

    def call(*args):
        return mgpu_kernel.paged_prefill_attention_mosaic(*args, page_size=16, num_kv_heads=2, sm_scale=0.1,
                                                          block_q=block_q, schedule_barrier=schedule_barrier)

    text = jax.jit(call).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


SIM_CASES = [  # (num_kv_heads, num_heads, head_dim, page_size, n_new, prior, extra)
    pytest.param(1, 2, 64, 16, [70, 1, 0, 30], [0, 40, 5, 20], dict(block_q=128, block_k=64, num_stages=2),
                 id="gqa2-two-consumers-turns-ragged"),
    pytest.param(1, 2, 64, 128, [130], [10], dict(block_q=64, block_k=64, num_stages=2),
                 id="one-consumer-page-bigger-than-block"),
    pytest.param(2, 2, 64, 16, [33, 20], [0, 0], dict(block_q=16, num_stages=3, schedule_barrier=False),
                 id="mha-small-block-q-gets-own-tiles", marks=pytest.mark.slow),
    pytest.param(1, 1, 64, 16, [9, 64, 3], [5, 0, 60], dict(block_q=64, block_k=64, num_stages=2, q_load="staged"),
                 id="q-always-staged"),
]


@needs_simulator
@pytest.mark.parametrize("num_kv_heads,num_heads,head_dim,page_size,n_new,prior,extra", SIM_CASES)
def test_simulated_matches_reference(num_kv_heads, num_heads, head_dim, page_size, n_new, prior, extra):
    rng = np.random.default_rng()
    args, kw, q_starts = ragged_case(rng, num_kv_heads=num_kv_heads, num_heads=num_heads, head_dim=head_dim,
                                     page_size=page_size, n_new=n_new, prior=prior, pad_rows=6)
    out = mgpu_kernel.paged_prefill_attention_mosaic(*args, **kw, **extra, interpret=InterpretGPUParams())
    check(out, args, kw, q_starts, 2e-2)


def test_unsupported_shapes_are_named():
    kw = dict(page_size=16, num_kv_heads=2)
    pool = (1, 8, 64, 128)
    assert mgpu_kernel.mosaic_prefill_unsupported((4, 8, 128), jnp.bfloat16, pool, jnp.bfloat16, **kw) is None
    assert "dtype" in mgpu_kernel.mosaic_prefill_unsupported((4, 8, 128), jnp.float32, pool, jnp.float32, **kw)
    assert "head_dim" in mgpu_kernel.mosaic_prefill_unsupported((4, 8, 96), jnp.bfloat16, (1, 8, 64, 96),
                                                                 jnp.bfloat16, **kw)
    assert "page_size" in mgpu_kernel.mosaic_prefill_unsupported((4, 8, 128), jnp.bfloat16, (1, 8, 16, 128),
                                                                  jnp.bfloat16, page_size=4, num_kv_heads=2)
    # 8-token pages: refused until a GPU run clears them (their first GPU test did not finish in time)
    assert "page_size" in mgpu_kernel.mosaic_prefill_unsupported((4, 8, 128), jnp.bfloat16, (1, 8, 32, 128),
                                                                  jnp.bfloat16, page_size=8, num_kv_heads=2)
    assert "shared memory" in mgpu_kernel.mosaic_prefill_unsupported((4, 8, 128), jnp.bfloat16, pool, jnp.bfloat16,
                                                                      **kw, num_stages=3)
    with pytest.raises(ValueError, match="q_load"):
        mgpu_kernel.paged_prefill_attention_mosaic(jnp.zeros((4, 8, 128), jnp.bfloat16),
                                                   jnp.zeros((1, 8, 64, 128), jnp.bfloat16), jnp.int32(0),
                                                   jnp.zeros((1, 4), jnp.int32), jnp.asarray([0, 4], jnp.int32),
                                                   jnp.asarray([4], jnp.int32), sm_scale=0.1, q_load="tiled", **kw)
    with pytest.raises(ValueError, match="head_dim"):
        mgpu_kernel.paged_prefill_attention_mosaic(jnp.zeros((4, 8, 96), jnp.bfloat16),
                                                   jnp.zeros((1, 8, 64, 96), jnp.bfloat16), jnp.int32(0),
                                                   jnp.zeros((1, 4), jnp.int32), jnp.asarray([0, 4], jnp.int32),
                                                   jnp.asarray([4], jnp.int32), sm_scale=0.1, **kw)


@pytest.mark.skipif(ON_HOPPER, reason="checks the fallback where Mosaic cannot run")
def test_auto_backend_falls_back_to_triton_and_mosaic_refuses_interpret():
    rng = np.random.default_rng()
    args, kw, q_starts = ragged_case(rng, num_kv_heads=1, num_heads=2, head_dim=32, page_size=8, n_new=[9, 20],
                                     prior=[3, 0], pad_rows=3, dtype=jnp.float32)
    tiles = jnp.asarray(prefill_tile_map(q_starts, np.asarray(args[5]), args[0].shape[0], 16))
    auto = backends.get_backend("pallas-auto-prefill").prefill_attention
    out = auto(*args, **kw, tile_map=tiles, block_q=16, interpret=True)
    check(out, args, kw, q_starts, 2e-5)
    with pytest.raises(ValueError, match="interpret"):
        backends.get_backend("pallas-mosaic-prefill").prefill_attention(*args, **kw, tile_map=tiles, block_q=16,
                                                                        interpret=True)


# ------------------------------------------------------------------------------------------------------------ GPU

GPU_TEST_TIMEOUT_S = 60  # compile + reference + kernel of one case take seconds; a hang takes forever


@pytest.fixture
def hang_guard(request, capfd):
    with capfd.disabled():  # the test's name and any dump go to the real stderr, not to a capture lost on exit
        sys.stderr.write(f"\n[mosaic gpu test] {request.node.nodeid}\n")
        sys.stderr.flush()
        real_stderr = os.fdopen(os.dup(2), "w")
    faulthandler.dump_traceback_later(GPU_TEST_TIMEOUT_S, exit=True, file=real_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        real_stderr.close()


GPU_CASES = [  # (num_kv_heads, num_heads, head_dim, block_q, schedule_barrier, q_load)
    pytest.param(8, 8, 128, 128, False, "auto", id="mha-hd128-bq128-noturns"),
    pytest.param(8, 8, 128, 128, True, "auto", id="mha-hd128-bq128"),
    pytest.param(8, 32, 128, 128, True, "auto", id="gqa4-hd128-bq128"),
    pytest.param(8, 32, 128, 128, True, "staged", id="gqa4-hd128-bq128-q-staged"),
    pytest.param(8, 32, 128, 64, True, "auto", id="gqa4-hd128-bq64"),
    pytest.param(4, 16, 64, 128, True, "auto", id="gqa4-hd64-bq128"),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.usefixtures("hang_guard")
@pytest.mark.parametrize("num_kv_heads,num_heads,head_dim,block_q,schedule_barrier,q_load", GPU_CASES)
def test_gpu_matches_reference(num_kv_heads, num_heads, head_dim, block_q, schedule_barrier, q_load):
    """Sequences starting on and off multiples of 8 rows (700, 701, 1001, ...): both q paths of ``auto``."""
    rng = np.random.default_rng()
    args, kw, q_starts = ragged_case(rng, num_kv_heads=num_kv_heads, num_heads=num_heads, head_dim=head_dim,
                                     page_size=16, n_new=[700, 1, 0, 300, 129], prior=[0, 900, 40, 250, 7],
                                     pad_rows=24)
    q = args[0]
    out = poisoned(lambda: mgpu_kernel.paged_prefill_attention_mosaic(
        *args, **kw, block_q=block_q, schedule_barrier=schedule_barrier, q_load=q_load), q.shape, q.dtype)
    check(out, args, kw, q_starts, 2e-2)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.usefixtures("hang_guard")
@pytest.mark.parametrize("page_size,block_k", [(16, 128), (16, 64), (128, 64)])
def test_gpu_role_with_host_tiles_and_page_sizes(page_size, block_k):
    """Through the backend role (host tile table, as the engine calls it), then other page sizes and key blocks."""
    rng = np.random.default_rng()
    args, kw, q_starts = ragged_case(rng, num_kv_heads=2, num_heads=8, head_dim=128, page_size=page_size,
                                     n_new=[2048, 77], prior=[0, 1000], pad_rows=51)
    q = args[0]
    if block_k == 128 and page_size == 16:
        tiles = jnp.asarray(prefill_tile_map(q_starts, np.asarray(args[5]), q.shape[0], 128))
        role = backends.get_backend("pallas-mosaic-prefill").prefill_attention
        out = poisoned(lambda: role(*args, **kw, tile_map=tiles, block_q=128), q.shape, q.dtype)
    else:
        out = poisoned(lambda: mgpu_kernel.paged_prefill_attention_mosaic(*args, **kw, block_k=block_k), q.shape,
                       q.dtype)
    check(out, args, kw, q_starts, 2e-2)
