"""The step's packed host input at the same device address every call.

Why: on the GPU the whole step runs as one CUDA graph, and XLA re-records and updates that graph (``command_buffer::
update``, ~2.9 ms of host time a call for a 7B decode step at batch 64 on the H200) whenever an allocation one of its
commands uses has moved. A fresh ``device_put`` of the input each step moves it. So the input is copied into one
persistent buffer per input size by a tiny executable of its own (the buffer donated, its output aliasing it), and the
step reads that buffer. Measured in the dispatch probe first (benchmarks/NOTES.md, session 9: the same buffer every
call made the call 2.3-5 ms cheaper); the copy costs one small launch and the ``device_put``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["StableInputs"]


def _copy_into(buf: jax.Array, x: jax.Array) -> jax.Array:
    return buf.at[:].set(x)


_copy = jax.jit(_copy_into, donate_argnums=0)


class StableInputs:
    """One persistent int32 device buffer per packed-input length; :meth:`put` fills it with a step's input."""

    def __init__(self):
        self._bufs: dict[int, jax.Array] = {}

    def prepare(self, lengths) -> None:
        """Compile the copy and make the buffer for each length (warm-up), so serving compiles nothing."""
        for n in sorted(set(lengths)):
            self.put(np.zeros(n, np.int32))

    def put(self, packed: np.ndarray) -> jax.Array:
        """``packed`` on the device, in this length's persistent buffer (valid until the next ``put`` of its
        length, which a step still reading it safely follows: both run in the device's order)."""
        n = int(packed.shape[0])
        buf = self._bufs.get(n)
        if buf is None:
            buf = jnp.zeros(n, jnp.int32)
        self._bufs[n] = buf = _copy(buf, jax.device_put(packed))
        return buf
