"""What the engine thread does per step inside the HTTP server that an in-process engine loop does not, on CPU.

    PYTHONPATH=. python benchmarks/engine_thread_probe.py --mode both --seconds 20 --out probe.json

The same closed-loop load (``--batch`` requests open at a time, random prompt and output lengths, power-law
adapter choice over ``--adapters`` rank-8 q,k,v,o adapters, so prefills and adapter loads happen as in S1) runs on
the tiny random model (reference backend) twice: ``inproc`` (a loop adds requests and calls ``Engine.step``, as
``serving.py`` does) and ``server`` (the real ``Server`` with raw streaming clients in other processes, as
``http_overhead.py`` drives it). In both the engine is instrumented from outside: ``Engine.step``,
``Scheduler.schedule`` and ``StepRunner.decode`` / ``prefill`` are wrapped to add up their wall and thread-CPU
seconds (``time.thread_time``), and ``Engine.time_in`` gives the step's phases. Per step that gives:

- ``<phase>_wall_ms`` / ``_cpu_ms`` / ``_runq_ms`` (waiting for a core, from Linux schedstat) / ``_blocked_ms`` (the
  rest: not runnable, i.e. waiting for the GIL; for ``step`` also the device wait, its ``phase_wait_ms``);
- ``between_cpu_ms``: the engine thread's CPU outside ``Engine.step`` (taking requests, hand-offs, releases);
- ``loop_cpu_ms``: the event loop's CPU per step (server only): the GIL the engine thread competes for.

``--profile DIR`` writes a cProfile (thread CPU) of the engine thread per mode, top functions per step.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import multiprocessing
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent


class Meter:
    """Wall and thread-CPU seconds spent in wrapped callables (any thread), and the engine thread's CPU clock."""

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.runq: dict[str, float] = {}  # seconds runnable but without a core (the OS run queue)
        self.thread_cpu = 0.0  # time.thread_time() of the thread that last entered ``step``
        self.step_entries = 0
        self.tokens = 0  # new tokens in the outputs ``step`` returned

    def wrap(self, obj, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **k):
            w, c, q = time.perf_counter(), time.thread_time(), runq_s()
            if label == "step":
                self.thread_cpu, self.step_entries = c, self.step_entries + 1
            result = None
            try:
                result = fn(*a, **k)
                return result
            finally:
                if label == "step" and result:
                    self.tokens += sum(len(o.new_token_ids) for o in result)
                self.wall[label] = self.wall.get(label, 0.0) + time.perf_counter() - w
                self.cpu[label] = self.cpu.get(label, 0.0) + time.thread_time() - c
                self.runq[label] = self.runq.get(label, 0.0) + runq_s() - q
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(obj, attr, timed)

    def snapshot(self, engine) -> dict:
        return {"wall": dict(self.wall), "cpu": dict(self.cpu), "runq": dict(self.runq), "calls": dict(self.calls),
                "thread_cpu": self.thread_cpu, "time_in": dict(engine.time_in), "steps": engine.num_steps,
                "step_calls": self.calls.get("step", 0), "tokens": self.tokens, "t": time.perf_counter()}


