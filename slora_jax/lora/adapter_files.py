"""Open an adapter's files as untrusted input: regular files only, bounded reads, and, for runtime loads, only files
whose real path is inside the allowed directories.

The containment check looks at the file actually opened (its ``/proc/self/fd`` link on Linux), not at a path
resolved beforehand, so a symlink swapped in between a check and the open cannot lead outside. Files are opened
non-blocking, so a FIFO or device node named like an adapter file is refused instead of hanging the reader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from slora_jax.lora.errors import RETRY_AFTER_S, AdapterError, AdapterNotAllowed

__all__ = ["OpenFile", "inside", "open_adapter_file", "read_bounded"]

_FD_LINKS = Path("/proc/self/fd")
_OPEN_ERRORS = {errno.ENOENT: "missing", errno.ENOTDIR: "missing", errno.ELOOP: "a symlink loop at",
                errno.ENAMETOOLONG: "a name too long in", errno.EACCES: "no permission to read"}
_LASTING = ("a symlink loop at", "a name too long in")  # open errors no later read can get past


@dataclasses.dataclass(frozen=True)
class OpenFile:
    """An opened adapter file: ``fd``, a ``path`` that reopens exactly this file, and its ``size`` in bytes."""

    fd: int
    path: str
    size: int


def inside(real: str | Path, roots: tuple[Path, ...]) -> bool:
    """Whether the resolved path ``real`` is one of ``roots`` (resolved) or below one."""
    real = Path(real)
    return any(real == root or real.is_relative_to(root) for root in roots)


@contextlib.contextmanager
def open_adapter_file(path: Path, name: str, roots: tuple[Path, ...] = ()) -> Iterator[OpenFile]:
    """Open ``path`` for reading if it is a regular file (and, with ``roots``, really inside one of them).

    Raises :class:`AdapterError` with the file's name and the reason, :class:`AdapterNotAllowed` if it resolves
    outside ``roots``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        what = _OPEN_ERRORS.get(e.errno)
        # missing, unreadable or an I/O error: may pass (a file being replaced, a disk away); the rest will not
        later = None if what in _LASTING else RETRY_AFTER_S
        if what == "missing":
            raise AdapterError(name, f"missing {path.name} in {path.parent}", later) from None
        if what is not None:
            raise AdapterError(name, f"{what} {path.name}", later) from None
        raise AdapterError(name, f"cannot open {path.name}: {e.strerror}", later) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AdapterError(name, f"{path.name} is not a regular file")
        link = _FD_LINKS / str(fd)
        if roots:
            real = os.readlink(link) if _FD_LINKS.is_dir() else os.path.realpath(path)
            if not inside(real, roots):
                raise AdapterNotAllowed(name, f"{path.name} resolves outside the directories adapters may be loaded "
                                              "from")
        reopen = str(link) if _FD_LINKS.is_dir() else os.path.realpath(path)
        yield OpenFile(fd, reopen, info.st_size)
    finally:
        os.close(fd)


def read_bounded(file: OpenFile, name: str, what: str, max_bytes: int) -> bytes:
    """All of an open file, refusing one larger than ``max_bytes`` (checked before and while reading)."""
    if file.size > max_bytes:
        raise AdapterError(name, f"{what} is {file.size} bytes; the limit is {max_bytes}")
    chunks, total = [], 0
    while chunk := os.read(file.fd, min(1 << 20, max_bytes + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise AdapterError(name, f"{what} is larger than the limit of {max_bytes} bytes")
    return b"".join(chunks)
