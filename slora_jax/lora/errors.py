"""The errors of adapters we cannot serve, and the one way loaders raise them.

Every reader of adapter files runs its work through :func:`rejecting`, so whatever goes wrong (a bad value, a
corrupt file, an OS error, a parser's recursion limit) reaches the caller as an :class:`AdapterError` with the
adapter's name and a reason, and never as a 500 or a crashed IO thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


RETRY_AFTER_S = 30.0  # a failure that may pass (a read that timed out, files unreadable for now) stands this long


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the reason.

    ``retry_after_s``: set for failures that may pass (a slow or briefly unreachable disk): the store stops
    answering with this error after that many seconds and reads the adapter again on its next use, instead of
    refusing it until it is loaded again."""

    retry_after_s: float | None = None  # also for one rebuilt without __init__ (engine_wire)

    def __init__(self, name: str, reason: str, retry_after_s: float | None = None):
        super().__init__(f"adapter {name!r}: {reason}")
        self.adapter = name
        self.reason = reason
        self.retry_after_s = retry_after_s


class AdapterNotAllowed(AdapterError):
    """An adapter file whose real path is outside the directories adapters may be loaded from (HTTP 403)."""


def rejecting(name: str, fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)``, any failure of which is raised as a fresh :class:`AdapterError` of ``name``.

    Fresh, and raised from here, outside the ``except``: the error then carries no traceback into ``fn``'s frames,
    which hold the tensors being checked, and no ``__context__`` leading there. A rejected adapter's memory is
    therefore freed as soon as the caller drops it, not at the next garbage collection (a stored failure, or a
    reference cycle through a frame, used to keep hundreds of MB alive).
    """
    try:
        return fn(*args, **kwargs)
    except AdapterNotAllowed as e:
        error: AdapterError = AdapterNotAllowed(name, e.reason)
    except AdapterError as e:
        error = AdapterError(name, e.reason, e.retry_after_s)
    except RecursionError:
        error = AdapterError(name, "nested too deeply to read")
    except MemoryError:
        error = AdapterError(name, "too large to read into memory")
    except OSError as e:
        error = AdapterError(name, f"cannot read {e.filename or 'a file'}: {e.strerror or type(e).__name__}",
                             RETRY_AFTER_S)  # the disk may come back (a registration's failure stands all the same)
    except Exception as e:  # any other failure of one adapter's files must not escape as a server error
        error = AdapterError(name, f"invalid adapter: {type(e).__name__}: {e}")
    try:
        raise error
    finally:
        del error
