"""Host time of one engine decode step: schedule, step-input building, dispatch, at several batch sizes.

    PYTHONPATH=. python benchmarks/host_step.py                       # tiny model, vocab 32000 (CPU or GPU)
    PYTHONPATH=. python benchmarks/host_step.py --model-dir DIR --out r.json --batches 64,256

B running decode sequences with mixed adapters (some base, several adapters of different targets) and mixed sampling
(greedy, top-p/top-k, penalties and logit_bias, logprobs); every request ignores EOS and has room for every step, so
the batch stays B. After a few steps to reach steady decode, each measured step is split by wrapping the engine's
parts (wall and this thread's CPU time):

* schedule: ``Scheduler.schedule`` (page reservation, the decodable list),
* items: ``Engine._item`` for every sequence,
* build: the runner's numpy inputs and their packing (``StepRunner._host_inputs``),
* dispatch: the jitted step's call (``StepRunner._run``),
* host: the whole ``Engine.step`` less its wait for the previous step's tokens (so it includes the append phase).

On the CPU the "device" runs on the host's cores, so by default (``--sync``) each measured step starts once the step in
flight is done: schedule, items and build then run alone; dispatch and what follows it still share the cores with the
step just queued. Compare thread CPU times there; wall times are for the GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams
from slora_jax.model.config import ModelConfig
from slora_jax.tools import synth

PHASES = ("schedule", "items", "build", "dispatch")
ADAPTER_TARGETS = (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"),
                   ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


class Clock:
    """Accumulates wall and thread-CPU seconds per phase over one step."""

    def __init__(self):
        self.wall = dict.fromkeys(PHASES, 0.0)
        self.cpu = dict.fromkeys(PHASES, 0.0)

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[phase] += time.perf_counter() - w
                self.cpu[phase] += time.thread_time() - c
        return timed

    def reset(self):
        self.wall = dict.fromkeys(PHASES, 0.0)
        self.cpu = dict.fromkeys(PHASES, 0.0)


def sampling_mix(i: int, rng: np.random.Generator, max_tokens: int) -> SamplingParams:
    """Request i's settings: a quarter each greedy, top-p, top-k + top-p with logprobs, penalties + logit_bias."""
    kind = i % 4
    common = dict(max_tokens=max_tokens, ignore_eos=True, seed=int(rng.integers(2**31)))
    if kind == 0:
        return SamplingParams(temperature=0.0, **common)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_p=0.9, **common)
    if kind == 2:
        return SamplingParams(temperature=1.0, top_k=40, top_p=0.95, logprobs=5, **common)
    return SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                          logit_bias=((5, 2.0), (7, -1.0)), **common)


def run_batch(engine: Engine, clock: Clock, batch: int, steps: int, rng: np.random.Generator,
              adapters: list[str | None], prompt_len: tuple[int, int], profile: bool = False,
              sync: bool = False) -> dict:
    ids = []
    for i in range(batch):
        n = int(rng.integers(*prompt_len))
        prompt = rng.integers(3, engine.cfg.vocab_size, size=n).tolist()
        ids.append(engine.add_request(prompt, adapter=adapters[i % len(adapters)],
                                      sampling=sampling_mix(i, rng, max_tokens=steps + 64)))
    while len(engine.scheduler.waiting) or engine.last_plan is None or engine.last_plan.kind != "decode":
        engine.step()  # prefills
    for _ in range(4):  # steady decode: every bucket variant compiled, pipelining in place
        engine.step()
    rows = []
    profiler = cProfile.Profile() if profile else None
    for _ in range(steps):
        if sync and engine._inflight is not None:  # noqa: SLF001 - the step still running, as the next one reads it
            jax.block_until_ready(engine._inflight[2])  # noqa: SLF001
        clock.reset()
        w, c = time.perf_counter(), time.thread_time()
        if profiler is not None:
            profiler.enable()
        engine.step()
        wall, cpu = time.perf_counter() - w, time.thread_time() - c
        if profiler is not None:
            profiler.disable()
        plan = engine.last_plan
        assert plan is not None and plan.kind == "decode" and len(plan.seqs) == batch, "the batch must stay whole"
        wait = engine.clock.last.wait
        rows.append(dict(host_wall=wall - wait, host_cpu=cpu, **{f"{p}_wall": clock.wall[p] for p in PHASES},
                         **{f"{p}_cpu": clock.cpu[p] for p in PHASES}))
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    result = {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}  # ms, median over steps
    result.update({f"{k}_min": min(r[k] for r in rows) * 1e3 for k in ("host_cpu", "build_cpu")})
    result.update(alone(engine))
    end_requests(engine, ids)
    return result


def end_requests(engine: Engine, ids) -> None:
    """Abort the measured requests, step until they are gone and release them: the engine is empty again."""
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    for rid in ids:
        engine.release(rid)


