"""In-memory LoRA adapter: what a validated PEFT dir becomes on the host.

It lives in `model` (not `lora`) because the reference forward consumes it and `lora` builds on `model`: imports
run lora -> model only, never back."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class LoraModule:
    """One adapted projection in one layer: ``delta = (x @ a) @ b * scale``.

    ``a`` is ``[d_in, r]`` and ``b`` is ``[r, d_out]`` (float32 numpy; bfloat16 where a read for a bfloat16 pool
    kept a BF16 file's values). PEFT stores
    ``lora_A.weight`` as ``[r, d_in]`` (= ``a.T``) and ``lora_B.weight`` as ``[d_out, r]`` (= ``b.T``).
    """

    a: np.ndarray
    b: np.ndarray
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[1]


@dataclasses.dataclass
class LoraAdapter:
    """A whole adapter: ``modules[(layer, module_name)]`` for every adapted projection."""

    name: str
    modules: dict[tuple[int, str], LoraModule]

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())
