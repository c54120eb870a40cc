"""The clients of ``http_serving.py`` and their figures: a request of a trace streamed through plain httpx (the
timed traces) or the ``openai`` async client (the warm-up's check), many per process and several processes per
trace, and the latencies and throughput made from each request's token times.

A record per request: ``sent`` / ``first`` / ``end`` in seconds from the trace start, ``gaps`` (gap per token, tokens)
per chunk after the first, ``tokens`` streamed, ``usage`` the server's count, ``error`` a kind or None.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time

import httpx
import numpy as np


@dataclasses.dataclass(frozen=True)
class HttpRequest:
    arrival: float
    adapter: str
    prompt_ids: list[int]
    max_tokens: int


# ---------------------------------------------------------------- the client (one event loop per process)


def _new_record(i: int, r: HttpRequest, t0: float) -> dict:
    return {"i": i, "arrival": r.arrival, "sent": time.monotonic() - t0, "first": None, "end": None, "tokens": 0,
            "usage": None, "finish": None, "error": None, "gaps": []}


def _take_chunk(rec: dict, chunk: dict, now: float, last: float | None) -> float | None:
    """Account one parsed stream chunk (a dict) at time ``now``; returns the time of the last token seen."""
    if chunk.get("usage"):
        rec["usage"] = chunk["usage"].get("completion_tokens")
    for c in chunk.get("choices") or ():
        k = len(c.get("token_ids") or ())
        if k:
            if last is None:
                rec["first"] = now
            else:
                rec["gaps"].append(((now - last) / k, k))
            last = now
            rec["tokens"] += k
        if c.get("finish_reason") is not None:
            rec["finish"], rec["end"] = c["finish_reason"], now
    return last


def _check_record(rec: dict, r: HttpRequest) -> dict:
    if rec["error"] is None:
        if rec["finish"] != "length" or rec["first"] is None:
            rec["error"] = f"finish_{rec['finish']}"
        elif rec["tokens"] != r.max_tokens or rec["usage"] not in (None, rec["tokens"]):
            rec["error"], rec["detail"] = "token_count", f"{rec['tokens']} streamed, usage {rec['usage']}"
    return rec


def _request_body(r: HttpRequest) -> dict:
    return {"model": r.adapter, "prompt": r.prompt_ids, "max_tokens": r.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True}


async def stream_request(http, url: str, api_key: str | None, i: int, r: HttpRequest, t0: float) -> dict:
    """One request streamed with plain httpx: server-sent events split on blank lines, each ``json.loads``-ed.
    The openai client builds a pydantic object per chunk (~300 us of CPU per chunk on the H200 host, measured from
    the clients' CPU share in the 2026-12-01 run): at batch 256 that is several cores of client for one server."""
    await asyncio.sleep(max(0.0, t0 + r.arrival - time.monotonic()))
    rec, last = _new_record(i, r, t0), None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=_request_body(r), headers=headers) as resp:
            if resp.status_code != 200:
                rec["error"], rec["detail"] = f"http_{resp.status_code}", (await resp.aread())[:300].decode(
                    "utf-8", "replace")
                return rec
            buf = b""
            async for data in resp.aiter_bytes():
                now = time.monotonic() - t0
                *events, buf = (buf + data).split(b"\n\n")
                for ev in events:
                    if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                        continue
                    chunk = json.loads(ev[6:])
                    if "error" in chunk:
                        rec["error"], rec["detail"] = "stream_error", str(chunk["error"])[:300]
                        return rec
                    last = _take_chunk(rec, chunk, now, last)
    except Exception as e:  # noqa: BLE001 (counted by kind, never raised: one request must not stop the trace)
        name = type(e).__name__
        kind = "timeout" if "Timeout" in name else "connection" if ("Connect" in name or "Protocol" in name
                                                                    or "ReadError" in name) else name
        rec["error"], rec["detail"] = kind, str(e)[:300]
    return _check_record(rec, r)


