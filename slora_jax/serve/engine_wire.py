"""What crosses the pipe between the server process and its engine process (``engine_process``,
``engine_client``): messages are plain tuples, pickled in batches (one ``Connection.send`` per step, not per token).

A step's outputs travel as tuples, not ``RequestOutput`` objects: most are ``(request id, token ids)`` (a token of a
request that goes on), the rest carry the whole output with logprobs as ``(token id, logprob, top)`` tuples. An
exception crosses as (class, args, attributes) and is rebuilt without calling its ``__init__`` (``AdapterError``'s
takes other arguments than its ``args``), so the server maps it to the same HTTP answer as in one process.

Server -> engine: ``("submit", rid, prompt_ids, adapter, sampling, watch_stop_strings, tenant, first_token_slo_s, n,
grammar_spec)``, ``("abort", rid)``, ``("call", cid, name, args)`` (an engine-thread call, ``ENGINE_CALLS``),
``("ask", cid, name, args)`` (a thread-safe engine query, :data:`ASKS`), ``("end_all", reason)``, ``("stop",)``.
Engine -> server: ``("ready", facts)`` or ``("failed", reason)`` once; then ``("out", outputs)``,
``("accepted", rid, error)``, ``("reply", cid, result, error)``, ``("event", adapter, event, seconds)`` (adapter
pool loads, evictions, reads: the server's metrics) and ``("status", steps, step_failures, consecutive_failures,
last_error, fatal)``.
"""

from __future__ import annotations

import pickle
from typing import Any

from ..engine.logprobs import TokenLogprob
from ..engine.sequence import RequestOutput

# The engine's thread-safe methods the server calls (off the engine thread, in the engine process's ask threads)
ASKS = ("has_adapter", "register_adapter", "register_mix", "read_adapter")


def _pack_logprob(lp: TokenLogprob | None):
    return None if lp is None else (lp.token_id, lp.logprob, lp.top)


def _unpack_logprob(t) -> TokenLogprob | None:
    return None if t is None else TokenLogprob(t[0], t[1], t[2])


def pack_output(out: RequestOutput) -> tuple:
    """``out`` as a tuple: ``(rid, ids)`` for a plain token, else every field."""
    if not (out.finished or out.text or out.logprobs or out.prompt_logprobs or out.error or out.finish_reason):
        return out.request_id, out.new_token_ids
    logprobs = None if out.logprobs is None else [_pack_logprob(lp) for lp in out.logprobs]
    prompt = None if out.prompt_logprobs is None else [_pack_logprob(lp) for lp in out.prompt_logprobs]
    return (out.request_id, out.new_token_ids, out.finished, out.finish_reason, out.error, out.text, out.error_kind,
            logprobs, prompt)


def unpack_output(t: tuple) -> RequestOutput:
    if len(t) == 2:
        return RequestOutput(t[0], t[1], False)
    rid, ids, finished, reason, error, text, kind, logprobs, prompt = t
    return RequestOutput(rid, ids, finished, reason, error, text, kind,
                         None if logprobs is None else [_unpack_logprob(x) for x in logprobs],
                         None if prompt is None else [_unpack_logprob(x) for x in prompt])


def pack_error(e: BaseException) -> tuple:
    """``e`` as (class, args, attributes), checked to pickle; else a RuntimeError with its text."""
    packed = (type(e), e.args, dict(getattr(e, "__dict__", {})))
    try:
        pickle.loads(pickle.dumps(packed))
    except Exception:
        packed = (RuntimeError, (f"{type(e).__name__}: {e}",), {})
    return packed


def unpack_error(packed: tuple) -> BaseException:
    cls, args, attrs = packed
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(attrs)
    return e


def pickles(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True
