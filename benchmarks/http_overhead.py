"""What streaming over HTTP costs the server and the client, per token, on CPU, and what it does to the step loop.

    PYTHONPATH=. python benchmarks/http_overhead.py server --batch 64 --host-ms 1.6 --device-ms 1.8 --out s.json
    PYTHONPATH=. python benchmarks/http_overhead.py client --chunks 20000 --out c.json

``server``: the real ``Server`` (app, engine thread, uvicorn) on the demo model, with the engine's ``step`` replaced by
a paced one (:class:`PacedEngine`): every step holds the GIL ``--host-ms`` (the engine's Python: schedule, dispatch,
append) then waits ``--device-ms`` with the GIL released (the device), and gives every running request one token,
which the server streams as it would a real one. ``--batch`` streams run at once (closed loop, token-id prompts,
``ignore_eos``, ``return_token_ids``), read by ``--client-procs`` processes that only count bytes, so the server is
what is measured. Reported: the event loop's and the engine thread's CPU per streamed token (``time.thread_time`` in
each thread), and the mean step time against the paced one: the step loop's slowdown from the GIL the HTTP side
holds. On the H200 (Llama-2-7B, batch 256) a step is ~13.6 ms of which ~6.3 ms is host Python (in-process
``decode_host_s``), so a loop cost of c us per token takes 256 c us of GIL per step.

``client``: CPU per streamed chunk of a client: the ``openai`` client (as ``http_serving.py`` used it) and the plain
httpx SSE reader of ``http_client.py``, each reading the same chunks from an in-memory transport (no server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent


# ---------------------------------------------------------------- the paced engine (server side)


class PacedEngine:
    """The real engine for everything the server asks (adapters, limits, tokenizer, stats) except the requests:
    those are generated here, one token per running request per step, at a set host/device time per step."""

    def __init__(self, real, batch: int, host_ms: float, device_ms: float, seed: int = 0):
        self._real, self.batch, self.host_s, self.device_s = real, batch, host_ms / 1e3, device_ms / 1e3
        self._reqs: dict[str, list] = {}  # rid -> [max_tokens, produced, on_output]
        self._order: list[str] = []
        self._rng = np.random.default_rng(seed)
        self._vocab = real.cfg.vocab_size
        self.steps = self.tokens = 0
        self.step_s = 0.0
        self.pipelined, self._device_done = False, 0.0
        self.host_cpu = False  # host time counted in this thread's CPU (a GIL wait then stretches the step)
        self.host_releases = 0  # GIL drops spread over the host time (jax's dispatch drops it at each runtime call)
        self.runner = _QueueMark()  # the step's "queued on the device" point, which the server's hand-off watches

    def __getattr__(self, name):
        return getattr(self._real, name)

    def add_request(self, prompt_ids, adapter=None, sampling=None, request_id=None, on_output=None, **_):
        self._reqs[request_id] = [sampling.max_tokens, 0, on_output]
        self._order.append(request_id)
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def abort(self, rid: str) -> bool:
        from slora_jax.engine.sequence import RequestOutput

        r = self._reqs.pop(rid, None)
        if r is not None:
            self._order.remove(rid)
            r[2](RequestOutput(rid, [], True, "abort"))
        return r is not None

    def release(self, rid: str) -> None:
        pass

    def stats(self) -> dict:
        """The real engine's, with this stand-in's counters and the CPU of the thread asking (the engine thread: the
        server asks for stats there) and of its process: what an engine in another process reports."""
        return {**self._real.stats(), "paced": {"steps": self.steps, "tokens": self.tokens, "step_s": self.step_s,
                                                "thread_cpu": time.thread_time(), "process_cpu": time.process_time()}}

    def running_request_ids(self) -> list[str]:
        return list(self._order[:self.batch])

    def pool_lost(self) -> bool:
        return False

    def step(self):
        from slora_jax.engine.sequence import RequestOutput

        t0 = time.perf_counter()
        clock = time.thread_time if self.host_cpu else time.perf_counter
        c0 = clock()
        drops = [c0 + self.host_s * (i + 1) / (self.host_releases + 1) for i in range(self.host_releases)]
        while clock() - c0 < self.host_s:  # Python work: holds the GIL (preemptible, as real code)
            if drops and clock() >= drops[0]:
                drops.pop(0)
                time.sleep(0)  # a runtime call: the GIL is dropped and must be won back
        self.runner.decode()
        if self.pipelined:  # the engine's overlap: this step's work queued, the previous step's tokens awaited
            now = time.perf_counter()
            done_prev, self._device_done = self._device_done, max(now, self._device_done) + self.device_s
            time.sleep(max(0.0, done_prev - now))
        else:
            time.sleep(self.device_s)  # the device: GIL released
        rows = self._order[:self.batch]
        toks = self._rng.integers(3, self._vocab, size=len(rows)).tolist()
        outs = []
        for rid, tok in zip(rows, toks, strict=True):
            r = self._reqs[rid]
            r[1] += 1
            done = r[1] >= r[0]
            out = RequestOutput(rid, [tok], done, "length" if done else None)
            if done:
                del self._reqs[rid]
            outs.append(out)
            r[2](out)
        if len(rows) and any(o.finished for o in outs):
            self._order = [rid for rid in self._order if rid in self._reqs]
        self.steps += 1
        self.tokens += len(outs)
        self.step_s += time.perf_counter() - t0
        return outs


class _QueueMark:
    """Stands for the engine's step runner: ``decode`` returns once the step is queued (nothing to run here)."""

    def decode(self, *args, **kwargs):
        return None

    def prefill(self, *args, **kwargs):
        return None


