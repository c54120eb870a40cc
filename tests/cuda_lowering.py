"""Lowering for CUDA on a host with no GPU, on every jax the project supports (the tests' one way to do it).

Why: jax 0.10 lowers Pallas Triton kernels for CUDA with no GPU present. jax 0.11 asks the default device for its
compute capability and, on a CPU host, fails ("No supported GPU devices found") unless an abstract GPU is given
through an abstract mesh. The abstract GPU is an H200, the card the GPU suite runs on. On a GPU host, and on a jax
without abstract devices, lowering runs as it is.
"""

from __future__ import annotations

import contextlib

import jax

ABSTRACT_GPU = dict(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def abstract_gpu():
    """A context in which lowering for CUDA sees a GPU: an abstract mesh of one abstract H200 (jax >= 0.11 on a
    host without a GPU); a no-op where a GPU is present or this jax has no abstract devices."""
    if jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    try:
        from jax.sharding import AbstractDevice, AbstractMesh, AxisType

        mesh = AbstractMesh((1,), ("_",), axis_types=(AxisType.Auto,), abstract_device=AbstractDevice(**ABSTRACT_GPU))
        return jax.sharding.use_abstract_mesh(mesh)
    except (ImportError, AttributeError, TypeError):  # a jax without abstract devices lowers without them
        return contextlib.nullcontext()


def lower_for_cuda(fn, *args) -> jax.stages.Lowered:
    """``jax.jit(fn)`` traced at ``args`` (arrays or ShapeDtypeStructs) and lowered for CUDA; nothing compiled."""
    with abstract_gpu():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
