"""Wire an engine, its thread, the app and uvicorn together; run in the foreground (CLI) or a background thread.

Tests and embedding programs use ``Server(...).start_background()`` (port 0 picks a free port); the CLI uses
``run()``. Either way the engine thread is started before the first request and stopped after the last.
"""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

from .app import create_app
from .config import ServerConfig
from .engine_thread import EngineThread

log = logging.getLogger("slora_jax.serve")


class _Uvicorn(uvicorn.Server):
    """uvicorn that logs our ready line (with the real port) once the socket is bound."""

    def __init__(self, config: uvicorn.Config, on_ready):
        super().__init__(config)
        self._on_ready = on_ready

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_ready()


class Server:
    def __init__(self, engine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
                 log_level: str = "info", tokenizer=None):
        self.engine = engine
        self.engine_thread = EngineThread(engine)
        self.app = create_app(self.engine_thread, config, tokenizer=tokenizer)
        self.config = config
        self.host = host
        uv_config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level, access_log=False,
                                   timeout_graceful_shutdown=5, lifespan="off")
        self._uvicorn = _Uvicorn(uv_config, self._ready)
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _ready(self) -> None:
        sockets = [s for srv in self._uvicorn.servers for s in srv.sockets]
        self.port = sockets[0].getsockname()[1] if sockets else self._uvicorn.config.port
        n = len(self.engine.adapter_names())
        log.info("slora-jax ready: %s/v1 (model %r, %d adapters; try %s/v1/models)", self.url,
                 self.config.served_model_name, n, self.url)

    def run(self) -> None:
        """Serve in the foreground until interrupted."""
        self.engine_thread.start()
        try:
            self._uvicorn.run()
        finally:
            self.engine_thread.stop()

    def start_background(self, timeout: float = 60.0) -> str:
        """Serve from a daemon thread; returns the base URL once the socket accepts connections."""
        self.engine_thread.start()
        self._thread = threading.Thread(target=self._uvicorn.run, name="slora-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.engine_thread.stop()
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self.url

    def stop(self, timeout: float = 15.0) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine_thread.stop()
