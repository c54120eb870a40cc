"""The HTTP server through the real ``openai`` client: completions, chat, streaming, many adapters at once.

Greedy outputs must equal ``Engine.generate`` on the same engine for the same prompts: the server adds transport,
never a different answer. Token ids come back through vLLM's ``return_token_ids`` extension, so the comparison is
exact, and the text must be what those ids add to the prompt's decoding.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest
from server_fixtures import BASE_NAME, start_server

from slora_jax.engine.detok import MAX_PENDING, IncrementalDetokenizer
from slora_jax.engine.sampling import SamplingParams
from slora_jax.serve.protocol import VLLM_UNIMPLEMENTED

N_ADAPTERS = 12  # more than max_loras=8: adapters are evicted and reloaded while serving
MAX_TOKENS = 8
PROMPTS = ["Hello, how are you today?", "Once upon a time there was", "The quick brown fox", "Numbers: one two",
           "Please summarise the following text", "What is the weather like", "A language model predicts"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("server"), n_adapters=N_ADAPTERS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient_factory(srv):
    return lambda: openai.AsyncOpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def _models(i: int, srv) -> str:
    """Request i's model: the base model for every 5th, else an adapter (cycling through all of them)."""
    return BASE_NAME if i % 5 == 0 else srv.adapters[i % len(srv.adapters)]


def _greedy_reference(srv, prompts_ids: list[list[int]], models: list[str]) -> list[list[int]]:
    adapters = [None if m == BASE_NAME else m for m in models]
    return srv.offline_generate(prompts_ids, adapters, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))


def continuation(tok, prompt_ids: list[int], ids: list[int]) -> str:
    """The text ``ids`` add to the prompt's (vLLM's answer text: a SentencePiece decoder would strip the leading
    space of ``ids`` decoded alone; for this byte-level tokenizer both are the same)."""
    prompt = tok.decode(prompt_ids, skip_special_tokens=True)
    return tok.decode(prompt_ids + ids, skip_special_tokens=True)[len(prompt):]


def test_models_lists_base_and_adapters(client, srv):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == BASE_NAME
    assert sorted(ids[1:]) == sorted(srv.adapters)


def test_health(srv):
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_greedy_matches_offline(client, srv):
    tok = srv.tokenizer
    models = [_models(i, srv) for i in range(len(PROMPTS))]
    expected = _greedy_reference(srv, [tok.encode(p) for p in PROMPTS], models)
    for prompt, model, want in zip(PROMPTS, models, expected, strict=True):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == want, model
        assert choice.text == continuation(tok, tok.encode(prompt), want)
        assert choice.finish_reason in ("length", "stop")
        assert r.usage.prompt_tokens == len(tok.encode(prompt)) and r.usage.completion_tokens == len(want)
        assert r.model == model


