"""The errors of adapters we cannot serve, and the one way loaders raise them.

Every reader of adapter files runs its work through :func:`rejecting`, so whatever goes wrong (a bad value, a
corrupt file, an OS error, a parser's recursion limit) reaches the caller as an :class:`AdapterError` with the
adapter's name and a reason, and never as a 500 or a crashed IO thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the reason."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"adapter {name!r}: {reason}")
        self.adapter = name
        self.reason = reason


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
        error = AdapterError(name, e.reason)
    except RecursionError:
        error = AdapterError(name, "nested too deeply to read")
    except MemoryError:
        error = AdapterError(name, "too large to read into memory")
    except OSError as e:
        error = AdapterError(name, f"cannot read {e.filename or 'a file'}: {e.strerror or type(e).__name__}")
    except Exception as e:  # any other failure of one adapter's files must not escape as a server error
        error = AdapterError(name, f"invalid adapter: {type(e).__name__}: {e}")
    try:
        raise error
    finally:
        del error
