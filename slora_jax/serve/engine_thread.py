"""The engine in the server's process: its thread (``engine_loop.EngineLoop``) steps, HTTP handlers talk to it from
the event loop, and every step's outputs come back to each request's :class:`RequestStream` in one
``loop.call_soon_threadsafe`` per step (not one per token: at batch 256 the per-token hand-off was 256 wake-ups of the
event loop and 256 self-pipe writes per step, all under the GIL the step loop needs).

:class:`EngineHandle` is what the app uses of an engine, whichever process runs it: ``submit`` / ``abort`` /
``end_all``, health, and the named engine-thread operations (adapter unregister, pin, unpin, residency, stats) that
replace passing a function to the engine thread (a function cannot cross to the engine process,
``engine_client.EngineClient``). ``engine`` is the engine's thread-safe surface (``has_adapter``,
``register_adapter``, ``register_mix``, ``read_adapter``, ``check_prompt_length``, ``adapter_names``,
``watch_adapters``, ``cfg``, ``ecfg``, ``tokenizer``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable
from typing import Any

from ..engine.forks import sample_ids
from ..engine.sampling import SamplingParams
from ..engine.sequence import RequestOutput
from .engine_loop import Call, EngineLoop, EngineUnavailable, Submission, watch_dispatch

__all__ = ["ENGINE_CALLS", "EngineHandle", "EngineThread", "EngineUnavailable", "RequestStream", "post_by_loop",
           "put_all", "watch_dispatch"]

# The engine methods the app runs on the engine thread, by name (the engine process runs no other)
ENGINE_CALLS = ("unregister_adapter", "adapter_states", "pin_adapter", "unpin_adapter", "stats")


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

    @property
    def route(self) -> asyncio.AbstractEventLoop:
        """Outputs are handed over per event loop (``EngineLoop.send``)."""
        return self.loop

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


def put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """One step's outputs, handed to their streams on the event loop in one callback."""
    for stream, out in items:
        stream.put(out)


def post_by_loop(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """Hand outputs to their streams from any thread: one ``put_all`` callback per event loop; a closed loop has
    nobody listening and is skipped."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, out in items:
        by_loop.setdefault(stream.loop, []).append((stream, out))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(put_all, batch)


def _resolve(fut: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Complete an event-loop future from the engine thread (ignored if the waiter went away)."""
    def settle() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    with contextlib.suppress(RuntimeError):
        fut.get_loop().call_soon_threadsafe(settle)


class EngineHandle:
    """What the app uses of an engine (in this process: :class:`EngineThread`; in its own:
    ``engine_client.EngineClient``). Subclasses give ``submit``, ``abort``, ``end_all``, ``start``, ``stop``, the
    health attributes (``alive``, ``healthy``, ``steps``, ``step_failures``, ``last_error``, ``fatal``, ``closing``,
    ``defer_hand_over``), ``engine`` and :meth:`engine_call`."""

    engine: Any

    async def engine_call(self, name: str, args: tuple = (), timeout: float | None = None) -> Any:
        """``engine.<name>(*args)`` on the engine thread between steps (``name`` in :data:`ENGINE_CALLS`)."""
        raise NotImplementedError

    async def unregister_adapter(self, name: str, timeout: float | None = None) -> None:
        return await self.engine_call("unregister_adapter", (name,), timeout)

    async def adapter_states(self, tier: str | None = None, timeout: float | None = None) -> list[dict]:
        return await self.engine_call("adapter_states", (tier,), timeout)

    async def pin_adapter(self, name: str, timeout: float | None = None) -> dict:
        return await self.engine_call("pin_adapter", (name,), timeout)

    async def unpin_adapter(self, name: str, timeout: float | None = None) -> dict:
        return await self.engine_call("unpin_adapter", (name,), timeout)

    async def stats(self, timeout: float | None = None) -> dict:
        return await self.engine_call("stats", (), timeout)


class EngineThread(EngineLoop, EngineHandle):
    """The engine in this process: ``submit`` / ``abort`` / ``call`` from the event loop, steps in a daemon thread.
    With ``defer_hand_over`` (``--defer-hand-over``, off by default) a step's outputs reach the loop once the next
    step is queued on the device."""

    def __init__(self, engine, name: str = "slora-engine", defer_hand_over: bool = False):
        super().__init__(engine, name, defer_hand_over)

    def send(self, route: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, RequestOutput]]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            route.call_soon_threadsafe(put_all, items)

    async def submit(self, prompt_ids: list[int], adapter: str | None, sampling: SamplingParams,
                     request_id: str, watch_stop_strings: bool = True, tenant: str | None = None,
                     first_token_slo_s: float | None = None, n: int = 1, grammar: Any = None,
                     grammar_spec: Any = None) -> RequestStream:
        """Queue a request; returns its output stream once the engine accepted it. ``n`` > 1: as many samples
        (``engine.forks.add_samples``: engine request ids ``sample_ids(request_id, n)``), all on the one stream.

        Raises what ``Engine.add_request`` raises (ValueError, KeyError, QueueFull) or :class:`EngineUnavailable`.
        ``watch_stop_strings=False``: the caller detokenizes the outputs and aborts on a stop string itself.
        ``tenant`` and ``first_token_slo_s`` go to ``add_request`` as they are (None: the engine's defaults), and
        ``grammar`` (a compiled ``GrammarMatcher``: structured output; ``grammar_spec``, its ``GrammarSpec``, is for
        an engine in another process and unused here).
        """
        if not self.alive or self.closing:
            raise EngineUnavailable(self.closing or self.fatal or "the engine is not running")
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        stream = RequestStream(request_id, loop, n)
        self.queue_submission(Submission(request_id, list(prompt_ids), adapter, sampling, watch_stop_strings, stream,
                                         lambda result, error: _resolve(accepted, result, error), tenant,
                                         first_token_slo_s, n, grammar))
        try:
            await accepted
        except asyncio.CancelledError:
            for rid in sample_ids(request_id, n):
                self.abort(rid)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages (non-blocking; any thread)."""
        self.queue_abort(request_id)

    async def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn()`` in the engine thread between steps and return its result (or raise its exception)."""
        done = asyncio.get_running_loop().create_future()
        self.queue_call(Call(fn, lambda result, error: _resolve(done, result, error)))
        return await asyncio.wait_for(done, timeout)

    async def engine_call(self, name: str, args: tuple = (), timeout: float | None = None) -> Any:
        if name not in ENGINE_CALLS:
            raise ValueError(f"{name!r} is not an engine call the server makes")
        method = getattr(self.engine, name)
        return await self.call(lambda: method(*args), timeout)