def test_completion_token_id_prompt(client, srv):
    ids = srv.tokenizer.encode("Hello there")
    (want,) = _greedy_reference(srv, [ids], [srv.adapters[1]])
    r = client.completions.create(model=srv.adapters[1], prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want


def test_chat_greedy_matches_offline(client, srv):
    tok = srv.tokenizer
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is two plus two?"}]
    prompt_ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    assert prompt_ids[0] == 1 and prompt_ids.count(1) == 1  # the template writes <s> once; encode adds none
    for model in (BASE_NAME, srv.adapters[2]):
        (want,) = _greedy_reference(srv, [prompt_ids], [model])
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == want
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(prompt_ids)


def test_completion_stream_equals_non_stream(client, srv):
    model = srv.adapters[3]
    full = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"return_token_ids": True})
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == full.choices[0].text
    assert [t for c in with_choices for t in c.choices[0].model_extra["token_ids"]] == \
        full.choices[0].model_extra["token_ids"]
    assert with_choices[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_stream(client, srv):
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(model=srv.adapters[4], messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0)
    chunks = list(client.chat.completions.create(model=srv.adapters[4], messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_raw_sse_format(srv):
    body = {"model": BASE_NAME, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_sampling_with_seed_is_reproducible(client, srv):
    kw = dict(model=srv.adapters[5], prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95,
              seed=1234, extra_body={"top_k": 50, "return_token_ids": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]


def test_stop_string_is_cut(client, srv):
    (want,) = _greedy_reference(srv, [srv.tokenizer.encode(PROMPTS[2])], [BASE_NAME])
    text = srv.tokenizer.decode(want, skip_special_tokens=True)
    stop = text[len(text) // 2:][:2]
    if not stop.strip() or "\ufffd" in stop:
        pytest.skip("no clean stop string in this greedy output")
    r = client.completions.create(model=BASE_NAME, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                  stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.find(stop)]


def test_stop_strings_are_watched_by_the_server_only(srv):
    """One detokenizer per request: the server's. The engine keeps none for a request with stop strings."""
    thread = srv.server.engine_thread

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
            with thread.hold():  # accepted but not stepped: the request is surely still open while we look
                body = {"model": BASE_NAME, "prompt": PROMPTS[0], "max_tokens": 4, "stop": ["zzqq"]}
                task = asyncio.ensure_future(client.post("/completions", json=body))
                detoks = []
                for _ in range(500):
                    detoks = await thread.call(lambda: [s.detok for s in srv.engine.requests.values()])
                    if detoks:
                        break
                    await asyncio.sleep(0.01)
            return detoks, await task

    detoks, response = asyncio.run(run())
    assert detoks == [None]
    assert response.status_code == 200, response.text


def test_many_concurrent_requests_on_different_adapters(srv, aclient_factory):
    """48 requests at once over every adapter and the base model, streamed and not: each gets its own answer."""
    tok = srv.tokenizer
    n = 48
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(n)]
    models = [_models(i, srv) for i in range(n)]
    expected = _greedy_reference(srv, [tok.encode(p) for p in prompts], models)

    async def one(client, i: int) -> list[int]:
        kw = dict(model=models[i], prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"return_token_ids": True})
        if i % 2:
            ids = []
            async for chunk in await client.completions.create(stream=True, **kw):
                if chunk.choices:
                    ids += chunk.choices[0].model_extra["token_ids"]
            return ids
        r = await client.completions.create(**kw)
        return r.choices[0].model_extra["token_ids"]

    async def run_all():
        async with aclient_factory() as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(n))), 180)

    got = asyncio.run(run_all())
    assert got == expected
    stats = srv.wait_idle()
    assert stats["pool"]["pages_kv"] == 0
    assert stats["adapters"]["evictions"] > 0  # 12 adapters through 8 slots


BAD_SEED = 2**62 + 12345  # never a server-drawn seed (those are < 2**31): marks the request whose inputs "break"


def test_one_requests_bad_step_inputs_fail_only_that_request(srv, monkeypatch):
    """A request whose step inputs cannot be packed (here: its sampling row raises once it is decoding) ends with a
    400 of its own, streamed or not; the streams of other adapters running beside it are untouched and give their
    usual greedy tokens. (Before, the step raised and the failure handler ended every running request.)"""
    from slora_jax.engine import step_runner

    real = step_runner.sampling_arrays

    def fragile(params, seeds, counters, rows, *args, **kwargs):
        if any(p is not None and p.seed == BAD_SEED and c >= 2 for p, c in zip(params, counters, strict=False)):
            raise OverflowError("injected: this request's sampling row cannot be packed")
        return real(params, seeds, counters, rows, *args, **kwargs)

    monkeypatch.setattr(step_runner, "sampling_arrays", fragile)
    tok = srv.tokenizer
    n = 6
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(n)]
    models = [srv.adapters[i] for i in range(n)]
    expected = _greedy_reference(srv, [tok.encode(p) for p in prompts], models)
    steps_before = srv.stats()["steps"]

    async def good(client, i: int) -> list[int]:
        body = {"model": models[i], "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True, "stream": True}
        ids, done = [], False
        async with client.stream("POST", "/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    ids += event["choices"][0].get("token_ids") or []
        assert done
        return ids

    async def bad(client, stream: bool):
        body = {"model": srv.adapters[7], "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0.5,
                "seed": BAD_SEED, "stream": stream}
        async with client.stream("POST", "/completions", json=body) as r:
            return r.status_code, (await r.aread()).decode()

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(good(client, i) for i in range(n)), bad(client, True),
                                                         bad(client, False)), 180)

    *got, (s_status, s_body), (j_status, j_body) = asyncio.run(run())
    assert got == expected
    assert s_status == 200  # the stream had started: its end is an error event, then [DONE]
    events = [e for e in s_body.split("\n\n") if e]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 400 and "invalid request" in error["message"] and "injected" in error["message"]
    assert events[-1] == "data: [DONE]"
    assert j_status == 400 and "injected" in json.loads(j_body)["error"]["message"]
    stats = srv.wait_idle()
    assert stats["pool"]["pages_kv"] == 0 and stats["steps"] > steps_before
    assert srv.server.engine_thread.step_failures == 0  # refused before dispatch: no step failed


