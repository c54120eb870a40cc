"""The S-LoRA synthetic workload: power-law adapter popularity, Gamma arrivals, uniform lengths."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Request:
    arrival: float  # seconds from the trace start
    adapter: int  # index into the trace's adapters
    prompt_len: int
    output_len: int


def make_trace(n_adapters: int, rate: float, num_requests: int, alpha: float = 1.0, cv: float = 1.0,
               in_range: tuple[int, int] = (8, 512), out_range: tuple[int, int] = (8, 512),
               seed: int = 0) -> list[Request]:
    """``num_requests`` requests at mean rate ``rate``/s (Gamma inter-arrivals with coefficient of variation ``cv``);
    adapter i is chosen with probability proportional to (i + 1) ** -alpha."""
    rng = np.random.default_rng(seed)
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / (shape * rate), size=num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    weights = (np.arange(n_adapters) + 1.0) ** -alpha
    adapters = rng.choice(n_adapters, size=num_requests, p=weights / weights.sum())
    ins = rng.integers(in_range[0], in_range[1] + 1, size=num_requests)
    outs = rng.integers(out_range[0], out_range[1] + 1, size=num_requests)
    return [Request(float(a), int(d), int(i), int(o)) for a, d, i, o in zip(arrivals, adapters, ins, outs,
                                                                            strict=True)]
