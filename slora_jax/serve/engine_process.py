"""The engine in a process of its own (``--engine-process``): the child side.

One Python process cannot both step the engine and serve HTTP at full speed: they share one GIL, and on the H200 the
engine thread's ~8.5 ms of host work per step plus the event loop's ~5 ms (JSON, SSE, detokenization, socket writes)
fill a 13 ms device step (benchmarks/NOTES.md, 2026-12-01). Here the engine runs alone: :func:`run` is the target of
a process started with multiprocessing's "spawn" (a process that has initialised JAX is never forked). It builds the
engine with a factory the server names (``cli.process_engine``: model load, adapters, warm-up), then

* the main thread receives the server's messages (``engine_wire``) and queues them for the engine thread (an
  :class:`EngineWorker`, the same ``EngineLoop`` as in one process) or, for the thread-safe queries (adapter
  registration reads every weight), runs them in two ask threads;
* the engine thread steps and hands each step's outputs to the :class:`Sender` (no pickling on the engine thread);
* the sender thread pickles and writes everything queued since its last write as one message, mostly while the
  engine thread waits on the device with the GIL released.

Structured output: a grammar matcher cannot cross processes, so the server sends its ``GrammarSpec`` and it is
compiled again here (the server compiled it once to answer 400 early), on a thread of its own
(:class:`GrammarSubmissions`): compiling on the main thread held up every submit, abort and call behind it.

The process ends when the server says ``stop`` or its end of the pipe closes (the server exited or died): open
requests are aborted, the last outputs sent, and the process exits, so it never outlives the server. Once serving,
it ignores SIGTERM while the server lives (:func:`ignore_sigterm_while_parent_lives`): service managers signal the
whole process group, and the server's drain needs the engine until it says ``stop`` (it kills a child that hangs).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import logging
import multiprocessing
import os
import signal
import threading
from typing import Any

from ..engine.forks import sample_ids
from .engine_loop import Call, EngineLoop, Submission
from .engine_thread import ENGINE_CALLS
from .engine_wire import ASKS, pack_error, pack_output, pickles

log = logging.getLogger("slora_jax.serve")


class _Remote:
    """The target of every request here: outputs go down the one pipe."""

    route = "pipe"


REMOTE = _Remote()


class Sender:
    """Writes queued messages to the server in batches, from its own thread (``put`` never blocks the caller).
    Each batch ends with the engine's status when it changed."""

    def __init__(self, conn, status=None):
        self.conn, self.status = conn, status
        self._items: list = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._last_status = None
        self._thread = threading.Thread(target=self._run, name="slora-engine-sender", daemon=True)

    def start(self) -> Sender:
        self._thread.start()
        return self

    def put(self, message: tuple) -> None:
        with self._lock:
            self._items.append(message)
        self._wake.set()

    def put_outputs(self, outputs: list) -> None:
        """One step's ``RequestOutput`` s, packed on the sender thread (they are not changed after the step)."""
        self.put(("outputs", outputs))

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop."""
        self._closing = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                items, self._items = self._items, []
            batch = [("out", [pack_output(o) for o in m[1]]) if m[0] == "outputs" else m for m in items]
            status = self.status() if self.status is not None else None
            if status is not None and status != self._last_status:
                batch.append(("status", *status))
                self._last_status = status
            if batch:
                try:
                    self.conn.send(batch)
                except (OSError, ValueError):  # the server is gone: nobody to tell
                    return
            if self._closing and not self._items:
                return


class EngineWorker(EngineLoop):
    """The engine loop of the engine process: outputs go to the :class:`Sender`."""

    def __init__(self, engine, sender: Sender, defer_hand_over: bool = False):
        super().__init__(engine, defer_hand_over=defer_hand_over)
        self.sender = sender
        self._grammars = None

    def send(self, route: Any, items: list) -> None:
        self.sender.put_outputs([out for _, out in items])

    def status(self) -> tuple:
        return self.steps, self.step_failures, self.consecutive_failures, self.last_error, self.fatal

    def grammar(self, spec):
        """``spec`` compiled for this engine's vocabulary (the server sent the spec, not a matcher)."""
        if spec is None:
            return None
        if self._grammars is None:
            from .structured import RequestGrammars

            tok = getattr(self.engine, "tokenizer", None)
            self._grammars = RequestGrammars(tok, self.engine.cfg.vocab_size, self.engine.cfg.eos_token_id)
        return self._grammars.compile_spec(spec)


