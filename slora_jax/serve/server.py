"""Wire an engine, its thread, the app and uvicorn together; run in the foreground (CLI) or a background thread.

Tests and embedding programs use ``Server(...).start_background()`` (port 0 picks a free port); the CLI uses
``run()``. Either way the engine thread is started before the first request and stopped after the last.

Shutting down drains (``shutdown.Drain``): SIGTERM or SIGINT (foreground) and :meth:`Server.request_shutdown` stop
new requests with 503, give running ones ``shutdown_grace_s`` to finish, end the rest with an error, and only then
let uvicorn exit. A second signal cuts the grace period short; a third exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time

import uvicorn

from .app import create_app
from .config import ServerConfig
from .engine_thread import EngineHandle, EngineThread
from .limits import http_protocol
from .shutdown import FLUSH_S

log = logging.getLogger("slora_jax.serve")


class _Uvicorn(uvicorn.Server):
    """uvicorn that logs our ready line (with the real port) once the socket is bound, and hands exit signals to
    ``on_signal`` (the drain) instead of exiting at once."""

    def __init__(self, config: uvicorn.Config, on_ready, on_signal):
        super().__init__(config)
        self._on_ready, self._on_signal = on_ready, on_signal
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            self._on_ready()

    def handle_exit(self, sig, frame) -> None:
        self._on_signal(sig, frame)

    def exit_now(self, sig, frame) -> None:
        """uvicorn's own exit: stop the main loop (and force it on a repeated SIGINT)."""
        super().handle_exit(sig, frame)


class Server:
    def __init__(self, engine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
                 log_level: str = "info", tokenizer=None, runner: EngineHandle | None = None):
        """Serve ``engine`` from a thread of this process, or (``runner``, ``engine`` None) the engine an
        ``EngineHandle`` already runs: an ``engine_client.EngineClient`` of an engine process."""
        self.engine = engine
        self.engine_thread = runner or EngineThread(engine, defer_hand_over=config.defer_hand_over)
        self.app = create_app(self.engine_thread, config, tokenizer=tokenizer)
        self.ctx = self.app.state.ctx
        self.config = config
        self.host = host
        # our drain finishes the requests first; uvicorn's own grace only covers connections left after it
        uv_config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level, access_log=False,
                                   timeout_graceful_shutdown=int(FLUSH_S), lifespan="off",
                                   http=http_protocol(config.header_timeout_s))
        self._uvicorn = _Uvicorn(uv_config, self._ready, self._signalled)
        self._thread: threading.Thread | None = None
        self._drain_task: asyncio.Task | None = None
        self._signals = 0
        self.port: int | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _ready(self) -> None:
        sockets = [s for srv in self._uvicorn.servers for s in srv.sockets]
        self.port = sockets[0].getsockname()[1] if sockets else self._uvicorn.config.port
        n = len(self.engine_thread.engine.adapter_names())
        log.info("slora-jax ready: %s/v1 (model %r, %d adapters; try %s/v1/models)", self.url,
                 self.config.served_model_name, n, self.url)

    # ---------------------------------------------------------------- shutting down
    def _signalled(self, sig, frame) -> None:
        """An exit signal (main thread, between bytecodes of the event loop): drain; cut it short; exit now."""
        self._signals += 1
        loop = self._uvicorn.loop
        if self._signals >= 3 or loop is None or not self._uvicorn.started:
            self._uvicorn.exit_now(sig, frame)
            return
        if self._signals == 1:
            log.info("signal %s: draining (grace %.1f s; signal again to end the remaining requests now)", sig,
                     self.config.shutdown_grace_s)
        self.request_shutdown(0.0 if self._signals == 2 else None)

    def request_shutdown(self, grace_s: float | None = None) -> None:
        """Start the drain (any thread; returns at once): new requests get 503, running ones have ``grace_s``
        (default: the config's ``shutdown_grace_s``) to finish, the rest end with an error, then the server exits.
        Called again while draining, it ends the grace period now if ``grace_s`` is 0."""
        loop = self._uvicorn.loop
        if loop is None or loop.is_closed():
            self._uvicorn.should_exit = True
            return
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        try:
            loop.call_soon_threadsafe(self._start_drain, grace)
        except RuntimeError:  # the loop closed meanwhile: nothing left to drain
            self._uvicorn.should_exit = True

    def _start_drain(self, grace_s: float) -> None:
        if self._drain_task is not None:
            if grace_s == 0:
                self.ctx.drain.cut_short()
            return
        self._drain_task = asyncio.ensure_future(self._drain_then_exit(grace_s))

    async def _drain_then_exit(self, grace_s: float) -> None:
        try:
            await self.ctx.drain.run(grace_s)
        except Exception:
            log.exception("the drain failed; exiting anyway")
        finally:
            self._uvicorn.should_exit = True

    # ---------------------------------------------------------------- running
    def _set_switch_interval(self) -> None:
        """The process's GIL switch interval (``ServerConfig.gil_switch_interval_s``): process-wide, set once the
        server serves, as the engine thread and the event loop share the one GIL."""
        if self.config.gil_switch_interval_s is not None:
            sys.setswitchinterval(self.config.gil_switch_interval_s)

    def run(self) -> None:
        """Serve in the foreground until a signal has drained the server."""
        self._set_switch_interval()
        self.engine_thread.start()
        try:
            self._uvicorn.run()
        finally:
            self._close()

    def start_background(self, timeout: float = 60.0) -> str:
        """Serve from a daemon thread; returns the base URL once the socket accepts connections."""
        self._set_switch_interval()
        self.engine_thread.start()
        self._thread = threading.Thread(target=self._uvicorn.run, name="slora-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._close()
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self.url

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Wait for a background server to exit (after a drain); True if it did."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        self._close()
        return True

    def stop(self, timeout: float = 15.0, grace_s: float = 0.0) -> None:
        """Drain with ``grace_s`` (default none: open requests end with an error at once) and wait for the exit."""
        self.request_shutdown(grace_s)
        self.wait_stopped(timeout + grace_s)

    def _close(self) -> None:
        self.engine_thread.stop()
        self.ctx.requests.close()
        self.ctx.adapters.close()
