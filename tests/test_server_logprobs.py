"""Logprobs, echo, penalties, logit_bias and min_tokens through the real ``openai`` client, whole and streamed.

Logprobs must equal PEFT's log-softmax on the exact token ids (they come back through ``return_token_ids``); streamed
chunks must add up to the whole answer; bad values are 400s that name the field; nothing compiles after warm-up.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch
from hf_reference import hf_logits
from server_fixtures import BASE_NAME, start_server

from slora_jax.engine.sampling import MAX_LOGIT_BIAS, SamplingParams

PROMPT = "Once upon a time there was"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("logprobs"), n_adapters=2, warmup=True, max_model_len=64,
                          max_prefill_tokens=64, max_batch_size=4, decode_lora_variants=False, prefix_cache=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)


def _ref(srv, ids: list[int], model: str) -> np.ndarray:
    """PEFT's log-softmax [len(ids), vocab] for the model / adapter the request named."""
    adapter = None if model == BASE_NAME else srv.adapter_dir / model
    return torch.log_softmax(torch.from_numpy(hf_logits(srv.model_dir, ids, adapter)).double(), -1).numpy()


_TEXTS: dict[int, str] = {}


def _text(srv, token_id: int) -> str:
    if token_id not in _TEXTS:
        _TEXTS[token_id] = srv.tokenizer.decode([token_id])
    return _TEXTS[token_id]