def runq_s() -> float:
    """Seconds this thread has waited for a core (Linux schedstat; 0 elsewhere): what is left of wall - CPU is time
    it was not runnable, e.g. waiting for the GIL or the device."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:
        return 0.0


def instrument(engine) -> Meter:
    m = Meter()
    m.wrap(engine, "step", "step")
    m.wrap(engine.scheduler, "schedule", "schedule")
    m.wrap(engine.runner, "decode", "runner")
    m.wrap(engine.runner, "prefill", "runner")
    return m


def per_step(a: dict, b: dict) -> dict:
    """Milliseconds per engine step between two snapshots."""
    n = max(b["step_calls"] - a["step_calls"], 1)
    out = {"step_calls": n, "tokens_per_step": (b["tokens"] - a["tokens"]) / n,
           "tokens_per_s": (b["tokens"] - a["tokens"]) / (b["t"] - a["t"]),
           "wall_ms_per_step": 1e3 * (b["t"] - a["t"]) / n}
    for k in ("step", "schedule", "runner"):
        out[f"{k}_wall_ms"] = 1e3 * (b["wall"].get(k, 0) - a["wall"].get(k, 0)) / n
        out[f"{k}_cpu_ms"] = 1e3 * (b["cpu"].get(k, 0) - a["cpu"].get(k, 0)) / n
        out[f"{k}_runq_ms"] = 1e3 * (b["runq"].get(k, 0) - a["runq"].get(k, 0)) / n
        out[f"{k}_blocked_ms"] = out[f"{k}_wall_ms"] - out[f"{k}_cpu_ms"] - out[f"{k}_runq_ms"]  # GIL (+ device)
    for k, v in b["time_in"].items():
        out[f"phase_{k}_ms"] = 1e3 * (v - a["time_in"][k]) / n
    thread = b["thread_cpu"] - a["thread_cpu"]  # between the first and last step entries of the window
    steps_cpu = b["cpu"]["step"] - a["cpu"]["step"]
    out["between_cpu_ms"] = 1e3 * (thread - steps_cpu) / n
    return out


def build_engine(root: Path, n_adapters: int, batch: int):
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]  # benchmarks/kernels.py vs transformers
    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    from slora_jax.model.config import ModelConfig
    from slora_jax.tools import synth
    from slora_jax.tools.tokenizer import load_tokenizer, write_tokenizer

    model_dir = synth.write_model(root / "model", "tiny", seed=3)
    write_tokenizer(model_dir, ModelConfig.from_model_dir(model_dir).vocab_size)
    cfg = ModelConfig.from_model_dir(model_dir)
    adapters = {f"ad-{i:03d}": synth.write_adapter(root / f"ad-{i:03d}", cfg, rank=8, seed=500 + i)
                for i in range(n_adapters)}
    ecfg = EngineConfig(num_pages=1024, max_model_len=256, max_prefill_tokens=512, max_batch_size=batch,
                        max_loras=8, max_lora_rank=8, dtype="float32", backend="reference")
    engine = Engine.from_model_dir(model_dir, ecfg, adapters=adapters, tokenizer=load_tokenizer(model_dir),
                                   progress=False)
    engine.warmup(progress=False)
    return engine, list(adapters), cfg.vocab_size, model_dir


def request_stream(adapters: list[str], vocab: int, seed: int):
    """(adapter, prompt ids, max_tokens): power-law adapters (alpha 1), prompts 8-96 tokens, outputs 8-96."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, len(adapters) + 1)
    w /= w.sum()
    while True:
        yield (adapters[rng.choice(len(adapters), p=w)], rng.integers(3, vocab, int(rng.integers(8, 97))).tolist(),
               int(rng.integers(8, 97)))


def run_inproc(engine, meter, adapters, vocab, batch, warmup_s, seconds, profile: Path | None) -> dict:
    from slora_jax.engine.sampling import SamplingParams

    reqs = request_stream(adapters, vocab, 0)
    open_ = {"n": 0, "tokens": 0}

    def on_output(out):
        open_["tokens"] += len(out.new_token_ids)
        if out.finished:
            open_["n"] -= 1

    def fill():
        while open_["n"] < batch:
            ad, prompt, mt = next(reqs)
            rid = engine.add_request(prompt, ad, SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True),
                                     on_output=on_output)
            open_["n"] += 1
            finished.append(rid)

    finished: list[str] = []
    t_end_warm = time.monotonic() + warmup_s
    snap = prof = None
    while True:
        now = time.monotonic()
        if snap is None and now >= t_end_warm:
            snap = meter.snapshot(engine)
            if profile:
                prof = cProfile.Profile(time.thread_time)
                prof.enable()
        if snap is not None and now >= t_end_warm + seconds:
            break
        fill()
        engine.step()
        for rid in finished[:-batch]:
            engine.release(rid)  # as the server does: finished requests do not pile up in engine.requests
        del finished[:-batch]
    if prof is not None:
        prof.disable()
    end = meter.snapshot(engine)
    res = per_step(snap, end)
    if prof is not None:
        res["profile_top"] = profile_text(prof, res["step_calls"], profile / "inproc.txt")
    return res


def profile_text(prof, steps: int, path: Path) -> str:
    buf = io.StringIO()
    buf.write(f"# engine thread, thread CPU, {steps} steps (divide by it for per-step)\n")
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(buf.getvalue())
    return str(path)


