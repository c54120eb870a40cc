"""A chat message's ``content`` given as a list of parts becomes the prompt vLLM's OpenAI server would build for a
text-only model with a string-content chat template: the parts' texts joined by a newline (vLLM's
``vllm/entrypoints/chat_utils.py``, ``_parse_chat_message_content_parts``), with ``text``, ``input_text``,
``output_text``, ``refusal`` and ``thinking`` parts and plain-string parts counted as text. Every other part (an image
on a text-only model, an unknown type, a part with no ``type``, a text part without its text) is refused with a 400
that says why, never a 500 and never dropped silently.

The expected prompts are built independently: the same conversation with each message's content as one string, run
through the tokenizer's chat template, and the template's output written out by hand.
"""

from __future__ import annotations

import types

import httpx
import pytest
from server_fixtures import BASE_NAME, start_server, write_model_with_tokenizer

from slora_jax.model.config import ModelConfig
from slora_jax.serve.protocol import APIError, ChatCompletionRequest, ChatMessage
from slora_jax.serve.request_builder import RequestBuilder
from slora_jax.tools.tokenizer import load_tokenizer

PARTS = [{"type": "text", "text": "first line"}, {"type": "text", "text": "second line"}]
JOINED = "first line\nsecond line"  # what vLLM gives its chat template for PARTS


# ---------------------------------------------------------------- the message's text


@pytest.mark.parametrize("content, text", [
    (PARTS, JOINED),
    ([{"type": "text", "text": "only"}], "only"),
    ([{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}], "a\n\nb"),
    ([{"type": "input_text", "text": "in"}, {"type": "output_text", "text": "out"}], "in\nout"),
    ([{"type": "refusal", "refusal": "no"}, {"type": "text", "text": "then"}], "no\nthen"),
    ([{"type": "thinking", "thinking": "hmm", "closed": True}, {"type": "text", "text": "so"}], "hmm\nso"),
    (["plain", {"type": "text", "text": "part"}], "plain\npart"),  # vLLM takes bare strings as text parts
    ([], ""),
    ("a string stays as it is\n", "a string stays as it is\n"),
    (None, ""),
])
def test_text_parts_are_joined_by_a_newline(content, text):
    assert ChatMessage(role="user", content=content).text() == text