def test_metrics_exposed(srv):
    # one request of its own (a prefill and decode steps), so the test does not lean on the ones before it
    r = httpx.post(srv.base_url + "/completions", json={"model": BASE_NAME, "prompt": "hi", "max_tokens": 3,
                                                        "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    srv.wait_idle()
    text = httpx.get(srv.url + "/metrics").text
    for name in ("slora_requests_total", "slora_prompt_tokens_total", "slora_generation_tokens_total",
                 "slora_time_to_first_token_seconds_bucket", "slora_time_per_output_token_seconds_bucket",
                 "slora_requests_waiting", "slora_requests_running", 'slora_adapters{tier="pool"}',
                 'slora_adapters{tier="host"}', 'slora_adapters{tier="disk"}', 'slora_pool_pages{kind="kv"}',
                 'slora_pool_live_bytes{kind="adapter"}', "slora_pool_utilisation", "slora_compiles"):
        assert name in text, name
    assert 'slora_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert f'slora_adapters{{tier="disk"}} {float(N_ADAPTERS)}' in text
    # the engine thread's time per step phase: requests were served above, so dispatch time is positive
    phases = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("slora_engine_host_seconds{")}
    assert set(phases) == {"schedule", "dispatch", "prefetch", "wait", "append"}
    assert phases["dispatch"] > 0
    # per kind of step read back: both kinds ran above; host-bound steps are a subset of the kind's steps
    by_kind = {(line.split("{")[0], line.split('"')[1]): float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("slora_engine_steps_read_back{", "slora_engine_host_bound_steps{",
                                   "slora_engine_wait_seconds{"))}
    for kind in ("prefill", "decode"):
        assert by_kind["slora_engine_steps_read_back", kind] >= 1
        assert 0 <= by_kind["slora_engine_host_bound_steps", kind] <= by_kind["slora_engine_steps_read_back", kind]
    assert math.isclose(by_kind["slora_engine_wait_seconds", "prefill"] + by_kind["slora_engine_wait_seconds",
                                                                                   "decode"], phases["wait"])


@pytest.mark.parametrize("text", ["plain ascii words", "h\u00e9llo w\u00f6rld \U0001f600 \u00fcn\u00efc\u00f8d\u00e9",
                                  "\u4e2d\u6587 \U0001f600\U0001f601\U0001f602"])