async def _server_streams(url: str, n: int, adapters: list[str], vocab: int, until: float, seed: int) -> dict:
    sys.path.insert(0, str(BENCH))
    from http_overhead import _CountingStream

    host, port = url.split("//")[1].rsplit(":", 1)
    gen = request_stream(adapters, vocab, seed)

    def raw():
        while True:
            ad, prompt, mt = next(gen)
            body = json.dumps({"model": ad, "prompt": prompt, "max_tokens": mt, "stream": True, "ignore_eos": True,
                               "return_token_ids": True, "temperature": 0.0}).encode()
            yield (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    loop = asyncio.get_running_loop()
    counts = {"chunks": 0, "requests": 0}
    dones = []
    for _ in range(n):
        done = loop.create_future()
        dones.append(done)
        await loop.create_connection(lambda done=done: _CountingStream(raw(), until, counts, done), host, int(port))
    await asyncio.gather(*dones)
    return counts


def _client_proc(job) -> dict:
    return asyncio.run(_server_streams(*job))


def run_server(engine, meter, adapters, vocab, model_dir, batch, warmup_s, seconds, procs,
               profile: Path | None, defer: bool = False) -> dict:
    from slora_jax.serve.config import ServerConfig
    from slora_jax.serve.server import Server
    from slora_jax.tools.tokenizer import load_tokenizer

    server = Server(engine, ServerConfig(served_model_name="tiny", defer_hand_over=defer), port=0, log_level="warning",
                    tokenizer=load_tokenizer(model_dir))
    server.start_background()
    et = server.engine_thread
    loop = server._uvicorn.loop

    def loop_cpu() -> float:
        async def ask():
            return time.thread_time()
        return asyncio.run_coroutine_threadsafe(ask(), loop).result(30)

    try:
        per = [batch // procs + (p < batch % procs) for p in range(procs)]
        until = time.monotonic() + warmup_s + seconds + 2
        pool = multiprocessing.get_context("spawn").Pool(procs)
        res_async = pool.map_async(_client_proc, [(server.url, n, adapters, vocab, until, 10 + i)
                                                  for i, n in enumerate(per)])
        time.sleep(warmup_s)
        prof = cProfile.Profile(time.thread_time) if profile else None
        snap, l0 = asyncio.run(et.call(lambda: meter.snapshot(engine), 30)), loop_cpu()
        if prof is not None:
            asyncio.run(et.call(prof.enable, 30))
        time.sleep(seconds)
        if prof is not None:
            asyncio.run(et.call(prof.disable, 30))
        end, l1 = asyncio.run(et.call(lambda: meter.snapshot(engine), 30)), loop_cpu()
        clients = res_async.get(seconds + warmup_s + 300)
        pool.close()
    finally:
        server.stop()
    res = per_step(snap, end)
    res["loop_cpu_ms"] = 1e3 * (l1 - l0) / res["step_calls"]
    res["requests_done"] = sum(c["requests"] for c in clients)
    res["switch_interval_ms"] = 1e3 * sys.getswitchinterval()
    res["defer_hand_over"] = defer
    if prof is not None:
        res["profile_top"] = profile_text(prof, res["step_calls"], profile / "server.txt")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="both", choices=["inproc", "server", "both"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=24)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--defer", action="store_true", help="hand a step's outputs over once the next step is queued")
    ap.add_argument("--out", default=None)
    ap.add_argument("--label", default=None)
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level="WARNING")
    out = {"label": args.label, "batch": args.batch, "adapters": args.adapters, "seconds": args.seconds}
    with tempfile.TemporaryDirectory() as tmp:
        engine, adapters, vocab, model_dir = build_engine(Path(tmp), args.adapters, args.batch)
        meter = instrument(engine)
        if args.mode in ("inproc", "both"):
            out["inproc"] = run_inproc(engine, meter, adapters, vocab, args.batch, args.warmup_s, args.seconds,
                                       args.profile)
            while engine.has_unfinished():
                engine.step()
        if args.mode in ("server", "both"):
            out["server"] = run_server(engine, meter, adapters, vocab, model_dir, args.batch, args.warmup_s,
                                       args.seconds, args.client_procs, args.profile, args.defer)
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "main"
    sys.exit(main())
