"""Run the engine in its own thread; HTTP handlers talk to it through thread-safe queues.

The engine is not thread-safe and a step blocks for the duration of a device step, so it cannot run on the event
loop. Every touch of the engine (add, abort, adapter unregistration, stats) is queued here and done between steps by
the one engine thread (only what the engine documents as thread-safe, such as ``has_adapter`` and
``register_adapter``, is called from elsewhere). Outputs come back to each request's :class:`RequestStream` in one
``loop.call_soon_threadsafe`` per step (not one per token: at batch 256 the per-token hand-off was 256 wake-ups of
the event loop and 256 self-pipe writes per step, all under the GIL the step loop needs). With ``defer_hand_over``
(``--defer-hand-over``, off by default) that callback is sent once the next step is queued on the device, so the
loop streams a step's tokens while the engine thread waits on the device with the GIL released, not while it
schedules and dispatches (``watch_dispatch``). The thread steps while there is work and sleeps on a condition
variable when idle.
A step that raises fails only the requests that were in it (their clients get an error, not a hang) and the thread
keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..engine.forks import add_samples, sample_ids
from ..engine.sampling import SamplingParams
from ..engine.sequence import RequestOutput

log = logging.getLogger("slora_jax.serve")


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
    """The engine thread is not running (stopped, or its pool was lost after a failed step)."""


class RequestStream:
    """One request's outputs, in order, as the engine thread produces them; iterate until ``finished``. A request
    for ``samples`` samples gets the outputs of all its engine requests here (``RequestOutput.request_id`` tells
    them apart) and is finished when each has sent its last. Filled on the event loop (``put``, from the engine
    thread's per-step hand-off); ``take_ready`` hands over whatever arrived meanwhile, so a reader that fell behind
    catches up in one go."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, samples: int = 1):
        self.request_id = request_id
        self.loop = loop
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self.open = samples  # engine requests that have not sent their last output
        self.finished = False

    def put(self, out: RequestOutput) -> None:
        """Event-loop side: append and wake the reader."""
        self._items.append(out)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pop(self) -> RequestOutput:
        out = self._items.popleft()
        if out.finished:
            self.open -= 1
            self.finished = self.open <= 0
        return out

    async def get(self, timeout: float | None = None) -> RequestOutput:
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await (self._waiter if timeout is None else asyncio.wait_for(self._waiter, timeout))
            finally:
                self._waiter = None
        return self._pop()

    def take_ready(self) -> list[RequestOutput]:
        """The outputs that arrived and were not read yet (none once ``finished``), without waiting."""
        out = []
        while self._items and not self.finished:
            out.append(self._pop())
        return out

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """One step's outputs, handed to their streams on the event loop in one callback."""
    for stream, out in items:
        stream.put(out)


@dataclasses.dataclass
class _Submission:
    request_id: str
    prompt_ids: list[int]
    adapter: str | None
    sampling: SamplingParams
    watch_stop_strings: bool
    stream: RequestStream
    accepted: asyncio.Future
    tenant: str | None = None
    first_token_slo_s: float | None = None
    n: int = 1
    grammar: Any = None  # GrammarMatcher the output must match (structured output)


@dataclasses.dataclass
class _Call:
    fn: Callable[[], Any]
    done: asyncio.Future | None  # None: fire and forget


def _resolve(fut: asyncio.Future | None, result: Any = None, error: BaseException | None = None) -> None:
    """Complete an event-loop future from the engine thread (ignored if the waiter went away)."""
    if fut is None:
        return

    def settle() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    with contextlib.suppress(RuntimeError):
        fut.get_loop().call_soon_threadsafe(settle)


class EngineThread:
    """Owns the engine: ``submit`` / ``abort`` / ``call`` from the event loop, steps in a daemon thread."""

    def __init__(self, engine, name: str = "slora-engine", defer_hand_over: bool = False):
        self.engine = engine
        self._cv = threading.Condition()
        self._submits: list[_Submission] = []
        self._aborts: list[str] = []
        self._calls: list[_Call] = []
        self._streams: dict[str, RequestStream] = {}  # engine-thread only
        self._finished: list[str] = []  # engine-thread only: ids to release after the outputs went out
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # engine-thread only: outputs not yet handed over
        # engine-thread only: a step's outputs held until the next step is on the device (``device_busy``)
        self._deferred: dict[asyncio.AbstractEventLoop, list] = {}
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

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> EngineThread:
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
        return self.alive and self.consecutive_failures < 3

    def end_all(self, reason: str) -> None:
        """Refuse new requests from now on and end every open one (waiting or running) with ``reason``: each gets
        an "abort" output carrying it, so clients see an error rather than a cut (any thread; does not wait)."""
        with self._cv:
            self.closing = reason
            self._calls.append(_Call(lambda: self._end_open(reason), None))
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

    # ---------------------------------------------------------------- event-loop side
    async def submit(self, prompt_ids: list[int], adapter: str | None, sampling: SamplingParams,
                     request_id: str, watch_stop_strings: bool = True, tenant: str | None = None,
                     first_token_slo_s: float | None = None, n: int = 1,
                     grammar: Any = None) -> RequestStream:
        """Queue a request; returns its output stream once the engine accepted it. ``n`` > 1: as many samples
        (``engine.forks.add_samples``: engine request ids ``sample_ids(request_id, n)``), all on the one stream.

        Raises what ``Engine.add_request`` raises (ValueError, KeyError, QueueFull) or :class:`EngineUnavailable`.
        ``watch_stop_strings=False``: the caller detokenizes the outputs and aborts on a stop string itself.
        ``tenant`` and ``first_token_slo_s`` go to ``add_request`` as they are (None: the engine's defaults), and
        ``grammar`` (a compiled ``GrammarMatcher``: structured output).
        """
        if not self.alive or self.closing:
            raise EngineUnavailable(self.closing or self.fatal or "the engine is not running")
        loop = asyncio.get_running_loop()
        sub = _Submission(request_id, list(prompt_ids), adapter, sampling, watch_stop_strings,
                          RequestStream(request_id, loop, n), loop.create_future(), tenant, first_token_slo_s, n)
        sub.grammar = grammar
        with self._cv:
            self._submits.append(sub)
            self._cv.notify()
        try:
            await sub.accepted
        except asyncio.CancelledError:
            for rid in sample_ids(request_id, n):
                self.abort(rid)
            raise
        return sub.stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages (non-blocking; any thread)."""
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    async def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn()`` in the engine thread between steps and return its result (or raise its exception)."""
        if not self._thread.is_alive() or self._stopping:
            raise EngineUnavailable("the engine is not running")
        done = asyncio.get_running_loop().create_future()
        with self._cv:
            self._calls.append(_Call(fn, done))
            self._cv.notify()
        return await asyncio.wait_for(done, timeout)

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

    def _add(self, sub: _Submission) -> None:
        if self.fatal is not None or self.closing is not None:
            _resolve(sub.accepted, error=EngineUnavailable(self.closing or self.fatal))
            return
        try:
            ids = add_samples(self.engine, sub.n, sub.prompt_ids, sub.adapter, sub.sampling,
                              request_id=sub.request_id, on_output=self._on_output,
                              watch_stop_strings=sub.watch_stop_strings, tenant=sub.tenant,
                              first_token_slo_s=sub.first_token_slo_s, grammar=sub.grammar)
        except Exception as e:  # ValueError / KeyError / QueueFull go back to the handler as they are
            _resolve(sub.accepted, error=e)
            return
        for rid in ids:
            self._streams[rid] = sub.stream
        _resolve(sub.accepted, sub.stream)

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("abort of %s failed", request_id)
            self._deliver(RequestOutput(request_id, [], True, "abort"))

    def _run_call(self, call: _Call) -> None:
        try:
            result = call.fn()
        except Exception as e:
            self._hand_over()  # what the call delivered reaches its streams before the caller hears back
            _resolve(call.done, error=e)
        else:
            self._hand_over()
            _resolve(call.done, result)

    def _on_output(self, out: RequestOutput) -> None:
        """The engine's callback (engine thread): forward to the request's stream."""
        self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
            self._finished.append(out.request_id)
        self._outbox.setdefault(stream.loop, []).append((stream, out))

    def device_busy(self) -> None:
        """The engine thread's step is queued on the device and the thread is about to wait for the previous one's
        tokens (GIL released): hand over the held outputs now, so the event loop streams them while the engine
        thread holds no GIL instead of while it schedules and dispatches. Called on the engine thread, from the
        engine's dispatch listener (see ``defer_hand_over``)."""
        if self._deferred:
            self._hand_over()

    def _defer(self) -> None:
        """Hold this step's outputs (after any held before them: per-stream order is kept)."""
        for loop, items in self._outbox.items():
            self._deferred.setdefault(loop, []).extend(items)
        self._outbox = {}

    def _hand_over(self) -> None:
        """Send the held outputs and those gathered since: one callback per event loop (engine thread)."""
        self._defer()
        outbox, self._deferred = self._deferred, {}
        for loop, items in outbox.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
                loop.call_soon_threadsafe(_put_all, items)

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
        elif self.consecutive_failures >= 3:
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
            _resolve(sub.accepted, error=EngineUnavailable("the server is shutting down"))
        for call in calls:
            _resolve(call.done, error=EngineUnavailable("the server is shutting down"))
        for rid in list(self._streams):
            self._abort(rid)
        self._hand_over()
        self._release_finished()
        if self._unwatch is not None:
            self._unwatch()
