"""Offline use of the engine from a script: run a batch of prompts to the end, or stream one request, driving
``Engine.step`` in the caller's thread (a server drives it from its engine thread instead)."""

from __future__ import annotations

from collections.abc import Iterator

from ..lora.peft import AdapterError
from .sampling import SamplingParams
from .sequence import RequestOutput


def generate(engine, prompts: list[list[int]], adapters: list[str | None] | None = None,
             sampling: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
    """Every prompt's generated token ids; a request that ended with an error raises its ``AdapterError``."""
    adapters = adapters or [None] * len(prompts)
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    ids = [engine.add_request(p, a, s) for p, a, s in zip(prompts, adapters, samplings, strict=True)]
    while engine.has_unfinished():
        engine.step()
    seqs = [engine.requests.pop(rid) for rid in ids]
    for seq in seqs:
        if seq.finish_reason == "error":
            raise AdapterError(seq.adapter or "?", seq.error or "failed")
    return [seq.output_ids for seq in seqs]


def stream(engine, prompt_ids: list[int], adapter: str | None = None,
           sampling: SamplingParams | None = None) -> Iterator[RequestOutput]:
    """One request's outputs as they come; a consumer that stops early aborts it (its pages and pin freed)."""
    got: list[RequestOutput] = []
    rid = engine.add_request(prompt_ids, adapter, sampling, on_output=got.append)
    finished = False
    try:
        while not finished:
            engine.step()
            while got and not finished:
                out = got.pop(0)
                finished = out.finished
                yield out
    finally:
        if not finished:
            engine.abort(rid)
        engine.requests.pop(rid, None)
