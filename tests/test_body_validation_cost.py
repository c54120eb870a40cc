"""A body of wrongly typed array items costs a few validation errors, not one per item (body_types.py).

Before, a 4 MiB chat body whose one message had ``content: [1, 1, ...]`` made pydantic record an error per item per
union branch and FastAPI build a dict of each, on the event loop: every stream of the server stopped for ~45 s. Here
each such body is validated with 100k bad items (what counts is the number of errors, which grew with the items),
and over HTTP the refusal is a 400 naming the field while the server goes on answering.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from pydantic import ValidationError
from server_fixtures import BASE_NAME, start_server

from slora_jax.serve.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest

N = 100_000
MAX_ERRORS = 8  # a few per union branch


def _bad_items(rng) -> list:
    """N items of one type that no list field here accepts (drawn fresh: objects, lists or booleans-in-lists)."""
    kind = rng.integers(3)
    return [{}] * N if kind == 0 else [[{}]] * N if kind == 1 else [[True, {}]] * N


def _bodies(items: list) -> list[tuple[type, dict, str]]:
    chat = {"model": BASE_NAME, "messages": [{"role": "user", "content": "hi"}]}
    comp = {"model": BASE_NAME, "prompt": "hi"}
    return [
        (ChatCompletionRequest, {**chat, "messages": [{"role": "user", "content": items}]}, "content"),
        (ChatCompletionRequest, {**chat, "messages": [{"role": "user", "content": 1}] * N}, "messages"),
        (ChatCompletionRequest, {**chat, "tools": items}, "tools"),
        (ChatCompletionRequest, {**chat, "stop": items}, "stop"),
        (CompletionRequest, {**comp, "prompt": items}, "prompt"),
        (CompletionRequest, {**comp, "stop_token_ids": items}, "stop_token_ids"),
        (CompletionRequest, {**comp, "guided_choice": items}, "guided_choice"),
        (CompletionRequest, {**comp, "logit_bias": {str(i): "x" for i in range(N)}}, "logit_bias"),
        (CompletionRequest, {**comp, "adapters": {f"a{i}": "x" for i in range(N)}}, "adapters"),
        (TokenizeRequest, {"messages": [{"role": "user", "content": items}]}, "content"),
    ]


def test_a_long_array_of_bad_items_costs_a_few_errors_naming_its_field():
    rng = np.random.default_rng()
    for model, body, field in _bodies(_bad_items(rng)):
        with pytest.raises(ValidationError) as e:
            model.model_validate(body)
        errors = e.value.errors()
        assert 1 <= len(errors) <= MAX_ERRORS, (field, len(errors))
        assert all(field in err["loc"] for err in errors), (field, [err["loc"] for err in errors[:3]])


def test_valid_lists_within_the_caps_still_validate():
    rng = np.random.default_rng()
    ids = [int(t) for t in rng.integers(0, 32000, size=int(rng.integers(1, 5000)))]
    req = CompletionRequest.model_validate({"model": BASE_NAME, "prompt": ids, "stop": ["a", "b"],
                                            "stop_token_ids": ids[:1024], "guided_choice": ["yes", "no"],
                                            "logit_bias": {str(i): 1.0 for i in ids[:300]}})
    assert req.prompt == ids and req.stop_token_ids == ids[:1024] and len(req.logit_bias) == len(set(ids[:300]))
    parts = [{"type": "text", "text": "x"}, "y"] * int(rng.integers(1, 100))
    chat = ChatCompletionRequest.model_validate({"model": BASE_NAME,
                                                 "messages": [{"role": "user", "content": parts}]})
    assert chat.messages[0].content == parts


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("cost"), n_adapters=1)
    yield srv
    srv.stop()


def test_over_http_the_refusal_is_a_400_naming_the_field_and_the_server_keeps_serving(server):
    rng = np.random.default_rng()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for path, body, field in (
                ("/v1/chat/completions", {"model": BASE_NAME, "max_tokens": 1,
                                          "messages": [{"role": "user", "content": [1] * 1_000_000}]}, "content"),
                ("/v1/completions", {"model": BASE_NAME, "max_tokens": 1, "prompt": "hi", "stop": [1] * 1_000_000},
                 "stop")):
            r = client.post(path, json=body)
            assert r.status_code == 400, r.text
            assert field in r.json()["error"]["message"]
        prompt = [int(t) for t in rng.integers(3, 200, size=5)]
        r = client.post("/v1/completions", json={"model": BASE_NAME, "prompt": prompt, "max_tokens": 3,
                                                  "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