def alone(engine: Engine, repeats: int = 50) -> dict:
    """Thread-CPU ms (median) of the host phases repeated on their own, the device idle (nothing runs beside them):
    schedule (idempotent once the step's pages are reserved), the items, and the build (inputs of the running
    batch, built and packed, not dispatched)."""
    jax.block_until_ready(engine._inflight[2])  # noqa: SLF001 - let the step in flight finish first
    seqs = engine.scheduler.schedule().seqs
    runner = engine.runner
    phases = dict(schedule=engine.scheduler.schedule, items=lambda: [engine._item(s, "decode") for s in seqs],  # noqa: SLF001
                  build=lambda: runner._host_inputs(runner.build_decode, items))  # noqa: SLF001
    items = phases["items"]()
    out = {}
    for name, fn in phases.items():
        times = []
        for _ in range(repeats):
            c = time.thread_time()
            fn()
            times.append(time.thread_time() - c)
        out[f"{name}_alone"] = statistics.median(times) * 1e3
    return out


def build_engine(model_dir: str | None, tmp: Path, batches: list[int], max_model_len: int, n_adapters: int,
                 gpu_pool: dict | None = None) -> tuple[Engine, list[str | None], float]:
    """The engine the host probes measure (this script, dispatch_probe.py): ``model_dir`` or a tiny random model
    with Llama-2's vocabulary, ``n_adapters`` of 3 target sets and ranks 4/8/16 written under ``tmp``, every 4th
    request without one. ``gpu_pool``: the pool's EngineConfig fields on a GPU (default: sized from free memory).
    Returns (engine, adapter per request index, seconds to load the model)."""
    on_gpu = jax.default_backend() == "gpu"
    if model_dir is None:
        preset = dict(synth.preset_config("tiny"), vocab_size=32000, max_position_embeddings=max_model_len)
        model_dir = synth.write_model(tmp / "model", preset, seed=1)
    cfg = ModelConfig.from_model_dir(model_dir)
    pool = (gpu_pool or dict(num_pages=None)) if on_gpu else \
        dict(num_pages=max(batches) * (max_model_len // 16 + 1) + 1024)
    ecfg = EngineConfig(max_batch_size=max(batches), max_prefill_tokens=max(2048, max_model_len),
                        max_prefill_seqs=16, max_model_len=max_model_len, page_size=16, max_lora_rank=16,
                        max_loras=max(2, n_adapters), min_decode_bucket=1,
                        dtype="bfloat16" if on_gpu else "float32", backend="pallas" if on_gpu else "reference",
                        **pool)
    t = time.monotonic()
    engine = Engine.from_model_dir(model_dir, ecfg, progress=False)
    load_s = time.monotonic() - t
    names: list[str | None] = []
    for i in range(n_adapters):
        path = synth.write_adapter(tmp / f"a{i}", cfg, rank=(4, 8, 16)[i % 3], targets=ADAPTER_TARGETS[i % 3],
                                   seed=100 + i)
        engine.register_adapter(f"a{i}", path)
        names.append(f"a{i}")
    adapters = [None if i % 4 == 3 else names[i % len(names)] for i in range(max(len(names), 4))] if names else [None]
    return engine, adapters, load_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="default: a random tiny model with a 32000-token vocabulary")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--adapters", type=int, default=12, help="distinct adapters (every 4th request has none)")
    ap.add_argument("--prompt-len", default="64,512", help="prompt lengths drawn uniformly from [lo, hi)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--sync", action=argparse.BooleanOptionalAction, default=jax.default_backend() == "cpu",
                    help="wait for the step in flight before each measured step (default on CPU, where the 'device' "
                         "shares the host's cores: without it the host phases are timed against the step's threads)")
    ap.add_argument("--profile", action="store_true", help="cProfile the measured steps of the largest batch")
    ap.add_argument("--label", default="", help="written into the JSON (e.g. before / after)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="host_step_"))
    engine, adapters, _ = build_engine(args.model_dir, tmp, batches, args.max_model_len, args.adapters)
    clock = Clock()
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine._item = clock.wrap("items", engine._item)  # noqa: SLF001 - a benchmark's probe
    engine.runner._host_inputs = clock.wrap("build", engine.runner._host_inputs)  # noqa: SLF001
    engine.runner._run = clock.wrap("dispatch", engine.runner._run)  # noqa: SLF001
    rng = np.random.default_rng(0)
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    results = {}
    for b in batches:
        results[b] = run_batch(engine, clock, b, args.steps, rng, adapters, (lo, hi),
                               profile=args.profile and b == max(batches), sync=args.sync)
        r = results[b]
        print(f"B={b:4d}  host {r['host_wall']:7.2f} ms wall {r['host_cpu']:7.2f} ms cpu | "
              + "  ".join(f"{p} {r[p + '_wall']:6.2f}/{r[p + '_cpu']:6.2f}" for p in PHASES)
              + f" | alone: schedule {r['schedule_alone']:.3f} items {r['items_alone']:.3f}"
              + f" build {r['build_alone']:.3f}"
              + f" | min cpu: host {r['host_cpu_min']:.2f} build {r['build_cpu_min']:.2f}", flush=True)
    if args.out:
        from common import git_commit  # benchmarks/common.py (PYTHONPATH=.:benchmarks)

        Path(args.out).write_text(json.dumps(dict(
            date=time.strftime("%Y-%m-%d %H:%M:%S"), device=str(jax.devices()[0]), jax=jax.__version__,
            commit=git_commit(), label=args.label, model=str(args.model_dir or "tiny, vocab 32000"),
            steps=args.steps, sync=args.sync, ms_median=results), indent=1))


if __name__ == "__main__":
    main()
