"""The engine-thread half of serving: the one thread that touches the engine, fed by queues, stepping while there is
work. Two front ends feed it: :class:`~slora_jax.serve.engine_thread.EngineThread` (the engine in the server's
process; outputs go to the event loop) and the engine process's worker (``engine_process``; outputs go down a pipe).
A front end supplies what a request's outputs are delivered to (a *target*: anything with a hashable ``route``) and
how one step's outputs leave (:meth:`EngineLoop.send`).

Every touch of the engine (add, abort, named calls) is queued and done between steps by this thread. A step's outputs
are handed over in one :meth:`send` per route (not one per token). With ``defer_hand_over`` they are sent once the
next step is queued on the device (``watch_dispatch``), so the receiver works while this thread waits on the device
with the GIL released. A step that raises fails only the requests that were in it and the thread keeps serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..engine.forks import add_samples
from ..engine.sampling import SamplingParams
from ..engine.sequence import RequestOutput

log = logging.getLogger("slora_jax.serve")

# Steps failing in a row after which the engine counts as unhealthy and every open request is ended.
FAILING_STEPS = 3

Reply = Callable[[Any, BaseException | None], None]  # reply(result, error): a submission's or a call's answer


def watch_dispatch(engine, callback: Callable[[], None]) -> Callable[[], None] | None:
    """Call ``callback()`` (engine thread) each time ``engine.step`` has queued a step on the device, just before it
    waits for the previous step's tokens; returns the function that undoes it, or None if the engine has no step
    runner to watch (a stand-in engine). The engine offers no such hook, so the runner's two public step calls are
    wrapped on this engine object."""
    runner = getattr(engine, "runner", None)
    names = ("decode", "prefill")
    if runner is None or not all(callable(getattr(runner, n, None)) for n in names):
        return None
    plain = {n: getattr(runner, n) for n in names}

    def queued_then(queue):
        def call(*args, **kwargs):
            try:
                return queue(*args, **kwargs)
            finally:
                callback()
        return call

    for n in names:
        setattr(runner, n, queued_then(plain[n]))

    def undo() -> None:
        for n in names:
            setattr(runner, n, plain[n])
    return undo


class EngineUnavailable(RuntimeError):
    """The engine is not running (stopped, its pool lost after a failed step, or its process gone)."""


@dataclasses.dataclass
class Submission:
    request_id: str
    prompt_ids: list[int]
    adapter: str | None
    sampling: SamplingParams
    watch_stop_strings: bool
    target: Any  # what its outputs are delivered to (``target.route`` groups a step's outputs)
    reply: Reply  # reply(target, None) once accepted, reply(None, error) if refused
    tenant: str | None = None
    first_token_slo_s: float | None = None
    n: int = 1
    grammar: Any = None  # GrammarMatcher the output must match (structured output)


@dataclasses.dataclass
class Call:
    fn: Callable[[], Any]
    reply: Reply | None  # None: fire and forget


class EngineLoop:
    """Owns the engine: queue with :meth:`queue_submission` / :meth:`queue_abort` / :meth:`queue_call` (any
    thread), steps in a daemon thread (:meth:`start`), hands outputs over with :meth:`send` (subclasses)."""

    def __init__(self, engine, name: str = "slora-engine", defer_hand_over: bool = False):
        self.engine = engine
        self._cv = threading.Condition()
        self._submits: list[Submission] = []
        self._aborts: list[str] = []
        self._calls: list[Call] = []
        self._streams: dict[str, Any] = {}  # engine-thread only: request id -> target
        self._finished: list[str] = []  # engine-thread only: ids to release after the outputs went out
        self._outbox: dict[Any, list] = {}  # engine-thread only: outputs not yet handed over, by route
        # engine-thread only: a step's outputs held until the next step is on the device (``device_busy``)
        self._deferred: dict[Any, list] = {}
        self._unwatch = watch_dispatch(engine, self.device_busy) if defer_hand_over else None
        self.defer_hand_over = self._unwatch is not None
        self._stopping = False
        self._held = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0
        self.step_failures = 0
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.fatal: str | None = None
        self.closing: str | None = None  # set by end_all: why new requests are refused
        self._idle_steps = 0

    # ---------------------------------------------------------------- what a front end implements
    def send(self, route: Any, items: list[tuple[Any, RequestOutput]]) -> None:
        """Hand one step's outputs for ``route`` over (engine thread; must not block on the receiver)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- lifecycle
    def start(self):
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.fatal is None

    @property
    def healthy(self) -> bool:
        """Alive and not failing step after step."""
        return self.alive and self.consecutive_failures < FAILING_STEPS

    def end_all(self, reason: str) -> None:
        """Refuse new requests from now on and end every open one (waiting or running) with ``reason``: each gets
        an "abort" output carrying it, so clients see an error rather than a cut (any thread; does not wait)."""
        with self._cv:
            self.closing = reason
            self._calls.append(Call(lambda: self._end_open(reason), None))
            self._cv.notify()

    @contextlib.contextmanager
    def hold(self):
        """Queue requests but take no step while inside (maintenance; tests use it to fill the waiting queue)."""
        with self._cv:
            self._held += 1
        try:
            yield
        finally:
            with self._cv:
                self._held -= 1
                self._cv.notify_all()

    # ---------------------------------------------------------------- queues (any thread)
    def queue_submission(self, sub: Submission) -> None:
        with self._cv:
            self._submits.append(sub)
            self._cv.notify()

    def queue_abort(self, request_id: str) -> None:
        """Stop a request and free its pages (non-blocking; any thread)."""
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def queue_call(self, call: Call) -> None:
        if not self._thread.is_alive() or self._stopping:
            raise EngineUnavailable("the engine is not running")
        with self._cv:
            self._calls.append(call)
            self._cv.notify()

    # ---------------------------------------------------------------- engine-thread side
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._submits or self._aborts or self._calls
                           or (not self._held and self._has_work())):
                    self._cv.wait()
                if self._stopping:
                    break
                submits, self._submits = self._submits, []
                aborts, self._aborts = self._aborts, []
                calls, self._calls = self._calls, []
                held = self._held > 0
            for sub in submits:
                self._add(sub)
            for rid in aborts:
                self._abort(rid)
            for call in calls:
                self._run_call(call)
            if self._outbox or not self.defer_hand_over:
                self._hand_over()  # aborts' last outputs go before the step's wait
            if not held and self._has_work():
                self._step()
            if self.defer_hand_over and not self._deferred and self._has_work():
                self._defer()  # handed over once the next step is queued (device_busy), else after it
            else:
                self._hand_over()
            self._release_finished()
        self._shutdown()

    def _has_work(self) -> bool:
        try:
            return self.fatal is None and self.engine.has_unfinished()
        except Exception:  # never let a bookkeeping bug stop the thread
            log.exception("engine.has_unfinished failed")
            return False

    def _add(self, sub: Submission) -> None:
        if self.fatal is not None or self.closing is not None:
            sub.reply(None, EngineUnavailable(self.closing or self.fatal))
            return
        try:
            ids = add_samples(self.engine, sub.n, sub.prompt_ids, sub.adapter, sub.sampling,
                              request_id=sub.request_id, on_output=self._deliver,
                              watch_stop_strings=sub.watch_stop_strings, tenant=sub.tenant,
                              first_token_slo_s=sub.first_token_slo_s, grammar=sub.grammar)
        except Exception as e:  # ValueError / KeyError / QueueFull go back to the caller as they are
            sub.reply(None, e)
            return
        for rid in ids:
            self._streams[rid] = sub.target
        sub.reply(sub.target, None)

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("abort of %s failed", request_id)
            self._deliver(RequestOutput(request_id, [], True, "abort"))

    def _run_call(self, call: Call) -> None:
        try:
            result = call.fn()
        except Exception as e:
            self._hand_over()  # what the call delivered reaches its streams before the caller hears back
            if call.reply is not None:
                call.reply(None, e)
        else:
            self._hand_over()
            if call.reply is not None:
                call.reply(result, None)

    def _deliver(self, out: RequestOutput) -> None:
        """The engine's output callback (engine thread): to the request's target, with the step's others."""
        target = self._streams.get(out.request_id)
        if target is None:
            return
        if out.finished:
            del self._streams[out.request_id]
            self._finished.append(out.request_id)
        self._outbox.setdefault(target.route, []).append((target, out))

    def device_busy(self) -> None:
        """The engine thread's step is queued on the device and the thread is about to wait for the previous one's
        tokens (GIL released): hand over the held outputs now, so the receiver works while the engine thread holds
        no GIL instead of while it schedules and dispatches (see ``defer_hand_over``)."""
        if self._deferred:
            self._hand_over()

    def _defer(self) -> None:
        """Hold this step's outputs (after any held before them: per-stream order is kept)."""
        for route, items in self._outbox.items():
            self._deferred.setdefault(route, []).extend(items)
        self._outbox = {}

    def _hand_over(self) -> None:
        """Send the held outputs and those gathered since: one :meth:`send` per route (engine thread)."""
        self._defer()
        outbox, self._deferred = self._deferred, {}
        for route, items in outbox.items():
            self.send(route, items)

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._step_failed(e)
            return
        self.steps += 1
        self.consecutive_failures = 0
        if not outputs:  # work is queued but none could be scheduled: wait a little instead of spinning
            self._idle_steps = min(self._idle_steps + 1, 6)
            self._hand_over()  # nothing held while it waits
            with self._cv:
                self._cv.wait(0.001 * 2 ** self._idle_steps)
        else:
            self._idle_steps = 0
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d took %.1f ms", self.steps, 1e3 * (time.monotonic() - t0))

    def _step_failed(self, e: Exception) -> None:
        """Fail the requests of the failed step with the reason; keep the others and keep serving."""
        self.step_failures += 1
        self.consecutive_failures += 1
        self.last_error = f"{type(e).__name__}: {e}"
        log.exception("engine step failed (%d in a row)", self.consecutive_failures)
        for rid in self._ask_engine("running_request_ids", []):
            self._deliver(RequestOutput(rid, [], True, "error", error=f"engine step failed: {self.last_error}"))
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
        if self._ask_engine("pool_lost", False):
            # the step had the pool donated and died: the KV cache and resident adapters are gone for good
            self.fatal = f"the engine lost its pool after a failed step ({self.last_error}); restart the server"
            log.error(self.fatal)
            self._fail_all(self.fatal)
        elif self.consecutive_failures >= FAILING_STEPS:
            # failing before anything runs (e.g. while admitting a waiting request): end every open request so none
            # waits forever; new requests still get their chance
            self._fail_all(f"engine steps keep failing: {self.last_error}")
        time.sleep(min(0.01 * 2 ** self.consecutive_failures, 1.0))  # no hot loop of failing steps

    def _ask_engine(self, question: str, default: Any) -> Any:
        """The engine's answer to ``question`` (a method name of its server interface), or ``default`` if asking
        raised: a failed step must not also stop the thread."""
        try:
            return getattr(self.engine, question)()
        except Exception:
            log.exception("engine.%s() failed after a failed step", question)
            return default

    def _fail_all(self, reason: str) -> None:
        for rid in list(self._streams):
            self._deliver(RequestOutput(rid, [], True, "error", error=reason))
            with contextlib.suppress(Exception):
                self.engine.abort(rid)

    def _end_open(self, reason: str) -> None:
        for rid in list(self._streams):
            self._deliver(RequestOutput(rid, [], True, "abort", error=reason))
            with contextlib.suppress(Exception):
                self.engine.abort(rid)

    def _release_finished(self) -> None:
        finished, self._finished = self._finished, []
        for rid in finished:
            with contextlib.suppress(Exception):
                self.engine.release(rid)

    def _shutdown(self) -> None:
        """Stopping: tell every open request and every waiting call, so no client hangs."""
        with self._cv:
            submits, self._submits = self._submits, []
            calls, self._calls = self._calls, []
        for sub in submits:
            sub.reply(None, EngineUnavailable("the server is shutting down"))
        for call in calls:
            if call.reply is not None:
                call.reply(None, EngineUnavailable("the server is shutting down"))
        for rid in list(self._streams):
            self._abort(rid)
        self._hand_over()
        self._release_finished()
        if self._unwatch is not None:
            self._unwatch()
