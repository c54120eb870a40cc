"""The server's side of an engine process (``--engine-process``): :class:`EngineClient` offers the app what
``EngineThread`` offers (``EngineHandle``), answered by the engine in a child process (``engine_process``).

The child is started with multiprocessing's "spawn" (never fork a process that has initialised JAX) and owns the
device; this process keeps uvicorn, the app, tokenization, detokenization and SSE, and must not start JAX on the GPU
(:func:`keep_jax_on_cpu`). A receiver thread reads the child's batches (one per step): outputs go to their streams
in one ``call_soon_threadsafe`` per event loop, replies complete their callers' futures, adapter events reach the
metrics' listeners.

The engine's thread-safe surface is :class:`EngineProxy` (``client.engine``): adapter names are mirrored here (every
registration and unregistration goes through this process), so ``has_adapter`` and ``adapter_names`` cost no round
trip; mixes (they come and go in the child) and registrations are asked of the child. The mirror follows the
engine's replies as they arrive (the receiver thread, before the caller wakes), not its callers: a caller that timed
out must not leave a name the engine unregistered later (it was listed, refused on use, load and unload for good).

If the child dies, every open request ends with an error naming how, ``alive`` and ``healthy`` turn false (the app
answers 503 with the reason) and pending calls raise :class:`EngineUnavailable`. ``stop`` asks the child to stop,
then kills it if it does not (the child ignores SIGTERM while this process lives: a SIGTERM to the whole process group
must not cut the drain short); the child also exits by itself when this process's end of the pipe closes, and is
told to stop when this interpreter exits (multiprocessing would otherwise SIGTERM and wait for it forever).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.util
import threading
import time
from collections.abc import Callable
from typing import Any

from ..engine.forks import sample_ids
from ..engine.scheduler import check_prompt_fits
from ..engine.sequence import RequestOutput
from . import engine_process
from .engine_loop import FAILING_STEPS
from .engine_thread import ENGINE_CALLS, EngineHandle, EngineUnavailable, RequestStream, post_by_loop
from .engine_wire import unpack_error, unpack_output

log = logging.getLogger("slora_jax.serve")

ASK_TIMEOUT_S = 600.0  # a thread-safe query with no timeout of its own (a registration reads every weight)


def keep_jax_on_cpu() -> None:
    """This process never starts JAX on an accelerator (the engine process owns it): any JAX use here lands on the
    CPU. Must run before anything here initialises a JAX backend; the child's environment is untouched."""
    import jax

    jax.config.update("jax_platforms", "cpu")


class EngineProxy:
    """The engine's thread-safe methods and facts, for the app (``RequestBuilder``, ``AdapterAdmin``, routes)."""

    def __init__(self, client: EngineClient, facts: dict):
        self._client = client
        self.cfg, self.ecfg = facts["cfg"], facts["ecfg"]
        self.tokenizer = None  # the server loads its own
        self._names = dict.fromkeys(facts["adapters"])  # registered adapters but mixes, in registration order
        self._listeners: list = []

    def has_adapter(self, name: str) -> bool:
        if name in self._names:
            return True
        return name.startswith("mix:") and bool(self._client.ask("has_adapter", name))

    def adapter_names(self) -> list[str]:
        return list(self._names)

    def register_adapter(self, name: str, source, verify: bool = False) -> None:
        self._client.ask("register_adapter", name, source, verify, on_reply=self._registered(name))

    def register_mix(self, parts: dict[str, float]) -> str:
        return self._client.ask("register_mix", dict(parts))

    def read_adapter(self, name: str, timeout: float | None = None) -> None:
        self._client.ask("read_adapter", name, timeout, timeout=None if timeout is None else timeout + 5.0)

    def check_prompt_length(self, n_prompt: int) -> None:
        """The scheduler's rule, which reads only the engine's config: answered here, no round trip."""
        check_prompt_fits(self.ecfg, n_prompt)

    def watch_adapters(self, listener) -> None:
        self._listeners.append(listener)

    def forget(self, name: str) -> None:
        self._names.pop(name, None)

    def _registered(self, name: str) -> Callable:
        """The mirror's update on the engine's reply to registering ``name`` (however long it took)."""
        def update(result, error) -> None:
            if error is None:
                self._names[name] = None
        return update

    def unregistered(self, name: str) -> Callable:
        """The mirror's update on the engine's reply to unregistering ``name``: gone, or unknown there (KeyError)."""
        def update(result, error) -> None:
            if error is None or isinstance(error, KeyError):
                self.forget(name)
        return update

    def adapter_event(self, name: str, event: str, seconds: float | None) -> None:
        for listener in self._listeners:
            try:
                listener(name, event, seconds)
            except Exception:
                log.exception("adapter listener failed")