def paced_engine(batch: int, host_ms: float, device_ms: float, pipelined: bool = False, host_releases: int = 0,
                 host_cpu: bool = False):
    """(the paced engine over the demo model, what the server needs of it); also the engine process's factory."""
    # benchmarks/ off the path: transformers probes for a package named 'kernels' and would run benchmarks/kernels.py
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    from slora_jax.serve.demo import ensure_demo
    from slora_jax.tools.tokenizer import load_tokenizer

    model_dir, adapters_dir = ensure_demo("float32")
    adapters = {p.name: p for p in sorted(adapters_dir.iterdir())[:4]}
    ecfg = EngineConfig(num_pages=256, max_model_len=1024, max_prefill_tokens=1024, max_batch_size=16, max_loras=4,
                        max_lora_rank=32, dtype="float32", backend="reference")
    real = Engine.from_model_dir(model_dir, ecfg, adapters=adapters, tokenizer=load_tokenizer(model_dir),
                                 progress=False)
    engine = PacedEngine(real, batch, host_ms, device_ms)
    engine.pipelined, engine.host_releases, engine.host_cpu = pipelined, host_releases, host_cpu
    return engine, {"model_dir": model_dir, "adapters": list(adapters), "vocab": real.cfg.vocab_size}


def build_server(batch: int, host_ms: float, device_ms: float, switch_interval_ms: float | None = None,
                 pipelined: bool = False, defer: bool = False, host_releases: int = 0, host_cpu: bool = False,
                 engine_process: bool = False):
    """(server, the paced engine or None when it runs in the engine process, adapters, vocabulary size)."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]  # as paced_engine: 'kernels'
    from slora_jax.serve.config import ServerConfig
    from slora_jax.serve.server import Server
    from slora_jax.tools.tokenizer import load_tokenizer

    config = ServerConfig(served_model_name="paced")
    if hasattr(config, "defer_hand_over"):
        config.defer_hand_over = defer
    if switch_interval_ms and hasattr(config, "gil_switch_interval_s"):
        config.gil_switch_interval_s = switch_interval_ms / 1e3
    factory_args = (batch, host_ms, device_ms, pipelined, host_releases, host_cpu)
    if engine_process:
        from slora_jax.serve.engine_client import EngineClient

        client = EngineClient.launch(paced_engine, factory_args, defer_hand_over=defer, log_level="warning")
        engine, info = None, client.info
        server = Server(None, config, port=0, log_level="warning", tokenizer=load_tokenizer(info["model_dir"]),
                        runner=client)
    else:
        engine, info = paced_engine(*factory_args)
        server = Server(engine, config, port=0, log_level="warning", tokenizer=load_tokenizer(info["model_dir"]))
    server.start_background()
    return server, engine, info["adapters"], info["vocab"]


def counters(server, engine) -> tuple[int, int, float, float, float]:
    """(steps, tokens, seconds inside engine.step, engine thread CPU, engine process CPU or 0 in-process)."""
    if engine is not None:
        return engine.steps, engine.tokens, engine.step_s, thread_cpu(server, True), 0.0
    p = asyncio.run_coroutine_threadsafe(server.engine_thread.stats(30), server._uvicorn.loop).result(30)["paced"]
    return p["steps"], p["tokens"], p["step_s"], p["thread_cpu"], p["process_cpu"]


def thread_cpu(server, engine_side: bool) -> float:
    """``time.thread_time`` of the event loop's thread, or of the engine thread (asked from this thread)."""
    loop = server._uvicorn.loop

    async def ask():
        if engine_side:
            return await server.engine_thread.call(time.thread_time, timeout=30)
        return time.thread_time()

    return asyncio.run_coroutine_threadsafe(ask(), loop).result(30)


