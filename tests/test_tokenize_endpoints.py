"""vLLM's tokenizer endpoints, ``POST /tokenize`` and ``POST /detokenize``, through the real HTTP server.

The expected ids come from an independently loaded HF tokenizer (``AutoTokenizer.from_pretrained`` on the model dir)
and from what the generation endpoints report as their prompt (``return_token_ids``): ``/tokenize`` must give exactly
the ids ``/v1/completions`` (``prompt``) or ``/v1/chat/completions`` (``messages``) would use. Every bad input is a
4xx naming the field, the API key is required as on ``/v1``, and the server still serves a completion afterwards.

The main server has an API key (its client sends it); a second one has no tokenizer.
"""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest
from server_fixtures import BASE_NAME, SMALL_ENGINE, start_server
from transformers import AutoTokenizer

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.serve.config import ServerConfig
from slora_jax.serve.server import Server

KEY = "tok-key-456"
MAX_MODEL_LEN = SMALL_ENGINE["max_model_len"]
MAX_CHARS = 32 * MAX_MODEL_LEN  # --max-prompt-chars' default
PROMPTS = ["Hello, how are you today?", "Once upon a time there was", "  spaces\tand\ttabs\n\nnewlines ",
           "caf\u00e9 \u2603 \U0001f600 \u4e2d\u6587", "<s> looks special", "x"]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "first line"}, {"type": "text", "text": "second"}]},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("tokenize"), n_adapters=2, api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def hf_tok(srv):
    """The tokenizer loaded on its own from the model dir (not the server's copy)."""
    return AutoTokenizer.from_pretrained(srv.model_dir)


@pytest.fixture(scope="module")
def vocab(srv):
    return srv.engine.cfg.vocab_size


def tokenize(http, **body) -> dict:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_MODEL_LEN
    return out


