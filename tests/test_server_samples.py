"""``n`` through the HTTP server and the real ``openai`` client: completions and chat, streamed and not.

Choices are indexed 0..n-1 (streamed chunks carry their index); greedy choices equal the offline greedy answer;
seeded choices are reproducible, differ from each other, and choice 0 is what ``n=1`` with the same seed answers;
stop strings end one choice alone; usage counts the prompt once; ``best_of`` answers the samples of highest
cumulative logprob; bad ``n`` / ``best_of`` are 400s; nothing is left in the pool.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import httpx
import openai
import pytest
from server_fixtures import BASE_NAME, start_server

from slora_jax.engine.forks import MAX_SAMPLES
from slora_jax.engine.sampling import SamplingParams

MAX_TOKENS = 6
PROMPT = "Once upon a time there was"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("samples"), n_adapters=3, num_pages=96)  # 1536 tokens of KV
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=600)


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def _assert_idle_and_freed(srv):
    stats = srv.wait_idle()
    assert stats["pool"]["pages_kv"] == 0
    assert srv.call(lambda: srv.engine.scheduler.fork_pages.num_pages) == 0


def test_greedy_choices_equal_the_offline_answer(client, srv):
    tok = srv.tokenizer
    model = srv.adapters[1]
    (want,) = srv.offline_generate([tok.encode(PROMPT)], [model], SamplingParams(max_tokens=MAX_TOKENS,
                                                                                 temperature=0.0))
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, n=3,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(_ids(c) == want for c in r.choices)
    assert all(c.text == tok.decode(want, skip_special_tokens=True) for c in r.choices)
    assert r.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert r.usage.completion_tokens == 3 * len(want)
    _assert_idle_and_freed(srv)


def test_seeded_choices_are_reproducible_and_distinct(client, srv):
    kw = dict(model=srv.adapters[2], messages=[{"role": "user", "content": "Tell me a story."}],
              max_tokens=MAX_TOKENS, temperature=1.2, seed=4242, extra_body={"return_token_ids": True})
    a = client.chat.completions.create(n=4, **kw)
    b = client.chat.completions.create(n=4, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [_ids(c) for c in a.choices] == [_ids(c) for c in b.choices]
    assert len({tuple(_ids(c)) for c in a.choices}) > 1, "samples should differ"
    one = client.chat.completions.create(n=1, **kw)
    assert _ids(one.choices[0]) == _ids(a.choices[0])  # choice 0 uses the request's seed, as n=1 does
    assert a.usage.completion_tokens == sum(len(_ids(c)) for c in a.choices)
    _assert_idle_and_freed(srv)


def test_completion_stream_interleaves_indexed_choices(client, srv):
    kw = dict(model=BASE_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=77, n=3,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text, ids, finish = defaultdict(str), defaultdict(list), defaultdict(list)
    for chunk in chunks:
        for c in chunk.choices:
            text[c.index] += c.text
            ids[c.index] += c.model_extra["token_ids"] or []
            if c.finish_reason is not None:
                finish[c.index].append(c.finish_reason)
    assert sorted(text) == [0, 1, 2]
    for c in full.choices:
        assert text[c.index] == c.text and ids[c.index] == _ids(c)
        assert finish[c.index] == [c.finish_reason] == ["length"]  # one final chunk per choice
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 3 * MAX_TOKENS
    _assert_idle_and_freed(srv)


def test_chat_stream_sends_a_role_chunk_per_choice(client, srv):
    kw = dict(model=srv.adapters[0], messages=[{"role": "user", "content": "Hi there"}], max_tokens=MAX_TOKENS,
              temperature=0.8, seed=5, n=2)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    roles = [c.index for chunk in chunks for c in chunk.choices if c.delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    content = defaultdict(str)
    for chunk in chunks:
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
    assert [content[i] for i in range(2)] == [c.message.content for c in full.choices]
    _assert_idle_and_freed(srv)


def test_a_stop_string_ends_its_choice_alone(client, srv):
    tok = srv.tokenizer
    kw = dict(model=BASE_NAME, prompt=PROMPT, max_tokens=3 * MAX_TOKENS, temperature=1.0, seed=9, n=6,
              extra_body={"ignore_eos": True})
    free = client.completions.create(**kw)
    # a stop string from one choice's text: that choice is cut there, every choice ends before its first match
    text = next(c.text for c in free.choices if len(c.text.strip()) > 4)
    stop = text.strip()[2:4]
    cut = client.completions.create(stop=[stop], **kw)
    assert any(c.finish_reason == "stop" for c in cut.choices)
    for before, after in zip(free.choices, cut.choices, strict=True):
        if stop in before.text:
            assert after.finish_reason == "stop" and after.text == before.text[:before.text.find(stop)]
        else:
            assert after.finish_reason == "length" and after.text == before.text
    assert tok is not None
    _assert_idle_and_freed(srv)


@pytest.mark.parametrize("body, fragment", [
    ({"n": 0}, "n must be"),
    ({"n": -2}, "n must be"),
    ({"n": MAX_SAMPLES + 1}, "n must be"),
    ({"n": 8, "max_tokens": 200}, "n=8 samples"),  # 8 x 13 pages do not fit the 96-page pool together
    ({"n": 3, "best_of": 2}, "best_of must be"),
    ({"best_of": MAX_SAMPLES + 1}, "best_of must be"),
    ({"n": 1, "best_of": 2, "stream": True}, "cannot be streamed"),
])
def test_bad_n_is_a_400(srv, body, fragment):
    for path, extra in (("/completions", {"prompt": PROMPT}), ("/chat/completions",
                                                               {"messages": [{"role": "user", "content": "hi"}]})):
        if "best_of" in body and path != "/completions":
            continue
        r = httpx.post(srv.base_url + path, json={"model": BASE_NAME, **extra, **body}, timeout=600)
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]["message"]
        assert r.json()["error"]["param"] in ("n", "best_of")
    _assert_idle_and_freed(srv)


def test_best_of_answers_the_most_likely_samples(client, srv):
    kw = dict(model=srv.adapters[1], prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=31,
              extra_body={"ignore_eos": True})
    every = client.completions.create(n=5, logprobs=0, **kw)  # the same seed: the same 5 samples
    scores = [sum(c.logprobs.token_logprobs) for c in every.choices]
    order = sorted(range(5), key=lambda i: scores[i], reverse=True)[:2]
    best = client.completions.create(n=2, best_of=5, logprobs=0, **kw)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [every.choices[i].text for i in order]
    assert [c.logprobs.token_logprobs for c in best.choices] == [every.choices[i].logprobs.token_logprobs
                                                                  for i in order]
    assert best.usage.completion_tokens == 5 * MAX_TOKENS  # every sample generated counts
    plain = client.completions.create(n=2, best_of=5, **kw)  # logprobs on only to rank: not in the answer
    assert [c.text for c in plain.choices] == [c.text for c in best.choices]
    assert all(c.logprobs is None for c in plain.choices)
    _assert_idle_and_freed(srv)


def test_a_client_leaving_a_stream_frees_every_sample(srv):
    async def run():
        body = {"model": BASE_NAME, "prompt": PROMPT, "max_tokens": 40, "n": 4, "stream": True,
                "ignore_eos": True}
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=600) as http:
            async with http.stream("POST", "/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        return  # leave after the first chunk

    asyncio.run(run())
    _assert_idle_and_freed(srv)
