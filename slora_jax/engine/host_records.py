"""The host tier's records: a registered adapter (what its cheap validation found), one read of it in flight, and
the adapters that failed.

Kept apart from ``host_tier`` so that module keeps to the tier's behaviour; both records are guarded by the tier's
lock, never by their own.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from slora_jax.lora.errors import AdapterError
from slora_jax.lora.sources import AdapterSource

__all__ = ["AdapterEntry", "Failures", "HostLoad"]


@dataclasses.dataclass(eq=False)
class AdapterEntry:
    name: str
    source: AdapterSource
    pages: int  # pool pages once resident (from the rank table; refreshed from the real rows after a load)
    rank: int = 0  # largest rank over layers and projections (0: registered as failed)
    targets: tuple[str, ...] = ()  # projections adapted in some layer
    reads: tuple[int, float, float | None] = (0, 0.0, None)  # reads from the source: count, seconds summed, last
    ranks: np.ndarray | None = None  # int32 [L, len(MODULES)] from validation (None: registered as failed)

    def check_shape(self, rows) -> None:
        """Raise if a read's rows (``AdapterRows``) have other ranks than validation found: the files were replaced
        by an adapter of another shape, and admission sizes the adapter (and checked it fits the pool) by the
        registered one. A failure that stands until the adapter is registered (or retried) again."""
        if self.ranks is not None and not np.array_equal(rows.rank, self.ranks):
            raise AdapterError(self.name, "its files changed shape since it was registered (other ranks or "
                                          "projections); load it again to serve the new files")


@dataclasses.dataclass(eq=False)
class HostLoad:
    """One read of an adapter from its source. Whoever claims it first runs it: an IO worker, or a blocking
    ``rows_now`` when it would otherwise wait behind other queued loads."""

    entry: AdapterEntry
    future: Future
    claimed: bool = False
    cold: bool = False  # a background fill's read: kept only in free room (HostTier.read_ahead)


class Failures:
    """Adapter name -> its :class:`AdapterError`, as a dict. A failed read whose error has ``retry_after_s`` (one
    that may pass) is forgotten that long after it was recorded (:meth:`record_read`), so the adapter's next use
    reads it again; other failures (validation's, recorded by item assignment) stand until the adapter is
    registered or retried again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._errors: dict[str, tuple[AdapterError, float]] = {}  # name -> (error, when it expires)

    def __setitem__(self, name: str, error: AdapterError) -> None:
        self._errors[name] = (error, float("inf"))

    def record_read(self, name: str, error: AdapterError) -> None:
        after = error.retry_after_s
        self._errors[name] = (error, float("inf") if after is None else self._clock() + after)

    def get(self, name: str) -> AdapterError | None:
        """The adapter's error; one that expires says how long it has left (``retry_after_s``, whole seconds, at
        least 1), so a client told to retry is not told to wait longer than the failure stands."""
        record = self._errors.get(name)
        if record is None:
            return None
        error, expires = record
        left = expires - self._clock()
        if left <= 0:
            del self._errors[name]
            return None
        if math.isinf(left):
            return error
        return type(error)(error.adapter, error.reason, float(max(1, math.ceil(left))))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def pop(self, name: str, default=None):
        record = self._errors.pop(name, None)
        return default if record is None else record[0]

    def items(self) -> list[tuple[str, AdapterError]]:
        return [(name, error) for name in list(self._errors) if (error := self.get(name)) is not None]

    def __len__(self) -> int:
        return len(self.items())