def generation_prompt_ids(http, path: str, **body) -> list[int]:
    r = http.post(path, json={"model": BASE_NAME, "max_tokens": 1, "temperature": 0, "return_token_ids": True,
                              **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["prompt_token_ids"]


# ---------------------------------------------------------------- /tokenize: the prompt form


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_ids_equal_hf_encode_and_the_completions_prompt(http, hf_tok, prompt):
    out = tokenize(http, prompt=prompt)
    assert out["tokens"] == hf_tok.encode(prompt)
    assert out["tokens"][0] == hf_tok.bos_token_id
    assert out["token_strs"] is None
    assert out["tokens"] == generation_prompt_ids(http, "/v1/completions", prompt=prompt)


def test_model_may_be_the_base_an_adapter_or_absent(http, srv):
    want = tokenize(http, prompt=PROMPTS[0])["tokens"]
    for model in (BASE_NAME, *srv.adapters):
        assert tokenize(http, model=model, prompt=PROMPTS[0])["tokens"] == want
        assert http.post("/detokenize", json={"model": model, "tokens": want}).status_code == 200


def test_add_special_tokens_false_drops_bos(http, hf_tok):
    for prompt in PROMPTS:
        with_bos = tokenize(http, prompt=prompt, add_special_tokens=True)["tokens"]
        without = tokenize(http, prompt=prompt, add_special_tokens=False)["tokens"]
        assert with_bos == [hf_tok.bos_token_id] + without
        assert without == hf_tok.encode(prompt, add_special_tokens=False)


def test_token_strs_equal_convert_ids_to_tokens(http, hf_tok):
    for body in ({"prompt": PROMPTS[3]}, {"prompt": PROMPTS[2], "add_special_tokens": False}, {"messages": CHAT}):
        out = tokenize(http, **body, return_token_strs=True)
        assert out["token_strs"] == hf_tok.convert_ids_to_tokens(out["tokens"])
        assert tokenize(http, **body, return_token_strs=False)["token_strs"] is None


def test_a_prompt_longer_than_the_context_is_counted(http, hf_tok):
    """Counting is what the endpoint is for: only --max-prompt-chars bounds it, not the context."""
    text = "The quick brown fox jumps over the lazy dog. " * 100  # 4500 characters, > 256 tokens
    out = tokenize(http, prompt=text)
    assert out["count"] > MAX_MODEL_LEN and out["tokens"] == hf_tok.encode(text)


# ---------------------------------------------------------------- /tokenize: the chat form


def joined(messages):
    """The conversation with each message's content parts joined by a newline (as vLLM and the server join them)."""
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "\n".join(p["text"] for p in m["content"])} for m in messages]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_ids_equal_the_chat_completions_prompt(http, hf_tok, add_generation_prompt):
    body = {"messages": CHAT} if add_generation_prompt else {"messages": CHAT, "add_generation_prompt": False}
    ids = tokenize(http, **body)["tokens"]
    assert ids == generation_prompt_ids(http, "/v1/chat/completions", **body)
    text = hf_tok.apply_chat_template(joined(CHAT), tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert ids.count(hf_tok.bos_token_id) == 1  # the template's own BOS, no second one


def test_chat_add_special_tokens_adds_bos_on_top_of_the_template(http, hf_tok):
    plain = tokenize(http, messages=CHAT)["tokens"]
    assert tokenize(http, messages=CHAT, add_special_tokens=False)["tokens"] == plain
    assert tokenize(http, messages=CHAT, add_special_tokens=True)["tokens"] == [hf_tok.bos_token_id] + plain


def test_add_special_tokens_reaches_the_generation_routes(http, hf_tok):
    """vLLM's ``add_special_tokens`` on completions (default true) and chat (default false) is honoured as
    ``/tokenize`` honours it (both routes used to ignore it)."""
    for special in (True, False):
        want = tokenize(http, prompt=PROMPTS[1], add_special_tokens=special)["tokens"]
        assert generation_prompt_ids(http, "/v1/completions", prompt=PROMPTS[1], add_special_tokens=special) == want
        want = tokenize(http, messages=CHAT, add_special_tokens=special)["tokens"]
        assert generation_prompt_ids(http, "/v1/chat/completions", messages=CHAT, add_special_tokens=special) == want
    assert want.count(hf_tok.bos_token_id) == 1  # chat without: the template's BOS only


def test_defaults_per_form_are_vllms_even_when_null(http):
    """``add_special_tokens: null`` is the form's default; false flags of unimplemented fields are accepted."""
    assert tokenize(http, prompt="hi", add_special_tokens=None) == tokenize(http, prompt="hi")
    assert (tokenize(http, messages=CHAT, add_special_tokens=None, continue_final_message=False, chat_template=None,
                     chat_template_kwargs={}, tools=[], mm_processor_kwargs=None)
            == tokenize(http, messages=CHAT))


# ---------------------------------------------------------------- /detokenize


def test_detokenize_random_ids_equals_hf_decode(http, hf_tok, vocab):
    rng = np.random.default_rng()  # fresh: any ids must round-trip
    for n in (1, 7, 200, 4 * MAX_MODEL_LEN):
        ids = rng.integers(0, vocab, size=n).tolist()
        r = http.post("/detokenize", json={"tokens": ids})
        assert r.status_code == 200, (ids, r.text)
        assert r.json() == {"prompt": hf_tok.decode(ids)}


def test_detokenize_keeps_special_tokens_and_round_trips(http, hf_tok):
    for prompt in PROMPTS:
        ids = tokenize(http, prompt=prompt)["tokens"]
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text == hf_tok.decode(ids) and text.startswith(hf_tok.bos_token)
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_work_runs_in_the_tokenizer_threads(http, srv, monkeypatch):
    """Never on the event loop: both endpoints' work runs in RequestBuilder's worker threads."""
    builder, seen = srv.server.app.state.ctx.requests, []
    for name in ("build_tokenize", "build_detokenize"):
        real = getattr(builder, name)

        def recording(*args, _real=real):
            seen.append(threading.current_thread().name)
            return _real(*args)

        monkeypatch.setattr(builder, name, recording)
    tokenize(http, prompt="hi")
    tokenize(http, messages=CHAT)
    assert http.post("/detokenize", json={"tokens": [1, 5]}).status_code == 200
    assert len(seen) == 3 and all(n.startswith("slora-tokenize") for n in seen), seen


# ---------------------------------------------------------------- bad input: 4xx naming the field

IMAGE = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
BAD = {  # id: (path, body, status, message fragment, param)
    "unknown-model": ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "'nope' does not exist", "model"),
    "unknown-model-chat": ("/tokenize", {"model": "nope", "messages": CHAT}, 404, "does not exist", "model"),
    "unknown-model-detok": ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "does not exist", "model"),
    "prompt-too-long": ("/tokenize", {"prompt": "a" * (MAX_CHARS + 1)}, 400, "--max-prompt-chars", "prompt"),
    "messages-too-long": ("/tokenize", {"messages": [{"role": "user", "content": "a" * MAX_CHARS}]}, 400,
                          "--max-prompt-chars", "messages"),
    "prompt-surrogate": ("/tokenize", {"prompt": "a\ud800b"}, 400, "lone UTF-16 surrogate", "prompt"),
    "messages-surrogate": ("/tokenize", {"messages": [{"role": "user", "content": "a\udfffb"}]}, 400,
                           "lone UTF-16 surrogate", "messages"),
    "part-surrogate": ("/tokenize", {"messages": [{"role": "user", "content": ["ok", "\ud800"]}]}, 400,
                       "surrogate", "messages"),
    "image-part": ("/tokenize", {"messages": [{"role": "user", "content": [IMAGE]}]}, 400, "text only", "messages"),
    "both": ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, "not both", "prompt"),
    "neither": ("/tokenize", {"model": BASE_NAME}, 400, "not neither", "messages"),
    "neither-null": ("/tokenize", {"prompt": None, "messages": None}, 400, "exactly one of prompt", "messages"),
    "messages-empty": ("/tokenize", {"messages": []}, 400, "messages is empty", "messages"),
    "continue_final_message": ("/tokenize", {"messages": CHAT, "add_generation_prompt": False,
                                             "continue_final_message": True}, 400, "not supported",
                               "continue_final_message"),
    "chat_template": ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "not supported",
                      "chat_template"),
    "chat_template_kwargs": ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}},
                             400, "not supported", "chat_template_kwargs"),
    "tools": ("/tokenize", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
              "not supported", "tools"),
    "mm_processor_kwargs": ("/tokenize", {"messages": CHAT, "mm_processor_kwargs": {"a": 1}}, 400, "not supported",
                            "mm_processor_kwargs"),
    "chat_template-with-prompt": ("/tokenize", {"prompt": "hi", "chat_template": "x"}, 400, "not supported",
                                  "chat_template"),
    "tool_calls": ("/tokenize", {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "tool_calls",
                   "messages"),
    "tool_call_id": ("/tokenize", {"messages": [*CHAT, {"role": "tool", "content": "1", "tool_call_id": "c1"}]},
                     400, "tool_call_id", "messages"),
    # the chat route refuses what /tokenize refuses: both build the prompt one way, or neither answers
    "chat-chat_template": ("/v1/chat/completions", {"model": BASE_NAME, "messages": CHAT, "chat_template": "{{ 'X' }}"},
                           400, "not supported", "chat_template"),
    "chat-chat_template_kwargs": ("/v1/chat/completions", {"model": BASE_NAME, "messages": CHAT,
                                                           "chat_template_kwargs": {"enable_thinking": False}},
                                  400, "not supported", "chat_template_kwargs"),
    "chat-mm_processor_kwargs": ("/v1/chat/completions", {"model": BASE_NAME, "messages": CHAT,
                                                          "mm_processor_kwargs": {"a": 1}}, 400, "not supported",
                                 "mm_processor_kwargs"),
    "chat-documents": ("/v1/chat/completions", {"model": BASE_NAME, "messages": CHAT, "documents": [{"t": "x"}]}, 400,
                       "not supported", "documents"),
    "chat-tool_calls": ("/v1/chat/completions", {"model": BASE_NAME, "messages": [{"role": "assistant", "content": "",
                                                 "tool_calls": [{"id": "c1"}]}]}, 400, "tool_calls", "messages"),
    # past MAX_MESSAGES the list is refused before its messages are validated one by one on the event loop
    "too-many-messages": ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * 16385}, 400,
                          "at most 16384", None),
    "chat-too-many-messages": ("/v1/chat/completions", {"model": BASE_NAME, "messages": [{"role": "user",
                                                        "content": "x"}] * 16385}, 400, "at most 16384", None),
    "prompt-not-a-string": ("/tokenize", {"prompt": 123}, 400, "prompt", None),
    "prompt-token-ids": ("/tokenize", {"prompt": [1, 2, 3]}, 400, "prompt", None),
    "add_special_tokens-not-bool": ("/tokenize", {"prompt": "hi", "add_special_tokens": "maybe"}, 400,
                                    "add_special_tokens", None),
    "model-not-a-string": ("/tokenize", {"model": 5, "prompt": "hi"}, 400, "model", None),
    "tokens-missing": ("/detokenize", {"model": BASE_NAME}, 400, "tokens", None),
    "tokens-not-a-list": ("/detokenize", {"tokens": "1 2 3"}, 400, "tokens", None),
    "token-string": ("/detokenize", {"tokens": [1, "7"]}, 400, 'tokens[1] is "7", not a token id', "tokens"),
    "token-float": ("/detokenize", {"tokens": [1, 2, 7.0]}, 400, "tokens[2] is 7.0, not a token id", "tokens"),
    "token-bool": ("/detokenize", {"tokens": [True]}, 400, "tokens[0] is true, not a token id", "tokens"),
    "token-null": ("/detokenize", {"tokens": [3, None]}, 400, "tokens[1] is null", "tokens"),
    "token-list": ("/detokenize", {"tokens": [[1, 2]]}, 400, "tokens[0] is an array", "tokens"),
    "token-object": ("/detokenize", {"tokens": [1, {"id": 2}]}, 400, "tokens[1] is an object", "tokens"),
    "token-negative": ("/detokenize", {"tokens": [1, 2, -1]}, 400, "tokens[2] is -1, not a token id (an integer "
                       "in [0, 512))", "tokens"),
    "token-vocab": ("/detokenize", {"tokens": [512, 1]}, 400, "tokens[0] is 512", "tokens"),
    "token-huge": ("/detokenize", {"tokens": [1, 2**70]}, 400, f"tokens[1] is {2**70}", "tokens"),
    "first-bad-named": ("/detokenize", {"tokens": [0, 1, 9999, "x"]}, 400, "tokens[2] is 9999", "tokens"),
    "tokens-too-many": ("/detokenize", {"tokens": [1] * (4 * MAX_MODEL_LEN + 1)}, 400,
                        f"at most {4 * MAX_MODEL_LEN}", "tokens"),
}


