"""Request bodies are untrusted: a corpus of wrong types, out-of-range and extreme values for every field of
/v1/completions and /v1/chat/completions, plus bodies that are too large, too slow or not JSON at all.

Each refused case must get a 4xx whose JSON error says why (never a 500, never a hang); each accepted extreme (a top_k
beyond int32, a top_p that float32 flushes to 0, the largest seed) must be served, and where it means greedy, give
the greedy tokens. A fixed greedy probe request gives the same tokens before and after the corpus, so nothing in it
disturbed the engine. The server is tight on purpose: 64 KiB bodies, 4096-character prompts, 1 s to send headers
or a body.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from server_fixtures import BASE_NAME, start_server_with_options

from slora_jax.engine.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

MAX_BODY = 64 * 1024
MAX_CHARS = 4096
VOCAB = 512  # the tiny model's
CONTEXT = 256  # SMALL_ENGINE's max_model_len
TIMEOUT_S = 30
PROBE = {"model": "ad-000", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0,
         "return_token_ids": True}
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server_with_options(
        tmp_path_factory.mktemp("corpus"), dict(max_body_bytes=MAX_BODY, max_prompt_chars=MAX_CHARS,
                                                header_timeout_s=1.0, body_timeout_s=1.0), n_adapters=2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def probe_before(http):
    # the module's first generation compiles the engine's steps: on a GPU shared by the suite's 12 workers that took
    # over TIMEOUT_S (every test using this fixture then errored), so the first probe waits longer
    return probe(http, timeout=600)


def probe(http, timeout: float = TIMEOUT_S) -> list[int]:
    r = http.post("/v1/completions", json=PROBE, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def post(http, path: str, body) -> httpx.Response:
    """POST ``body`` as JSON the way a hostile client may: NaN, Infinity and lone surrogates included."""
    return http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def assert_refused(r: httpx.Response) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == r.status_code and err["message"].strip(), err
    return err


# ---------------------------------------------------------------- the corpus

COMPLETION = {"model": BASE_NAME, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": BASE_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
HUGE = [2**31, 2**63, 2**64, 10**30, 1e30, 1e308, INF]

COMMON_BAD = {
    "model": [None, 5, ["x"], "", "no-such-model", "m" * 2000, "\ud800"],
    "max_tokens": ["lots", [], {}, 0, -1, 1.5, -(2**63), *HUGE],
    "temperature": ["hot", [], -1, -1e-9, 100.5, 1e30, 1e308, NAN, INF, -INF, 2**1100],
    "top_p": ["x", {}, 0, -0.5, 1.0000001, 2, 1e30, NAN, INF, -INF],
    "top_k": ["x", [], -2, -(2**31), -(2**63), 1.5, 1e300, NAN, INF],
    "seed": ["x", -2, -(2**63), 1.5, 2**63, 2**64, 10**30, 1e30, NAN],  # -1 is vLLM's "no seed": taken
    "stop": [5, [5], [""], [None], {}, ["s"] * (MAX_STOP_STRINGS + 1), ["s" * (MAX_STOP_STRING_CHARS + 1)],
             "\ud800", ["a", "\udfff"]],
    "stop_token_ids": ["x", 5, [-1], [VOCAB], [2**31], [2**63], [10**30], [1.5], [None],
                       list(range(MAX_STOP_TOKEN_IDS + 1))],
    "ignore_eos": ["maybe", [], {}, 2],
    "n": [0, 17, -1, 2**63, "x", 1.5, [2]],
    "stream": ["maybe", 2, [], {}],
    "stream_options": ["x", 5, {"include_usage": "maybe"}],
    "presence_penalty": [2.5, -2.01, 1e30, "x", NAN],
    "frequency_penalty": [-3, 1e308, "x", INF],
    "repetition_penalty": [0, -1, 100.5, 1e308, "x", NAN, INF],
    "min_tokens": [-1, "x", 1.5, 3, 2**63, 10**30],  # 3: more than max_tokens
    # finite biases beyond +-100 are clamped, as vLLM does: taken, so not here
    "logit_bias": [{"1": INF}, {"1": -INF}, "x", {"1": "x"}, [1], {"x": 1}, {"-1": 1}, {"1.5": 1}, {"٣": 1},
                   {str(VOCAB): 1}, {str(2**40): 1}, {"1": NAN}, {str(i): 1 for i in range(301)}],
    "user": [5, ["x"], {}],
    "return_token_ids": ["maybe", [], 2],
    # structured output: wrong shapes, grammars that do not compile, several at once, lone surrogates
    "response_format": ["json", 5, [], {}, {"type": "xml"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"schema": 5}},
                        {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}],
    "guided_json": [5, [], "{", {"type": "objectx"}, {"$ref": "#"}, {"type": "string", "pattern": "(("},
                    {"type": "string", "pattern": "\ud800"}],
    "guided_regex": [5, [], "((", "\ud800", "a{2,1}"],
    "guided_choice": ["x", [], [5], [""], ["\ud800"], ["c"] * 2001],
    "guided_grammar": [5, "start: undefined_rule", "\ud800"],
    "structured_outputs": ["x", {}, {"regex": "a", "choice": ["b"]}, {"regex": "(("}, {"json": 5}],
}
COMPLETION_BAD = {
    "prompt": [None, 5, "", [], [[]], [""], [-1], [VOCAB], [2**31], [10**30], [1.5], ["a", "b"], [[1], [2]],
               {"a": 1}, "\ud800", ["ok", "\ud800"], "x" * (MAX_CHARS + 1), [1] * (CONTEXT + 1), [[1] * CONTEXT]],
    "logprobs": [21, "x", -1, 1.5, 2**63],
    "echo": ["x", [], 2],
    "suffix": ["x", 5],
    "best_of": [0, 17, -1, "x", 1.5, 2**63],  # below n (1), above 16
}
CHAT_BAD = {
    "messages": [None, "x", [], [5], [{}], [{"role": 5, "content": "x"}], [{"content": "x"}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": [5]}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
                 [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                 [{"role": "user", "content": "\ud800"}], [{"role": "\ud800", "content": "x"}],
                 [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
                 [{"role": "user", "content": "x" * (MAX_CHARS + 1)}],
                 [{"role": "user", "content": "x"}] * 300,  # tiny messages, but many: over the character limit
                 # within the character limit, beyond the context
                 [{"role": "user", "content": "The quick brown fox. " * 150}]],
    "max_completion_tokens": [0, -1, 2**63, 10**30, "x", 1.5, INF],
    "logprobs": ["x", 5, []],
    "top_logprobs": [5, "x", -1, 21, 1.5],  # without logprobs, or out of range
    "tools": [[{"type": "function", "function": {"name": "f"}}], "x"],
    "add_generation_prompt": ["maybe", []],
}


def _cases() -> list:
    cases = []
    endpoints = (("/v1/completions", COMPLETION, COMPLETION_BAD), ("/v1/chat/completions", CHAT, CHAT_BAD))
    for path, base, extra in endpoints:
        kind = "chat" if "chat" in path else "completion"
        for field, values in {**COMMON_BAD, **extra}.items():
            # max_completion_tokens is checked against max_tokens first: leave that out to reach its own checks
            body = {k: v for k, v in base.items() if field != "max_completion_tokens" or k != "max_tokens"}
            for i, value in enumerate(values):
                cases.append(pytest.param(path, {**body, field: value}, id=f"{kind}-{field}-{i}"))
                if field not in ("stream", "stream_options"):  # the same refusal when the client asked for a stream
                    cases.append(pytest.param(path, {**body, field: value, "stream": True},
                                              id=f"{kind}-{field}-{i}-stream"))
        without = {k: v for k, v in base.items() if k != "model"}
        cases.append(pytest.param(path, without, id=f"{kind}-no-model"))
    cases.append(pytest.param("/v1/chat/completions", {**CHAT, "max_tokens": 2, "max_completion_tokens": 3},
                              id="chat-max-tokens-disagree"))
    return cases


CASES = _cases()


@pytest.mark.parametrize("path, body", CASES)
def test_bad_field_is_refused_with_a_reason(http, probe_before, path, body):
    assert_refused(post(http, path, body))


@pytest.mark.parametrize("field, value", [("stop", ["s" * (MAX_STOP_STRING_CHARS + 1)]),
                                          ("stop", ["s"] * (MAX_STOP_STRINGS + 1)), ("temperature", 101),
                                          ("min_tokens", 3)])
def test_a_sampling_refusal_names_its_field(http, probe_before, field, value):
    """The sampler names the field it refuses; the error's param says which (the stop-string length once had none)."""
    err = assert_refused(post(http, "/v1/completions", {**COMPLETION, field: value}))
    assert err["param"] == field, err