REFUSED = {
    "image_url": ({"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}, "text only"),
    "input_image": ({"type": "input_image", "image_url": "http://example.com/cat.png"}, "text only"),
    "input_audio": ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "text only"),
    "video_url": ({"type": "video_url", "video_url": {"url": "http://example.com/v.mp4"}}, "text only"),
    "unknown-type": ({"type": "banana", "text": "x"}, "unsupported"),
    "no-type": ({"text": "x"}, "no 'type'"),
    "null-type": ({"type": None, "text": "x"}, "no 'type'"),
    "number-type": ({"type": 5, "text": "x"}, "not a string"),
    "text-without-text": ({"type": "text"}, "needs a string 'text'"),
    "text-null": ({"type": "text", "text": None}, "needs a string 'text'"),
    "text-number": ({"type": "text", "text": 5}, "needs a string 'text'"),
    "refusal-without-refusal": ({"type": "refusal", "text": "x"}, "needs a string 'refusal'"),
    "tool_reference": ({"type": "tool_reference", "name": "f"}, "unsupported"),
}


@pytest.mark.parametrize("part, fragment", REFUSED.values(), ids=REFUSED.keys())
def test_other_parts_are_refused_with_a_reason(part, fragment):
    msg = ChatMessage(role="user", content=[{"type": "text", "text": "hi"}, part])
    with pytest.raises(APIError) as e:
        msg.text()
    assert e.value.status == 400 and e.value.param == "messages"
    assert fragment.lower() in e.value.message.lower(), e.value.message
    assert "content part 1" in e.value.message, e.value.message  # which part


# ---------------------------------------------------------------- the prompt through the chat template


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_with_tokenizer(tmp_path_factory.mktemp("parts") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def builder(model_dir, tokenizer):
    """A request builder on the real tokenizer; the engine is only asked for its vocabulary, adapters and whether a
    prompt fits (any does)."""
    engine = types.SimpleNamespace(cfg=ModelConfig.from_model_dir(model_dir), has_adapter=lambda name: False,
                                   check_prompt_length=lambda n_tokens: None)
    b = RequestBuilder(engine, BASE_NAME, tokenizer, max_prompt_chars=100_000, threads=1)
    yield b
    b.close()


def chat(messages, **extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=BASE_NAME, messages=messages, **extra)


def template_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_prompt_equals_the_one_from_joined_string_content(builder, tokenizer):
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    answer = [{"type": "output_text", "text": "ok"}, {"type": "refusal", "refusal": "but no"}]
    parts = [{"role": "system", "content": system}, {"role": "user", "content": PARTS},
             {"role": "assistant", "content": answer},
             {"role": "user", "content": ["bare", {"type": "input_text", "text": "string"}]}]
    strings = [{"role": "system", "content": "Be brief.\nBe kind."}, {"role": "user", "content": JOINED},
               {"role": "assistant", "content": "ok\nbut no"}, {"role": "user", "content": "bare\nstring"}]
    prepared = builder.build_chat(chat(parts))
    assert prepared.prompt_ids == template_ids(tokenizer, strings)
    assert prepared.prompt_ids == builder.build_chat(chat(strings)).prompt_ids
    # and the template's output written out by hand (the tiny tokenizer's template: "role: content\n" per turn)
    by_hand = (f"{tokenizer.bos_token}system: Be brief.\nBe kind.\nuser: first line\nsecond line\n"
               "assistant: ok\nbut no\nuser: bare\nstring\nassistant:")
    assert prepared.prompt_ids == tokenizer(by_hand, add_special_tokens=False)["input_ids"]


def test_prompt_differs_from_parts_run_together(builder, tokenizer):
    """The old join (none at all) gave "first linesecond line": a different prompt from vLLM's."""
    prepared = builder.build_chat(chat([{"role": "user", "content": PARTS}]))
    assert prepared.prompt_ids != template_ids(tokenizer, [{"role": "user", "content": "first linesecond line"}])


def test_refused_part_fails_the_build_with_400_naming_its_message(builder):
    with pytest.raises(APIError) as e:
        builder.build_chat(chat([{"role": "user", "content": "fine"}, {"role": "assistant", "content": "ok"},
                                 {"role": "user", "content": ["also fine", REFUSED["image_url"][0]]}]))
    assert e.value.status == 400 and "image_url" in e.value.message
    assert e.value.message.startswith("messages[2]: content part 1 "), e.value.message


# ---------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("parts-http"), n_adapters=0)
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=300) as client:
        yield client
    server.stop()


def post_chat(http, messages, **extra) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": BASE_NAME, "messages": messages, "max_tokens": 1,
                                                   "temperature": 0, "return_token_ids": True, **extra})


def test_http_prompt_matches_string_content(http, tokenizer):
    r_parts = post_chat(http, [{"role": "user", "content": PARTS}])
    r_string = post_chat(http, [{"role": "user", "content": JOINED}])
    assert r_parts.status_code == 200, r_parts.text
    assert r_string.status_code == 200, r_string.text
    ids = r_parts.json()["choices"][0]["prompt_token_ids"]
    assert ids == r_string.json()["choices"][0]["prompt_token_ids"]
    assert ids == template_ids(tokenizer, [{"role": "user", "content": JOINED}])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("part, fragment", REFUSED.values(), ids=REFUSED.keys())
def test_http_refuses_other_parts_with_400(http, part, fragment, stream):
    r = post_chat(http, [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}], stream=stream)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and err["param"] == "messages"
    assert fragment.lower() in err["message"].lower(), err["message"]


def test_http_still_serves_after_refusals(http):
    assert post_chat(http, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]).status_code == 200



def test_bare_string_part_is_checked_like_text(builder):
    """A bare string part holding a lone surrogate is refused as a text part's would be (tokenizers fail on one)."""
    with pytest.raises(APIError) as e:
        builder.build_chat(chat([{"role": "user", "content": ["ok", "\ud800"]}]))
    assert e.value.status == 400 and "surrogate" in e.value.message