@pytest.mark.parametrize("path, body, status, fragment, param", BAD.values(), ids=BAD.keys())
def test_bad_input_is_a_4xx_naming_the_field(http, vocab, path, body, status, fragment, param):
    assert vocab == 512  # the fragments above quote the tiny vocabulary
    # json.dumps escapes a lone surrogate as JSON may ("\\ud800"); httpx's json= cannot encode one
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and fragment in err["message"], err
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_malformed_bodies_are_400(http, path):
    for content in (b"{not json", b"", b"[1, 2]", b'"text"'):
        r = http.post(path, content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (content, r.text)
        assert r.json()["error"]["code"] == 400


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_wrong_method_is_405(http, path):
    assert http.get(path).status_code == 405


# ---------------------------------------------------------------- the API key and the request metrics


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})])
def test_the_api_key_is_required(srv, http, path, body):
    for headers, fragment in (({}, "missing API key"), ({"Authorization": "Bearer wrong"}, "invalid API key"),
                              ({"Authorization": KEY}, "invalid API key")):
        r = httpx.post(srv.url + path, json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert fragment in r.json()["error"]["message"]
    assert httpx.post(srv.url + path, json=body, headers={"Authorization": f"bearer  {KEY}"}).status_code == 200


def test_requests_are_counted_per_endpoint(srv, http):
    tokenize(http, prompt="count me")
    assert http.post("/tokenize", json={"model": "nope", "prompt": "hi"}).status_code == 404
    assert http.post("/tokenize", json={"prompt": "hi", "messages": CHAT}).status_code == 400
    http.post("/detokenize", json={"tokens": [1]})
    assert http.post("/detokenize", json={"tokens": [-5]}).status_code == 400
    for path in ("/tokenize", "/detokenize"):
        assert httpx.post(srv.url + path, json={}).status_code == 401  # no key
    text = http.get("/metrics").text
    for endpoint, status in (("/tokenize", 200), ("/tokenize", 401), ("/tokenize", 404), ("/tokenize", 400),
                             ("/detokenize", 200), ("/detokenize", 401), ("/detokenize", 400)):
        assert f'slora_requests_total{{endpoint="{endpoint}",status="{status}"}}' in text, (endpoint, status)


# ---------------------------------------------------------------- a server without a tokenizer


@pytest.fixture(scope="module")
def bare(srv):
    """The same model served without a tokenizer (token-id prompts only)."""
    engine = Engine.from_model_dir(srv.model_dir, EngineConfig(**SMALL_ENGINE), progress=False)
    assert engine.tokenizer is None
    server = Server(engine, ServerConfig(served_model_name=BASE_NAME), host="127.0.0.1", port=0, log_level="warning")
    server.start_background()
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client
    server.stop()


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "hi"}), ("/tokenize", {"messages": CHAT}),
                                        ("/detokenize", {"tokens": [1, 2]})])
