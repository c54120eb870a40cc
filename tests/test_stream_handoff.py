"""The streaming path's cheap per-token pieces give what the plain ones gave, and a stream that fell behind catches up.

At batch 256 the event loop's per-token work held the GIL the engine's step loop needs (issue 13), so the hot path was
cut: one engine->loop hand-off per step, a per-request JSON template for plain chunks, the tokenizer backend's own
decode, and outputs that queued up joined into one chunk. Each is checked here against the plain construction
(``json.dumps`` of the envelope, ``tokenizer.decode``, the engine's greedy tokens) on fresh random inputs.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time

import httpx
import numpy as np
import pytest
from server_fixtures import start_server

from slora_jax.engine.sampling import SamplingParams
from slora_jax.engine.sequence import RequestOutput
from slora_jax.serve.choices import BackendDecoder
from slora_jax.serve.engine_thread import EngineThread
from slora_jax.serve.generation import merge_outputs
from slora_jax.serve.protocol import ChunkTemplate, chat_delta, completion_choice, envelope, json_line

ALPHABET = list("ab \"\\/\n\r\t\x00\x0b\x1c\x1f\x7f\x85") + ["\u00e9", "\u4e2d", "\U0001f600", "\u2028", "\u2029",
                                                             "</script>"]


def _random_text(rng, n: int) -> str:
    return "".join(ALPHABET[i] for i in rng.integers(0, len(ALPHABET), n))


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_chunk_template_writes_what_json_dumps_writes(kind):
    rng = np.random.default_rng()
    for _ in range(200):
        rid, model = f"id-{_random_text(rng, 6)}", _random_text(rng, int(rng.integers(0, 12)))
        created, index = int(rng.integers(0, 2**31)), int(rng.integers(0, 16))
        text = _random_text(rng, int(rng.integers(0, 20)))
        finish = [None, "length", "stop", "abort"][int(rng.integers(0, 4))]
        ids = [None, [], rng.integers(0, 32000, int(rng.integers(1, 6))).tolist()][int(rng.integers(0, 3))]
        if kind == "completion":
            choice = completion_choice(text, finish, ids)
        else:
            choice = chat_delta({"content": text} if text else {}, finish, ids)
        choice["index"] = index
        want = envelope(kind, rid, model, [choice], chunk=True, created=created)
        got = ChunkTemplate(kind, rid, model, created).event(index, text, finish, ids)
        assert got == f"data: {json_line(want)}\n\n"
        assert json.loads(got[6:]) == want
        assert got.splitlines() == [got[:-2], ""]  # one line to every reader, str.splitlines' too


def test_backend_decoder_decodes_as_the_tokenizer(tmp_path):
    from slora_jax.tools.tokenizer import load_tokenizer, write_tokenizer

    vocab = 300
    write_tokenizer(tmp_path, vocab)
    tok = load_tokenizer(tmp_path)
    dec = BackendDecoder.wrap(tok)
    assert isinstance(dec, BackendDecoder)
    rng = np.random.default_rng()
    for _ in range(100):
        ids = rng.integers(0, vocab, int(rng.integers(0, 12))).tolist()  # special ids (0-2) included
        for skip in (True, False):
            assert dec.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True  # its decode is more than the backend's: not wrapped
    assert BackendDecoder.wrap(cleaning) is cleaning


def test_merge_outputs_joins_each_request_in_order():
    rng = np.random.default_rng()
    rids = [f"r{i}" for i in range(int(rng.integers(2, 5)))]
    outs, want = [], {r: [] for r in rids}
    for _ in range(int(rng.integers(5, 30))):
        rid = rids[int(rng.integers(0, len(rids)))]
        ids = rng.integers(0, 1000, int(rng.integers(0, 3))).tolist()
        outs.append(RequestOutput(rid, ids, False, text="".join(map(str, ids))))
        want[rid] += ids
    last = outs[-1]
    outs[-1] = RequestOutput(last.request_id, last.new_token_ids, True, "length", text=last.text)
    merged = merge_outputs(outs)
    seen = [o.request_id for o in outs]
    assert [m.request_id for m in merged] == sorted(set(seen), key=seen.index)
    for m in merged:
        assert m.new_token_ids == want[m.request_id]
        assert m.text == "".join(map(str, want[m.request_id]))
        assert m.finished == (m.request_id == last.request_id)


def next_token(open_requests: dict[str, list], rid: str) -> RequestOutput:
    """One more token for an open request of a stand-in engine ([max_tokens, count, on_output]); it is closed (and
    dropped) at max_tokens. The output goes to the request's callback and is returned."""
    r = open_requests[rid]
    r[1] += 1
    out = RequestOutput(rid, [r[1]], r[1] >= r[0], "length" if r[1] >= r[0] else None)
    if out.finished:
        del open_requests[rid]
    r[2](out)
    return out


