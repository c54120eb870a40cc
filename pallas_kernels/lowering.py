"""How the kernels of the ``pallas-triton`` backend are lowered: Pallas through Triton.

Every Triton kernel in this package calls :func:`pallas_call` and the masked
:func:`load` / :func:`store` from here instead of ``pl.pallas_call``, so lowering
options live in one place. Kernel bodies are written for this lowering (masked
gathers, no scalar prefetch): a Mosaic GPU backend is its own kernel files with
their own lowering module, registered as a sibling entry in
:mod:`pallas_kernels.backends`, not a change to this file.

We lower through Triton: it runs on jax 0.10.2 and 0.11.2 and, with
``interpret=True``, on CPU. Triton lowering has no scalar prefetch and no
scratch, wants power-of-two block shapes, and gathers through index arrays that
are passed as ordinary inputs. Gathers in interpret mode must index every axis
with arrays (``ref[rows[:, None], cols[None, :]]``): mixing an index array with
``pl.ds`` slices is not supported by the interpreter.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

load = pltriton.load
store = pltriton.store
atomic_add = pltriton.atomic_add


@functools.cache
def default_interpret() -> bool:
    """Interpret on machines without a GPU (CPU tests and CI)."""
    return jax.default_backend() != "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
    return default_interpret() if interpret is None else bool(interpret)


def pallas_call(kernel, *, out_shape, grid, in_specs, out_specs, interpret=None,
                num_warps: int = 4, num_stages: int = 2, input_output_aliases=None, name=None):
    """``pl.pallas_call`` with the Triton lowering selected explicitly."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=resolve_interpret(interpret),
        input_output_aliases=input_output_aliases or {},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=name,
    )


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1): Triton block shapes must be powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def any_spec() -> pl.BlockSpec:
    """A whole-array operand the kernel indexes itself (gathers, page tables)."""
    return pl.BlockSpec(memory_space=pl.ANY)
