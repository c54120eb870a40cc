"""Bad input and faults: each gets a precise JSON error ({"error": {"message", "type", "code"}}) and the server keeps
serving, which every test checks with a successful request right after the fault.

The server here is deliberately tight: an API key, a waiting queue of 4, a 1024-token context but a pool of only 48
pages (768 tokens), max LoRA rank 16, and an extra allowed upload dir for runtime adapter loads.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
import time

import httpx
import openai
import pytest
from server_fixtures import BASE_NAME, start_server

from slora_jax.model.config import ModelConfig
from slora_jax.serve.protocol import APIError
from slora_jax.tools import synth

KEY = "test-key-123"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    (root / "uploads").mkdir()
    (root / "outside").mkdir()
    server = start_server(root, n_adapters=3, api_key=KEY, allowed_dirs=(root / "uploads",), ranks=(4, 8),
                          max_waiting=4, max_model_len=1024, max_prefill_tokens=1024, num_pages=48, max_lora_rank=16)
    server.root = root
    yield server
    server.stop()


@pytest.fixture
def slow_engine(srv):
    """Steps take at least 20 ms, so a long request is surely still running when its client goes away."""
    engine, real_step = srv.engine, srv.engine.step

    def slow_step():
        time.sleep(0.02)
        return real_step()

    engine.step = slow_step
    yield
    engine.step = real_step


@pytest.fixture(scope="module")
def cfg(srv):
    return ModelConfig.from_model_dir(srv.model_dir)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120) as client:
        yield client


def assert_error(r: httpx.Response, status: int, fragment: str = "") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    err = body["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == status
    assert fragment.lower() in err["message"].lower(), err["message"]
    return err


def assert_serving(http: httpx.Client, model: str = BASE_NAME) -> None:
    r = http.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def completion(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": BASE_NAME, "prompt": "Hi", "max_tokens": 2, **body})


# ---------------------------------------------------------------- malformed requests


def test_malformed_json(http):
    r = http.post("/v1/completions", content=b'{"model": "tiny-test", "prompt": ', headers={
        "Content-Type": "application/json"})
    assert_error(r, 400, "malformed JSON")
    assert_serving(http)


@pytest.mark.parametrize("path, body, fragment", [
    ("/v1/completions", {}, "required"),
    ("/v1/completions", {"model": BASE_NAME}, "prompt"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/chat/completions", {"model": BASE_NAME}, "messages"),
    ("/v1/chat/completions", {"model": BASE_NAME, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": BASE_NAME, "messages": [{"content": "no role"}]}, "role"),
    ("/v1/completions", {"model": BASE_NAME, "prompt": "hi", "max_tokens": "lots"}, "max_tokens"),
    ("/v1/completions", {"model": BASE_NAME, "prompt": 5}, "prompt"),
    ("/v1/completions", [1, 2, 3], ""),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path"),
])
def test_missing_or_wrong_fields_are_400_not_422(http, path, body, fragment):
    assert_error(http.post(path, json=body), 400, fragment)
    assert_serving(http)


def test_empty_body(http):
    assert_error(http.post("/v1/completions", content=b"", headers={"Content-Type": "application/json"}), 400)
    assert_serving(http)


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)
    assert_serving(http)


# ---------------------------------------------------------------- unknown model, lengths, sampling


def test_unknown_model_is_404(http, srv):
    err = assert_error(completion(http, model="no-such-adapter"), 404, "no-such-adapter")
    assert err["type"] == "not_found_error"
    chat = {"model": "no-such-adapter", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(http.post("/v1/chat/completions", json=chat), 404)
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert_serving(http)


def test_prompt_longer_than_context(http, srv):
    assert_error(completion(http, prompt=[5] * 1100), 400, "context")
    long_text = "The quick brown fox jumps over the lazy dog. " * 200
    assert len(srv.tokenizer.encode(long_text)) > 1024
    assert_error(completion(http, prompt=long_text), 400, "context")
    chat = {"model": BASE_NAME, "messages": [{"role": "user", "content": long_text}]}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, "context")
    assert_serving(http)


@pytest.mark.parametrize("max_tokens, fragment", [(0, "max_tokens"), (-5, "max_tokens"), (2000, "context")])
def test_max_tokens_out_of_range(http, max_tokens, fragment):
    assert_error(completion(http, max_tokens=max_tokens), 400, fragment)
    assert_serving(http)


def test_request_larger_than_the_pool_is_refused_not_queued_forever(http):
    # fits the 1024-token context but not the 768-token pool: it could never be admitted
    assert_error(completion(http, prompt=[5] * 10, max_tokens=900), 400, "pool")
    # chat without max_tokens gets what fits, not the whole context
    chat = {"model": BASE_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": None,
            "stop_token_ids": list(range(512))}  # any token stops it: the test only needs admission
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert_serving(http)


@pytest.mark.parametrize("extra, fragment", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": 1000}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"seed": -2}, "seed"),  # -1 is vLLM's "no seed"
    ({"n": 17}, "n must be"),
    ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": 0}, "echo"),
    ({"presence_penalty": 2.5}, "penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"prompt": ["a", "b"]}, "batch"),
    ({"prompt": [1, 2, 999999]}, "token ids"),
])
def test_invalid_sampling_values(http, extra, fragment):
    assert_error(completion(http, **extra), 400, fragment)
    assert_serving(http)


def test_chat_top_logprobs_needs_logprobs(http, srv):
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=BASE_NAME, messages=[{"role": "user", "content": "hi"}],
                                       top_logprobs=2)
    assert_serving(http)


# ---------------------------------------------------------------- adapter loading


def _write_good(path, cfg, rank=4):
    return synth.write_adapter(path, cfg, rank=rank, seed=77)


def _truncated_config(path, cfg):
    _write_good(path, cfg)
    text = (path / "adapter_config.json").read_text()
    (path / "adapter_config.json").write_text(text[: len(text) // 2])


def _garbage_weights(path, cfg):
    _write_good(path, cfg)
    (path / "adapter_model.safetensors").write_bytes(b"\x00\x01not a safetensors file" * 10)


def _wrong_shapes(path, cfg):
    mha = ModelConfig.from_dict(synth.preset_config("tiny-mha"))  # k/v projections twice as wide
    synth.write_adapter(path, mha, rank=4, seed=5)


def _rank_too_high(path, cfg):
    _write_good(path, cfg, rank=32)


def _missing_weights(path, cfg):
    _write_good(path, cfg)
    (path / "adapter_model.safetensors").unlink()


def _not_lora(path, cfg):
    _write_good(path, cfg)
    conf = json.loads((path / "adapter_config.json").read_text())
    conf["peft_type"] = "PREFIX_TUNING"
    (path / "adapter_config.json").write_text(json.dumps(conf))


@pytest.mark.parametrize("make, fragment", [
    (_truncated_config, "adapter_config.json"),
    (_garbage_weights, "safetensors"),
    (_wrong_shapes, "do not match"),
    (_rank_too_high, "rank 32"),
    (_missing_weights, "adapter_model.safetensors"),
    (_not_lora, "peft_type"),
    (None, "not a directory"),
])
def test_corrupt_or_mismatched_adapter_is_400_with_reason(http, srv, cfg, make, fragment):
    name = f"bad-{make.__name__.strip('_') if make else 'missing'}"
    path = srv.root / "uploads" / name
    if make is not None:
        make(path, cfg)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    err = assert_error(r, 400, fragment)
    assert name in err["message"] or make is None
    models = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert name not in models
    assert_error(completion(http, model=name), 404)
    assert_serving(http)


def test_slow_adapter_loads_hold_up_no_other_route(http, srv, cfg, monkeypatch):
    """Adapter loads run in admin threads of their own, and past ADMIN_PENDING a load is refused (503, Retry-After)
    instead of queued: 69 loads that hang (a slow disk) leave /health and completions answering at once. (They ran
    in Starlette's shared pool of 40 threads, which every route's dependency also needed: /health took seconds.)"""
    import concurrent.futures

    from slora_jax.serve.adapters import ADMIN_PENDING

    path = _write_good(srv.root / "uploads" / "slow-one", cfg)
    assert_serving(http)  # compiled before the clock runs
    admin, gate = srv.server.app.state.ctx.adapters, threading.Event()
    real = admin.register

    def hanging_register(name, p):
        assert gate.wait(60)
        raise APIError(400, f"{name}: not loaded (test)", "lora_name")

    monkeypatch.setattr(admin, "register", hanging_register)
    extra = 5

    def load(i):
        return httpx.post(srv.url + "/v1/load_lora_adapter", headers=srv.headers, timeout=120,
                          json={"lora_name": f"slow-{i}", "lora_path": str(path)})

    with concurrent.futures.ThreadPoolExecutor(ADMIN_PENDING + extra) as pool:
        loads = [pool.submit(load, i) for i in range(ADMIN_PENDING + extra)]
        try:
            deadline = time.monotonic() + 30
            while sum(f.done() for f in loads) < extra and time.monotonic() < deadline:
                time.sleep(0.05)
            t0 = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
            assert_serving(http)
            assert time.monotonic() - t0 < 5
            refused = [f.result() for f in loads if f.done()]
            assert len(refused) == extra and all(r.status_code == 503 and r.headers.get("retry-after")
                                                 for r in refused), [r.text for r in refused]
        finally:
            gate.set()
        assert sorted(f.result().status_code for f in loads) == [400] * ADMIN_PENDING + [503] * extra
    monkeypatch.setattr(admin, "register", real)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "slow-ok", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    assert_serving(http, "slow-ok")


def test_load_from_outside_allowed_dirs_is_403(http, srv, cfg):
    outside = _write_good(srv.root / "outside" / "evil", cfg)
    assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": str(outside)}), 403)
    assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": "../outside/evil"}),
                 403)
    link = srv.root / "uploads" / "sneaky-link"
    os.symlink(outside, link)
    assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": str(link)}), 403)
    assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": "/etc"}), 403)
    assert "evil" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert_serving(http)


def test_load_use_unload_cycle(http, srv, cfg):
    _write_good(srv.root / "uploads" / "fresh", cfg, rank=8)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": "fresh"})  # relative: uploads/
    assert r.status_code == 200, r.text
    assert "fresh" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert_serving(http, model="fresh")
    dup = http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": "fresh"})
    assert_error(dup, 400, "already")
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"}).status_code == 200
    assert_error(completion(http, model="fresh"), 404)
    assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"}), 404)
    assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": BASE_NAME}), 400)
    assert_serving(http)


def test_unload_while_in_use_is_409(http, srv, cfg, slow_engine):
    _write_good(srv.root / "uploads" / "busy", cfg)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": "busy"}).status_code == 200
    body = {"model": "busy", "prompt": "Hi", "max_tokens": 600, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}), 409, "busy")
    srv.wait_idle()
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}).status_code == 200
    assert_serving(http)


# ---------------------------------------------------------------- auth, overload, disconnects, engine faults


def test_api_key(srv, http):
    url = srv.url + "/v1/models"
    assert_error(httpx.get(url), 401, "missing")
    assert_error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401, "invalid")
    assert_error(httpx.get(url, headers={"Authorization": f"Basic {KEY}"}), 401)
    assert_error(httpx.post(srv.url + "/v1/completions", json={"model": BASE_NAME, "prompt": "hi"}), 401)
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200  # operations endpoints stay open
    assert httpx.get(srv.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0).models.list()
    assert_serving(http)


@pytest.mark.parametrize("header, ok", [
    (f"Bearer {KEY}", True),
    (f"bearer {KEY}", True),  # RFC 7235: the scheme is case-insensitive
    (f"BEARER {KEY}", True),
    (f"Bearer  {KEY}", True),  # RFC 6750: "Bearer" 1*SP token
    (f"Bearer {KEY} ", True),  # HTTP drops the whitespace around a header value before anyone sees it
    (f"Bearer\t{KEY}", False),
    (f"Bearer {KEY}x", False),
    (f"Bearer {KEY[:-1]}", False),
    (f"Bearer {KEY} {KEY}", False),
    (f"Bearer{KEY}", False),
    (KEY, False),
    ("Bearer", False),
    ("Bearer ", False),
    (f"Token {KEY}", False),
])
def test_authorization_header_variants(srv, header, ok):
    """The rule in docs/SERVING.md: scheme case-insensitive, one or more spaces, then exactly the key. Sent raw, as
    clients (httpx included) refuse to send some of these."""
    with socket.create_connection(("127.0.0.1", srv.server.port), timeout=30) as s:
        s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: {header}\r\nConnection: close\r\n\r\n"
                  .encode())
        response = b""
        while chunk := s.recv(65536):
            response += chunk
    status = int(response.split(b" ", 2)[1])
    assert status == (200 if ok else 401), response[:300]
    if not ok:
        assert b"API key" in response


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
def test_docs_are_off_when_an_api_key_is_set(srv, path):
    assert httpx.get(srv.url + path).status_code == 404
    assert httpx.get(srv.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


@pytest.mark.parametrize("key", ["", " ", "\t", " padded", "padded "])
def test_a_key_that_cannot_protect_anything_is_refused_at_start_up(key):
    """An empty --api-key used to turn authentication off without a word; one with surrounding whitespace could
    never match (HTTP strips it from header values)."""
    from slora_jax.serve.cli import main
    from slora_jax.serve.config import ServerConfig

    with pytest.raises(ValueError, match="API key"):
        ServerConfig(served_model_name="m", api_key=key)
    with pytest.raises(SystemExit) as exited:  # before any model is loaded
        main(["--api-key", key, "--model", "/nonexistent"])
    assert exited.value.code == 2


def test_queue_full_is_429(srv, http):
    srv.wait_idle()

    async def burst():
        async with httpx.AsyncClient(base_url=srv.url, headers=srv.headers, timeout=120) as client:
            body = {"model": BASE_NAME, "prompt": "Hi", "max_tokens": 2}
            with srv.server.engine_thread.hold():  # the engine queues but does not step: waiting fills up
                tasks = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(5)]
                done, _ = await asyncio.wait(tasks, timeout=30, return_when=asyncio.FIRST_COMPLETED)
                assert done, "no request was refused while the queue was full"
            return await asyncio.gather(*tasks)

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200, 200, 200, 429], [r.text for r in responses]
    err = assert_error(next(r for r in responses if r.status_code == 429), 429, "busy")
    assert err["type"] == "rate_limit_error"
    assert_serving(http)


def _metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_client_disconnect_aborts_and_frees_pages(srv, http, slow_engine):
    before = srv.wait_idle()
    dropped_metric = 'slora_request_finish_total{reason="client_disconnect"}'
    dropped_before = _metric(srv, dropped_metric)
    body = {"model": BASE_NAME, "prompt": "Tell me everything", "max_tokens": 700, "ignore_eos": True}
    for kind in ("completions", "chat/completions"):
        req = dict(body, stream=True)
        if kind.startswith("chat"):
            req = dict(req, messages=[{"role": "user", "content": "Tell me everything"}])
            del req["prompt"]
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60) as client:
            with client.stream("POST", f"/v1/{kind}", json=req) as r:
                lines = r.iter_lines()
                seen = [line for _, line in zip(range(6), lines, strict=False)]
                assert any(line.startswith("data: {") for line in seen)
            # leaving both blocks drops the connection mid-stream
    with pytest.raises(httpx.TimeoutException):  # a non-streaming client that gives up
        httpx.post(srv.url + "/v1/completions", json=body, headers=srv.headers, timeout=1.0)
    after = srv.wait_idle(timeout=60)
    assert after["pool"] == before["pool"]
    assert after["steps"] - before["steps"] < 700  # aborted long before their 700 tokens
    assert _metric(srv, dropped_metric) - dropped_before == 3
    assert_serving(http)


def test_engine_step_failure_fails_only_that_step_and_keeps_serving(srv, http):
    srv.wait_idle()
    engine = srv.engine
    real_step = engine.step

    def failing_step():
        engine.step = real_step  # once
        real_step()
        raise RuntimeError("injected step failure")

    engine.step = failing_step
    try:
        r = completion(http, max_tokens=4)
    finally:
        engine.step = real_step
    err = assert_error(r, 500, "engine step failed")
    assert err["type"] == "server_error"
    after = srv.wait_idle()
    assert after["pool"]["pages_kv"] == 0
    assert httpx.get(srv.url + "/health").status_code == 200
    assert_serving(http)


def test_a_failed_prefill_fails_its_requests_once_and_keeps_serving(srv, http):
    """The prefill step itself raises: the engine puts its batch back to wait (an offline caller may step again),
    and the server still fails those requests with the step's error, as it does a running batch, rather than
    retrying a step that may fail the same way until every open request is ended."""
    srv.wait_idle()
    runner, calls = srv.engine.runner, []
    real_prefill = runner.prefill

    def failing_prefill(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected prefill failure")
        return real_prefill(*args, **kw)

    runner.prefill = failing_prefill
    try:
        r = completion(http, max_tokens=4)
    finally:
        runner.prefill = real_prefill
    assert_error(r, 500, "injected prefill failure")
    after = srv.wait_idle()
    assert after["pool"]["pages_kv"] == 0 and after["waiting"] == 0 and len(calls) == 1
    assert_serving(http)


def test_repeated_step_failures_end_requests_instead_of_hanging(srv, http):
    srv.wait_idle()
    engine = srv.engine
    real_step, calls = engine.step, []

    def broken_step():  # fails before doing anything, as a scheduler bug on the waiting head would
        calls.append(1)
        if len(calls) >= 3:
            engine.step = real_step
        raise RuntimeError("injected admission failure")

    engine.step = broken_step
    try:
        r = completion(http, max_tokens=4)
    finally:
        engine.step = real_step
    assert_error(r, 500, "keep failing")
    srv.wait_idle()
    assert_serving(http)
    assert httpx.get(srv.url + "/health").status_code == 200