def loop_profile(server, prof, out: str | None = None):
    """Start a cProfile of the event loop's thread (``prof`` None), or stop ``prof`` and print its top functions."""
    import cProfile
    import io
    import pstats

    def run():
        if prof is None:
            p = cProfile.Profile(time.thread_time)  # CPU time: a wait for the GIL is not the code's cost
            p.enable()
            return p
        prof.disable()
        return prof

    async def ask():
        return run()

    p = asyncio.run_coroutine_threadsafe(ask(), server._uvicorn.loop).result(30)
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(p, stream=buf).sort_stats("tottime").print_stats(45)
        Path(out).write_text(buf.getvalue())
    return p


class _CountingStream(asyncio.Protocol):
    """One keep-alive connection that sends the next request when a stream ends and counts chunks by their
    ``token_ids`` key in the raw bytes: the cheapest reader, so the server is what the run measures."""

    def __init__(self, requests, until: float, counts: dict, done: asyncio.Future):
        self.requests, self.until, self.counts, self.done = requests, until, counts, done
        self.tail = b""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.transport.write(next(self.requests))

    def data_received(self, data: bytes) -> None:
        data = self.tail + data
        self.counts["chunks"] += data.count(b'"token_ids"') - self.tail.count(b'"token_ids"')
        self.tail = data[-16:]
        if b"data: [DONE]" in data:
            self.counts["requests"] += 1
            self.tail = b""
            if time.monotonic() < self.until:
                self.transport.write(next(self.requests))
            else:
                self.transport.close()

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(None)


