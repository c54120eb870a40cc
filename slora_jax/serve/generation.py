"""One accepted generation request between the engine thread and its HTTP response (JSON or server-sent events).

Text is made here from the token ids (``IncrementalDetokenizer``), off the engine thread, so characters split across
tokens and stop strings split across tokens come out right in streams too. This is the request's only detokenizer:
the engine is told not to watch stop strings (``watch_stop_strings=False``); when one matches here the request ends
with "stop" and is aborted in the engine, which frees its pages.

A request the engine ended with an error is answered by whose fault it was (``RequestOutput.error_kind``): the
request's own (a bad adapter, inputs that cannot be packed) 400; a first-token deadline it could not meet (early
abort) 503 ``deadline_exceeded``, so the client retries later or elsewhere; an adapter whose read failed in a way that
may pass (its files gone for now, a read that timed out: read again after ``AdapterError.retry_after_s``) 503;
anything else 500.

A request for ``n`` samples is ``n`` engine requests (one prefill, see ``engine.forks``) answered as ``n`` choices
(``choices.Choice``): the response lists them by index, a stream interleaves their chunks. If one fails, the request
fails (the others are aborted). Usage counts the prompt once and every choice's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.engine import QueueFull, RequestRejected
from ..engine.forks import sample_ids
from ..engine.sequence import RequestOutput
from ..lora.errors import RETRY_AFTER_S
from ..lora.peft import AdapterError
from .choices import BackendDecoder, Choice
from .engine_thread import EngineHandle, EngineUnavailable, RequestStream
from .logprob_format import ChoiceLogprobs, TokenTexts
from .metrics import ServerMetrics
from .protocol import (
    APIError,
    ChunkTemplate,
    chat_choice,
    chat_delta,
    completion_choice,
    envelope,
    json_line,
    new_id,
    usage,
)
from .request_builder import PreparedRequest

# RequestOutput.error_kind values: the request's own fault (400), and a first-token deadline missed (503)
CLIENT_FAULTS = ("adapter", "request")
DEADLINE = "deadline"
UNAVAILABLE = "adapter_unavailable"  # an adapter read failure that may pass (503: retry later)


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its generator, so a dropped client aborts its request at once."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Each engine request's outputs in ``outputs`` joined into one, in order of first appearance: their tokens and
    text in order, the last one's ending. For outputs without logprobs."""
    parts: dict[str, list[RequestOutput]] = {}
    for out in outputs:
        parts.setdefault(out.request_id, []).append(out)
    return [outs[0] if len(outs) == 1 else dataclasses.replace(
        outs[-1], new_token_ids=[t for o in outs for t in o.new_token_ids], text="".join(o.text for o in outs))
        for outs in parts.values()]