def test_no_tokenizer_is_a_400_saying_so(bare, path, body):
    r = bare.post(path, json=body)
    assert r.status_code == 400, r.text
    assert f"this server has no tokenizer, so {path} is unavailable" in r.json()["error"]["message"]
    assert bare.post("/tokenize", json={"model": "nope", "prompt": "hi"}).status_code == 404
    r = bare.post("/v1/completions", json={"model": BASE_NAME, "prompt": [1, 5, 9], "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- still serving


def test_still_serves_a_completion_after_the_errors(http, hf_tok):
    r = http.post("/v1/completions", json={"model": BASE_NAME, "prompt": PROMPTS[0], "max_tokens": 4,
                                           "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == hf_tok.encode(PROMPTS[0]) and len(choice["token_ids"]) >= 1
    assert json.loads(http.post("/tokenize", json={"prompt": PROMPTS[0]}).text)["tokens"] == choice["prompt_token_ids"]


def test_a_streamed_completion_gives_each_choice_the_prompt_ids_in_its_first_chunk(http, hf_tok):
    """As non-streamed completions and streamed chats do (vLLM's return_token_ids): it once never came."""
    rng = np.random.default_rng()
    prompt = PROMPTS[int(rng.integers(len(PROMPTS)))]
    body = {"model": BASE_NAME, "prompt": prompt, "max_tokens": 4, "n": 2, "seed": int(rng.integers(2**31)),
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    seen: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            seen.setdefault(choice["index"], []).append(choice)
    assert sorted(seen) == [0, 1]
    for choices in seen.values():
        assert choices[0]["prompt_token_ids"] == hf_tok.encode(prompt)
        assert all("prompt_token_ids" not in c for c in choices[1:])
        assert len([t for c in choices for t in c["token_ids"]]) == 4
