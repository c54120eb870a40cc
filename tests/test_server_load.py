"""A bounded loopback load test: 240 concurrent streaming requests over 24 adapters against the real server.

Every request must end in exactly one of two ways: completed (all its tokens, then ``[DONE]``) or refused with
429/503 (the waiting queue is capped at 128, so some may be). None may be lost or hang (each has a deadline and the
whole run a bound), and at the end the engine must be idle with every KV page back in the pool.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from server_fixtures import BASE_NAME, start_server

N_REQUESTS = 240
N_ADAPTERS = 24
REQUEST_TIMEOUT_S = 120
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("load"), n_adapters=N_ADAPTERS, max_waiting=128)
    yield server
    server.stop()


async def _one(client: httpx.AsyncClient, i: int, model: str, max_tokens: int) -> tuple[str, str]:
    """('ok' | 'rejected' | 'bad', detail) for one streaming request."""
    chat = i % 2 == 1
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0.7,
            "seed": i, "return_token_ids": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Request number {i}: tell me a story."}]
    else:
        body["prompt"] = f"Request number {i}: once upon a time"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", path, json=body) as r:
        if r.status_code in (429, 503):
            err = json.loads(await r.aread())["error"]
            return ("rejected", err["type"]) if err["code"] == r.status_code else ("bad", str(err))
        if r.status_code != 200:
            return "bad", f"status {r.status_code}: {(await r.aread())[:200]!r}"
        tokens, finish, usage, done = 0, None, None, False
        async for line in r.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                return "bad", f"error event {event['error']}"
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                tokens += len(choice.get("token_ids") or [])
                finish = choice["finish_reason"] or finish
    if not done or finish != "length" or tokens != max_tokens or usage["completion_tokens"] != max_tokens:
        return "bad", f"done={done} finish={finish} tokens={tokens}/{max_tokens} usage={usage}"
    return "ok", ""


def test_many_concurrent_streams_complete_or_are_rejected(srv):
    rng = random.Random(0)
    models = [BASE_NAME if i % 10 == 0 else srv.adapters[i % N_ADAPTERS] for i in range(N_REQUESTS)]
    max_tokens = [rng.randint(2, 10) for _ in range(N_REQUESTS)]

    async def run():
        limits = httpx.Limits(max_connections=N_REQUESTS + 10, max_keepalive_connections=N_REQUESTS + 10)
        async with httpx.AsyncClient(base_url=srv.url, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
            async def guarded(i):
                try:
                    return await asyncio.wait_for(_one(client, i, models[i], max_tokens[i]), REQUEST_TIMEOUT_S)
                except (TimeoutError, httpx.HTTPError) as e:
                    return "bad", f"{type(e).__name__}: {e}"

            return await asyncio.wait_for(asyncio.gather(*(guarded(i) for i in range(N_REQUESTS))), RUN_TIMEOUT_S)

    t0 = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - t0
    outcomes = [r[0] for r in results]
    bad = [(i, d) for i, (o, d) in enumerate(results) if o == "bad"]
    assert not bad, bad[:5]
    assert len(results) == N_REQUESTS
    n_ok = outcomes.count("ok")
    assert n_ok >= N_REQUESTS // 3, f"only {n_ok} of {N_REQUESTS} completed"
    served = {models[i] for i, o in enumerate(outcomes) if o == "ok"}
    assert len(served - {BASE_NAME}) >= 20  # the load really spread over many adapters
    print(f"{n_ok} completed, {outcomes.count('rejected')} rejected in {elapsed:.1f}s")

    stats = srv.wait_idle(timeout=60)
    assert stats["pool"]["pages_kv"] == 0 and stats["pool"]["kv_tokens_live"] == 0
    assert srv.call(lambda: len(srv.engine.requests)) == 0
    assert stats["adapters"]["pinned"] == 0
    metrics = httpx.get(srv.url + "/metrics").text
    answered = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("slora_requests_total{endpoint=\"/v1/") and "completions" in line)
    assert answered == N_REQUESTS