class Generation:
    """The state of one request's answer: its choices so far (text, tokens, how each ended) and latency metrics."""

    def __init__(self, prepared: PreparedRequest, rid: str, stream: RequestStream, engine_thread: EngineHandle,
                 metrics: ServerMetrics, arrival: float, tokenizer, adapter_label: str | None = None,
                 token_texts: TokenTexts | None = None, eos_ids: tuple[int, ...] = ()):
        """``eos_ids``: the model's EOS ids (their text is left out when one ends a choice)."""
        self.req, self.rid, self.stream = prepared, rid, stream
        self.adapter_label = adapter_label  # its label in the per-adapter series (None: the base model)
        # labels never move (metrics.AdapterLabels), so the series is looked up once, not once per token
        self._adapter_tokens = None if adapter_label is None else metrics.adapter_tokens.labels(adapter_label)
        self.engine_thread, self.metrics, self.arrival = engine_thread, metrics, arrival
        sp = prepared.sampling
        # decoded after the prompt's last ids (a SentencePiece decoder keeps the answer's leading space then)
        end_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else frozenset(eos_ids))
        self.choices = [Choice(i, sid, tokenizer, sp.stop, prepared.prompt_ids, sp.min_tokens, end_ids)
                        for i, sid in enumerate(sample_ids(rid, prepared.n))]
        self._by_request = {c.request_id: c for c in self.choices}
        asked = (sp.logprobs is not None and not prepared.rank_logprobs_only) or sp.prompt_logprobs is not None
        texts = token_texts or TokenTexts(tokenizer)
        # per choice index, when logprobs were asked for; and the choices whose echoed prompt is still to stream
        self.logprobs = {c.index: ChoiceLogprobs(prepared.kind, texts, prepared.prompt_ids)
                         for c in self.choices} if asked else {}
        self.echo_pending = {c.index for c in self.choices} if prepared.echo_text is not None else set()
        # completions choices whose first chunk is still to carry the prompt's ids (chat's role chunk carries them)
        ids_first = prepared.kind == "completion" and prepared.return_token_ids
        self.prompt_ids_pending = {c.index for c in self.choices} if ids_first else set()
        # outputs that queued up may be joined before they are read: not with stop strings (the tokens after a
        # match must be dropped one output at a time) nor logprobs (kept per output)
        self._mergeable = not sp.stop and not self.logprobs
        self.created = int(time.time())
        self.template = ChunkTemplate(prepared.kind, rid, prepared.model, self.created)
        self.first_token = False
        self.failed: Choice | None = None  # the first choice that ended in error or abort: the answer fails

    @property
    def done(self) -> bool:
        """Every choice is complete, or one failed (then the answer fails)."""
        return self.failed is not None or all(c.done for c in self.choices)

    def _record(self, out: RequestOutput) -> tuple[Choice, str]:
        """Account for one output; returns its choice and the text that may be sent now."""
        choice = self._by_request[out.request_id]
        if choice.done:  # ended by a stop string: tokens already on their way are dropped
            choice.ended |= out.finished
            return choice, ""
        now = time.monotonic()
        tokens = len(out.new_token_ids)
        if tokens:
            if not self.first_token:
                self.metrics.ttft.observe(now - self.arrival)
                self.first_token = True
            elif choice.last_token_time is not None:
                self.metrics.tpot.observe((now - choice.last_token_time) / tokens)
            choice.last_token_time = now
            self.metrics.generated_tokens.inc(tokens)
            if self._adapter_tokens is not None:
                self._adapter_tokens.inc(tokens)
        text, stopped = choice.add(out)
        if self.logprobs:
            self.logprobs[choice.index].add(out)
        if stopped:  # a stop string: end here and free the engine's pages now (the engine does not watch them)
            self.engine_thread.abort(choice.request_id)
        if choice.done:
            deadline = choice.finish_reason == "error" and choice.error_kind == DEADLINE
            self.metrics.finished.labels("deadline" if deadline else choice.finish_reason).inc()
            if not choice.ok and self.failed is None:
                self.failed = choice
            if self.done and self.failed is None:
                self.metrics.e2e.observe(now - self.arrival)
        return choice, text

    def _abort_if_open(self) -> None:
        for choice in self.choices:
            if not choice.ended:
                self.engine_thread.abort(choice.request_id)
            if not choice.done:  # the client went away first (or another choice failed)
                choice.done, choice.finish_reason = True, "abort"
                self.metrics.finished.labels("client_disconnect" if self.failed is None else "abort").inc()

    def _failure(self) -> APIError:
        choice = self.failed
        if choice is None:
            return APIError(503, "the request was aborted")
        if choice.finish_reason == "error":
            message = choice.error or "generation failed"
            if choice.error_kind == DEADLINE:
                return APIError(503, message, error_type="deadline_exceeded")
            if choice.error_kind == UNAVAILABLE:
                return APIError(503, message, retry_after_s=RETRY_AFTER_S)
            return APIError(400 if choice.error_kind in CLIENT_FAULTS else 500, message)
        return APIError(503, choice.error or f"the request was aborted ({choice.finish_reason})")  # shutting down

    def _ok(self) -> bool:
        return self.failed is None and self.done

    def _usage(self) -> dict:
        return usage(len(self.req.prompt_ids), sum(len(c.token_ids) for c in self.choices))

    # ---------------------------------------------------------------- whole response
    async def collect(self, request: Request) -> dict | None:
        """Wait for the end; None if the client went away (the request is then aborted)."""
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            while not self.done:
                getter = asyncio.ensure_future(self.stream.get())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return None
                self._record(getter.result())
        finally:
            watcher.cancel()
            self._abort_if_open()
        if not self._ok():
            raise self._failure()
        kept = self.choices
        if self.req.best_of_keep is not None:  # best_of: the samples whose generated tokens are most likely
            kept = sorted(kept, key=lambda c: c.cumulative_logprob, reverse=True)[:self.req.best_of_keep]
        return envelope(self.req.kind, self.rid, self.req.model, [self._choice(c, i) for i, c in enumerate(kept)],
                        chunk=False, created=self.created, usage=self._usage())

    def _choice(self, c: Choice, index: int) -> dict:
        with_ids = self.req.return_token_ids
        make_choice = completion_choice if self.req.kind == "completion" else chat_choice
        choice = make_choice((self.req.echo_text or "") + c.text, c.finish_reason, c.token_ids if with_ids else None)
        choice["index"] = index
        if self.logprobs:
            choice["logprobs"] = self.logprobs[c.index].whole()
        if with_ids:
            choice["prompt_token_ids"] = self.req.prompt_ids
        return choice

    # ---------------------------------------------------------------- server-sent events
    def _chunk(self, index: int, text: str, finish_reason: str | None, ids: list[int] | None,
               role: bool = False) -> str:
        ids = ids if self.req.return_token_ids else None
        if not (role or self.logprobs or index in self.echo_pending or index in self.prompt_ids_pending):
            # the plain chunk of nearly every token
            return self.template.event(index, text, finish_reason, ids)
        if index in self.echo_pending:  # the answer starts with the prompt
            self.echo_pending.discard(index)
            text = self.req.echo_text + text
        if self.req.kind == "completion":
            choice = completion_choice(text, finish_reason, ids)
        else:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            choice = chat_delta(delta, finish_reason, ids)
        choice["index"] = index
        if self.logprobs and not role:
            choice["logprobs"] = self.logprobs[index].take()
        if (role or index in self.prompt_ids_pending) and self.req.return_token_ids:
            self.prompt_ids_pending.discard(index)
            choice["prompt_token_ids"] = self.req.prompt_ids
        body = envelope(self.req.kind, self.rid, self.req.model, [choice], chunk=True, created=self.created)
        return f"data: {json_line(body)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        try:
            if self.req.kind == "chat":
                for c in self.choices:
                    yield self._chunk(c.index, "", None, None, role=True)
            async for first in self.stream:
                # the outputs that arrived while this request waited for the loop go out together: one event per
                # choice, so a loop that fell behind catches up instead of falling further behind
                gathered: dict[int, tuple[list[str], list[int]]] = {}
                batch = [first, *self.stream.take_ready()]
                if len(batch) > 1 and self._mergeable:  # detokenized and counted once per chunk, not per token
                    batch = merge_outputs(batch)
                for out in batch:
                    was_done = self._by_request[out.request_id].done
                    c, text = self._record(out)
                    if was_done:
                        continue
                    texts, ids = gathered.setdefault(c.index, ([], []))
                    texts.append(text)
                    ids.extend(out.new_token_ids)
                    if self.failed is not None or self.done:
                        break
                for index, (texts, ids) in gathered.items():
                    c, text = self.choices[index], "".join(texts)
                    if c is self.failed:
                        if ids or text:
                            yield self._chunk(index, text, None, ids)
                        continue
                    fresh = index in self.echo_pending or (self.logprobs and self.logprobs[index].pending())
                    if text or c.done or fresh or (self.req.return_token_ids and ids):
                        yield self._chunk(index, text, c.finish_reason, ids)
                if self.failed is not None:
                    yield f"data: {json.dumps(self._failure().body())}\n\n"
                    break
                if self.done:
                    break
            if self.req.include_usage:
                body = envelope(self.req.kind, self.rid, self.req.model, [], chunk=True, created=self.created,
                                usage=self._usage())
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self._abort_if_open()


