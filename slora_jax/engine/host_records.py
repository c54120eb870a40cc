"""The host tier's records: a registered adapter (what its cheap validation found) and one read of it in flight.

Kept apart from ``host_tier`` so that module keeps to the tier's behaviour; both records are guarded by the tier's
lock, never by their own.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import numpy as np

from slora_jax.lora.sources import AdapterSource

__all__ = ["AdapterEntry", "HostLoad"]


@dataclasses.dataclass(eq=False)
class AdapterEntry:
    name: str
    source: AdapterSource
    pages: int  # pool pages once resident (from the rank table; refreshed from the real rows after a load)
    rank: int = 0  # largest rank over layers and projections (0: registered as failed)
    targets: tuple[str, ...] = ()  # projections adapted in some layer
    reads: tuple[int, float, float | None] = (0, 0.0, None)  # reads from the source: count, seconds summed, last
    ranks: np.ndarray | None = None  # int32 [L, len(MODULES)] from validation (None: registered as failed)


@dataclasses.dataclass(eq=False)
class HostLoad:
    """One read of an adapter from its source. Whoever claims it first runs it: an IO worker, or a blocking
    ``rows_now`` when it would otherwise wait behind other queued loads."""

    entry: AdapterEntry
    future: Future
    claimed: bool = False
