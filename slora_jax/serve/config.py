"""The HTTP server's own settings (the engine's are ``EngineConfig``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    allowed_adapter_dirs: tuple[Path, ...] = ()  # runtime loads only from below these (resolved) directories
    metrics_timeout_s: float = 5.0
    admin_timeout_s: float = 60.0
