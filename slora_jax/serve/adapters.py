"""Adapters by name: the one path that validates and registers an adapter, for ``--lora-modules`` at start-up and
``/v1/load_lora_adapter`` at run time, plus the rules of runtime loads (allowed directories) and of unloading.

Registration reads and checks every weight before the name is served (``engine.register_adapter(verify=True)``), so
a corrupt or mismatched adapter is refused with its reason and never reaches a request. Refusals are
:class:`APIError` s with the status the HTTP API answers; the CLI reports their message and stops.
"""

from __future__ import annotations

from pathlib import Path

from ..lora.peft import AdapterError
from .protocol import APIError


class AdapterAdmin:
    def __init__(self, engine, base_name: str, allowed_dirs: tuple[Path, ...] = ()):
        self.engine, self.base_name = engine, base_name
        self.allowed_roots = tuple(Path(d).expanduser().resolve() for d in allowed_dirs)

    def check_name(self, name: str) -> None:
        if name == self.base_name or name != name.strip():
            raise APIError(400, f"invalid adapter name {name!r}", "lora_name")

    def resolve_path(self, raw: str) -> Path:
        """A runtime-load path inside an allowed directory (relative paths are tried under each), else 403."""
        if not self.allowed_roots:
            raise APIError(403, "loading adapters at run time is disabled (start the server with --adapter-dir or "
                           "--allowed-adapter-dir)", "lora_path")
        given = Path(raw).expanduser()
        candidates = [given] if given.is_absolute() else [root / given for root in self.allowed_roots]
        inside = [c.resolve() for c in candidates]
        inside = [r for r in inside if any(r == root or r.is_relative_to(root) for root in self.allowed_roots)]
        if not inside:
            raise APIError(403, f"{raw!r} is outside the directories adapters may be loaded from", "lora_path")
        return next((r for r in inside if r.exists()), inside[0])

    def register(self, name: str, path: Path) -> None:
        """Validate the adapter fully, then serve it as ``name``. Blocks on disk: call it off the event loop and
        off the engine thread (any other thread is fine; registration is thread-safe)."""
        self.check_name(name)
        if self.engine.has_adapter(name):
            raise APIError(400, f"an adapter named {name!r} is already loaded; unload it first", "lora_name")
        try:
            self.engine.register_adapter(name, path, verify=True)
        except AdapterError as e:
            raise APIError(400, str(e), "lora_path") from None
        except OSError as e:
            raise APIError(400, f"adapter {name!r}: {e}", "lora_path") from None
        except ValueError as e:  # the name was taken meanwhile
            raise APIError(400, str(e), "lora_name") from None

    def check_unloadable(self, name: str) -> None:
        if name == self.base_name:
            raise APIError(400, "the base model cannot be unloaded", "lora_name")
        if not self.engine.has_adapter(name):
            raise APIError(404, f"no adapter named {name!r} is loaded", "lora_name")

    def unregister(self, name: str) -> None:
        """Stop serving ``name``. Engine thread only (``engine_thread.call``)."""
        try:
            self.engine.unregister_adapter(name)
        except KeyError:
            raise APIError(404, f"no adapter named {name!r} is loaded", "lora_name") from None
        except (RuntimeError, ValueError) as e:  # e.g. still used by running requests
            raise APIError(409, str(e), "lora_name") from None
