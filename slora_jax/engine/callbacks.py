"""Running callers' callbacks for many requests at once: one that raises must leave no other request undone.

Why: a request's ``on_output`` is a caller's code (a server's delivery, an embedder's function). When the engine
appends a step's tokens or ends the requests it could not serve, each request is handled even if an earlier one's
callback raised; the first error is raised once all are done, so the caller still sees it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def each_then_raise(items: Iterable[T], handle: Callable[[T], R | None]) -> list[R]:
    """``handle(item)`` for every item, in order; the results that are not None. The first exception is raised after
    the last item."""
    results, error = [], None
    for item in items:
        try:
            result = handle(item)
        except Exception as e:  # noqa: BLE001 - a caller's callback: the other requests must still be handled
            error = error or e
            continue
        if result is not None:
            results.append(result)
    if error is not None:
        raise error
    return results