def _check_completion_logprobs(srv, lp, ids: list[int], n_prompt: int, model: str, k: int, echo: bool) -> None:
    ref = _ref(srv, ids, model)
    first = 0 if echo else n_prompt
    assert lp.tokens == [_text(srv, t) for t in ids[first:]]
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    for pos, (tok_lp, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, strict=True), start=first):
        if pos == 0:
            assert tok_lp is None and top is None
            continue
        want = ref[pos - 1]
        np.testing.assert_allclose(tok_lp, want[ids[pos]], rtol=1e-4, atol=1e-6)
        best = np.argsort(-want)[:k]
        assert set(top) <= {_text(srv, t) for t in best} | {_text(srv, ids[pos])} and len(top) >= min(k, 1)
        for text, value in top.items():  # a text may decode from several ids: the likeliest one's logprob
            same = [t for t in range(len(want)) if _text(srv, t) == text]
            np.testing.assert_allclose(value, want[same].max(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("echo", [False, True])
def test_completion_logprobs_equal_peft_whole_and_streamed(client, srv, echo):
    model = srv.adapters[1]
    body = dict(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, echo=echo,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    r = client.completions.create(**body)
    choice = r.choices[0]
    prompt_ids, out_ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    assert len(out_ids) == 5 and choice.text.startswith(PROMPT) == echo
    _check_completion_logprobs(srv, choice.logprobs, prompt_ids + out_ids, len(prompt_ids), model, 3, echo)
    # the stream's chunks add up to the same answer
    chunks = list(client.completions.create(**body, stream=True))
    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert sum((lp.tokens for lp in lps), []) == choice.logprobs.tokens
    assert sum((lp.token_logprobs for lp in lps), []) == choice.logprobs.token_logprobs
    assert sum((lp.top_logprobs for lp in lps), []) == choice.logprobs.top_logprobs
    assert sum((lp.text_offset for lp in lps), []) == choice.logprobs.text_offset


def test_echo_with_max_tokens_zero_scores_the_prompt(client, srv):
    """What lm-evaluation-harness' loglikelihood asks: the prompt's own logprobs, nothing generated; the prompt's
    cached prefix (an earlier request) is not used, so every token is scored."""
    tok = srv.tokenizer
    ids = tok.encode(PROMPT + " in a small village")
    client.completions.create(model=BASE_NAME, prompt=ids, max_tokens=1)  # fills the prefix cache
    r = client.completions.create(model=BASE_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
    _check_completion_logprobs(srv, choice.logprobs, ids, len(ids), BASE_NAME, 1, echo=True)
    # echo without logprobs: the prompt, no logprobs
    r = client.completions.create(model=BASE_NAME, prompt=PROMPT, max_tokens=0, echo=True)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs is None


def test_chat_logprobs_equal_peft_whole_and_streamed(client, srv):
    model = srv.adapters[0]
    body = dict(model=model, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=6, temperature=0,
                logprobs=True, top_logprobs=4, extra_body={"return_token_ids": True, "ignore_eos": True})
    r = client.chat.completions.create(**body)
    choice = r.choices[0]
    prompt_ids, out_ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    ref = _ref(srv, prompt_ids + out_ids, model)
    content = choice.logprobs.content
    assert [c.token for c in content] == [_text(srv, t) for t in out_ids]
    for j, entry in enumerate(content):
        want = ref[len(prompt_ids) + j - 1]
        np.testing.assert_allclose(entry.logprob, want[out_ids[j]], rtol=1e-4, atol=1e-6)
        # a piece of a character reports its own bytes (below: they join to the text), the others their text's
        assert entry.bytes == list(entry.token.encode()) if "\ufffd" not in entry.token else \
            bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 4
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], np.sort(want)[::-1][:4], rtol=1e-4,
                                   atol=1e-6)
        assert [t.token for t in entry.top_logprobs] == [_text(srv, t) for t in np.argsort(-want)[:4]]
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == choice.message.content
    streamed = [e for c in client.chat.completions.create(**body, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # logprobs without top_logprobs: the chosen tokens only
    r = client.chat.completions.create(**{**body, "top_logprobs": None})
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_penalties_bias_and_min_tokens_through_the_client(client, srv):
    """The server passes every field through: the greedy answer equals the engine's own for the same settings, and
    a +100 bias on EOS ends the answer right after min_tokens."""
    tok = srv.tokenizer
    ids = tok.encode(PROMPT)
    bias = {str(t): float(b) for t, b in ((11, 4.0), (40, -3.0), (7, 1.5))}
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.6,
                        repetition_penalty=1.4, logit_bias=tuple((int(k), v) for k, v in bias.items()))
    [want] = srv.offline_generate([ids], [srv.adapters[1]], sp)
    for stream in (False, True):
        body = dict(model=srv.adapters[1], prompt=ids, max_tokens=10, temperature=0, presence_penalty=0.8,
                    frequency_penalty=0.6, logit_bias=bias,
                    extra_body={"repetition_penalty": 1.4, "ignore_eos": True, "return_token_ids": True})
        if stream:
            got = sum((c.choices[0].model_extra.get("token_ids") or [] for c in
                       client.completions.create(**body, stream=True) if c.choices), [])
        else:
            got = client.completions.create(**body).choices[0].model_extra["token_ids"]
        assert got == want
    [plain] = srv.offline_generate([ids], [srv.adapters[1]], SamplingParams(max_tokens=10, temperature=0.0,
                                                                             ignore_eos=True))
    assert plain != want  # the settings did something
    eos = srv.engine.cfg.eos_token_id[0]
    r = client.chat.completions.create(model=BASE_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=9,
                                       temperature=0, logit_bias={str(eos): 100},
                                       extra_body={"min_tokens": 4, "return_token_ids": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["token_ids"][4:] == [eos]


@pytest.mark.parametrize("path, body, field", [
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 0, "echo": False, "logprobs": 1}, "max_tokens"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
])
def test_bad_values_are_400_with_the_field_named(client, srv, path, body, field):
    kw = {"model": BASE_NAME, "max_tokens": 2}
    if path == "chat":
        kw["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        kw["prompt"] = "Hi"
    standard = {"logprobs", "max_tokens", "logit_bias", "presence_penalty", "frequency_penalty", "top_logprobs",
                "echo"}
    kw.update({k: v for k, v in body.items() if k in standard})
    extra = {k: v for k, v in body.items() if k not in standard}
    create = client.chat.completions.create if path == "chat" else client.completions.create
    with pytest.raises(openai.BadRequestError) as err:
        create(**kw, extra_body=extra)
    assert field in str(err.value)


@pytest.mark.parametrize("body, field", [({"temperature": 101}, "temperature"), ({"seed": -2}, "seed"),
                                         ({"top_p": 0}, "top_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                                         ({"min_tokens": 9, "max_tokens": 3}, "min_tokens")])
def test_the_samplers_refusals_name_their_field_as_param(client, body, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=BASE_NAME, prompt="Hi", extra_body={"max_tokens": 3, **body})
    assert err.value.param == field and field in str(err.value)


def test_vllms_spellings_of_its_defaults_are_taken(client, srv):
    """seed -1 (no seed), null penalties, chat top_logprobs 0 without logprobs, and a bias beyond +-100 (clamped to
    the bound, as vLLM does) are accepted, each answering as its plain spelling does."""
    rng = np.random.default_rng()
    kw = {"model": BASE_NAME, "prompt": "Hi", "max_tokens": 6, "temperature": 0}

    def ids(**extra):
        r = client.completions.create(**kw, extra_body={"return_token_ids": True, **extra})
        return r.choices[0].model_extra["token_ids"]

    plain = ids()
    assert ids(seed=-1) == plain  # greedy: no seed changes nothing
    assert ids(presence_penalty=None, frequency_penalty=None, repetition_penalty=None) == plain
    tok = int(rng.integers(10, srv.engine.cfg.vocab_size))
    at_bound = ids(logit_bias={str(tok): 100}, ignore_eos=True)
    assert at_bound == [tok] * 6 and ids(logit_bias={str(tok): 250}, ignore_eos=True) == at_bound
    low = ids(logit_bias={str(plain[0]): -100})
    assert low[0] != plain[0] and ids(logit_bias={str(plain[0]): -1e9}) == low
    r = client.chat.completions.create(model=BASE_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=0, top_logprobs=0)
    assert r.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=BASE_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       top_logprobs=1)


def test_no_compile_after_warm_up(srv):
    assert srv.engine.compiles_since_warmup() == 0
