"""The server on a model with a Llama-2-style SentencePiece tokenizer, whose decoder strips the first decoded token's
leading space: the answer must still be the text its tokens add to the prompt (" the", as vLLM answers), streamed
or not, with echo, and the same as the engine's own detokenizer gives offline."""

from __future__ import annotations

import json

import httpx
import pytest
from server_fixtures import BASE_NAME, SMALL_ENGINE, RunningServer

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams
from slora_jax.model.config import ModelConfig
from slora_jax.serve.config import ServerConfig
from slora_jax.serve.server import Server
from slora_jax.tools import synth
from slora_jax.tools.tokenizer import load_tokenizer, write_tokenizer

PROMPT = "The capital of France is"
WORD = "\u2581the"  # a piece that starts a word: decoded first and alone, its space is stripped


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model_dir = synth.write_model(tmp_path_factory.mktemp("sp") / "model", "tiny", seed=3)
    write_tokenizer(model_dir, ModelConfig.from_model_dir(model_dir).vocab_size, style="sentencepiece")
    engine = Engine.from_model_dir(model_dir, EngineConfig(**SMALL_ENGINE), tokenizer=load_tokenizer(model_dir),
                                   progress=False)
    server = Server(engine, ServerConfig(served_model_name=BASE_NAME), host="127.0.0.1", port=0,
                    log_level="warning", tokenizer=load_tokenizer(model_dir))
    server.start_background()
    yield RunningServer(server, engine, model_dir, model_dir, [], None)
    server.stop()


def forced(srv, **body) -> dict:
    """A greedy completion whose tokens are all ``WORD`` (logit_bias), so each starts a word."""
    word = srv.tokenizer.convert_tokens_to_ids(WORD)
    return {"model": BASE_NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "return_token_ids": True,
            "logit_bias": {str(word): 100}, **body}


def post(srv, body: dict) -> dict:
    r = httpx.post(srv.base_url + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_answer_keeps_its_leading_space(srv):
    tok = srv.tokenizer
    choice = post(srv, forced(srv))
    ids = choice["token_ids"]
    assert tok.convert_ids_to_tokens(ids) == [WORD] * 3
    assert tok.decode(ids, skip_special_tokens=True) == "the the the"  # the decoder strips the first space
    assert choice["text"] == " the the the"
    assert post(srv, forced(srv, echo=True))["text"] == PROMPT + " the the the"
    r = httpx.post(srv.base_url + "/completions", json=forced(srv, stream=True), timeout=120)
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert "".join(c["text"] for e in events for c in e["choices"]) == " the the the"


def test_stop_string_with_a_leading_space_matches_at_the_start(srv):
    choice = post(srv, forced(srv, stop=[" the"]))
    assert choice["finish_reason"] == "stop" and choice["text"] == ""


def test_offline_text_agrees_with_the_servers(srv):
    """The engine's own detokenizer (offline, stop strings watched) starts from the prompt's ids too."""
    tok = srv.tokenizer
    word = tok.convert_tokens_to_ids(WORD)
    sampling = SamplingParams(max_tokens=3, temperature=0.0, logit_bias=((word, 100.0),), stop=("zzqq",))
    outs = srv.call(lambda: list(srv.engine.stream(tok.encode(PROMPT), None, sampling)), timeout=300)
    assert "".join(o.text for o in outs) == " the the the"
