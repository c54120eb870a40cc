"""Graceful drain: on shutdown new requests get 503, running ones finish within the grace period, and whatever is
still open after it ends with an error event and ``[DONE]`` (streams) or a 503 body (whole responses). No stream
is ever cut without one of the two (before, SIGTERM cut 30 of 60 streams bare and left 9 requests unanswered).

Two in-process servers (steps slowed to 20 ms so requests are surely running when the drain starts) cover the two
outcomes; a real ``python -m slora_jax.serve`` process covers SIGTERM itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_fixtures import BASE_NAME, start_server_with_options, write_adapters, write_model_with_tokenizer

from slora_jax.model.config import ModelConfig


def slow_steps(engine, seconds: float = 0.02) -> None:
    real_step = engine.step

    def slow_step():
        time.sleep(seconds)
        return real_step()

    engine.step = slow_step


async def stream_outcome(client: httpx.AsyncClient, body: dict, started: asyncio.Event) -> tuple[str, dict]:
    """('done', last choice) for a stream that finished, ('error', error) for one ended with an error event then
    [DONE]; anything else (a cut, a bad status) is ('bad', detail)."""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return "bad", {"status": r.status_code}
        last, error = None, None
        async for line in r.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                if error is not None:
                    return "error", error
                return ("done", last) if last and last["finish_reason"] == "length" else ("bad", {"last": last})
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                error = event["error"]
            else:
                last = event["choices"][0]
                started.set()
    return "bad", {"cut": True, "error": error}


async def whole_outcome(client: httpx.AsyncClient, body: dict) -> tuple[int, dict]:
    r = await client.post("/v1/completions", json=body)
    return r.status_code, r.json()


async def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def run_drain(srv, grace_s: float, max_tokens: int, n_streams: int = 6, n_whole: int = 2):
    """Start requests, wait until all are in flight and every stream has a token, drain; returns the outcomes and
    what a new request got while the server was draining."""
    models = [BASE_NAME if i % 3 == 0 else srv.adapters[i % len(srv.adapters)] for i in range(n_streams + n_whole)]
    drain = srv.server.ctx.drain

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            started = [asyncio.Event() for _ in range(n_streams)]
            body = {"prompt": "Tell me a long story", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
            streams = [asyncio.ensure_future(stream_outcome(client, {**body, "model": models[i]}, started[i]))
                       for i in range(n_streams)]
            wholes = [asyncio.ensure_future(whole_outcome(client, {**body, "model": models[n_streams + i]}))
                      for i in range(n_whole)]
            await wait_for(lambda: drain.in_flight == n_streams + n_whole and all(e.is_set() for e in started))
            srv.drain_started = time.monotonic()
            srv.server.request_shutdown(grace_s)
            await wait_for(lambda: drain.draining)
            async with httpx.AsyncClient(base_url=srv.url, timeout=10) as fresh:
                refused = await fresh.post("/v1/completions", json={**body, "model": BASE_NAME})
                health = await fresh.get("/health")
            return (await asyncio.gather(*streams), await asyncio.gather(*wholes), refused, health)

    return asyncio.run(asyncio.wait_for(run(), 120))


def test_running_requests_finish_within_the_grace_period(tmp_path):
    srv = start_server_with_options(tmp_path, dict(shutdown_grace_s=30), n_adapters=3)
    slow_steps(srv.engine)
    streams, wholes, refused, health = run_drain(srv, grace_s=30, max_tokens=12)
    assert [kind for kind, _ in streams] == ["done"] * len(streams), streams
    assert [status for status, _ in wholes] == [200] * len(wholes), wholes
    assert all(body["usage"]["completion_tokens"] == 12 for _, body in wholes)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert health.status_code == 503
    assert srv.server.wait_stopped(30)
    # Exits once the requests are done, not at the end of the grace period (timed from the drain's start: getting
    # the requests running first can take long on a loaded machine).
    assert time.monotonic() - srv.drain_started < 25


def test_requests_open_after_the_grace_period_end_with_an_error(tmp_path):
    srv = start_server_with_options(tmp_path, dict(shutdown_grace_s=0.3), n_adapters=3)
    slow_steps(srv.engine)
    streams, wholes, refused, health = run_drain(srv, grace_s=0.3, max_tokens=200)  # ~4 s of steps: cut by the drain
    for kind, error in streams:
        assert kind == "error", (kind, error)
        assert error["code"] == 503 and "shutting down" in error["message"]
    for status, body in wholes:
        assert status == 503 and "shutting down" in body["error"]["message"]
    assert refused.status_code == 503
    t0 = time.monotonic()
    assert srv.server.wait_stopped(15)
    assert time.monotonic() - t0 < 10


def test_a_second_shutdown_call_cuts_the_grace_period_short(tmp_path):
    srv = start_server_with_options(tmp_path, dict(shutdown_grace_s=60), n_adapters=2)
    slow_steps(srv.engine)

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            started = asyncio.Event()
            body = {"model": srv.adapters[0], "prompt": "Go on", "max_tokens": 200, "ignore_eos": True}
            task = asyncio.ensure_future(stream_outcome(client, body, started))
            await asyncio.wait_for(started.wait(), 60)
            srv.server.request_shutdown()  # 60 s of grace
            await asyncio.sleep(0.2)
            cut.append(time.monotonic())
            srv.server.request_shutdown(0)  # as a second SIGTERM does
            return await task

    cut: list[float] = []  # when the second call came: the stop is timed from there, not from the (slow) first token
    kind, error = asyncio.run(asyncio.wait_for(run(), 60))
    assert kind == "error" and error["code"] == 503
    assert srv.server.wait_stopped(15)
    assert time.monotonic() - cut[0] < 15  # the first call alone would have waited 60 s


# ---------------------------------------------------------------- a real server process and SIGTERM


@pytest.fixture
def served_process(tmp_path):
    model_dir = write_model_with_tokenizer(tmp_path / "model")
    write_adapters(tmp_path / "adapters", ModelConfig.from_model_dir(model_dir), 3)
    cmd = [sys.executable, "-m", "slora_jax.serve", "--model", str(model_dir), "--adapter-dir",
           str(tmp_path / "adapters"), "--num-pages", "256", "--max-model-len", "256", "--max-batch-size", "16",
           "--max-loras", "8", "--max-lora-rank", "32", "--no-warmup", "--port", "0", "--shutdown-grace-s", "0.5",
           "--served-model-name", BASE_NAME, "--compilation-cache-dir", str(tmp_path / "xla")]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        url = None
        while url is None:
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            found = [m for line in list(lines) if (m := re.search(r"slora-jax ready: (http://\S+)/v1", line))]
            url = found[0].group(1) if found else None
            time.sleep(0.1)
        yield proc, url, lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_sigterm_drains_a_server_process(served_process):
    proc, url, lines = served_process
    n = 6

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            started = [asyncio.Event() for _ in range(n)]
            tasks = [asyncio.ensure_future(stream_outcome(
                client, {"model": BASE_NAME if i == 0 else f"ad-00{i % 3}", "prompt": f"Story {i}", "max_tokens": 240,
                         "ignore_eos": True}, started[i])) for i in range(n)]
            await wait_for(lambda: all(e.is_set() for e in started) or any(t.done() for t in tasks), 120)
            assert all(e.is_set() for e in started), [t.result() for t in tasks if t.done()]
            proc.send_signal(signal.SIGTERM)
            async with httpx.AsyncClient(base_url=url, timeout=5) as fresh:
                statuses = []
                for _ in range(100):  # the drain starts as soon as the process handles the signal
                    try:
                        statuses.append((await fresh.get("/health")).status_code)
                    except httpx.HTTPError:
                        statuses.append("closed")  # the grace (0.5 s) was over and the server gone
                    if statuses[-1] != 200:
                        break
                    await asyncio.sleep(0.02)
            return await asyncio.gather(*tasks), statuses

    outcomes, statuses = asyncio.run(asyncio.wait_for(run(), 180))
    assert statuses[-1] in (503, "closed"), statuses
    for kind, detail in outcomes:
        assert kind in ("done", "error"), (kind, detail)  # completed, or ended with an error event; never cut
        if kind == "error":
            assert detail["code"] == 503 and "shutting down" in detail["message"]
    assert proc.wait(30) == 0, "".join(lines)