class GrammarSubmissions:
    """Submissions whose grammar compiles off the main thread, one at a time: a slow grammar holds up only the
    grammars behind it. An abort that arrives while its request compiles is kept and queued right after the
    submission (queued under the same lock), so it is never lost."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="slora-engine-grammar")
        self._lock = threading.Lock()
        self._aborted: dict[str, bool] = {}  # request id -> an abort arrived while it compiled

    def submit(self, sub: Submission, spec) -> None:
        with self._lock:  # aborts name each sample of the request (``cmpl-x#0``, ...) when it has several
            self._aborted.update(dict.fromkeys(sample_ids(sub.request_id, sub.n), False))
        self._pool.submit(self._compile, sub, spec)

    def abort(self, request_id: str) -> bool:
        """True if ``request_id`` is still compiling (its abort follows its submission); else the caller queues it."""
        with self._lock:
            if request_id in self._aborted:
                self._aborted[request_id] = True
                return True
            return False

    def _compile(self, sub: Submission, spec) -> None:
        error = None
        try:
            sub = dataclasses.replace(sub, grammar=self.worker.grammar(spec))
        except Exception as e:  # noqa: BLE001 - the server compiled it already: unexpected, but answered
            error = e
        with self._lock:
            aborted = [rid for rid in sample_ids(sub.request_id, sub.n) if self._aborted.pop(rid)]
            if error is None:
                self.worker.queue_submission(sub)
                for rid in aborted:
                    self.worker.queue_abort(rid)
        if error is not None:
            sub.reply(None, error)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _reply(sender: Sender, kind: str, key, result: Any = None, error: BaseException | None = None) -> None:
    if error is not None:
        sender.put((kind, key, None, pack_error(error)))
    elif pickles(result):
        sender.put((kind, key, result, None))
    else:
        sender.put((kind, key, None, pack_error(TypeError(f"the engine's answer ({type(result).__name__}) cannot be "
                                                          "sent to the server"))))


def _receive(conn, worker: EngineWorker, asks: concurrent.futures.Executor, grammars: GrammarSubmissions) -> None:
    """The server's messages, until ``stop`` or the pipe closes (main thread)."""
    sender = worker.sender
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            log.info("engine process: the server is gone; stopping")
            return
        for msg in batch:
            kind = msg[0]
            if kind == "submit":
                rid, prompt, adapter, sampling, watch, tenant, slo, n, spec = msg[1:]

                def accepted(result, error, rid=rid):
                    sender.put(("accepted", rid, None if error is None else pack_error(error)))
                sub = Submission(rid, prompt, adapter, sampling, watch, REMOTE, accepted, tenant, slo, n)
                if spec is None:
                    worker.queue_submission(sub)
                else:
                    grammars.submit(sub, spec)
            elif kind == "abort":
                if not grammars.abort(msg[1]):
                    worker.queue_abort(msg[1])
            elif kind == "call":
                _, cid, name, args = msg
                if name not in ENGINE_CALLS:
                    _reply(sender, "reply", cid, error=ValueError(f"unknown engine call {name!r}"))
                    continue
                method = getattr(worker.engine, name)
                worker.queue_call(Call(lambda m=method, a=args: m(*a),
                                       lambda result, error, cid=cid: _reply(sender, "reply", cid, result, error)))
            elif kind == "ask":
                _, cid, name, args = msg
                if name not in ASKS:
                    _reply(sender, "reply", cid, error=ValueError(f"unknown engine query {name!r}"))
                    continue
                asks.submit(_ask, sender, worker.engine, cid, name, args)
            elif kind == "end_all":
                worker.end_all(msg[1])
            elif kind == "stop":
                return


def _ask(sender: Sender, engine, cid: int, name: str, args: tuple) -> None:
    try:
        result = getattr(engine, name)(*args)
    except Exception as e:
        _reply(sender, "reply", cid, error=e)
    else:
        _reply(sender, "reply", cid, result)


def facts(engine) -> dict:
    """What the server needs to know of the engine without asking: its configs and adapters."""
    return {"cfg": engine.cfg, "ecfg": engine.ecfg, "adapters": list(engine.adapter_names()), "pid": os.getpid()}


def ignore_sigterm_while_parent_lives(parent: int) -> None:
    """SIGTERM does nothing while ``parent`` (the server) is still our parent: a SIGTERM to the process group
    (systemd's KillMode=control-group, ``kill -TERM -PGID``, ``tini -g``) must not kill the engine under the server's
    drain, which stops us itself. Once the server is gone (we were re-parented), SIGTERM kills as by default."""
    def on_sigterm(signum, frame) -> None:
        if os.getppid() == parent:
            log.warning("engine process: SIGTERM ignored; the server (pid %d) drains, then stops this process "
                        "(signal the server, or SIGKILL this process)", parent)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def run(conn, factory, factory_args: tuple, defer_hand_over: bool = False, log_level: str = "INFO") -> None:
    """The engine process: ``factory(*factory_args)`` -> (engine, info for the server), then serve the pipe."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    spawner = multiprocessing.parent_process()  # the server's pid as it started us, even if it is gone already
    parent = spawner.pid if spawner is not None else os.getppid()
    # a terminal's Ctrl-C reaches the whole process group: the server drains, then stops us. SIGTERM keeps its
    # default during start-up (the server has nothing to drain yet and dies of it too)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine, info = factory(*factory_args)
    except BaseException as e:  # noqa: BLE001 - tell the server why, whatever it was (SystemExit from flag checks)
        log.exception("engine process: start-up failed")
        try:
            conn.send([("failed", f"{type(e).__name__}: {e}")])
        finally:
            conn.close()
        os._exit(1)
    sender = Sender(conn)
    worker = EngineWorker(engine, sender, defer_hand_over=defer_hand_over)
    sender.status = worker.status
    watch = getattr(engine, "watch_adapters", None)
    if watch is not None:
        watch(lambda name, event, seconds: sender.put(("event", name, event, seconds)))
    sender.start()
    ignore_sigterm_while_parent_lives(parent)  # from now on the server can drain, then stop us
    sender.put(("ready", {**facts(engine), "info": copy.copy(info)}))
    worker.start()
    asks = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="slora-engine-ask")
    grammars = GrammarSubmissions(worker)
    try:
        _receive(conn, worker, asks, grammars)
    finally:
        grammars.close()
        worker.stop()  # open requests end (abort) and their last outputs are queued
        asks.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):  # its read workers and their transfer dir (os._exit runs no finalizer)
            engine.store.close(wait=False)
        sender.close()
        conn.close()
        logging.shutdown()
        os._exit(0)  # IO threads of the engine must not keep the process alive