class _TokenEngine:
    """Engine stand-in: every step gives each open request one token, until its max_tokens."""

    def __init__(self):
        self.open: dict[str, list] = {}

    def add_request(self, prompt_ids, adapter=None, sampling=None, request_id=None, on_output=None, **_):
        self.open[request_id] = [sampling.max_tokens, 0, on_output]
        return request_id

    def has_unfinished(self):
        return bool(self.open)

    def step(self):
        return [next_token(self.open, rid) for rid in list(self.open)]

    def release(self, rid):
        pass


def test_engine_thread_hands_a_step_over_in_one_callback():
    """Many requests stepping together: their outputs reach the loop in about one callback per step, not one per
    output, and every stream still gets all its tokens in order."""
    rng = np.random.default_rng()
    n, steps = int(rng.integers(20, 40)), int(rng.integers(5, 12))
    thread = EngineThread(_TokenEngine())
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):
            calls.append(threading.current_thread() is thread._thread)
            return plain(cb, *args, **kw)

        loop.call_soon_threadsafe = counting
        with thread.hold():  # all accepted before the first step
            streams = await asyncio.gather(*(thread.submit([1, 2], None, SamplingParams(max_tokens=steps), f"q{i}")
                                             for i in range(n)))
            calls.clear()
        got = []
        for s in streams:
            got.append([t async for out in s for t in out.new_token_ids])
        return got

    thread.start()
    try:
        got = asyncio.run(main())
    finally:
        thread.stop()
    assert got == [list(range(1, steps + 1))] * n
    assert len(calls) <= steps + 2  # a callback per step (and a stray empty one at most), not n * steps


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("handoff"), n_adapters=2)
    yield server
    server.stop()


def _read_chunks(srv, body: dict, block_loop_s: float) -> list[dict]:
    """Stream ``body``; after the first chunk the server's event loop is blocked ``block_loop_s`` while the engine
    keeps stepping, so outputs queue up for the stream."""
    chunks = []
    with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 1:
                srv.server._uvicorn.loop.call_soon_threadsafe(time.sleep, block_loop_s)
    return chunks


@pytest.mark.parametrize("stop", [None, ["\u2603\u2603"]])
def test_a_stream_that_fell_behind_catches_up_with_the_same_tokens_and_text(srv, stop):
    rng = np.random.default_rng()
    prompt = rng.integers(3, 200, int(rng.integers(3, 12))).tolist()
    max_tokens, adapter = 24, srv.adapters[int(rng.integers(0, len(srv.adapters)))]
    want = srv.offline_generate([prompt], [adapter], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                    ignore_eos=True))[0]
    body = {"model": adapter, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    if stop:
        body["stop"] = stop  # a stop string no output has: outputs are kept apart, the chunks still catch up
    chunks = _read_chunks(srv, body, block_loop_s=1.0)
    with_choices = [c for c in chunks if c["choices"]]
    ids = [t for c in with_choices for t in c["choices"][0]["token_ids"]]
    assert ids == want
    assert "".join(c["choices"][0]["text"] for c in with_choices) == srv.tokenizer.decode(want,
                                                                                         skip_special_tokens=True)
    assert max(len(c["choices"][0]["token_ids"]) for c in with_choices) > 1  # the queued outputs came together
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
