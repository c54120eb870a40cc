"""Structured output through the real ``openai`` client: response_format (json_object, json_schema) and vLLM's
guided_json / guided_regex / guided_choice, on chat and completions, streamed and not.

The model has random weights, so its text is junk unless constrained: every answer parsing and validating against
its schema (``jsonschema``, the independent reference), matching its regex (``re.fullmatch``) or being one of its
choices is the grammar's doing. Requests run concurrently (grammar rows batched with each other and with adapters),
sampled at temperature > 0, after a warm-up: nothing may compile while serving.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from pydantic import BaseModel, Field
from server_fixtures import BASE_NAME, start_server

# Five schemas with bounded output (string lengths, array sizes, number ranges with multipleOf: a number without
# one may be written with digits forever; binary fractions, as jsonschema checks multipleOf in floating point),
# so max_tokens never cuts one.
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age"],
     "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 120},
                    "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}}},
    {"type": "object", "additionalProperties": False, "required": ["items", "total"],
     "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
         "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
         "properties": {"sku": {"enum": ["A1", "B2", "C3"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
         "total": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.25}}},
    {"type": "object", "additionalProperties": False, "required": ["ok", "level"],
     "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]},
                    "note": {"type": ["string", "null"], "maxLength": 5}}},
    {"type": "object", "additionalProperties": False, "required": ["meta", "score"],
     "properties": {"meta": {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
                             "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                            "tags": {"type": "array", "maxItems": 2,
                                                     "items": {"type": "string", "maxLength": 4}}}},
                    "score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.125}}},
    {"type": "array", "minItems": 1, "maxItems": 5, "items": {"type": "integer", "minimum": 0, "maximum": 50}},
]
MAX_TOKENS = 160
PROMPTS = ["Describe it as JSON.", "Hello, how are you today?", "Once upon a time there was", "The quick brown fox"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    # one prefill and one decode bucket keep the CPU warm-up short; all 16 decode rows in every step
    server = start_server(tmp_path_factory.mktemp("structured"), n_adapters=3, warmup=True,
                          decode_lora_variants=False, min_decode_bucket=16, min_prefill_bucket=256)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)


def _aclient(srv):
    return openai.AsyncOpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)


async def _ask(client, kind: str, model: str, prompt: str, stream: bool, **body) -> tuple[str, str]:
    """(text, finish_reason) of one request, streamed or whole."""
    common = dict(model=model, max_tokens=MAX_TOKENS, temperature=1.0, stream=stream)
    if kind == "chat":
        extra = {k: v for k, v in body.items() if k != "response_format"}
        call = client.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                              response_format=body.get("response_format", openai.NOT_GIVEN),
                                              extra_body=extra or None, **common)
    else:
        call = client.completions.create(prompt=prompt, extra_body=body, **common)
    r = await call
    if not stream:
        choice = r.choices[0]
        return (choice.message.content if kind == "chat" else choice.text), choice.finish_reason
    text, finish = "", None
    async for chunk in r:
        for choice in chunk.choices:
            text += (choice.delta.content or "") if kind == "chat" else choice.text
            finish = choice.finish_reason or finish
    return text, finish


def _json_body(i: int, schema: dict) -> dict:
    """Alternate how the schema is asked for: response_format (OpenAI), guided_json (vLLM), as object or text."""
    if schema["type"] != "object" or i % 3 == 2:
        return {"guided_json": schema if i % 2 else json.dumps(schema)}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                       "strict": True}}}


def test_50_schema_requests_validate(srv):
    models = [BASE_NAME, *srv.adapters]
    jobs = [(i, SCHEMAS[i % 5], "chat" if i % 2 else "completion", models[i % len(models)], i % 4 == 1)
            for i in range(50)]

    async def run():
        client = _aclient(srv)
        return await asyncio.gather(*[_ask(client, kind, model, PROMPTS[i % 4], stream, **_json_body(i, schema))
                                      for i, schema, kind, model, stream in jobs])

    results = asyncio.run(run())
    for (i, schema, kind, model, stream), (text, finish) in zip(jobs, results, strict=True):
        where = f"request {i} ({kind}, {model}, stream={stream}): {text!r}"
        assert finish == "stop", where
        jsonschema.validate(json.loads(text), schema)
    assert srv.stats()["compiles_since_warmup"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_guided_choice_and_regex(srv, stream):
    choices = ["positive", "negative", "mixed feelings"]
    pattern = r"[A-Z][a-z]{2,8} [0-9]{3}(-[a-z]{2})?"

    async def run():
        client = _aclient(srv)
        jobs = [_ask(client, kind, BASE_NAME if i % 2 else srv.adapters[0], PROMPTS[i % 4], stream, **body)
                for i in range(4) for kind in ("chat", "completion")
                for body in ({"guided_choice": choices}, {"guided_regex": pattern})]
        return await asyncio.gather(*jobs)

    for n, (text, finish) in enumerate(asyncio.run(run())):
        assert finish == "stop", text
        if n % 2 == 0:
            assert text in choices
        else:
            assert re.fullmatch(pattern, text), text
    assert srv.stats()["compiles_since_warmup"] == 0


def test_json_object_is_an_object_or_cut_at_length(client):
    for stream in (False, True):
        for i in range(3):
            kw = dict(model=BASE_NAME, messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=48,
                      temperature=0.8, response_format={"type": "json_object"}, seed=i)
            if not stream:
                choice = client.chat.completions.create(**kw).choices[0]
                text, finish = choice.message.content, choice.finish_reason
            else:
                text, finish = "", None
                for chunk in client.chat.completions.create(stream=True, **kw):
                    text += chunk.choices[0].delta.content or "" if chunk.choices else ""
                    finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
            assert text.startswith("{")
            if finish == "stop":
                assert isinstance(json.loads(text), dict)
            else:
                assert finish == "length"


def test_n_samples_each_follow_the_grammar(client, srv):
    """n samples share one compiled grammar; each follows its own copy (streamed: choices by index)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMAS[1]}}
    r = client.chat.completions.create(model=srv.adapters[2], messages=[{"role": "user", "content": "Order?"}], n=3,
                                       max_tokens=MAX_TOKENS, temperature=1.0, response_format=fmt)
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[1])
    texts, finishes = ["", ""], [None, None]
    for chunk in client.completions.create(model=BASE_NAME, prompt="Numbers:", n=2, max_tokens=MAX_TOKENS,
                                           temperature=1.0, stream=True, extra_body={"guided_json": SCHEMAS[4]}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert finishes == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[4])


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    likes_tea: bool


