"""The HTTP benchmark's bookkeeping (benchmarks/http_serving.py, benchmarks/aiperf_run.py): it must send the very
requests the in-process benchmark serves, ask aiperf for our length window, and compute latencies as defined."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest

# transformers first, while benchmarks/ is off sys.path: it probes for a package named 'kernels', which
# benchmarks/kernels.py would shadow (and run)
import transformers  # noqa: F401

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
sys.path.insert(0, BENCHMARKS)
import aiperf_run  # noqa: E402
import http_client  # noqa: E402
import http_server_probe  # noqa: E402
import http_serving  # noqa: E402
import serving  # noqa: E402
from workload import make_trace  # noqa: E402

sys.path.remove(BENCHMARKS)  # the rest of the test session must not see benchmarks/ scripts as packages


class _RecordingEngine:
    """Just enough of an Engine for serving.run_trace: records add_request and finishes nothing."""

    def __init__(self):
        self.added = []
        self.store = self
        self.last_plan = None

    def stats(self):
        return dict.fromkeys(("hits", "misses", "loads", "prefetch_loads", "staged_loads", "evictions",
                              "host_loads"), 0)

    def add_request(self, prompt, adapter, sampling, on_output=None):
        self.added.append((list(prompt), adapter, sampling.max_tokens, sampling.ignore_eos))

    def has_unfinished(self):
        return False


def test_http_requests_are_the_in_process_requests():
    rng = np.random.default_rng()
    n, vocab = int(rng.integers(3, 40)), int(rng.integers(50, 5000))
    trace = make_trace(n, 2000.0, int(rng.integers(5, 30)), in_range=(3, 40), out_range=(2, 30),
                       seed=int(rng.integers(1 << 30)))
    names = [f"a{i}-{rng.integers(1 << 20)}" for i in range(n)]
    engine = _RecordingEngine()
    serving.run_trace(engine, "t", trace, names, vocab, budget_end=float("inf"))
    reqs = http_serving.trace_requests(trace, names, vocab)
    assert [(r.prompt_ids, r.adapter, r.max_tokens, True) for r in reqs] == engine.added
    assert [r.arrival for r in reqs] == [t.arrival for t in trace]


@pytest.mark.parametrize("lo_hi", [(8, 512), (8, 64), (1, 2), (100, 101), (3, 1000), (8, 513)])
def test_aiperf_length_window_is_ours(lo_hi):
    lo, hi = lo_hi
    mean, r = aiperf_run.range_ratio(lo, hi)
    # vLLM's random-range rule, as aiperf documents it for --random-corpus-style vllm
    assert math.floor(mean * (1 - r)) == lo
    assert math.ceil(mean * (1 + r)) in (hi, hi + 1)


def test_latency_figures_from_token_times():
    rng = np.random.default_rng()
    records = []
    for i in range(int(rng.integers(3, 12))):
        arrival = float(rng.uniform(0, 5))
        k = rng.integers(1, 4, size=int(rng.integers(2, 9)))  # tokens per chunk
        times = arrival + np.cumsum(rng.uniform(0.001, 0.5, size=k.size))
        gaps = [((times[j] - times[j - 1]) / k[j], int(k[j])) for j in range(1, k.size)]
        records.append({"i": i, "arrival": arrival, "sent": arrival, "first": float(times[0]),
                        "end": float(times[-1]), "tokens": int(k.sum()), "error": None, "gaps": gaps})
    records.append({"i": 99, "arrival": 1.0, "sent": 1.0, "first": None, "end": None, "tokens": 0,
                    "error": "http_503", "gaps": []})
    res = http_client.summarize("t", records, slo_s=0.25)
    ok = records[:-1]
    per_token = np.concatenate([np.full(k, g) for r in ok for g, k in r["gaps"]])
    assert res["itl_ms"]["mean"] == pytest.approx(per_token.mean() * 1e3)
    assert res["itl_ms"]["p90"] == pytest.approx(np.percentile(per_token, 90) * 1e3)
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok]
    assert res["tpot_ms"]["p50"] == pytest.approx(np.median(tpot) * 1e3)
    elapsed = max(r["end"] for r in ok)
    assert res["throughput_req_s"] == pytest.approx(len(ok) / elapsed)
    assert res["throughput_tok_s"] == pytest.approx(sum(r["tokens"] for r in ok) / elapsed)
    assert res["slo_attainment"] == pytest.approx(sum(r["first"] - r["arrival"] <= 0.25 for r in ok) / len(records))
    assert res["errors"] == {"http_503": 1}


def _sse_stream(rng, max_tokens: int, error: bool = False) -> tuple[bytes, list[int]]:
    """A completion stream of random chunking (1-3 tokens a chunk), usage, [DONE]; or one cut by an error event."""
    ids = rng.integers(0, 32000, max_tokens).tolist()
    events, i = [], 0
    while i < len(ids):
        k = int(rng.integers(1, 4))
        part, i = ids[i:i + k], i + k
        fin = "length" if i >= len(ids) else None
        events.append({"id": "c", "object": "text_completion", "created": 1, "model": "m",
                       "choices": [{"index": 0, "text": "x" * len(part), "logprobs": None, "finish_reason": fin,
                                    "token_ids": part}]})
        if error and len(events) == 2:
            events.append({"error": {"message": "engine step failed", "type": "server_error", "code": 500}})
            break
    events.append({"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": [],
                   "usage": {"prompt_tokens": 3, "completion_tokens": max_tokens, "total_tokens": max_tokens + 3}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n", ids


@pytest.mark.parametrize("error", [False, True])
def test_httpx_and_openai_clients_read_a_stream_alike(error):
    """Our plain httpx reader (timed traces) and the openai client (the check) take the same tokens, ending and usage
    from one stream, split into network reads at random points."""
    import httpx
    import openai

    rng = np.random.default_rng()
    max_tokens = int(rng.integers(4, 40))
    payload, ids = _sse_stream(rng, max_tokens, error)
    cuts = sorted(rng.choice(np.arange(1, len(payload)), size=min(10, len(payload) - 1), replace=False).tolist())

    async def body():
        for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True):
            yield payload[a:b]

    def handler(request):
        sent = json.loads(request.content)
        assert sent["prompt"] == [5, 6, 7] and sent["max_tokens"] == max_tokens and sent["ignore_eos"]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    req = http_client.HttpRequest(0.0, "m", [5, 6, 7], max_tokens)

    async def both():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        ours = await http_client.stream_request(http, "http://x", None, 0, req, 0.0)
        client = openai.AsyncOpenAI(base_url="http://x/v1", api_key="k", http_client=http, max_retries=0)
        theirs = await http_client.openai_request(client, 0, req, 0.0)
        return ours, theirs

    ours, theirs = asyncio.run(both())
    if error:
        assert ours["error"] == theirs["error"] == "stream_error"
        return
    for rec in (ours, theirs):
        assert rec["error"] is None, rec.get("detail")
        assert rec["tokens"] == rec["usage"] == max_tokens and rec["finish"] == "length"
    assert sum(k for _, k in ours["gaps"]) == sum(k for _, k in theirs["gaps"]) == max_tokens - len(
        json.loads(payload.split(b"\n\n")[0][6:])["choices"][0]["token_ids"])


@pytest.mark.parametrize("adapter_set", ["S2", "all7"])
def test_prepared_adapter_sets_have_s_loras_ranks_and_targets(tmp_path, adapter_set):
    """--adapter-set writes PEFT dirs with S-LoRA's ranks round-robin and targets, also in the hard-linked dirs
    (``distinct`` rounded up to a multiple of the ranks' count, so each dir has its turn's rank)."""
    ranks, targets = http_serving.ADAPTER_SETS[adapter_set]
    _, adapters, _ = http_serving.prepare_preset("tiny", tmp_path, 10, 3, ranks, targets)
    want_ranks = [int(r) for r in ranks.split(",")]
    assert adapters.name.endswith(f"-n10-k{-(-3 // len(want_ranks)) * len(want_ranks)}")
    for i in range(10):
        config = json.loads((adapters / f"adapter-{i:04d}" / "adapter_config.json").read_text())
        assert config["r"] == want_ranks[i % len(want_ranks)], i
        assert sorted(config["target_modules"]) == sorted(targets.split(","))


@pytest.mark.parametrize("counts, n, max_s, ended_by, seen", [
    ([100, 400, 900, 2000], 2000, 60, "all", 2000),  # every adapter read
    ([100, 1270, 1270, 1270, 1270, 1270, 1270, 1270, 1270, 1270], 2000, 60, "settled", 1270),  # the host budget full
    (list(range(100, 3000, 10)), 2000, 3, "max_s", None),  # still growing when the wait ends
])
def test_the_host_fill_wait_ends_on_all_settled_or_time(monkeypatch, counts, n, max_s, ended_by, seen):
    """The timed traces wait for the server's host fill; a fake clock and /metrics drive each way it can end."""
    clock = {"t": 0.0}
    gauge = iter(counts)

    def counters(url, api_key):
        return {"adapters_in_host": float(next(gauge, counts[-1]))}

    def sleep(s):
        clock["t"] += s

    monkeypatch.setattr(http_server_probe, "server_counters", counters)
    # the probe's own clock only: the time module itself stays real for everything else in the process
    monkeypatch.setattr(http_server_probe, "time", types.SimpleNamespace(monotonic=lambda: clock["t"], sleep=sleep))
    got = http_server_probe.wait_host_fill("http://x", None, n, max_s, settle_s=4.0, poll_s=1.0)
    assert got["ended_by"] == ended_by and got["of"] == n
    if seen is not None:
        assert got["adapters_in_host"] == seen
    assert got["waited_s"] <= max_s + 1


