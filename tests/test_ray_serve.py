"""Replicas on Ray Serve (issue 17): two engines behind one endpoint, requests sent to replicas holding their adapter.

One local Ray cluster (2 CPUs) and one deployment for the whole module, next to a single server started from the very
same flags: the single server is the reference every answer through Ray must equal (greedy, token for token). The
tiny model keeps compiles few (max_model_len 64, batch 4: three prefill and three decode buckets, compiled once by the
single server's warm-up and loaded from the shared compilation cache by each replica).

Skipped where Ray Serve is not installed (``pip install -e ".[ray]"``; the GPU image has no Ray).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
# ray.init starts its processes by fork + exec after JAX started threads; the exec makes the fork safe
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
pytest.importorskip("ray.serve.request_router")  # the request router extension API
import httpx  # noqa: E402
import openai  # noqa: E402
from ray import serve  # noqa: E402
from server_fixtures import write_adapters, write_model_with_tokenizer  # noqa: E402

from slora_jax.model.config import ModelConfig  # noqa: E402
from slora_jax.serve.cli import build_parser, build_server  # noqa: E402
from slora_jax.serve.ray_app import APP_NAME, build_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# loaded by path: benchmarks/ on sys.path would shadow packages (transformers probes for one named 'kernels')
_spec = importlib.util.spec_from_file_location("ray_routing", ROOT / "benchmarks" / "ray_routing.py")
ray_routing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ray_routing)

BASE = "tiny-ray"
N_ADAPTERS = 100  # 50 for the random-routing trace, 50 for the affinity trace, so neither starts warm
HOST_ADAPTERS = 25  # a replica's host tier holds half of a trace's adapters: affinity fits, random thrashes
FLAGS = ["--served-model-name", BASE, "--max-model-len", "64", "--max-batch-size", "4", "--num-pages", "512",
         "--max-loras", "8", "--max-cpu-loras", str(HOST_ADAPTERS), "--max-lora-rank", "32", "--log-level", "warning",
         "--replicas", "2", "--host", "127.0.0.1", "--port", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    model_dir = write_model_with_tokenizer(root / "model")
    adapters = write_adapters(root / "adapters", ModelConfig.from_model_dir(model_dir), N_ADAPTERS, ranks=(4, 8, 16))
    args = build_parser().parse_args(["--model", str(model_dir), "--adapter-dir", str(root / "adapters"),
                                      "--compilation-cache-dir", str(root / "xla"), *FLAGS])
    single = build_server(args)
    single.start_background()
    # Ray's workers get the driver's environment: they must import this checkout too
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args, BASE, stats_period_s=0.5), name=APP_NAME, route_prefix="/")
        yield {"single": single.url, "ray": f"http://127.0.0.1:{port}", "adapters": sorted(adapters),
               "handle": serve.get_deployment_handle(ray_routing.REPLICA_DEPLOYMENT, app_name=APP_NAME)}
    finally:
        serve.shutdown()
        ray.shutdown()
        single.stop()


def words(rng, n: int) -> str:
    letters = list("abcdefghijklmnopqrstuvwxyz")
    return " ".join("".join(rng.choice(letters, size=rng.integers(2, 8))) for _ in range(n))


def prompt_ids(rng) -> list[int]:
    """8 random token ids: with 48 new tokens they fit the 64-token context."""
    return rng.integers(3, 500, size=8).tolist()


def answers(url: str, calls: list[dict]) -> list[tuple]:
    """(text, token ids, finish reason) of each call through the openai client, streamed or not, 8 at a time."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def one(call: dict) -> tuple:
        kind, stream = call["kind"], call["stream"]
        kw = dict(model=call["model"], max_tokens=call["max_tokens"], temperature=0, stream=stream,
                  extra_body={"return_token_ids": True})
        if kind == "chat":
            res = client.chat.completions.create(messages=[{"role": "user", "content": call["prompt"]}], **kw)
        else:
            res = client.completions.create(prompt=call["prompt"], **kw)
        if not stream:
            choice = res.choices[0]
            text = choice.message.content if kind == "chat" else choice.text
            return text, choice.model_extra["token_ids"], choice.finish_reason
        text, ids, reason = "", [], None
        for chunk in res:
            for choice in chunk.choices:
                text += (choice.delta.content or "") if kind == "chat" else choice.text
                ids += choice.model_extra.get("token_ids") or []
                reason = choice.finish_reason or reason
        return text, ids, reason

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, calls))


def test_two_replicas_answer_the_openai_client_like_one_server(deployed, rng):
    models = [BASE, *rng.choice(deployed["adapters"], size=7, replace=False)]
    calls = [dict(kind=kind, stream=stream, model=str(models[i % len(models)]), prompt=words(rng, 4),
                  max_tokens=int(rng.integers(4, 12)))
             for i, (kind, stream) in enumerate([(k, s) for k in ("completion", "chat") for s in (False, True)] * 6)]
    before = ray_routing.replica_stats()
    assert len(before) == 2
    want = answers(deployed["single"], calls)
    got = answers(deployed["ray"], calls)
    for call, w, g in zip(calls, want, got, strict=True):
        assert g == w, call
        assert w[1] and w[2] in ("stop", "length")
    served = ray_routing.delta(before, ray_routing.replica_stats(), "requests")
    assert sum(served.values()) == len(calls)
    assert all(n > 0 for n in served.values()), f"one replica served everything: {served}"


