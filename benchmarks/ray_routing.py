"""Adapter routing across Ray Serve replicas (issue 17), on CPU with the tiny model: cold loads per routing mode and
what the Ray hop costs a request.

    python benchmarks/ray_routing.py [--replicas 2] [--out benchmarks/results/DATE_ray_routing_cpu.json]

* Cold loads: a power-law trace over 50 adapters per mode (each mode gets adapters of its own, so none starts warm),
  sent straight to the replica deployment with a DeploymentHandle so the mode can change per request; counted over
  the first ``--warm`` requests (cold start: they fill the replicas' host tiers) and the ``--counted`` after them
  (steady state). Loads are read from each
  replica's counters (``SloraReplica.record_routing_stats``: the numbers its /metrics exports).
* Overhead: the same requests one at a time to a single server and through the Ray ingress (one token; 32 tokens
  streamed): the difference of the medians is the latency routing and relaying add; the CPU time of Ray's HTTP proxy
  and the ingress over those requests is what one request (and one streamed token) costs the relay.

The test module (tests/test_ray_serve.py) drives its trace with these functions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# Ray gives its workers the driver script's directory if it is on sys.path: here that would let benchmarks/kernels.py
# shadow the 'kernels' package transformers probes for. The repository root goes there instead.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]

import ray  # noqa: E402
from ray import serve  # noqa: E402

from slora_jax.serve.asgi_relay import RelayedRequest, ResponseStart  # noqa: E402
from slora_jax.serve.ray_app import ACCEPTED, APP_NAME  # noqa: E402

REPLICA_DEPLOYMENT = "SloraReplica"


def power_law_trace(adapters: list[str], n: int, rng: np.random.Generator, alpha: float = 1.0) -> list[str]:
    """``n`` adapter names; adapter i drawn with probability proportional to (i + 1) ** -alpha (S-LoRA's trace)."""
    weights = (np.arange(len(adapters)) + 1.0) ** -alpha
    return [adapters[i] for i in rng.choice(len(adapters), size=n, p=weights / weights.sum())]


def completion(model: str, prompt_ids: list[int], max_tokens: int) -> RelayedRequest:
    body = json.dumps({"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0}).encode()
    return RelayedRequest("POST", "/v1/completions", b"", [(b"content-type", b"application/json")], body)


def call(handle, req: RelayedRequest, adapter: str, routing: str) -> tuple[int, bytes]:
    """(status, body) of one request sent to a replica the router picks in mode ``routing``."""
    stream = handle.options(stream=True, multiplexed_model_id=adapter).forward.remote(req, routing=routing)
    items = list(stream)
    assert items[0] == ACCEPTED and isinstance(items[1], ResponseStart), items[:2]
    return items[1].status, b"".join(items[2:])


def run_trace(handle, trace: list[str], routing: str, rng: np.random.Generator, concurrency: int = 8,
              max_tokens: int = 2, vocab: int = 256) -> list[int]:
    """Send the trace (random 8-token prompts) with ``concurrency`` requests in flight; their statuses."""
    prompts = rng.integers(3, vocab, size=(len(trace), 8)).tolist()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(call, handle, completion(a, p, max_tokens), a, routing)
                   for a, p in zip(trace, prompts, strict=True)]
        return [f.result()[0] for f in futures]


def replica_stats(app: str = APP_NAME) -> dict[str, dict]:
    """Each live replica's ``record_routing_stats`` (residency and counters), by replica id."""
    out = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] != "serve" or not actor["name"].startswith(f"SERVE_REPLICA::{app}#{REPLICA_DEPLOYMENT}#"):
            continue
        try:
            stats = ray.get(ray.get_actor(actor["name"], namespace="serve").record_routing_stats.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError,
                ValueError):
            continue  # died meanwhile, or still starting
        out[stats["replica"]] = stats
    return out


def delta(before: dict[str, dict], after: dict[str, dict], key: str) -> dict[str, int]:
    return {rid: s[key] - before.get(rid, {}).get(key, 0) for rid, s in after.items()}


def measure_mode(handle, adapters: list[str], routing: str, rng: np.random.Generator, windows: tuple[int, ...],
                 concurrency: int = 8) -> list[dict]:
    """One power-law trace of sum(``windows``) requests; cold loads and requests per replica in each window."""
    trace = power_law_trace(adapters, sum(windows), rng)
    out, start, before = [], 0, replica_stats()
    for n in windows:
        part = trace[start:start + n]
        statuses = run_trace(handle, part, routing, rng, concurrency)
        after = replica_stats()
        cold, requests = delta(before, after, "cold_loads"), delta(before, after, "requests")
        out.append({"routing": routing, "first_request": start, "statuses": sorted(set(statuses)),
                    "cold_loads": sum(cold.values()), "cold_loads_per_replica": cold,
                    "pool_loads": sum(delta(before, after, "pool_loads").values()),
                    "requests_per_replica": requests,
                    "max_request_share": max(requests.values()) / max(sum(requests.values()), 1),
                    "distinct_adapters": len(set(part))})
        start, before = start + n, after
    return out


def latency(url: str, model: str, n: int, rng: np.random.Generator, max_tokens: int = 1,
            stream: bool = False) -> list[float]:
    """Seconds of each of ``n`` requests sent one at a time (random 8-token prompts)."""
    import httpx

    out = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(n):
            body = {"model": model, "prompt": rng.integers(3, 256, size=8).tolist(), "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": stream}
            t = time.perf_counter()
            with client.stream("POST", "/v1/completions", json=body) as r:
                r.read()
            out.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
    return out


def relay_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of the processes a request crosses before a replica: Ray's HTTP proxy and the ingress."""
    import psutil

    total = {"proxy": 0.0, "ingress": 0.0}
    for proc in psutil.process_iter(["cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        kind = "proxy" if "ProxyActor" in title else "ingress" if f"{APP_NAME}:SloraIngress" in title else None
        if kind:
            with contextlib.suppress(psutil.Error):
                cpu = proc.cpu_times()
                total[kind] += cpu.user + cpu.system
    return total


def _minus(a: dict, b: dict) -> dict:
    return {k: a[k] - b[k] for k in a}


def overhead(single_url: str, ray_url: str, n: int, rng: np.random.Generator) -> dict:
    """Latency added by the Ray path (one token, not streamed), and the relay's CPU per request and per streamed
    token (32-token streams)."""
    out = {}
    for name, max_tokens, stream in (("one_token", 1, False), ("stream_32", 32, True)):
        direct = latency(single_url, "ad-000", n, rng, max_tokens, stream)
        cpu0, t0 = relay_cpu_seconds(), time.monotonic()
        relayed = latency(ray_url, "ad-000", n, rng, max_tokens, stream)
        cpu, busy_s = _minus(relay_cpu_seconds(), cpu0), time.monotonic() - t0
        idle0 = relay_cpu_seconds()  # what the proxy and the ingress spend with no requests (health checks, polls)
        time.sleep(busy_s)
        idle = _minus(relay_cpu_seconds(), idle0)
        per_request = {k: (cpu[k] - idle[k]) / n for k in cpu}
        out[name] = {"single_median_s": statistics.median(direct), "ray_median_s": statistics.median(relayed),
                     "added_median_s": statistics.median(relayed) - statistics.median(direct),
                     "relay_cpu_s_per_request": sum(per_request.values()), "cpu_s_per_request": per_request,
                     "relay_idle_cpu_s": idle, "seconds": busy_s}
    one, streamed = out["one_token"]["cpu_s_per_request"], out["stream_32"]["cpu_s_per_request"]
    out["cpu_s_per_streamed_token"] = {k: (streamed[k] - one[k]) / 31 for k in one}
    out["relay_cpu_s_per_streamed_token"] = sum(out["cpu_s_per_streamed_token"].values())
    return out


def setup(root: Path, replicas: int, n_adapters: int, port: int):
    """Tiny model + adapters under ``root``; a single server and the Ray app on the same flags."""
    from slora_jax.model.config import ModelConfig
    from slora_jax.serve.cli import build_parser, build_server
    from slora_jax.serve.ray_app import build_app
    from slora_jax.tools import synth
    from slora_jax.tools.tokenizer import write_tokenizer

    model = synth.write_model(root / "model", "tiny", seed=3)
    write_tokenizer(model, ModelConfig.from_model_dir(model).vocab_size)
    cfg = ModelConfig.from_model_dir(model)
    for i in range(n_adapters):
        synth.write_adapter(root / "adapters" / f"ad-{i:03d}", cfg, rank=(4, 8, 16)[i % 3], seed=500 + i)
    args = build_parser().parse_args([
        "--model", str(model), "--adapter-dir", str(root / "adapters"), "--served-model-name", "tiny",
        "--max-model-len", "64", "--max-batch-size", "4", "--num-pages", "512", "--max-loras", "8",
        "--max-cpu-loras", "25", "--compilation-cache-dir", str(root / "xla"), "--log-level", "warning",
        "--replicas", str(replicas), "--port", "0"])
    single = build_server(args)
    single.start_background()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # workers
    ray.init(num_cpus=replicas, include_dashboard=False, logging_level="WARNING")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args, "tiny"), name=APP_NAME, route_prefix="/")
    return single, f"http://127.0.0.1:{port}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--warm", type=int, default=200)
    p.add_argument("--counted", type=int, default=200)
    p.add_argument("--overhead-requests", type=int, default=200)
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--modes", default="random,multiplex,affinity,multiplex,affinity",  # "" for the overhead alone
                   help="routing modes in order, each over 50 adapters of its own")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    modes = [m for m in args.modes.split(",") if m]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        single, ray_url = setup(Path(tmp), args.replicas, max(50 * len(modes), 1), args.port)
        print(f"ready in {time.monotonic() - t0:.0f} s", flush=True)
        handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=APP_NAME)
        result = {"replicas": args.replicas, "warm": args.warm, "counted": args.counted, "runs": []}
        for k, mode in enumerate(modes):
            adapters = [f"ad-{i:03d}" for i in range(50 * k, 50 * (k + 1))]
            cold, steady = measure_mode(handle, adapters, mode, rng, (args.warm, args.counted))
            result["runs"].append({"routing": mode, "cold_start": cold, "steady": steady})
            print(json.dumps(result["runs"][-1]), flush=True)
        result["overhead"] = overhead(single.url, ray_url, args.overhead_requests, rng)
        print(json.dumps(result["overhead"]), flush=True)
        serve.shutdown()
        ray.shutdown()
        single.stop()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