def test_server_counters_read_the_per_kind_step_totals(monkeypatch):
    """The probe reads the engine's per-kind gauges and reports each kind's steps, mean wait and host-bound share."""
    def metrics(text):
        return types.SimpleNamespace(text=text)

    before = ('slora_engine_steps 10.0\nslora_engine_steps_read_back{kind="prefill"} 2.0\n'
              'slora_engine_steps_read_back{kind="decode"} 8.0\nslora_engine_wait_seconds{kind="prefill"} 0.001\n'
              'slora_engine_wait_seconds{kind="decode"} 0.05\nslora_engine_host_bound_steps{kind="prefill"} 1.0\n'
              'slora_engine_host_seconds{phase="wait"} 0.051\n')
    after = ('slora_engine_steps 30.0\nslora_engine_steps_read_back{kind="prefill"} 6.0\n'
             'slora_engine_steps_read_back{kind="decode"} 24.0\nslora_engine_wait_seconds{kind="prefill"} 0.009\n'
             'slora_engine_wait_seconds{kind="decode"} 0.21\nslora_engine_host_bound_steps{kind="prefill"} 3.0\n'
             'slora_engine_host_seconds{phase="wait"} 0.219\n')
    monkeypatch.setattr(http_server_probe.httpx, "get", lambda *a, **k: metrics(before))
    a = http_server_probe.server_counters("http://x", None)
    monkeypatch.setattr(http_server_probe.httpx, "get", lambda *a, **k: metrics(after))
    b = http_server_probe.server_counters("http://x", None)
    share = http_server_probe.server_share(a, b, 1.0)
    assert share["by_kind"] == {"prefill": {"steps": 4.0, "wait_ms_mean": 2.0, "host_bound_share": 0.5},
                                "decode": {"steps": 16.0, "wait_ms_mean": 10.0, "host_bound_share": 0.0}}
    assert share["host_ms_per_step"] == {"wait": 8.4}