async def openai_request(client, i: int, r: HttpRequest, t0: float) -> dict:
    """One request through the ``openai`` async client (the user's client; a correctness check of our stream)."""
    import openai

    await asyncio.sleep(max(0.0, t0 + r.arrival - time.monotonic()))
    rec, last = _new_record(i, r, t0), None
    try:
        stream = await client.completions.create(
            model=r.adapter, prompt=r.prompt_ids, max_tokens=r.max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
        async with stream:
            async for chunk in stream:
                last = _take_chunk(rec, chunk.model_dump(), time.monotonic() - t0, last)
    except openai.APIStatusError as e:
        rec["error"], rec["detail"] = f"http_{e.status_code}", str(e)[:300]
    except openai.APITimeoutError as e:
        rec["error"], rec["detail"] = "timeout", str(e)[:300]
    except openai.APIConnectionError as e:
        rec["error"], rec["detail"] = "connection", str(e)[:300]
    except openai.APIError as e:  # an error event in the stream
        rec["error"], rec["detail"] = "stream_error", str(e)[:300]
    except Exception as e:  # noqa: BLE001 (counted by kind, never raised: one request must not stop the trace)
        rec["error"], rec["detail"] = type(e).__name__, str(e)[:300]
    return _check_record(rec, r)


async def replay(url: str, api_key: str | None, reqs: list[tuple[int, HttpRequest]], t0: float,
                 timeout_s: float, client_kind: str = "httpx") -> dict:
    """Send ``reqs`` at ``t0`` + their arrival (``time.monotonic`` clock, shared by processes) and stream them,
    with plain httpx (``client_kind`` "httpx") or the ``openai`` client ("openai")."""
    import openai

    try:  # the HTTP library this openai release is built on (httpx2 from openai 3.x), else httpx
        import httpx2 as hx
    except ImportError:
        hx = httpx
    limits = hx.Limits(max_connections=None, max_keepalive_connections=None)  # the pool must never queue us
    http = hx.AsyncClient(limits=limits, timeout=hx.Timeout(timeout_s, connect=60.0))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key or "unused", http_client=http, max_retries=0)
    lags, running = [], True

    async def ticker(period=0.005):  # how late the loop wakes up: a busy client shows here first
        while running:
            t = time.monotonic()
            await asyncio.sleep(period)
            lags.append(time.monotonic() - t - period)

    cpu0, wall0 = time.process_time(), time.monotonic()
    tick = asyncio.ensure_future(ticker())
    if client_kind == "openai":
        records = await asyncio.gather(*(openai_request(client, i, r, t0) for i, r in reqs))
    else:
        records = await asyncio.gather(*(stream_request(http, url, api_key, i, r, t0) for i, r in reqs))
    running = False
    await tick
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    await client.close()
    busy_wall = max(wall - max(0.0, t0 - wall0), 1e-9)  # from the trace start, not from when the process woke
    chunks = sum(len(rec["gaps"]) + (rec["first"] is not None) for rec in records)
    return {"records": records, "client": client_kind, "cpu_frac": cpu / busy_wall,
            "cpu_us_per_chunk": 1e6 * cpu / max(chunks, 1),
            "loop_lag_ms_p99": float(np.percentile(lags, 99) * 1e3) if lags else None,
            "loop_lag_ms_max": float(max(lags) * 1e3) if lags else None}


def client_init() -> None:
    import openai  # noqa: F401 (imported once per process, before any trace starts)


def _replay_in_process(job) -> dict:
    try:
        import uvloop

        return uvloop.run(replay(*job))
    except ImportError:
        return asyncio.run(replay(*job))


def run_http_trace(pool, procs: int, url: str, api_key, reqs: list[HttpRequest], timeout_s: float,
                   lead_s: float = 1.0, client_kind: str = "httpx") -> tuple[list[dict], list[dict]]:
    """Split the trace round-robin over ``procs`` client processes that share one start time."""
    t0 = time.monotonic() + lead_s
    jobs = [(url, api_key, [(i, r) for i, r in enumerate(reqs) if i % procs == p], t0, timeout_s, client_kind)
            for p in range(procs)]
    outs = pool.map(_replay_in_process, jobs, chunksize=1)
    records = sorted((rec for o in outs for rec in o["records"]), key=lambda d: d["i"])
    return records, [{k: v for k, v in o.items() if k != "records"} for o in outs]


# ---------------------------------------------------------------- figures


def dist(values, scale: float = 1.0) -> dict | None:
    if len(values) == 0:
        return None
    v = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99)), "max": float(v.max())}


def summarize(name: str, records: list[dict], slo_s: float, clients: list[dict] | None = None) -> dict:
    ok = [r for r in records if r["error"] is None]
    elapsed = max((r["end"] for r in ok), default=0.0)  # from the trace start (the first arrival)
    toks = sum(r["tokens"] for r in ok)
    ttft = [r["first"] - r["arrival"] for r in ok]
    gaps = [g for r in ok for g, k in r["gaps"] for _ in range(k)]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    errors = collections.Counter(r["error"] for r in records if r["error"])
    examples = {}
    for r in records:
        if r["error"] and r["error"] not in examples:
            examples[r["error"]] = r.get("detail")
    return {
        "trace": name, "requests": len(records), "finished": len(ok), "elapsed_s": elapsed,
        "throughput_req_s": len(ok) / elapsed if elapsed else 0.0,
        "throughput_tok_s": toks / elapsed if elapsed else 0.0,
        "mean_first_token_s": float(np.mean(ttft)) if ttft else None,
        "mean_latency_s": float(np.mean([r["end"] - r["arrival"] for r in ok])) if ok else None,
        "slo_attainment": sum(t <= slo_s for t in ttft) / max(len(records), 1),
        "ttft_ms": dist(ttft, 1e3), "itl_ms": dist(gaps, 1e3), "tpot_ms": dist(tpot, 1e3),
        "e2e_s": dist([r["end"] - r["arrival"] for r in ok]),
        "send_lag_ms": dist([r["sent"] - r["arrival"] for r in records], 1e3),
        "errors": dict(errors), "error_examples": examples, "clients": clients or [],
    }
