"""``pallas_kernels.small_matmul`` against its jnp reference: rows that are not a tile (1, 3, 20), one split (the
residual added in the kernel) and several (float32 partials summed by XLA), with and without a residual; plans that do
not tile the weight are refused; on the GPU the compiled kernel at Llama-2-7B's o and down shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from pallas_kernels.small_matmul import SmallMatmulPlan, plan_fits, small_matmul, small_matmul_reference

gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def _inputs(rng, m, k, n, residual, dtype=jnp.bfloat16):
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), dtype)
    r = jnp.asarray(rng.normal(size=(m, n)), dtype) if residual else None
    return x, w, r


def _check(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    # both round one float32 sum once and differ in summation order only: one bf16 ulp of the entry, or of the
    # largest entry for results near zero by cancellation (the float32 sums' own error is far below both)
    tol = 2.0 ** -7 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize(("m", "k", "n", "plan"), [
    (1, 256, 128, SmallMatmulPlan(32, 64, 2)),
    (3, 256, 128, SmallMatmulPlan(64, 64, 1)),
    (16, 128, 64, SmallMatmulPlan(16, 32, 4)),
    (20, 192, 64, SmallMatmulPlan(32, 64, 1)),  # K = 3 tiles: the loop is not a power of two
])
def test_matches_the_reference(m, k, n, plan, residual):
    rng = np.random.default_rng()
    x, w, r = _inputs(rng, m, k, n, residual)
    got = small_matmul(x, w, r, plan=plan, interpret=True)
    assert got.shape == (m, n) and got.dtype == x.dtype
    _check(got, small_matmul_reference(x, w, r), jnp.bfloat16)


def test_float32_inputs_keep_float32():
    rng = np.random.default_rng()
    x, w, r = _inputs(rng, 5, 128, 64, True, jnp.float32)
    got = small_matmul(x, w, r, plan=SmallMatmulPlan(16, 32, 2), interpret=True)
    assert got.dtype == jnp.float32
    _check(got, small_matmul_reference(x, w, r), jnp.float32)


def test_every_split_and_column_block_counts():
    """A weight whose every column block and contraction share carries a distinct signal: a program that skipped
    its block or its split, or wrote another's, changes the result."""
    rng = np.random.default_rng()
    m, k, n = 2, 256, 128
    x = jnp.asarray(rng.integers(1, 4, size=(m, k)), jnp.float32)
    w = jnp.asarray(np.add.outer(np.arange(k) // 64, 10 * (np.arange(n) // 32)) + 1.0, jnp.float32)
    got = np.asarray(small_matmul(x, w, plan=SmallMatmulPlan(32, 32, 4), interpret=True))
    np.testing.assert_array_equal(got, np.asarray(x) @ np.asarray(w))


@pytest.mark.parametrize(("n", "plan"), [(128, SmallMatmulPlan(48, 64, 1)), (128, SmallMatmulPlan(32, 64, 3)),
                                         (128, SmallMatmulPlan(32, 512, 1)),
                                         (96, SmallMatmulPlan(48, 64, 1)),  # tiles N, but 48 is not a power of two
                                         (128, SmallMatmulPlan(32, 96, 1))])  # nor is 96 (256 = 2 x 96 + 64)
def test_a_plan_that_does_not_tile_the_weight_is_refused(n, plan):
    x, w, _ = _inputs(np.random.default_rng(), 2, 256, n, False)
    assert not plan_fits(plan, 256, n)
    with pytest.raises(ValueError, match="does not tile"):
        small_matmul(x, w, plan=plan, interpret=True)


def test_shapes_that_disagree_are_refused():
    x, w, _ = _inputs(np.random.default_rng(), 2, 256, 128, False)
    with pytest.raises(ValueError, match="disagree"):
        small_matmul(x, w, jnp.zeros((3, 128), x.dtype), plan=SmallMatmulPlan(32, 64, 1), interpret=True)
    with pytest.raises(ValueError, match="disagree"):
        small_matmul(x, w.astype(jnp.float32), plan=SmallMatmulPlan(32, 64, 1), interpret=True)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled and run on a GPU below")
@pytest.mark.parametrize("plan", [SmallMatmulPlan(32, 128, 2), SmallMatmulPlan(16, 256, 1)])
def test_lowers_to_triton_for_a_gpu(plan):
    """Lowered for CUDA on the CPU: every primitive has its Triton rule and every block is a power of two."""
    s = jax.ShapeDtypeStruct
    avals = (s((3, 11008), jnp.bfloat16), s((11008, 4096), jnp.bfloat16), s((3, 4096), jnp.bfloat16))
    text = lower_for_cuda(lambda x, w, r: small_matmul(x, w, r, plan=plan, interpret=False), *avals).as_text()
    assert "__gpu$xla.gpu.triton" in text and "small_matmul" in text


@gpu
@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize(("k", "n", "plan"), [(4096, 4096, SmallMatmulPlan(32, 128, 1)),
                                              (11008, 4096, SmallMatmulPlan(32, 128, 2)),
                                              (11008, 4096, SmallMatmulPlan(16, 256, 1))])
def test_compiled_kernel_at_7b_shapes(m, k, n, plan):
    rng = np.random.default_rng()
    x, w, r = _inputs(rng, m, k, n, True)
    _check(small_matmul(x, w, r, plan=plan), small_matmul_reference(x, w, r), jnp.bfloat16)