def test_openai_parse_with_a_pydantic_model(client, srv):
    """The client's own structured-output helper: it sends a strict json_schema and parses the answer."""
    for model in (BASE_NAME, srv.adapters[1]):
        r = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Who is it?"}],
                                          response_format=Person, max_tokens=MAX_TOKENS, temperature=1.0)
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
        assert len(person.name) <= 8 and 0 <= person.age <= 120


NESTED: dict = {"type": "object"}
for _ in range(300):
    NESTED = {"type": "object", "properties": {"a": NESTED}}


@pytest.mark.parametrize("body, reason", [
    ({"guided_regex": "(("}, "unclosed group"),
    ({"guided_json": {"type": "objectx"}}, "objectx"),
    ({"guided_json": '{"type": '}, "not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                                           "minimum": "a"}}}},
     "minimum"),
    ({"response_format": {"type": "xml"}}, "response_format type"),
    ({"response_format": {"type": "json_schema"}}, "json_schema object"),
    ({"guided_choice": []}, "non-empty list"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"guided_grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}}, "whitespace_pattern is not supported"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, "structural_tag is not supported"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "unknown key 'backend'"),
    ({"structured_outputs": {"json": {}, "disable_additional_properties": "yes"}}, "must be true or false"),
    ({"structured_outputs": {"json": NESTED, "disable_additional_properties": True}}, "more than 200 levels"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_grammars_are_400_with_the_reason(client, body, reason, stream):
    with pytest.raises(openai.BadRequestError, match=reason):
        client.completions.create(model=BASE_NAME, prompt="hi", max_tokens=4, stream=stream, extra_body=body)


def test_grammar_over_the_parser_limits_ends_with_400(client):
    """A regex too large to follow ends when its lexer gives up (here or at compile), never costing every step."""
    with pytest.raises(openai.BadRequestError, match="too many expressions"):
        client.completions.create(model=BASE_NAME, prompt="hi", max_tokens=40, extra_body={"guided_regex": "a{100000}"})


def test_text_format_and_good_requests_after_bad_ones(client):
    r = client.chat.completions.create(model=BASE_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(model=BASE_NAME, prompt="hi", max_tokens=20, temperature=1.0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


def test_disable_additional_properties_closes_every_object(client):
    """vLLM's structured_outputs option: only the schema's named properties, at every level (it used to be
    ignored, and the model wrote properties the client had asked to forbid)."""
    schema = {"type": "object", "required": ["x", "properties"],
              "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                             "properties": {"type": "object", "required": ["y"],  # a property named "properties"
                                            "properties": {"y": {"type": "boolean"}}}}}
    r = client.completions.create(model=BASE_NAME, prompt="JSON:", max_tokens=MAX_TOKENS, temperature=1.0, n=8,
                                  extra_body={"structured_outputs": {"json": schema, "disable_fallback": True,
                                                                     "disable_additional_properties": True}})
    for choice in r.choices:
        value = json.loads(choice.text)
        assert choice.finish_reason == "stop" and set(value) == {"x", "properties"}, choice.text
        assert set(value["properties"]) == {"y"}, choice.text


def test_closed_objects_follows_schema_keywords_only():
    from slora_jax.serve.structured import closed_objects

    schema = {"$defs": {"p": {"type": "object", "properties": {"a": {"type": "string"}}}},
              "anyOf": [{"$ref": "#/$defs/p"}, {"type": ["object", "null"]}],
              "properties": {"properties": {"type": "object"}, "type": {"type": "array", "items": {"properties": {}}}},
              "additionalProperties": True}
    got = closed_objects(schema)
    assert got["additionalProperties"] is True  # the schema's own choice stays
    assert got["$defs"]["p"]["additionalProperties"] is False
    assert got["anyOf"][1]["additionalProperties"] is False and "additionalProperties" not in got["anyOf"][0]
    assert got["properties"]["properties"] == {"type": "object", "additionalProperties": False}
    assert set(got["properties"]) == {"properties", "type"}  # property names are not schemas
    assert got["properties"]["type"]["items"] == {"properties": {}, "additionalProperties": False}
    assert "additionalProperties" not in schema["$defs"]["p"]  # a copy: the request's body is left as it was


def test_slow_grammars_hold_up_no_plain_request(srv, client, monkeypatch):
    """Grammars compile in threads of their own: six requests whose grammar takes long (held here) leave every
    tokenizer thread free, so a plain completion meanwhile is answered at once. (They compiled in the tokenizer
    threads, and four slow schemas held up every request behind them.)"""
    import concurrent.futures
    import threading

    compiler = srv.server.app.state.ctx.requests.grammars.compiler
    gate, real = threading.Event(), compiler.compile

    def held(spec, *args, **kw):
        gate.wait(60)
        return real(spec, *args, **kw)

    monkeypatch.setattr(compiler, "compile", held)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        slow = [pool.submit(client.completions.create, model=BASE_NAME, prompt="hi", max_tokens=8, temperature=1.0,
                            extra_body={"guided_choice": [f"yes{i}", f"no{i}"]}) for i in range(6)]
        try:
            plain = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=20)
            r = plain.completions.create(model=BASE_NAME, prompt="hi", max_tokens=2, temperature=0)
            assert r.choices[0].finish_reason == "length" and not any(f.done() for f in slow)
        finally:
            gate.set()
        assert all(f.result().choices[0].text in (f"yes{i}", f"no{i}") for i, f in enumerate(slow))


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_line_break_characters_reach_a_line_reader_intact(srv, kind):
    """U+0085, U+2028 and U+2029 are line ends to readers built on str.splitlines (httpx's aiter_lines), so a chunk
    carrying one raw was cut in two there; streamed text holding them must come back whole, template chunks and
    logprob chunks alike."""
    rng = np.random.default_rng()
    breaks = ["\x85", "\u2028", "\u2029"]
    choice = "".join(f"{rng.choice(list('xyz'))}{breaks[i]}" for i in rng.permutation(3)) + "!"
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    asked = {"prompt": "Say it."} if kind == "completion" else {"messages": [{"role": "user", "content": "Say it."}]}

    async def stream(logprobs: bool) -> str:
        body = {"model": BASE_NAME, "max_tokens": 32, "stream": True, "guided_choice": [choice], **asked}
        if logprobs:
            body.update({"logprobs": 1} if kind == "completion" else {"logprobs": True, "top_logprobs": 1})
        text = ""
        async with httpx.AsyncClient(base_url=srv.base_url.removesuffix("/v1"), timeout=120) as client:
            async with client.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        delta = json.loads(line.removeprefix("data: "))["choices"][0]
                        text += delta["text"] if kind == "completion" else delta["delta"].get("content") or ""
                    else:
                        assert line in ("", "data: [DONE]"), line
        return text

    async def run():
        return await asyncio.gather(stream(False), stream(True))

    assert asyncio.run(run()) == [choice, choice]


def test_chat_logprob_bytes_rebuild_characters_split_over_tokens(srv):
    """Tokens that are pieces of a character report its bytes (they once reported U+FFFD's), so the entries' bytes
    join to the text, real U+FFFD included."""
    rng = np.random.default_rng()
    chars = ["\u00e9", "\U0001f600", "\u4e2d", "\ufffd", "a"]
    choice = "".join(chars[i] for i in rng.integers(0, len(chars), 8)) + "\U0001f600!"
    r = httpx.post(srv.base_url + "/chat/completions", timeout=120, json={
        "model": BASE_NAME, "messages": [{"role": "user", "content": "Say it."}], "max_tokens": 48,
        "guided_choice": [choice], "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()["choices"][0]
    assert body["message"]["content"] == choice
    entries = body["logprobs"]["content"]
    assert any(e["token"] == "\ufffd" and bytes(e["bytes"]) != "\ufffd".encode() for e in entries)  # split ones
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8") == choice