def test_detokenizer_streams_split_characters_exactly(srv, text):
    tok = srv.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = []
    for i, t in enumerate(ids):
        detok.add([t], final=i == len(ids) - 1)
        pieces.append(detok.take(final=i == len(ids) - 1))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_work_per_token_stays_bounded_on_lone_continuation_bytes(srv):
    """Tokens that decode to U+FFFD forever (lone UTF-8 continuation bytes, which a request can force) are
    committed after MAX_PENDING of them; the text was once re-decoded from the last character at every token."""
    tok = srv.tokenizer
    lone = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")
    decoded = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    detok = IncrementalDetokenizer(Counting())
    sent = ""
    for _ in range(1000):
        detok.add([lone])
        sent += detok.take()
    assert max(decoded) <= 2 * MAX_PENDING and len(sent) >= 1000 - MAX_PENDING
    assert set(sent) == {"\ufffd"}


def test_detokenizer_never_sends_text_a_stop_string_swallows(srv):
    tok = srv.tokenizer
    ids = tok.encode("Hello world, how are you?", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=("d, h", "zzz"))
    sent = ""
    for t in ids:
        detok.add([t])
        sent += detok.take()
        assert "Hello worl".startswith(sent)  # never a character of the stop string
        if detok.stopped:
            break
    assert detok.stopped and detok.text == "Hello worl"
    assert sent + detok.take(final=True) == "Hello worl"


def _post(srv, body: dict) -> dict:
    r = httpx.post(srv.base_url + "/completions", json={"model": BASE_NAME, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _sse_text(srv, body: dict) -> tuple[str, list[int]]:
    r = httpx.post(srv.base_url + "/completions", json={"model": BASE_NAME, "temperature": 0, "stream": True,
                                                        "return_token_ids": True, **body}, timeout=120)
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    choices = [c for e in events for c in e["choices"]]
    return "".join(c["text"] for c in choices), [t for c in choices for t in c.get("token_ids") or ()]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_text_is_left_out(srv, stream):
    """A stop_token_ids token that ends the answer is in its token ids and usage, not in its text (vLLM's default,
    and what the engine's own detokenizer does, which is never fed it)."""
    tok = srv.tokenizer
    prompt_ids = tok.encode(PROMPTS[1])
    ids = _post(srv, {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "return_token_ids": True})["choices"][0]
    ids = ids["token_ids"]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and tok.decode([ids[i]]).strip())
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "stop_token_ids": [ids[k]], "return_token_ids": True}
    if stream:
        text, got = _sse_text(srv, body)
    else:
        choice = _post(srv, body)["choices"][0]
        assert choice["finish_reason"] == "stop"
        text, got = choice["text"], choice["token_ids"]
    assert got == ids[:k + 1]
    assert text == continuation(tok, prompt_ids, ids[:k])


def test_min_tokens_holds_off_stop_strings(srv):
    """Stop strings are looked for once more than min_tokens tokens exist (vLLM): a stop string that the first
    tokens hold does not end the answer below min_tokens."""
    tok = srv.tokenizer
    ids = _post(srv, {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "return_token_ids": True})["choices"][0]
    ids = ids["token_ids"]
    stop = tok.decode([ids[1]])
    assert stop.strip() and "\ufffd" not in stop
    answer = _post(srv, {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "min_tokens": 6, "stop": [stop]})
    assert answer["usage"]["completion_tokens"] >= 6, answer


@pytest.mark.parametrize("field, value", [("include_stop_str_in_output", True), ("min_p", 0.1),
                                          ("skip_special_tokens", False), ("prompt_logprobs", 1)])
def test_unimplemented_vllm_extensions_are_refused(srv, field, value):
    """vLLM's sampling extensions that we do not implement get a 400 naming them, not a silently different answer;
    sent with vLLM's default value they are accepted."""
    body = {"model": BASE_NAME, "prompt": PROMPTS[0], "max_tokens": 2, field: value}
    r = httpx.post(srv.base_url + "/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(srv.base_url + "/completions", json={**body, field: VLLM_UNIMPLEMENTED[field]}, timeout=120)
    assert r.status_code == 200, r.text