def test_errors_through_ray_are_the_single_servers(deployed):
    bodies = [b'{"model": "tiny-ray", "prompt": "x", "max_tokens": 0}', b'{"model": "no-such-adapter", "prompt": "x"}',
              b"{not json", b'{"model": ["a"], "prompt": "x"}']
    for body in bodies:
        want = httpx.post(deployed["single"] + "/v1/completions", content=body, timeout=60)
        got = httpx.post(deployed["ray"] + "/v1/completions", content=body, timeout=60)
        assert 400 <= want.status_code < 500 and (got.status_code, got.json()) == (want.status_code, want.json())
    r = httpx.post(deployed["ray"] + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert r.status_code == 501 and "not replicated" in r.json()["error"]["message"]
    assert httpx.get(deployed["ray"] + "/health").json() == {"status": "ok"}


def idle(timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = ray_routing.replica_stats()
        if all(s["running"] == 0 and s["waiting"] == 0 for s in stats.values()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def test_a_client_leaving_a_stream_ends_its_request_on_the_replica(deployed, rng):
    body = {"model": str(rng.choice(deployed["adapters"])), "prompt": prompt_ids(rng), "max_tokens": 48,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", deployed["ray"] + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = r.iter_lines()
        assert next(chunks).startswith("data: ")
    stats = idle()
    assert all(s["running"] == 0 and s["waiting"] == 0 for s in stats.values()), stats


def test_adapter_affinity_halves_the_cold_loads_of_random_routing(deployed, rng):
    """200 requests fill the replicas (cold start, printed), the next 200 are counted (steady state)."""
    handle, adapters = deployed["handle"], deployed["adapters"]
    results = {mode: ray_routing.measure_mode(handle, adapters[50 * k:50 * (k + 1)], mode, rng, (200, 200))
               for k, mode in enumerate(("random", "affinity"))}
    print(json.dumps(results, indent=1))
    for mode, windows in results.items():
        assert all(w["statuses"] == [200] for w in windows), mode
    (random_cold, random_steady), (affinity_cold, affinity_steady) = results["random"], results["affinity"]
    assert random_steady["cold_loads"] >= 20  # the baseline thrashes: the comparison means something
    assert affinity_steady["cold_loads"] <= 0.5 * random_steady["cold_loads"]
    assert affinity_cold["cold_loads"] < random_cold["cold_loads"]
    for window in results["affinity"]:
        assert window["max_request_share"] <= 0.65, window["requests_per_replica"]


def outcome(url: str, body: dict) -> str:
    """"ok", "error: ..." (a clear error: an error status with its JSON message, or an error event then [DONE] on a
    stream) or "unclear: ..." for anything else (a cut stream, a body without an error)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                r.read()
                return f"error: {r.status_code} {r.json()['error']['message']}"
            if not body.get("stream"):
                r.read()
                reason = r.json()["choices"][0]["finish_reason"]
                return "ok" if reason == "length" else f"unclear: finish {reason}"
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        return f"unclear: {type(e).__name__}: {e}"
    if events[-1:] != ["[DONE]"]:
        return f"unclear: stream cut after {len(events)} events"
    errors = [json.loads(e)["error"]["message"] for e in events[:-1] if '"error"' in e]
    return f"error: {errors[0]}" if errors else "ok"


def test_killing_a_replica_mid_run_ends_its_requests_clearly_and_serving_goes_on(deployed, rng):
    url, adapters = deployed["ray"], deployed["adapters"]
    bodies = [{"model": str(rng.choice(adapters)), "prompt": prompt_ids(rng), "max_tokens": 48, "ignore_eos": True,
               "stream": bool(i % 2)} for i in range(24)]
    results: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, outcome(url, bodies[i])), daemon=True)
               for i in range(len(bodies))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while True:  # kill the replica with the most requests running once requests run on both
        stats = ray_routing.replica_stats()
        if all(s["running"] > 0 for s in stats.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    victim = max(stats.values(), key=lambda s: s["running"] + s["waiting"])
    assert victim["running"] > 0, stats
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=max(1.0, killed + 150 - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a request hung after the replica was killed"
    unclear = {i: r for i, r in results.items() if not (r == "ok" or r.startswith("error: "))}
    assert not unclear, unclear
    assert any(r.startswith("error: ") for r in results.values()), "the kill hit no request"
    probe = {"model": adapters[0], "prompt": "again", "max_tokens": 4, "ignore_eos": True}  # sampled: EOS may come
    while outcome(url, probe) != "ok":
        assert time.monotonic() - killed < 60, "not serving 60 s after the kill"
        time.sleep(0.5)
    assert [outcome(url, {**probe, "model": a}) for a in adapters[:8]] == ["ok"] * 8
    deadline = killed + 240
    while not (len(stats := ray_routing.replica_stats()) == 2 and victim["pid"] not in {s["pid"] for s in
                                                                                           stats.values()}):
        assert time.monotonic() < deadline, f"Ray did not replace the killed replica: {stats}"
        time.sleep(1.0)