def _raw_requests(host: str, adapters: list[str], vocab: int, prompt_len: int, max_tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    i = 0
    while True:
        body = json.dumps({"model": adapters[i % len(adapters)], "prompt": rng.integers(3, vocab, prompt_len).tolist(),
                           "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "return_token_ids": True,
                           "stream_options": {"include_usage": True}}).encode()
        yield (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        i += 1


async def _count_streams(url: str, n: int, max_tokens: int, prompt_len: int, vocab: int, adapters: list[str],
                         until: float) -> dict:
    """``n`` closed-loop streams (token-id prompts, ``ignore_eos``), on raw connections."""
    host, port = url.split("//")[1].rsplit(":", 1)
    loop = asyncio.get_running_loop()
    counts = {"chunks": 0, "requests": 0}
    cpu0 = time.process_time()
    dones = []
    for i in range(n):
        done = loop.create_future()
        dones.append(done)
        await loop.create_connection(
            lambda i=i, done=done: _CountingStream(_raw_requests(host, adapters, vocab, prompt_len, max_tokens, i),
                                                   until, counts, done), host, int(port))
    await asyncio.gather(*dones)
    counts["cpu_s"] = time.process_time() - cpu0
    return counts


async def _replay_streams(url: str, n: int, max_tokens: int, prompt_len: int, vocab: int, adapters: list[str],
                          until: float, kind: str) -> dict:
    """``n`` streams at a time through ``http_client.replay`` (its httpx or openai client), rounds until ``until``."""
    sys.path.insert(0, str(BENCH))
    from http_client import HttpRequest, replay

    rng = np.random.default_rng()
    counts = {"chunks": 0, "requests": 0, "cpu_s": 0.0, "errors": 0}
    while time.monotonic() < until:
        reqs = [(i, HttpRequest(0.0, adapters[i % len(adapters)], rng.integers(3, vocab, prompt_len).tolist(),
                                max_tokens)) for i in range(n)]
        cpu = time.process_time()
        out = await replay(url, None, reqs, time.monotonic(), 120.0, kind)
        counts["cpu_s"] += time.process_time() - cpu
        counts["chunks"] += sum(len(r["gaps"]) + (r["first"] is not None) for r in out["records"])
        counts["requests"] += n
        counts["errors"] += sum(r["error"] is not None for r in out["records"])
    return counts


def _client_proc(job) -> dict:
    if job[-1] == "raw":
        return asyncio.run(_count_streams(*job[:-1]))
    return asyncio.run(_replay_streams(*job))


def run_server_bench(args) -> dict:
    import logging

    logging.basicConfig(level="WARNING")
    if args.switch_interval_ms:  # the old server's (which did not set it) and a new one's (config overrides it)
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    server, engine, adapters, vocab = build_server(args.batch, args.host_ms, args.device_ms, args.switch_interval_ms,
                                                   args.pipelined, args.defer, args.host_releases, args.host_cpu,
                                                   args.engine_process)
    try:
        procs = args.client_procs
        per = [args.batch // procs + (p < args.batch % procs) for p in range(procs)]
        until = time.monotonic() + args.warmup_s + args.seconds + 2
        pool = multiprocessing.get_context("spawn").Pool(procs)
        jobs = [(server.url, n, args.max_tokens, args.prompt_len, vocab, adapters, until, args.client)
                for n in per]
        res = pool.map_async(_client_proc, jobs)
        time.sleep(args.warmup_s)
        s0, k0, w0, eng0, child0 = counters(server, engine)
        loop0, t0 = thread_cpu(server, False), time.monotonic()
        proc0 = time.process_time()
        prof = loop_profile(server, None) if args.profile else None
        time.sleep(args.seconds)
        if prof is not None:
            loop_profile(server, prof, args.profile)
        s1, k1, w1, eng1, child1 = counters(server, engine)
        loop1, t1 = thread_cpu(server, False), time.monotonic()
        proc1 = time.process_time()
        clients = res.get(args.seconds + args.warmup_s + 300)
        run_tokens = counters(server, engine)[1]
        pool.close()
    finally:
        server.stop()
    steps, toks, wall = s1 - s0, k1 - k0, t1 - t0
    chunks = sum(c["chunks"] for c in clients)
    return {
        "batch": args.batch, "host_ms": args.host_ms, "device_ms": args.device_ms, "max_tokens": args.max_tokens,
        "seconds": wall, "steps": steps, "tokens": toks, "tokens_per_s": toks / wall,
        "pipelined": args.pipelined, "defer_hand_over": server.engine_thread.defer_hand_over,
        "engine_process": args.engine_process,
        "engine_process_us_per_token": 1e6 * (child1 - child0) / max(toks, 1),  # the child's CPU (0: in-process)
        "host_releases": args.host_releases, "host_cpu": args.host_cpu,
        "paced_step_ms": max(args.host_ms, args.device_ms) if args.pipelined else args.host_ms + args.device_ms,
        "step_ms_mean": 1e3 * wall / max(steps, 1),  # wall per step, including the engine thread's between-steps work
        "step_call_ms_mean": 1e3 * (w1 - w0) / max(steps, 1),  # inside engine.step: GIL waits stretch it
        "mean_batch": toks / max(steps, 1),
        "loop_us_per_token": 1e6 * (loop1 - loop0) / max(toks, 1),
        "engine_thread_us_per_token": 1e6 * (eng1 - eng0) / max(toks, 1),
        "engine_thread_cpu_ms_per_step": 1e3 * (eng1 - eng0) / max(steps, 1),
        "server_process_us_per_token": 1e6 * (proc1 - proc0) / max(toks, 1),
        "client": args.client, "client_errors": sum(c.get("errors", 0) for c in clients),
        "client_chunks": chunks, "tokens_per_chunk": run_tokens / max(chunks, 1),  # whole run: >1 = coalesced
        "client_cpu_us_per_chunk": 1e6 * sum(c["cpu_s"] for c in clients) / max(chunks, 1),
        "switch_interval_ms": 1e3 * sys.getswitchinterval(),
    }


# ---------------------------------------------------------------- client cost per chunk (no server)


def sse_bytes(n_chunks: int, rid: str = "cmpl-x") -> bytes:
    """A completion stream of ``n_chunks`` one-token chunks, a usage chunk and [DONE], as the server sends it."""
    rng = np.random.default_rng(0)
    parts = []
    for i in range(n_chunks):
        fin = "length" if i == n_chunks - 1 else None
        body = {"id": rid, "object": "text_completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": fin,
                             "token_ids": [int(rng.integers(3, 32000))]}]}
        parts.append(f"data: {json.dumps(body)}\n\n")
    usage = {"id": rid, "object": "text_completion", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 5, "completion_tokens": n_chunks, "total_tokens": n_chunks + 5}}
    parts.append(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n")
    return "".join(parts).encode()


def run_client_bench(args) -> dict:
    import httpx
    import openai

    sys.path.insert(0, str(BENCH))
    from http_client import HttpRequest, stream_request

    per_stream = args.tokens_per_stream
    streams = max(1, args.chunks // per_stream)
    events = [e + b"\n\n" for e in sse_bytes(per_stream).split(b"\n\n") if e]

    async def one_event_per_read():  # as a network read at one chunk per step delivers them
        for e in events:
            yield e

    def handler(request):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=one_event_per_read())

    async def with_openai():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        client = openai.AsyncOpenAI(base_url="http://x/v1", api_key="k", http_client=http, max_retries=0)
        n = 0
        for _ in range(streams):
            stream = await client.completions.create(model="m", prompt=[1, 2], max_tokens=per_stream, stream=True,
                                                     extra_body={"return_token_ids": True})
            async for chunk in stream:
                for c in chunk.choices:
                    n += len((c.model_extra or {}).get("token_ids") or ())
        return n

    async def with_httpx():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        n = 0
        for i in range(streams):
            rec = await stream_request(http, "http://x", None, i, HttpRequest(0.0, "m", [1, 2], per_stream), 0.0)
            n += rec["tokens"]
        return n

    out = {"chunks": streams * per_stream, "tokens_per_stream": per_stream}
    for name, fn in (("openai", with_openai), ("httpx_sse", with_httpx)):
        asyncio.run(fn())  # imports and first-call costs off the clock
        t = time.process_time()
        n = asyncio.run(fn())
        out[f"{name}_us_per_chunk"] = 1e6 * (time.process_time() - t) / max(n, 1)
        out[f"{name}_tokens"] = n
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("server")
    s.add_argument("--batch", type=int, default=64)
    s.add_argument("--host-ms", type=float, default=6.3)
    s.add_argument("--device-ms", type=float, default=7.3)
    s.add_argument("--max-tokens", type=int, default=200)
    s.add_argument("--prompt-len", type=int, default=64)
    s.add_argument("--client-procs", type=int, default=1)
    s.add_argument("--client", default="raw", choices=["raw", "httpx", "openai"],
                   help="raw: a byte counter (the server is measured); httpx / openai: http_client.py's clients")
    s.add_argument("--seconds", type=float, default=10.0)
    s.add_argument("--warmup-s", type=float, default=3.0)
    s.add_argument("--pipelined", action="store_true",
                   help="the device runs a step while the host prepares the next (the engine's overlap): a step is "
                   "max(host, device) when nothing else wants the GIL; --device-ms is then the device's time per step")
    s.add_argument("--defer", action="store_true", help="the server's deferred hand-off (ServerConfig.defer_hand_over)")
    s.add_argument("--host-releases", type=int, default=0, help="GIL drops per step's host time")
    s.add_argument("--host-cpu", action="store_true",
                   help="--host-ms is thread CPU, not wall: the GIL waits of the engine thread stretch its step")
    s.add_argument("--engine-process", action="store_true",
                   help="the paced engine runs in an engine process (--engine-process), not a thread of the server")
    s.add_argument("--switch-interval-ms", type=float, default=None, help="sys.setswitchinterval in the server")
    s.add_argument("--profile", default=None, help="write the event loop's cProfile (top by own time) here")
    c = sub.add_parser("client")
    c.add_argument("--chunks", type=int, default=20000)
    c.add_argument("--tokens-per-stream", type=int, default=250)
    for p in (s, c):
        p.add_argument("--out", default=None)
        p.add_argument("--label", default=None)
    args = ap.parse_args(argv)
    res = run_server_bench(args) if args.what == "server" else run_client_bench(args)
    res["label"] = args.label
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