RAW_BODIES = {
    "empty": b"",
    "truncated": b'{"model": "tiny-test", "prompt": ',
    "null": b"null",
    "array": b"[]",
    "string": b'"hello"',
    "number": b"5",
    "nan-literal": b'{"model": "tiny-test", "prompt": "x", "temperature": NaN}',
    "infinity-literal": b'{"model": "tiny-test", "prompt": "x", "top_p": -Infinity}',
    "huge-int-literal": b'{"model": "tiny-test", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}",
    "deep-nesting": b'{"model": "tiny-test", "prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}",
    "invalid-utf8": b'{"model": "tiny-test", "prompt": "\xff\xfe"}',
    "duplicate-keys": b'{"model": "tiny-test", "prompt": "x", "max_tokens": 2, "max_tokens": -1}',
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("name", sorted(RAW_BODIES))
def test_malformed_body_is_refused(http, probe_before, path, name):
    r = http.post(path, content=RAW_BODIES[name], headers={"Content-Type": "application/json"})
    assert_refused(r)


def test_json_sent_as_text_is_refused(http):
    r = http.post("/v1/completions", content=json.dumps(COMPLETION).encode(), headers={"Content-Type": "text/plain"})
    assert_refused(r)


# ---------------------------------------------------------------- extremes that are valid


@pytest.mark.parametrize("top_k", [2**31, 2**40, 2**63 - 1, 10**18])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_top_k_beyond_int32_is_off_not_a_crash(http, probe_before, path, top_k):
    """This value once overflowed the int32 sampler input and failed every running request of every adapter."""
    base = CHAT if "chat" in path else COMPLETION
    for stream in (False, True):
        r = post(http, path, {**base, "temperature": 1, "top_k": top_k, "seed": 3, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    greedy = post(http, "/v1/completions", {**PROBE, "top_k": top_k})
    assert greedy.json()["choices"][0]["token_ids"] == probe_before


@pytest.mark.parametrize("top_p", [1e-38, 1e-45, 5e-324])
def test_top_p_flushed_to_zero_in_float32_is_greedy(http, probe_before, top_p):
    for seed in (1, 2, 3):
        r = post(http, "/v1/completions", {**PROBE, "temperature": 1.0, "top_p": top_p, "seed": seed})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == probe_before


@pytest.mark.parametrize("extra", [
    {"seed": 2**63 - 1}, {"seed": 0}, {"temperature": 100}, {"temperature": 1e-300}, {"max_tokens": None},
    {"stop": ["s" * MAX_STOP_STRING_CHARS]}, {"stop": [f"zz{i}" for i in range(MAX_STOP_STRINGS)]},
    {"stop_token_ids": [VOCAB - 1]}, {"stop_token_ids": list(range(3, VOCAB))}, {"top_k": -1}, {"top_k": 0},
], ids=lambda e: next(iter(e)))
def test_extreme_but_valid_values_are_served(http, extra):
    assert post(http, "/v1/completions", {**COMPLETION, **extra}).status_code == 200


# ---------------------------------------------------------------- sizes and times


def test_body_over_the_limit_is_413_declared_or_streamed(http):
    big = {**COMPLETION, "prompt": "x" * (MAX_BODY + 10)}
    err = assert_refused(post(http, "/v1/completions", big))
    assert err["code"] == 413 and "too large" in err["message"]

    def chunks():  # no Content-Length: the limit is found while reading
        for _ in range(20):
            yield b"x" * 10_000

    err = assert_refused(http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}))
    assert err["code"] == 413
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200  # same client, connection reused


@pytest.mark.parametrize("method", ["GET", "DELETE", "OPTIONS"])
def test_a_body_on_any_method_is_bounded(http, method):
    """The limits hold for every method: the Ray ingress reads the body of any request it relays, and a GET with
    5 MB went through unbounded (the limits once covered POST, PUT and PATCH only)."""
    r = http.request(method, "/v1/models", content=b"x" * (MAX_BODY + 10))
    assert r.status_code == 413, r.text
    assert http.get("/v1/models").status_code == 200  # a GET without a body is as before


def _raw(port: int, payload: bytes, wait_s: float) -> tuple[bytes, float]:
    """Send ``payload`` and read until the server closes; (everything read, seconds until the close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(payload)
        t0, got = time.monotonic(), b""
        while chunk := s.recv(65536):
            got += chunk
        return got, time.monotonic() - t0


@pytest.mark.parametrize("payload", [
    b"",  # connects and says nothing
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # headers never finish (slowloris)
], ids=["silent", "slow-headers"])
def test_slow_headers_get_408_and_the_connection_closes(srv, payload):
    got, waited = _raw(srv.server.port, payload, wait_s=10)
    assert got.startswith(b"HTTP/1.1 408"), got
    assert 0.8 < waited < 5


def test_slow_body_gets_408(srv):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n")
    got, waited = _raw(srv.server.port, head + b'{"model": "tiny', wait_s=10)
    assert got.startswith(b"HTTP/1.1 408") and b"did not arrive" in got, got
    assert 0.8 < waited < 5


def test_tokenizing_happens_off_the_event_loop(srv, http):
    """A prompt that takes long to tokenize must not stall other clients (a 9.6 MB prompt once blocked every
    endpoint for 12.8 s): tokenization runs in worker threads while the loop answers /health."""
    builder = srv.server.ctx.requests
    real = builder.encode

    def slow_encode(*args, **kw):
        time.sleep(3.0)  # far longer than /health may take on CI's two loaded cores (below)
        return real(*args, **kw)

    builder.encode = slow_encode
    try:
        result = {}
        worker = threading.Thread(target=lambda: result.update(r=post(http, "/v1/completions", COMPLETION)))
        worker.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 1.5  # blocked behind the tokenizer it would take ~2.7 s
        worker.join(30)
    finally:
        del builder.encode
    assert result["r"].status_code == 200


def test_docs_stay_open_without_an_api_key(http):
    assert http.get("/openapi.json").status_code == 200


def test_probe_unchanged_after_the_corpus(http, probe_before, srv):
    """Last: nothing above disturbed the engine (same greedy tokens, every page back)."""
    assert probe(http) == probe_before
    stats = srv.wait_idle()
    assert stats["pool"]["pages_kv"] == 0
    assert srv.server.engine_thread.step_failures == 0
