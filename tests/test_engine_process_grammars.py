"""The engine process compiles grammars off its main thread (``engine_process.GrammarSubmissions``): the main thread
receives every submit, abort and call, and a schema that took a second to compile there held up all of them.

What must hold: a submission with a grammar is queued once its grammar compiled, in a thread of its own; an abort
that arrives meanwhile is queued right after it (never before it, where the engine would drop it as unknown and
then run the request); a grammar that fails is answered with its error and queues nothing.
"""

from __future__ import annotations

import threading
import time

from slora_jax.serve.engine_loop import Submission
from slora_jax.serve.engine_process import GrammarSubmissions


class FakeWorker:
    """What GrammarSubmissions uses of an EngineWorker: compile (held at a gate), queue a submission or an abort."""

    def __init__(self):
        self.gate, self.queued, self.compiled_on = threading.Event(), [], []

    def grammar(self, spec):
        self.compiled_on.append(threading.current_thread().name)
        assert self.gate.wait(10)
        if spec == "bad":
            raise ValueError("the grammar does not compile")
        return ("compiled", spec)

    def queue_submission(self, sub):
        self.queued.append(("submit", sub.request_id, sub.grammar))

    def queue_abort(self, request_id):
        self.queued.append(("abort", request_id))


def submission(rid: str, replies: list, n: int = 1) -> Submission:
    return Submission(rid, [1, 2], None, None, False, None, lambda target, error: replies.append((rid, error)), n=n)


def wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_an_abort_while_compiling_follows_its_submission():
    worker, replies = FakeWorker(), []
    grammars = GrammarSubmissions(worker)
    try:
        grammars.submit(submission("a", replies), "spec-a")
        grammars.submit(submission("b", replies), "spec-b")
        assert grammars.abort("a") is True  # still compiling: kept, not queued
        assert grammars.abort("plain") is False  # not ours: the caller queues it at once
        assert worker.queued == []
        worker.gate.set()
        wait_for(lambda: len(worker.queued) == 3)
        assert worker.queued == [("submit", "a", ("compiled", "spec-a")), ("abort", "a"),
                                 ("submit", "b", ("compiled", "spec-b"))]
        assert grammars.abort("a") is False and grammars.abort("b") is False  # queued: aborts go the usual way
        assert replies == [] and set(worker.compiled_on) == {"slora-engine-grammar_0"}
    finally:
        grammars.close()


def test_a_grammar_that_fails_is_answered_and_queues_nothing():
    worker, replies = FakeWorker(), []
    worker.gate.set()
    grammars = GrammarSubmissions(worker)
    try:
        grammars.submit(submission("x", replies), "bad")
        grammars.abort("x")
        wait_for(lambda: replies)
        (rid, error), = replies
        assert rid == "x" and "does not compile" in str(error) and worker.queued == []
    finally:
        grammars.close()


def test_aborts_of_a_requests_samples_while_compiling_follow_it():
    """A request of n samples is aborted sample by sample (``rid#0``, ``rid#1``: the engine's ids); those that
    arrive while it compiles are each queued after the submission (they were queued before it, and lost)."""
    worker, replies = FakeWorker(), []
    grammars = GrammarSubmissions(worker)
    try:
        grammars.submit(submission("cmpl-x", replies, n=3), "spec")
        assert grammars.abort("cmpl-x#0") and grammars.abort("cmpl-x#2")
        assert worker.queued == []
        worker.gate.set()
        wait_for(lambda: len(worker.queued) == 3)
        assert worker.queued == [("submit", "cmpl-x", ("compiled", "spec")), ("abort", "cmpl-x#0"),
                                 ("abort", "cmpl-x#2")]
        assert not grammars.abort("cmpl-x#1")  # queued by now: its abort goes the usual way
    finally:
        grammars.close()