class EngineClient(EngineHandle):
    """An engine in a child process, driven like ``EngineThread``. Make one with :meth:`launch`."""

    def __init__(self, conn, process, facts: dict, defer_hand_over: bool = False):
        self._conn, self.process = conn, process
        self.info = facts.get("info") or {}
        self.pid = facts.get("pid")
        self.engine = EngineProxy(self, facts)
        self.defer_hand_over = defer_hand_over
        self._send_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}  # engine request id -> its stream
        self._accepts: dict[str, concurrent.futures.Future] = {}
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._on_reply: dict[int, Callable] = {}  # call id -> what its reply changes here, waited for or not
        self._ids = itertools.count()
        self.steps = self.step_failures = self.consecutive_failures = 0
        self.last_error: str | None = None
        self.fatal: str | None = None
        self.closing: str | None = None
        self._stopping = False
        self._reaping = threading.Lock()  # one thread at a time waits for the process (two would race to reap it)
        self._receiver = threading.Thread(target=self._receive, name="slora-engine-client", daemon=True)
        self._receiver.start()

    @classmethod
    def launch(cls, factory, factory_args: tuple = (), defer_hand_over: bool = False, log_level: str = "info",
               start_timeout_s: float | None = None) -> EngineClient:
        """Spawn the engine process (``factory(*factory_args)`` builds the engine there) and wait until it is
        ready; RuntimeError with the child's reason if it could not start."""
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe(duplex=True)
        process = ctx.Process(target=engine_process.run, name="slora-engine",
                              args=(theirs, factory, factory_args, defer_hand_over, log_level), daemon=True)
        process.start()
        theirs.close()  # only the child holds its end: its exit closes the pipe for us
        try:
            facts = cls._wait_ready(mine, process, start_timeout_s)
        except BaseException:
            mine.close()
            _end(process, 5.0)
            raise
        client = cls(mine, process, facts, defer_hand_over)
        # at exit, before multiprocessing SIGTERMs its daemon children and joins them without a timeout: the child
        # ignores that SIGTERM while we live, so say stop first (a no-op after stop())
        multiprocessing.util.Finalize(client, _say_stop, (mine, client._send_lock), exitpriority=10)
        return client

    @staticmethod
    def _wait_ready(conn, process, timeout: float | None) -> dict:
        """The "ready" message's facts. The rest of its batch and what came before it (adapter events of the host
        fill's first reads, a status) are dropped: no listener can have asked for them yet."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                raise RuntimeError(f"the engine process was not ready within {timeout:.0f} s")
            if not conn.poll(1.0):
                if not process.is_alive():
                    raise RuntimeError(f"the engine process exited during start-up ({_exit_text(process)})")
                continue
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                process.join(5.0)
                raise RuntimeError(f"the engine process exited during start-up ({_exit_text(process)})") from None
            for kind, payload, *_ in batch:
                if kind == "ready":
                    return payload
                if kind == "failed":
                    raise RuntimeError(f"the engine process could not start: {payload}")

    # ---------------------------------------------------------------- health
    def start(self) -> EngineClient:
        return self  # running since launch

    @property
    def alive(self) -> bool:
        return self._receiver.is_alive() and not self._stopping and self.fatal is None

    @property
    def healthy(self) -> bool:
        return self.alive and self.consecutive_failures < FAILING_STEPS

    # ---------------------------------------------------------------- requests
    async def submit(self, prompt_ids: list[int], adapter: str | None, sampling, request_id: str,
                     watch_stop_strings: bool = True, tenant: str | None = None,
                     first_token_slo_s: float | None = None, n: int = 1, grammar: Any = None,
                     grammar_spec: Any = None) -> RequestStream:
        """As ``EngineThread.submit``; structured output needs ``grammar_spec`` (a matcher cannot cross)."""
        if not self.alive or self.closing:
            raise EngineUnavailable(self.closing or self.fatal or "the engine is not running")
        if grammar is not None and grammar_spec is None:
            raise ValueError("structured output in an engine process needs the grammar's spec")
        stream = RequestStream(request_id, asyncio.get_running_loop(), n)
        ids = sample_ids(request_id, n)
        for rid in ids:
            self._streams[rid] = stream
        accepted = self._accepts[request_id] = concurrent.futures.Future()
        try:
            if self.fatal is not None:  # it died between the check and the registration
                raise EngineUnavailable(self.fatal)
            self._send(("submit", request_id, list(prompt_ids), adapter, sampling, watch_stop_strings, tenant,
                        first_token_slo_s, n, grammar_spec))
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            for rid in ids:
                self.abort(rid)
                self._streams.pop(rid, None)  # nobody reads it now, and a refused request never sends an output
            raise
        except BaseException:
            for rid in ids:
                self._streams.pop(rid, None)
            raise
        finally:
            self._accepts.pop(request_id, None)
        return stream

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(EngineUnavailable):
            self._send(("abort", request_id))

    def end_all(self, reason: str) -> None:
        self.closing = reason
        with contextlib.suppress(EngineUnavailable):
            self._send(("end_all", reason))

    # ---------------------------------------------------------------- calls
    async def engine_call(self, name: str, args: tuple = (), timeout: float | None = None) -> Any:
        if name not in ENGINE_CALLS:
            raise ValueError(f"{name!r} is not an engine call the server makes")
        on_reply = self.engine.unregistered(args[0]) if name == "unregister_adapter" else None
        fut = self._request("call", name, args, on_reply)
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    def ask(self, name: str, *args, timeout: float | None = ASK_TIMEOUT_S, on_reply: Callable | None = None) -> Any:
        """A thread-safe engine query, answered by the engine process (blocks this thread). ``on_reply(result,
        error)`` runs when the reply arrives, even after ``timeout``."""
        fut = self._request("ask", name, args, on_reply)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the engine process did not answer {name} within {timeout} s") from None

    def _request(self, kind: str, name: str, args: tuple,
                 on_reply: Callable | None = None) -> concurrent.futures.Future:
        if not self.alive:
            raise EngineUnavailable(self.fatal or "the engine is not running")
        cid = next(self._ids)
        if on_reply is not None:
            self._on_reply[cid] = on_reply
        fut = self._replies[cid] = concurrent.futures.Future()
        if self.fatal is not None:
            self._replies.pop(cid, None)
            self._on_reply.pop(cid, None)
            raise EngineUnavailable(self.fatal)
        self._send((kind, cid, name, args))
        return fut

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send([message])
        except (OSError, ValueError):
            raise EngineUnavailable(self.fatal or "the engine process is gone") from None

    # ---------------------------------------------------------------- the child's messages
    def _receive(self) -> None:
        while True:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError, ValueError):
                break
            ready: list[tuple[RequestStream, RequestOutput]] = []
            for msg in batch:
                kind = msg[0]
                if kind == "out":
                    for packed in msg[1]:
                        out = unpack_output(packed)
                        stream = self._streams.pop(out.request_id, None) if out.finished else \
                            self._streams.get(out.request_id)
                        if stream is not None:
                            ready.append((stream, out))
                elif kind == "status":
                    self.steps, self.step_failures, self.consecutive_failures, self.last_error, fatal = msg[1:]
                    if fatal is not None and self.fatal is None:
                        self.fatal = fatal
                elif kind == "accepted":
                    _settle(self._accepts.get(msg[1]), None, _error(msg[2]))
                elif kind == "reply":
                    self._replied(msg[1], msg[2], _error(msg[3]))
                elif kind == "event":
                    self.engine.adapter_event(*msg[1:])
            post_by_loop(ready)
        self._gone()

    def _replied(self, cid: int, result: Any, error: BaseException | None) -> None:
        """A call's reply: first what it changes here (its caller may have timed out and cancelled its future),
        then the caller's future."""
        on_reply = self._on_reply.pop(cid, None)
        if on_reply is not None:
            try:
                on_reply(result, error)
            except Exception:
                log.exception("handling the engine's reply failed")
        _settle(self._replies.pop(cid, None), result, error)

    def _gone(self) -> None:
        """The pipe closed: end every open request and call with the reason, so nothing waits forever."""
        if self.process is not None:
            with self._reaping:
                self.process.join(5.0)
        if self._stopping:
            reason = self.closing or "the server is shutting down"
        else:
            reason = f"the engine process exited ({_exit_text(self.process)}); restart the server"
            log.error(reason)
        if self.fatal is None:
            self.fatal = reason
        error = EngineUnavailable(reason)
        for fut in list(self._accepts.values()) + list(self._replies.values()):
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                fut.set_exception(error)
        self._replies.clear()
        self._on_reply.clear()
        post_by_loop([(stream, RequestOutput(rid, [], True, "error", error=reason))
                      for rid, stream in list(self._streams.items())])
        self._streams.clear()

    # ---------------------------------------------------------------- stopping
    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine process (its open requests are aborted) and wait for it; terminate it if it hangs."""
        self._stopping = True
        with contextlib.suppress(EngineUnavailable):
            self._send(("stop",))
        if self.process is not None:
            started = time.monotonic()
            with self._reaping:
                _end(self.process, timeout)
            log.info("the engine process stopped (%s) in %.1f s", _exit_text(self.process), time.monotonic() - started)
        self._receiver.join(timeout)
        with contextlib.suppress(OSError):
            self._conn.close()


def _error(packed) -> BaseException | None:
    return None if packed is None else unpack_error(packed)


def _settle(fut: concurrent.futures.Future | None, result: Any, error: BaseException | None) -> None:
    if fut is None or fut.done():
        return
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


def _say_stop(conn, send_lock: threading.Lock) -> None:
    """Tell the engine process to stop, if the pipe is still open (at interpreter exit)."""
    if not send_lock.acquire(timeout=1.0):
        return
    try:
        with contextlib.suppress(OSError, ValueError):
            conn.send([("stop",)])
    finally:
        send_lock.release()


def _end(process, timeout: float) -> None:
    """Wait for the process; kill it if it hangs (SIGTERM would be ignored: it stops only on our word or SIGKILL)."""
    process.join(timeout)
    if process.is_alive():
        log.warning("the engine process did not stop within %.0f s: killing it", timeout)
        process.kill()
        process.join(5.0)


def _exit_text(process) -> str:
    code = None if process is None else process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}"