class GenerationRunner:
    """Submits prepared requests to the engine thread and answers them, streamed or whole."""

    def __init__(self, engine_thread: EngineHandle, metrics: ServerMetrics, tokenizer):
        self.engine_thread, self.metrics = engine_thread, metrics
        self.tokenizer = BackendDecoder.wrap(tokenizer)  # what the choices decode with: once per token
        self.token_texts = TokenTexts(tokenizer)  # token id -> text, for logprobs
        cfg = getattr(getattr(engine_thread, "engine", None), "cfg", None)
        self.eos_ids = tuple(cfg.eos_token_id) if cfg is not None else ()

    async def start(self, prepared: PreparedRequest, arrival: float) -> Generation:
        """Queue the request in the engine; the engine's refusals become API errors naming the field to blame."""
        rid = new_id("cmpl" if prepared.kind == "completion" else "chatcmpl")
        # labelled before the engine sees it: the pool load its arrival may start is then counted under that label
        label = None if prepared.adapter is None else self.metrics.adapter_labels.grant(prepared.adapter)
        try:
            stream = await self.engine_thread.submit(prepared.prompt_ids, prepared.adapter, prepared.sampling, rid,
                                                     watch_stop_strings=False, tenant=prepared.tenant,
                                                     first_token_slo_s=prepared.first_token_slo_s, n=prepared.n,
                                                     grammar=prepared.grammar, grammar_spec=prepared.grammar_spec)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}") from None
        except KeyError as e:
            raise APIError(404, str(e.args[0]) if e.args else "unknown adapter", "model") from None
        except AdapterError as e:
            raise APIError.of_adapter(e, 400, "model") from None
        except RequestRejected as e:
            raise APIError(400, str(e), e.param) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except EngineUnavailable as e:
            raise APIError(503, str(e)) from None
        self.metrics.prompt_tokens.inc(len(prepared.prompt_ids))
        if label is not None:
            self.metrics.adapter_requests.labels(label).inc()
        return Generation(prepared, rid, stream, self.engine_thread, self.metrics, arrival, self.tokenizer, label,
                          self.token_texts, self.eos_ids)

    async def respond(self, prepared: PreparedRequest, arrival: float, request: Request) -> Response:
        gen = await self.start(prepared, arrival)
        if prepared.stream:
            return SSEResponse(gen.events(), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        body = await gen.collect(request)
        if body is None:  # the client is gone; nobody will read this
            return Response(status_code=499)
        return JSONResponse(body)
