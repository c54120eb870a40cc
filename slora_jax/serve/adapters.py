"""Adapters by name: the one path that validates and registers an adapter, for ``--lora-modules`` at start-up and
``/v1/load_lora_adapter`` at run time, plus the rules of runtime loads (names, allowed directories) and of unloading.

Registration reads and checks every weight before the name is served (``engine.register_adapter(verify=True)``), so
a corrupt or mismatched adapter is refused with its reason and never reaches a request. Refusals are
:class:`APIError` s with the status the HTTP API answers; the CLI reports their message and stops.

The residency API's rules are here too: which tiers may be asked for, and how pin and unpin refusals are answered
(404 unknown, 409 cannot be loaded, cannot fit, or not pinned).

Runtime loads are untrusted: a name must be printable and at most :data:`MAX_NAME_CHARS` long; a path must be
printable, at most :data:`MAX_PATH_CHARS` long, and everything it leads to must really be inside an allowed
directory, symlinks followed at every level, the adapter's files included (403 otherwise; checked again on the
opened files at read time, see ``lora.adapter_files``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
from pathlib import Path

from ..engine.adapter_store import TIERS, NoRoom
from ..lora.adapter_files import inside
from ..lora.mixes import MIX_PREFIX
from ..lora.peft import AdapterError, AdapterNotAllowed
from ..lora.sources import PeftDirSource
from .engine_loop import EngineUnavailable
from .protocol import APIError

MAX_NAME_CHARS = 256
ADMIN_THREADS = 4  # adapter admin work (weight reads, engine-process questions) running at once
ADMIN_PENDING = 64  # admin calls running or queued; one more is refused with 503 (its client retries)
MAX_PATH_CHARS = 4096
_PATH_ERRORS = {errno.ELOOP: "it contains a symlink loop", errno.ENAMETOOLONG: "a name in it is too long",
                errno.EACCES: "the server may not read it"}


def timed_out(what: str, timeout: float | None, param: str | None = "lora_name") -> APIError:
    """504 for an admin call the engine did not answer in time (``admin_timeout_s``): it is still queued or running
    there and may yet take effect, so say so rather than fail with a bare 500."""
    return APIError(504, f"the engine did not {what} within {timeout} s (admin_timeout_s: it is busy); it may still "
                    "do so: GET /v1/models and /v1/adapters show the outcome", param, "timeout_error")


class AdapterAdmin:
    def __init__(self, engine, base_name: str, allowed_dirs: tuple[Path, ...] = ()):
        self.engine, self.base_name = engine, base_name
        self.allowed_roots = tuple(Path(d).expanduser().resolve() for d in allowed_dirs)
        self._pool = concurrent.futures.ThreadPoolExecutor(ADMIN_THREADS, thread_name_prefix="slora-admin")
        self._pending = 0  # changed on the event loop only

    async def off_loop(self, fn, *args):
        """``fn(*args)`` in the admin threads. Why its own: in Starlette's shared thread pool 40 slow adapter
        loads (a big adapter, a slow disk) held every thread, and every route, ``/health`` included, waited."""
        if self._pending >= ADMIN_PENDING:
            raise APIError(503, f"{ADMIN_PENDING} adapter operations are in progress; retry later",
                           retry_after_s=1.0)
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_name(self, name: str) -> None:
        """400 unless ``name`` is a usable adapter name: 1..MAX_NAME_CHARS printable characters, no surrounding
        whitespace, not the base model's name."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise APIError(400, f"invalid adapter name {name!r}: empty or surrounded by whitespace", "lora_name")
        if len(name) > MAX_NAME_CHARS:
            raise APIError(400, f"adapter name of {len(name)} characters (the limit is {MAX_NAME_CHARS})",
                           "lora_name")
        if not name.isprintable():
            raise APIError(400, f"invalid adapter name {name!r}: it contains control characters", "lora_name")
        if name == self.base_name:
            raise APIError(400, f"invalid adapter name {name!r}: that is the base model's name", "lora_name")
        if name.startswith(MIX_PREFIX):
            raise APIError(400, f"invalid adapter name {name!r}: names starting with {MIX_PREFIX!r} are kept for "
                           "adapter mixes", "lora_name")

    def resolve_path(self, raw: str) -> Path:
        """A runtime-load path, resolved, that is inside an allowed directory (403 otherwise); relative paths are
        tried under each allowed directory in turn, and the first that exists decides. 400 for a malformed path."""
        if not self.allowed_roots:
            raise APIError(403, "loading adapters at run time is disabled (start the server with --adapter-dir or "
                           "--allowed-adapter-dir)", "lora_path")
        given = self._parse(raw)
        candidates = [given] if given.is_absolute() else [root / given for root in self.allowed_roots]
        # Outside every allowed directory, even read loosely (symlinks that resolve followed, the rest as written):
        # 403 before any error that would tell whether a directory exists there (a loop, a name too long).
        if not any(inside(Path(os.path.realpath(c)), self.allowed_roots) for c in candidates):
            raise APIError(403, f"{raw[:200]!r} is outside the directories adapters may be loaded from", "lora_path")
        resolved = [self._resolve(raw, c) for c in candidates]
        existing = [real for real, exists in resolved if exists]
        # Nothing there: refuse if any reading of it points outside (``..``, a dangling symlink); else its load says
        # it is missing.
        chosen = existing[:1] or [real for real, _ in resolved]
        if not all(inside(real, self.allowed_roots) for real in chosen):
            raise APIError(403, f"{raw[:200]!r} is outside the directories adapters may be loaded from", "lora_path")
        return chosen[0]

    def register(self, name: str, path: Path) -> None:
        """Validate the adapter fully, then serve it as ``name``. Blocks on disk: call it off the event loop and
        off the engine thread (any other thread is fine; registration is thread-safe). With allowed directories,
        the adapter's files are read only if they really are inside them (403 otherwise)."""
        self.check_name(name)
        if self.engine.has_adapter(name):
            raise APIError(400, f"an adapter named {name!r} is already loaded; unload it first", "lora_name")
        source = PeftDirSource(path, allowed_roots=self.allowed_roots)
        try:
            self.engine.register_adapter(name, source, verify=True)
        except AdapterNotAllowed as e:
            raise APIError(403, str(e), "lora_path") from None
        except AdapterError as e:  # one that may pass (a disk away): not registered, retry later
            raise APIError.of_adapter(e, 400, "lora_path") from None
        except TimeoutError as e:  # before OSError, its base: the engine may still finish it
            raise APIError(504, f"loading adapter {name!r} timed out ({e}); it may still finish: GET /v1/models "
                           "lists it once it is loaded", "lora_name", "timeout_error") from None
        except OSError as e:
            raise APIError(400, f"adapter {name!r}: {e}", "lora_path") from None
        except ValueError as e:  # the name was taken meanwhile
            raise APIError(400, str(e), "lora_name") from None

    def check_unloadable(self, name: str, action: str = "unloaded") -> None:
        """400 for the base model (it cannot be ``action``), 404 for a name that is not a loaded adapter. May block
        (a mix's name is asked of an engine process): call it off the event loop."""
        if name == self.base_name:
            raise APIError(400, f"the base model cannot be {action}", "lora_name")
        if not self.engine.has_adapter(name):
            raise APIError(404, f"no adapter named {name!r} is loaded", "lora_name")

    # ---- residency ------------------------------------------------------------------------------------------------

    @staticmethod
    def check_tier(tier: str | None) -> None:
        if tier is not None and tier not in TIERS:
            raise APIError(400, f"tier must be one of {', '.join(TIERS)}, got {tier[:50]!r}", "tier")

    def read(self, name: str, timeout: float | None = None) -> None:
        """The adapter's rows into host memory ahead of its pin, so the engine thread does not wait on disk. Blocks:
        call it off the event loop and off the engine thread. 409 if it cannot be loaded."""
        try:
            self.engine.read_adapter(name, timeout)
        except AdapterError as e:
            if not self.engine.has_adapter(name):
                raise APIError(404, f"no adapter named {name!r} is loaded", "lora_name") from None
            raise APIError.of_adapter(e, 409, "lora_name", f"cannot pin: {e}") from None
        except TimeoutError:
            raise APIError(503, f"reading adapter {name!r} took longer than {timeout} s", "lora_name") from None

    async def pin(self, runner, name: str, timeout: float | None = None) -> dict:
        """Pin ``name`` resident through ``runner`` (the ``EngineHandle``: the engine thread does it); its state."""
        try:
            return await runner.pin_adapter(name, timeout)
        except TimeoutError:
            raise timed_out(f"pin adapter {name!r}", timeout) from None
        except KeyError:
            raise APIError(404, f"no adapter named {name!r} is loaded", "lora_name") from None
        except (AdapterError, NoRoom) as e:
            raise APIError.of_adapter(e, 409, "lora_name", f"cannot pin: {e}") from None

    async def unpin(self, runner, name: str, timeout: float | None = None) -> dict:
        """Drop one explicit pin through ``runner``; its state."""
        try:
            return await runner.unpin_adapter(name, timeout)
        except TimeoutError:
            raise timed_out(f"unpin adapter {name!r}", timeout) from None
        except KeyError:
            raise APIError(404, f"no adapter named {name!r} is loaded", "lora_name") from None
        except ValueError as e:
            raise APIError(409, str(e), "lora_name") from None

    async def unregister(self, runner, name: str, timeout: float | None = None) -> None:
        """Stop serving ``name`` through ``runner``."""
        try:
            await runner.unregister_adapter(name, timeout)
        except TimeoutError:
            raise timed_out(f"unload adapter {name!r}", timeout) from None
        except KeyError:
            raise APIError(404, f"no adapter named {name!r} is loaded", "lora_name") from None
        except (RuntimeError, ValueError) as e:  # e.g. still used by running requests
            if isinstance(e, EngineUnavailable):  # not a refusal: the engine is gone
                raise
            raise APIError(409, str(e), "lora_name") from None

    # ---- path rules -----------------------------------------------------------------------------------------------

    @staticmethod
    def _parse(raw: str) -> Path:
        """``raw`` as a path, or 400: too long, control characters (NUL included), a ``~user`` that does not exist."""
        if len(raw) > MAX_PATH_CHARS:
            raise APIError(400, f"lora_path of {len(raw)} characters (the limit is {MAX_PATH_CHARS})", "lora_path")
        if not raw.isprintable():
            raise APIError(400, f"lora_path {raw[:200]!r} contains control characters", "lora_path")
        try:
            return Path(raw).expanduser()
        except (RuntimeError, KeyError):  # ~nosuchuser
            raise APIError(400, f"lora_path {raw[:200]!r}: cannot expand the home directory in it",
                           "lora_path") from None

    @staticmethod
    def _resolve(raw: str, candidate: Path) -> tuple[Path, bool]:
        """(real path, whether it exists): every symlink followed, dangling ones to where they point. 400 for a
        symlink loop, an over-long name, or a path the server may not read."""
        try:
            return Path(os.path.realpath(candidate, strict=True)), True
        except OSError as e:
            if e.errno in _PATH_ERRORS:
                raise APIError(400, f"lora_path {raw[:200]!r}: {_PATH_ERRORS[e.errno]}", "lora_path") from None
        try:
            return Path(os.path.realpath(candidate)), False
        except (OSError, ValueError) as e:
            raise APIError(400, f"lora_path {raw[:200]!r}: {e}", "lora_path") from None
