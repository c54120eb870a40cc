"""The engine thread's deferred hand-off: a step's outputs reach the event loop while the next step runs on the device.

The server's engine thread ran at half speed beside the event loop because the loop streamed each step's tokens
while the engine thread scheduled and dispatched the next step, both wanting the GIL (issue 13). With
``defer_hand_over`` the outputs are handed over once the next step is queued (the thread then waits on the device
with the GIL released). Checked here on a pipelined stand-in engine that records which phase each hand-off lands in:
never during scheduling/dispatch, every token delivered in order, nothing held when work ends or when a step queues
nothing, aborts in order, and the runner restored at stop.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from test_stream_handoff import next_token

from slora_jax.engine.sampling import SamplingParams
from slora_jax.engine.sequence import RequestOutput
from slora_jax.serve.engine_thread import EngineThread, watch_dispatch


class _Runner:
    def __init__(self, engine):
        self.engine = engine

    def decode(self, *args, **kwargs):
        self.engine.phase = "queued"  # what the real runner returns after: the step is on the device
        return "ids"

    def prefill(self, *args, **kwargs):
        self.engine.phase = "queued"
        return "ids"


class _PipelinedEngine:
    """Like ``Engine.step``: schedule and dispatch step k (``runner.decode``), then read back and deliver step k-1's
    tokens. Every ``skip``-th step queues nothing (only reads back)."""

    def __init__(self, skip: int = 0, device_s: float = 0.0):
        self.device_s = device_s
        self.runner = _Runner(self)
        self.open: dict[str, list] = {}  # rid -> [max_tokens, given, on_output]
        self.inflight: list[str] | None = None
        self.phase = "idle"
        self.steps = 0
        self.skip = skip

    def add_request(self, prompt_ids, adapter=None, sampling=None, request_id=None, on_output=None, **_):
        self.open[request_id] = [sampling.max_tokens, 0, on_output]
        return request_id

    def has_unfinished(self):
        return bool(self.open) or bool(self.inflight)

    def abort(self, rid):
        r = self.open.pop(rid, None)
        if r is not None:
            r[2](RequestOutput(rid, [], True, "abort"))
        return r is not None

    def step(self):
        self.steps += 1
        self.phase = "host"  # scheduling and dispatching: the GIL-hungry part
        previous, self.inflight = self.inflight, None
        if self.open and not (self.skip and self.steps % self.skip == 0):
            plan = [rid for rid, r in self.open.items() if r[1] + (rid in (previous or ())) < r[0]]
            if plan:
                self.runner.decode(plan)
                self.inflight = plan
        time.sleep(self.device_s)  # waiting on the device: the GIL is free
        self.phase = "drain"  # the previous step's tokens read back: callbacks run
        outs = [next_token(self.open, rid) for rid in previous or () if rid in self.open]
        self.phase = "between"
        return outs

    def release(self, rid):
        pass


def _serve(engine, n, max_tokens, defer=True, abort_after=None):
    """Stream ``n`` requests through an EngineThread on ``engine``; (tokens per stream, finish reasons, the engine's
    phase at each hand-off callback with outputs)."""
    thread = EngineThread(engine, defer_hand_over=defer)
    phases = []

    async def main():
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def recording(cb, *args, **kw):
            if threading.current_thread() is thread._thread and args and isinstance(args[0], list):
                phases.append(engine.phase)
            return plain(cb, *args, **kw)

        loop.call_soon_threadsafe = recording
        with thread.hold():
            streams = await asyncio.gather(*(thread.submit([1, 2], None, SamplingParams(max_tokens=max_tokens[i]),
                                                           f"q{i}") for i in range(n)))

        async def read(i, s):
            toks, reason = [], None
            async for out in s:
                toks += out.new_token_ids
                reason = out.finish_reason
                if abort_after is not None and i == 0 and len(toks) == abort_after:
                    thread.abort(s.request_id)
            return toks, reason

        return await asyncio.wait_for(asyncio.gather(*(read(i, s) for i, s in enumerate(streams))), 60)

    thread.start()
    try:
        got = asyncio.run(main())
    finally:
        thread.stop()
    return [g[0] for g in got], [g[1] for g in got], phases


@pytest.mark.parametrize("skip", [0, 3])
def test_deferred_hand_off_lands_while_the_next_step_is_on_the_device(skip):
    rng = np.random.default_rng()
    n = int(rng.integers(5, 20))
    max_tokens = rng.integers(1, 15, n).tolist()
    engine = _PipelinedEngine(skip=skip)
    toks, reasons, phases = _serve(engine, n, max_tokens)
    assert toks == [list(range(1, m + 1)) for m in max_tokens]  # every token, in order, none held back at the end
    assert reasons == ["length"] * n
    assert phases and "host" not in phases and "drain" not in phases
    if not skip:
        # every hand-off but the last two (the last step queues nothing) goes out while a step is on the device
        assert phases.count("queued") >= max(max_tokens) - 2
    else:
        assert "between" in phases  # a step that queued nothing hands its outputs over after it, not later


def test_without_deferral_outputs_go_out_between_steps():
    """The control: the old hand-off lands after each step, just before the next one schedules."""
    rng = np.random.default_rng()
    n = int(rng.integers(3, 10))
    max_tokens = rng.integers(3, 10, n).tolist()
    toks, _, phases = _serve(_PipelinedEngine(), n, max_tokens, defer=False)
    assert toks == [list(range(1, m + 1)) for m in max_tokens]
    assert set(phases) == {"between"}


def test_an_abort_ends_its_stream_after_its_held_tokens():
    rng = np.random.default_rng()
    n, cut, m = int(rng.integers(2, 6)), int(rng.integers(1, 4)), 100
    toks, reasons, _ = _serve(_PipelinedEngine(device_s=0.002), n, [m] * n, abort_after=cut)
    assert reasons[0] == "abort" and reasons[1:] == ["length"] * (n - 1)
    assert toks[0] == list(range(1, len(toks[0]) + 1)) and cut <= len(toks[0]) < m  # in order, none after the end
    assert toks[1:] == [list(range(1, m + 1))] * (n - 1)


def test_the_runner_is_restored_at_stop_and_stand_ins_without_one_are_not_deferred():
    engine = _PipelinedEngine()
    plain = engine.runner.decode, engine.runner.prefill
    thread = EngineThread(engine, defer_hand_over=True).start()
    assert thread.defer_hand_over and engine.runner.decode is not plain[0]
    thread.stop()
    assert (engine.runner.decode, engine.runner.prefill) == plain

    class NoRunner:
        def has_unfinished(self):
            return False

    assert watch_dispatch(NoRunner(), lambda: None) is None
    assert not EngineThread(NoRunner(), defer_hand_over=True).defer_hand_over


def test_watch_dispatch_calls_back_after_each_queued_step_even_if_it_raises():
    engine = _PipelinedEngine()
    calls = []
    undo = watch_dispatch(engine, lambda: calls.append(engine.phase))
    engine.runner.decode([])
    engine.runner.prefill([])

    undo()
    assert engine.runner.decode == _Runner.decode.__get__(engine.runner)

    def boom(*a, **k):
        raise ValueError("bad input")

    engine.runner.decode = boom  # a refused step: the callback still runs (the outputs are not held forever)
    undo = watch_dispatch(engine, lambda: calls.append("after-error"))
    with pytest.raises(ValueError):
        engine.runner.decode([])
    undo()
    assert calls == ["queued", "queued", "after-error"]
    assert engine.runner.decode is boom


def test_deferral_is_off_by_default_and_the_cli_can_turn_it_on():
    from slora_jax.serve.cli import build_parser
    from slora_jax.serve.config import ServerConfig

    assert not ServerConfig(served_model_name="m").defer_hand_over
    assert not build_parser().parse_args(["--model", "x"]).defer_hand_over
    assert build_parser().parse_args(["--model", "x", "--defer-hand-over"]).defer_hand_over
    assert not build_parser().parse_args(["--model", "x", "--no-defer-hand-over"]).defer_hand_over
