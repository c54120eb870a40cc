"""Why dispatching one engine step costs milliseconds of host time on the GPU: HLO census, dispatch with the device
idle / a step in flight / behind an unrelated busy op, under XLA_FLAGS variants (command buffers off, ...).

    PYTHONPATH=. python benchmarks/dispatch_probe.py --tiny                    # CPU dry run: tiny model, vocab 32000
    PYTHONPATH=. python benchmarks/dispatch_probe.py --model-dir DIR --batches 1,256,64 --deadline-s 480 --out r.json

Session 8 (H200, 7B): the jitted decode step's call took 3.2 / 5.7 / 7.2 ms of host time (wall ~ thread CPU) at batch
1 / 64 / 256, ~0.5 ms on the CPU box; batch 1's 3.2 ms equals the 7B's weight read. This script tells a host sync
(the call waits for the device: an XLA ``while`` / ``conditional`` that copies its predicate to the host, or an
allocation waiting for the previous step's memory) from launch / argument cost (~1000 kernels launched on the calling
thread; ~300 parameter leaves per call). Each XLA_FLAGS variant runs in its own process (the flags are read when the
backend starts), one after the other with a share of the time left; every process builds an Engine as
benchmarks/host_step.py does, runs B requests to steady decode, then calls the step the engine last dispatched
(recorded from ``StepRunner._run``) directly, threading the donated pool and penalty state:

* census: the optimized HLO of that executable (``fn.lower(...).compile()``; the persistent cache serves the compile
  the engine's call made): while / conditional (with their source and first body lines), custom-calls by target,
  fusions, entry instructions, command-buffer markers; ``memory_analysis``.
* dispatch (wall and thread CPU, medians of ``--calls`` after warm-up): ``idle`` (everything of the previous call
  finished first), ``inflight`` (the previous step still running, its tokens and pool as inputs, as serving runs),
  ``busy`` (idle inputs, but an unrelated matmul chain of ~3x the step queued first), the packed host input as numpy
  vs already on the device, through the jitted function vs the ``jax.stages.Compiled``; floors: a trivial jitted op
  (idle and behind a step), the same with the ~300 parameter leaves as arguments, ``device_put`` of the packed input.
* device: call + block with the device idle before; ``period``: wall per step when pipelined.
* a profiler trace of a few calls in the first variant (``--trace-out``): host events inside the calls, kernels per
  step on the device.

Reading it: dispatch(idle) small and dispatch(inflight) ~ the device time -> a host sync (H1 / H4): ``busy`` ~ the busy
op's time says the step itself waits for the stream (H1: the census names the while / conditional), ``busy`` small
says it waits only on the previous step's buffers (H4 / donation). dispatch(idle) ~ dispatch(inflight) and large ->
launch or argument cost (H2 / H3): the command-buffer variants, the parameter-leaf floor and the compiled path say
which.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

DEFAULT_VARIANTS = ("default=;"
                    "cmdbuf_off=--xla_gpu_enable_command_buffer=;"
                    "cmdbuf_ctrl=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,"
                    "CONDITIONAL")
WARM = 3  # calls before each timed series (a first call of a new argument kind may compile or re-record a graph)
NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
             "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain"}


# ---------------------------------------------------------------- HLO census (pure text: testable on any backend)

HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
OPCODE = re.compile(r"(?:^|[\s)}\]])([a-z][a-z0-9\-]*)\(")


def parse_hlo(text: str) -> tuple[dict[str, list[tuple[str, str, str]]], str | None]:
    """{computation: [(instruction name, opcode, line)]}, the entry computation's name."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = HEADER.match(line.strip()) if " = " not in line.split("(")[0] else None
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = INSTR.match(line)
        if m:
            op = OPCODE.search(m.group(3))
            comps[current].append((m.group(2), op.group(1) if op else "?", line.strip()))
    return comps, entry


def _attr(line: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", line)
    return m.group(1) if m else None


def _source(line: str) -> str:
    name = re.search(r'op_name="([^"]*)"', line)
    src = re.search(r'source_file="([^"]*)"\s+source_line=(\d+)', line)
    return " @ ".join(x for x in ((name.group(1)[-160:] if name else ""),
                                  (f"{Path(src.group(1)).name}:{src.group(2)}" if src else "")) if x)


def _first_lines(comps: dict, name: str | None, n: int = 8) -> list[str]:
    return [line[:220] for _, _, line in comps.get(name or "", [])[:n]]


def census(text: str) -> dict:
    """Counts of the optimized HLO that matter for dispatch: control flow the host must follow (while without a known
    trip count, conditional), kernels (fusions, custom-calls, other ops with a kernel) in every computation the
    executable runs (entry, loop bodies, branches, called computations; not fused ones)."""
    comps, entry = parse_hlo(text)
    out: dict = {"hlo_chars": len(text), "computations": len(comps), "entry": entry,
                 "command_buffer_mentions": text.count("command_buffer")}
    if entry is None:
        out["error"] = "no ENTRY computation found"
        return out
    ops_entry = collections.Counter(op for _, op, _ in comps[entry])
    out["entry_instructions"] = len(comps[entry])
    out["entry_opcodes_top"] = dict(ops_entry.most_common(15))
    executed, todo, whiles, conds, calls = [], [entry], [], [], []
    while todo:  # computations the executable runs as control flow (fusion bodies are kernels, not walked)
        name = todo.pop()
        if name in executed or name not in comps:
            continue
        executed.append(name)
        for inst, op, line in comps[name]:
            if op == "while":
                body, cond = _attr(line, "body"), _attr(line, "condition")
                trip = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', line)
                whiles.append({"name": inst, "in": name, "known_trip_count": int(trip.group(1)) if trip else None,
                               "source": _source(line), "body": body, "body_instructions": len(comps.get(body, [])),
                               "body_first": _first_lines(comps, body),
                               "condition_first": _first_lines(comps, cond, 5)})
                todo += [body, cond]
            elif op == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", line)
                branches = [b.strip().lstrip("%") for b in m.group(1).split(",")] if m else \
                    [b for b in (_attr(line, "true_computation"), _attr(line, "false_computation")) if b]
                conds.append({"name": inst, "in": name, "source": _source(line), "branches": branches,
                              "branch_first": {b: _first_lines(comps, b, 5) for b in branches}})
                todo += branches
            elif op in ("call", "async-start"):
                callee = _attr(line, "to_apply") or _attr(line, "calls")
                if callee:
                    calls.append(callee)
                    todo.append(callee)
    ops = collections.Counter(op for name in executed for _, op, _ in comps[name])
    targets = collections.Counter(m.group(1) for name in executed for _, op, line in comps[name]
                                  if op == "custom-call" and (m := re.search(r'custom_call_target="([^"]*)"', line)))
    kinds = collections.Counter(m.group(1) for name in executed for _, op, line in comps[name]
                                if op == "fusion" and (m := re.search(r"kind=(k\w+)", line)))
    out.update(executed_computations=len(executed), opcodes_top=dict(ops.most_common(20)),
               kernel_like=sum(n for op, n in ops.items() if op not in NO_KERNEL),
               **{k: ops.get(op, 0) for k, op in (("while", "while"), ("conditional", "conditional"),
                                                   ("custom_call", "custom-call"), ("fusion", "fusion"),
                                                   ("copy", "copy"), ("sort", "sort"))},
               whiles_unknown_trip=sum(w["known_trip_count"] is None for w in whiles),
               custom_call_targets=dict(targets.most_common(20)), fusion_kinds=dict(kinds),
               called_computations=sorted(set(calls))[:40], whiles=whiles[:12], conditionals=conds[:12])
    return out


# ---------------------------------------------------------------- one variant's process

def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


class Recorder:
    """Wraps ``StepRunner._run``: the last call of each step kind (jitted fn, layout, packed input, prev tokens)."""

    def __init__(self, runner):
        self.runner, self.last = runner, {}
        names = {runner._prefill: "prefill", runner._prefill_echo: "prefill_echo"}  # noqa: SLF001 - a probe
        names.update({fn: f"decode:{variant}" for variant, fn in runner._decode.items()})  # noqa: SLF001
        inner = runner._run  # noqa: SLF001

        @functools.wraps(inner)
        def run(fn, layout, params, pool, table, packed, prev_tokens):
            name = names.get(fn, "?")
            self.last[name.split(":")[0]] = dict(name=name, fn=fn, layout=layout, packed=packed, prev=prev_tokens)
            return inner(fn, layout, params, pool, table, packed, prev_tokens)
        runner._run = run  # noqa: SLF001


class StepProbe:
    """Calls one recorded step directly, threading the donated pool and penalty state (given back to the engine at
    the end); a decode step takes the previous call's tokens as its ``prev_tokens``, as serving does."""

    def __init__(self, engine, rec: dict, calls: int):
        import jax

        self.jax, self.engine, self.runner, self.calls = jax, engine, engine.runner, calls
        self.name, self.fn, self.layout, self.packed = rec["name"], rec["fn"], rec["layout"], rec["packed"]
        self.decode = self.name.startswith("decode")
        self.params, self.table = engine.params, engine.pool.table
        self.pool, self.state, self.prev, self.out = engine.pool.array, self.runner.penalty_state, rec["prev"], None
        self.rows = dict((f[0], f[1]) for f in self.layout)["batch.tokens"][0]  # the bucket
        self.fixed_prev = None  # set: every call reads this one prev-tokens buffer (same address), not the last output

    def call(self, packed, via=None):
        """``packed``: the host input, a device array, or a function making it at each call (timed with it)."""
        packed = packed() if callable(packed) else packed
        prev = self.prev if self.fixed_prev is None else self.fixed_prev
        args = (self.params, self.pool, self.table, packed, prev, self.state)
        out, self.state, self.pool = self.fn(self.layout, *args) if via is None else via(*args)
        if self.decode:
            self.prev = out.tokens
        self.out = out
        return out

    def sync(self) -> None:
        self.jax.block_until_ready((self.out, self.pool, self.state, self.prev))

    def give_back(self) -> None:
        self.sync()
        self.engine.pool.array, self.runner.penalty_state = self.pool, self.state

    def idle(self, packed, via=None, n: int | None = None) -> dict:
        """Dispatch with nothing running; device: call + block (the step alone)."""
        w_, c_, d_ = [], [], []
        for i in range(WARM + (n or self.calls)):
            self.sync()
            w, c = time.perf_counter(), time.thread_time()
            self.call(packed, via)
            dw, dc = time.perf_counter() - w, time.thread_time() - c
            self.sync()
            if i >= WARM:
                w_.append(dw), c_.append(dc), d_.append(time.perf_counter() - w)
        return dict(wall=med(w_), cpu=med(c_), device=med(d_), wall_min=min(w_) * 1e3, wall_max=max(w_) * 1e3)

    def inflight(self, packed, via=None, n: int | None = None) -> dict:
        """Dispatch while the previous call's step runs (then wait for its tokens, as ``Engine.step`` does);
        period: wall per step of the pipelined series."""
        n = n or self.calls
        self.sync()
        previous = self.call(packed, via)
        w_, c_, t0 = [], [], time.perf_counter()
        for i in range(WARM + n):
            if i == WARM:
                t0 = time.perf_counter()
            w, c = time.perf_counter(), time.thread_time()
            out = self.call(packed, via)
            dw, dc = time.perf_counter() - w, time.thread_time() - c
            previous.tokens.block_until_ready()
            previous = out
            if i >= WARM:
                w_.append(dw), c_.append(dc)
        period = (time.perf_counter() - t0) / n * 1e3
        self.sync()
        return dict(wall=med(w_), cpu=med(c_), period=period, wall_min=min(w_) * 1e3, wall_max=max(w_) * 1e3)

    def behind(self, busy, packed, n: int | None = None) -> dict:
        """Dispatch with idle inputs but an unrelated busy op queued on the device first."""
        w_, c_ = [], []
        for i in range(WARM + (n or self.calls)):
            self.sync()
            b = busy()
            w, c = time.perf_counter(), time.thread_time()
            self.call(packed)
            dw, dc = time.perf_counter() - w, time.thread_time() - c
            self.sync()
            b.block_until_ready()
            if i >= WARM:
                w_.append(dw), c_.append(dc)
        return dict(wall=med(w_), cpu=med(c_))


class Busy:
    """A chain of matmuls (no loop: unrolled, so no host-followed control flow) sized to ~``target_ms``."""

    def __init__(self, on_gpu: bool):
        import jax
        import jax.numpy as jnp

        self.jax, n = jax, 4096 if on_gpu else 256
        self.x = jnp.full((n, n), 1e-3, jnp.bfloat16 if on_gpu else jnp.float32)
        self.fns: dict[int, object] = {}
        self.per_rep_ms = self._time(8) / 8

    def _fn(self, reps: int):
        if reps not in self.fns:
            def chain(x):
                y = x
                for _ in range(reps):
                    y = self.jax.numpy.tanh(y @ x)
                return y
            self.fns[reps] = self.jax.jit(chain)
        return self.fns[reps]

    def _time(self, reps: int) -> float:
        fn = self._fn(reps)
        fn(self.x).block_until_ready()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            fn(self.x).block_until_ready()
            ts.append(time.perf_counter() - t)
        return med(ts)

    def sized(self, target_ms: float) -> tuple[object, float]:
        reps = 1 << max(0, min(7, int(np.ceil(np.log2(max(1.0, target_ms / max(self.per_rep_ms, 1e-3)))))))
        fn = self._fn(reps)
        return (lambda: fn(self.x)), self._time(reps)


def floors(probe: StepProbe, calls: int) -> dict:
    """Host time of things that are not the step: a trivial jitted op (idle, and behind the step in flight), the same
    op taking the step's parameter pytree as (unused, kept) arguments, device_put of the packed input."""
    jax = probe.jax
    small = jax.device_put(np.zeros(8, np.float32))
    inc = jax.jit(lambda x: x + 1)
    with_params = jax.jit(lambda p, x: x + 1, keep_unused=True)
    leaves = len(jax.tree.leaves(probe.params))

    def series(fn, before=None):
        w_, c_ = [], []
        for i in range(WARM + calls):
            probe.sync()
            if before is not None:
                before()
            w, c = time.perf_counter(), time.thread_time()
            r = fn()
            dw, dc = time.perf_counter() - w, time.thread_time() - c
            jax.block_until_ready(r)
            probe.sync()
            if i >= WARM:
                w_.append(dw), c_.append(dc)
        return dict(wall=med(w_), cpu=med(c_))

    step = functools.partial(probe.call, probe.packed)
    return dict(param_leaves=leaves, trivial_idle=series(lambda: inc(small)),
                trivial_inflight=series(lambda: inc(small), before=step),
                trivial_params_idle=series(lambda: with_params(probe.params, small)),
                device_put_idle=series(lambda: jax.device_put(probe.packed)),
                device_put_inflight=series(lambda: jax.device_put(probe.packed), before=step))


def probe_step(engine, rec: dict, calls: int, busy: Busy, full: bool, hlo_sink=None) -> dict:
    """Census, then every dispatch mode of one recorded step."""
    from slora_jax.engine import compile_counter

    probe = StepProbe(engine, rec, calls)
    jax = probe.jax
    res: dict = {"step": probe.name, "rows": probe.rows}
    probe.sync()
    t, before = time.monotonic(), compile_counter.compile_count()
    compiled = None
    try:
        compiled = probe.fn.lower(probe.layout, probe.params, probe.pool, probe.table, probe.packed, probe.prev,
                                  probe.state).compile()
        text = compiled.as_text()
        res["census"] = census(text)
        if hlo_sink is not None:
            hlo_sink(f"{probe.name} rows={probe.rows}", text)
        m = compiled.memory_analysis()
        if m is not None:
            res["memory"] = {k: int(getattr(m, k)) for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                                            "output_size_in_bytes", "alias_size_in_bytes")
                             if hasattr(m, k)}
    except Exception as e:  # noqa: BLE001 - the timings below still tell a lot
        res["census_error"] = repr(e)[:500]
    res["census_s"] = time.monotonic() - t
    res["census_backend_compiles"] = compile_counter.compile_count() - before
    packed_dev = jax.device_put(probe.packed)  # uncommitted, like the numpy input: the same jit cache entry
    packed_dev.block_until_ready()
    n = calls if full else max(15, calls // 2)
    modes = res["modes"] = {}

    def mode(name, fn, *a, **kw):  # a compile in a mode's warm-up calls is counted, not timed
        c = compile_counter.compile_count()
        modes[name] = dict(fn(*a, **kw))
        modes[name]["compiles"] = compile_counter.compile_count() - c
    mode("jit_np_idle", probe.idle, probe.packed, n=n)
    mode("jit_np_inflight", probe.inflight, probe.packed, n=n)
    step_ms = modes["jit_np_idle"]["device"]
    fn, busy_ms = busy.sized(max(5.0, 3 * step_ms))  # at most 128 matmuls: ~30 ms on the H200
    mode("jit_np_busy", probe.behind, fn, probe.packed, n=n)
    modes["jit_np_busy"]["busy_ms"] = busy_ms
    if full:
        mode("jit_dev_idle", probe.idle, packed_dev)
        mode("jit_dev_inflight", probe.inflight, packed_dev)
        # the engine with --no-stable-step-inputs (StepRunner._run): a fresh device_put of the host input each call
        fresh = functools.partial(jax.device_put, probe.packed)
        mode("jit_put_idle", probe.idle, fresh)
        mode("jit_put_inflight", probe.inflight, fresh)
        # stable addresses (NOTES, session 9: the CUDA graph is updated when an allocation it uses moves): a fresh
        # device_put copied by a tiny donated executable into one persistent buffer, read by the step at one address
        from slora_jax.engine.stable_inputs import StableInputs  # the engine's own copy-in (stable_step_inputs)

        stable = functools.partial(StableInputs().put, probe.packed)
        mode("jit_stable_idle", probe.idle, stable)
        mode("jit_stable_inflight", probe.inflight, stable)
        # the bound: the same packed buffer and the same prev-tokens buffer every call (only outputs move)
        probe.sync()
        probe.fixed_prev = probe.prev
        mode("jit_fixed_idle", probe.idle, packed_dev)
        mode("jit_fixed_inflight", probe.inflight, packed_dev)
        probe.fixed_prev = None
        if compiled is not None:
            try:
                mode("compiled_np_idle", probe.idle, probe.packed, via=compiled)
                mode("compiled_np_inflight", probe.inflight, probe.packed, via=compiled)
            except (TypeError, ValueError) as e:
                res["compiled_error"] = repr(e)[:300]
        res["floors"] = floors(probe, calls)
    probe.give_back()
    return res


def trace_calls(engine, rec: dict, out_path: str) -> dict:
    """A profiler trace of 3 idle and 6 in-flight calls; summary: host events inside the calls (per call), and every
    device line's events per step (kernels per step)."""
    import jax
    from jax.profiler import ProfileData, TraceAnnotation

    probe = StepProbe(engine, rec, 6)
    tmp = tempfile.mkdtemp(prefix="dispatch_trace_")
    probe.sync()
    with jax.profiler.trace(tmp):
        for _ in range(3):
            probe.sync()
            with TraceAnnotation("probe_idle"):
                probe.call(probe.packed)
            probe.sync()
        previous = probe.call(probe.packed)
        for _ in range(6):
            with TraceAnnotation("probe_inflight"):
                out = probe.call(probe.packed)
            previous.tokens.block_until_ready()
            previous = out
        probe.sync()
    probe.give_back()
    files = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
    if not files:
        return {"error": "no xplane.pb written"}
    raw = Path(files[0]).read_bytes()
    if out_path:
        with gzip.open(out_path, "wb") as f:
            f.write(raw)
    data = ProfileData.from_serialized_xspace(raw)
    windows: dict[str, list[tuple[int, int]]] = {"probe_idle": [], "probe_inflight": []}
    probe_line = None
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                if e.name in windows:
                    windows[e.name].append((e.start_ns, e.start_ns + e.duration_ns))
                    probe_line = (plane.name, line.name)
    summary: dict = {"file": out_path, "bytes": len(raw), "probe_line": probe_line,
                     "windows": {k: len(v) for k, v in windows.items()}, "inside_calls": {}, "lines": []}
    for plane in data.planes:
        for line in plane.lines:
            events = [(e.name, e.start_ns, e.duration_ns) for e in line.events]
            if not events:
                continue
            for kind, wins in windows.items():  # events inside the calls, on every host line (per call)
                agg: dict[str, list[float]] = {}
                for name, start, dur in events:
                    if name in windows:
                        continue
                    if any(a <= start and start + dur <= b for a, b in wins):
                        s = agg.setdefault(name[:120], [0, 0.0])
                        s[0] += 1
                        s[1] += dur / 1e6
                if agg and plane.name.startswith("/host"):
                    top = sorted(agg.items(), key=lambda kv: -kv[1][1])[:15]
                    summary["inside_calls"].setdefault(kind, {})[f"{plane.name} | {line.name}"] = {
                        k: {"n_per_call": v[0] / max(1, len(wins)), "ms_per_call": v[1] / max(1, len(wins))}
                        for k, v in top}
            total = collections.Counter()
            count = collections.Counter()
            for name, _, dur in events:
                total[name[:120]] += dur / 1e6
                count[name[:120]] += 1
            steps = max(1, sum(len(v) for v in windows.values()) + 1)
            summary["lines"].append({"plane": plane.name, "line": line.name, "events": len(events),
                                     "events_per_step": len(events) / steps, "ms_total": sum(total.values()),
                                     "top": {k: [count[k], round(v, 3)] for k, v in total.most_common(10)}})
    summary["lines"] = sorted(summary["lines"], key=lambda x: -x["events"])[:25]
    return summary


def build_engine(args):
    import jax
    from host_step import build_engine as build  # benchmarks/ is on the path when run as a script

    from slora_jax.engine import compile_counter

    if args.cache_dir:
        compile_counter.enable_persistent_cache(args.cache_dir)
    tmp = Path(tempfile.mkdtemp(prefix="dispatch_probe_"))
    on_gpu = jax.default_backend() == "gpu"
    batches = [int(b) for b in args.batches.split(",")]
    engine, adapters, load_s = build(args.model_dir, tmp, batches, args.max_model_len, args.adapters,
                                     gpu_pool=dict(pool_bytes=int(args.pool_gb * (1 << 30)) if args.pool_gb > 0
                                                   else None))
    info = dict(model=str(args.model_dir or "tiny, vocab 32000"), load_s=load_s, on_gpu=on_gpu,
                layer_loop=engine.layer_loop, pool_pages=engine.pool.num_pages if hasattr(engine.pool, "num_pages")
                else None, pool_bytes=engine.ecfg.pool_bytes, num_pages=engine.ecfg.num_pages,
                decode_buckets=list(engine.ecfg.decode_buckets), prefill_buckets=list(engine.ecfg.prefill_buckets),
                memory_stats={k: v for k, v in (jax.devices()[0].memory_stats() or {}).items()
                              if k in ("bytes_in_use", "bytes_limit", "peak_bytes_in_use")})
    return engine, adapters, info


def child(args) -> None:
    """One XLA_FLAGS variant: every batch size in order; the JSON is rewritten after each, so a process cut by its
    time share still reports what it measured."""
    import jax
    from host_step import end_requests, sampling_mix

    from slora_jax.engine import compile_counter

    result: dict = {"variant": args.variant, "xla_flags": os.environ.get("XLA_FLAGS", ""), "pid": os.getpid(),
                    "device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
                    "jax": jax.__version__, "backend": jax.default_backend(), "batches": {}, "errors": []}

    def save():
        tmp = args.child_out + ".tmp"
        Path(tmp).write_text(json.dumps(result, indent=1, default=str))
        os.replace(tmp, args.child_out)

    t0 = time.monotonic()
    engine, adapters, info = build_engine(args)
    result["engine"] = dict(info, setup_s=time.monotonic() - t0)
    busy = Busy(info["on_gpu"])
    result["busy_per_rep_ms"] = busy.per_rep_ms
    save()
    rec = Recorder(engine.runner)
    rng = np.random.default_rng(0)
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    hlo_file = gzip.open(args.hlo_out, "wt") if args.hlo_out else None
    seen_prefill = set()
    batches = [int(b) for b in args.batches.split(",")]
    try:
        for bi, b in enumerate(batches):
            if time.time() > args.deadline - 30:  # the parent kills this process at its deadline: stop cleanly first
                result["errors"].append(f"B={b}: skipped, {args.deadline - time.time():.0f} s before the deadline")
                save()
                break
            t, c0 = time.monotonic(), compile_counter.compile_count()
            row: dict = {}
            rec.last.clear()
            ids = [engine.add_request(rng.integers(3, engine.cfg.vocab_size, size=int(rng.integers(lo, hi))).tolist(),
                                      adapter=adapters[i % len(adapters)],
                                      sampling=sampling_mix(i, rng, max_tokens=32))  # admission reserves it
                   for i in range(b)]
            while len(engine.scheduler.waiting) or engine.last_plan is None or engine.last_plan.kind != "decode":
                engine.step()
            for _ in range(4):  # steady decode, as host_step measures it
                engine.step()
            row["reach_decode_s"] = time.monotonic() - t
            row["reach_decode_compiles"] = compile_counter.compile_count() - c0
            row["decode_seqs"] = len(engine.last_plan.seqs)  # < B: the pool could not admit the whole batch
            jax.block_until_ready((engine._inflight[2], engine.pool.array))  # noqa: SLF001 - a probe
            sink = functools.partial(write_hlo, hlo_file, f"{args.variant} B={b}") if hlo_file else None
            try:
                row["decode"] = probe_step(engine, rec.last["decode"], args.calls, busy, True, sink)
            except Exception as e:  # noqa: BLE001 - keep the other batches
                result["errors"].append(f"B={b} decode: {e!r}"[:500])
            pre = rec.last.get("prefill")
            if pre is not None and args.prefill and pre["layout"] not in seen_prefill:
                seen_prefill.add(pre["layout"])
                try:
                    row["prefill"] = probe_step(engine, pre, args.calls, busy, False, sink)
                except Exception as e:  # noqa: BLE001
                    result["errors"].append(f"B={b} prefill: {e!r}"[:500])
            row["probe_s"] = time.monotonic() - t
            result["batches"][str(b)] = row
            save()
            print(f"B={b}: {one_line(row)}", flush=True)
            # the trace last (a profiler session must not disturb the batches timed after it, nor cost them if it
            # fails); XLA turns command buffers off while profiling, so it shows the step's launches one by one
            if args.trace_out and bi == len(batches) - 1:
                left = args.deadline - time.time()
                if left > 45:
                    try:
                        result["trace"] = dict(trace_calls(engine, rec.last["decode"], args.trace_out), batch=b,
                                               note="command buffers off while profiling (XLA's default)")
                    except Exception as e:  # noqa: BLE001
                        result["trace"] = {"error": repr(e)[:500]}
                else:
                    result["trace"] = {"skipped": f"{left:.0f} s left"}
                save()
            end_requests(engine, ids)
    finally:
        if hlo_file is not None:
            hlo_file.close()
    result["wall_s"] = time.monotonic() - t0
    save()


def write_hlo(f, where: str, title: str, text: str) -> None:
    """Lines cut at 2000 characters: a Pallas call's line carries its kernel's serialized IR (the census reads the
    whole text; the dump is for reading, and must stay under the device tool's per-file limit)."""
    lines = (ln if len(ln) <= 2000 else f"{ln[:2000]}...<{len(ln)} chars>" for ln in text.splitlines())
    f.write(f"\n==== {where} {title}\n" + "\n".join(lines))


def one_line(row: dict) -> str:
    d = row.get("decode", {}).get("modes", {})
    c = row.get("decode", {}).get("census", {})

    def g(mode, key="wall"):
        v = d.get(mode, {}).get(key)
        return f"{v:.2f}" if isinstance(v, float) else "-"
    return (f"decode dispatch idle {g('jit_np_idle')} inflight {g('jit_np_inflight')} busy {g('jit_np_busy')} "
            f"(busy op {g('jit_np_busy', 'busy_ms')}) device {g('jit_np_idle', 'device')} ms; while "
            f"{c.get('while', '-')} cond {c.get('conditional', '-')} custom-call {c.get('custom_call', '-')} fusion "
            f"{c.get('fusion', '-')} kernel-like {c.get('kernel_like', '-')}")


# ---------------------------------------------------------------- the parent: one process per variant

_RUNNING: set[int] = set()  # children's process groups, killed if this process is terminated


def _kill_children(signum, _frame) -> None:
    """A child runs in its own session with most of the card: one left behind would starve the next call."""
    for pid in list(_RUNNING):
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    raise SystemExit(128 + signum)


def run_variant(args, name: str, flags: str, timeout: float, extra: list[str], env_extra: dict) -> dict:
    fd, out = tempfile.mkstemp(prefix=f"dispatch_{name}_", suffix=".json")
    os.close(fd)
    os.unlink(out)  # the child writes it (after each batch)
    env = dict(os.environ, **env_extra)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # as the server sets it (serve/cli.py)
    env["XLA_FLAGS"] = " ".join(x for x in (os.environ.get("XLA_FLAGS", ""), flags) if x)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--variant", name, "--child-out", out,
           "--deadline", str(time.time() + timeout), *extra]
    t = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=25)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, bufsize=1)
    _RUNNING.add(proc.pid)

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip()[-400:])
            if "Can't reduce memory use" not in line:  # XLA's remat warning, once per 7B step compile
                print(f"  [{name}] {line.rstrip()[:400]}", flush=True)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own process group (start_new_session)
        rc = proc.wait()
    _RUNNING.discard(proc.pid)
    reader.join(timeout=5)
    res = {"name": name, "flags": flags, "rc": rc, "timed_out": timed_out, "timeout_s": timeout,
           "wall_s": time.monotonic() - t, "env": env_extra}
    try:
        res["result"] = json.loads(Path(out).read_text())
        os.unlink(out)
    except (OSError, ValueError):
        res["result"] = None
    if rc != 0 or res["result"] is None:
        res["log_tail"] = list(tail)
    return res


def parse_variants(spec: str) -> list[tuple[str, str]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, flags = part.partition("=")
        out.append((name.strip(), flags.strip()))
    return out


def parent(args) -> None:
    import jax  # the version only: no backend here (this process must leave the GPU's memory to its children)
    from common import git_commit

    t_end = time.time() + args.deadline_s
    signal.signal(signal.SIGTERM, _kill_children)
    jobs = [(name, flags, [], {}) for name, flags in parse_variants(args.variants)]
    if args.big_pool_gb is not None:
        jobs.append(("default_bigpool", jobs[0][1] if jobs else "", ["--pool-gb", str(args.big_pool_gb)], {}))
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "jax": jax.__version__, "commit": git_commit(),
              "label": args.label, "model": args.model_dir or "tiny, vocab 32000", "batches": args.batches,
              "calls": args.calls, "pool_gb": args.pool_gb, "big_pool_gb": args.big_pool_gb,
              "deadline_s": args.deadline_s, "env_xla_flags": os.environ.get("XLA_FLAGS", ""), "variants": [],
              "nvidia_smi": nvidia_smi()}
    common = ["--batches", args.batches, "--calls", str(args.calls), "--pool-gb", str(args.pool_gb),
              "--prompt-len", args.prompt_len, "--adapters", str(args.adapters), "--max-model-len",
              str(args.max_model_len)] + (["--model-dir", args.model_dir] if args.model_dir else []) + \
        (["--cache-dir", args.cache_dir] if args.cache_dir else []) + ([] if args.prefill else ["--no-prefill"])
    weights = [2.0 if i == 0 else 1.0 for i in range(len(jobs))]  # the first variant measures the most
    for i, (name, flags, extra, env_extra) in enumerate(jobs):
        left = t_end - time.time() - 5
        required = sum(w for j, w in zip(jobs[i:], weights[i:], strict=True) if j[0] != "default_bigpool")
        if name == "default_bigpool" and left < args.min_job_s:
            report["variants"].append({"name": name, "skipped": f"{left:.0f} s left (< {args.min_job_s})"})
            continue
        if left < 20:
            report["variants"].append({"name": name, "skipped": f"{left:.0f} s left"})
            continue
        share = left * weights[i] / max(1.0, required) if name != "default_bigpool" else left
        per_job = list(extra)
        if i == 0:
            per_job += (["--hlo-out", args.hlo_out] if args.hlo_out else []) + \
                (["--trace-out", args.trace_out] if args.trace_out else [])
        print(f"== variant {name} (XLA_FLAGS +{flags!r}), {share:.0f} s of {left:.0f} s left", flush=True)
        res = run_variant(args, name, flags, share, common + per_job, env_extra)
        report["variants"].append(res)
        print(f"== variant {name}: rc {res['rc']}{' (cut by its share)' if res['timed_out'] else ''}, "
              f"{res['wall_s']:.0f} s", flush=True)
        if res.get("log_tail") and res["rc"] != 0:
            print("   " + "\n   ".join(res["log_tail"][-6:]), flush=True)
        report["interpretation"] = interpret(report)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    report["interpretation"] = interpret(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print_table(report)


def nvidia_smi() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.used,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _modes(v: dict, b: str, kind: str = "decode") -> dict:
    return (((v.get("result") or {}).get("batches") or {}).get(b) or {}).get(kind, {}).get("modes", {})


def _get(modes: dict, mode: str, key: str = "wall") -> float | None:
    x = modes.get(mode, {}).get(key)
    return x if isinstance(x, (int, float)) and x == x else None


def interpret(report: dict) -> list[str]:
    """One verdict per batch of the first variant, then what the other variants change."""
    variants = [v for v in report["variants"] if v.get("result")]
    if not variants:
        return ["no variant reported"]
    base = variants[0]
    lines = []
    for b in (base["result"].get("batches") or {}):
        m = _modes(base, b)
        idle, fl, dev = _get(m, "jit_np_idle"), _get(m, "jit_np_inflight"), _get(m, "jit_np_idle", "device")
        busy, busy_ms, cpu = _get(m, "jit_np_busy"), _get(m, "jit_np_busy", "busy_ms"), _get(m, "jit_np_idle", "cpu")
        if None in (idle, fl, dev):
            continue
        dec = base["result"]["batches"][b].get("decode") or {}
        c = dec.get("census") or {}
        cf = f"census: {c.get('while', '?')} while ({c.get('whiles_unknown_trip', '?')} without a known trip " \
             f"count), {c.get('conditional', '?')} conditional, {c.get('kernel_like', '?')} kernel-like ops"
        head = f"B={b}: dispatch idle {idle:.2f} ms (cpu {cpu or 0:.2f}), in flight {fl:.2f}, behind a " \
               f"{busy_ms or 0:.1f} ms op {busy or float('nan'):.2f}, device step {dev:.2f}"
        if busy is not None and busy_ms and busy - idle > 0.5 * busy_ms:
            verdict = (f"a host SYNC inside the step (H1): behind an unrelated op the call waits for it too; with the "
                       f"device idle the call still lasts {idle / dev:.0%} of the device step (how far into the step "
                       "the host is held). Look for the while/conditional/host copy in the census and the trace")
        elif fl - idle > max(0.5, 0.3 * dev):
            verdict = ("the call waits for the step in flight but not for an unrelated op: it waits on the previous "
                       "step's buffers (donated pool/penalty state, the allocator: H4)")
        elif idle > 1.0:
            verdict = "LAUNCH/ARGUMENT cost on the host, the same with or without a step in flight (H2/H3)"
            if cpu is not None and cpu < 0.7 * idle:
                verdict += f"; but only {cpu:.2f} ms of it is CPU: the thread blocks on something"
            f_ = dec.get("floors") or {}
            tp = (f_.get("trivial_params_idle") or {}).get("wall")
            tr = (f_.get("trivial_idle") or {}).get("wall")
            comp, dv = _get(m, "compiled_np_idle"), _get(m, "jit_dev_idle")
            parts = []
            if tp is not None and tr is not None:
                parts.append(f"{f_.get('param_leaves')} parameter leaves cost {tp - tr:.2f} ms (H3)")
            if comp is not None:
                parts.append(f"Compiled.__call__ {comp:.2f} ms vs jit {idle:.2f}")
            if dv is not None:
                parts.append(f"packed input already on the device {dv:.2f} ms")
            parts.append("the rest is XLA launching its thunks (H2): see the command-buffer variants and the trace")
            verdict += "; " + "; ".join(parts)
        else:
            verdict = "dispatch is small: no problem at this batch"
        lines.append(f"{head} -> {verdict}. {cf}")
    for v in variants[1:]:
        for b in (v["result"].get("batches") or {}):
            m, m0 = _modes(v, b), _modes(base, b)
            a, a0 = _get(m, "jit_np_idle"), _get(m0, "jit_np_idle")
            f, f0 = _get(m, "jit_np_inflight"), _get(m0, "jit_np_inflight")
            d, d0 = _get(m, "jit_np_idle", "device"), _get(m0, "jit_np_idle", "device")
            if None in (a, a0, f, f0):
                continue
            lines.append(f"{v['name']} B={b}: dispatch idle {a:.2f} (vs {a0:.2f}), in flight {f:.2f} (vs {f0:.2f}), "
                         f"device {d or float('nan'):.2f} (vs {d0 or float('nan'):.2f}) ms"
                         + (" -> command buffers/graphs are a large part of the launch cost" if v["name"].startswith(
                             "cmdbuf") and a0 > 1.0 and abs(a - a0) > 0.3 * a0 else ""))
    for v in report["variants"]:
        if v.get("rc") not in (0, None) and not v.get("timed_out"):
            lines.append(f"{v['name']}: the process failed (rc {v['rc']}; an unknown XLA flag aborts): "
                         + " | ".join((v.get("log_tail") or [])[-2:])[:300])
    return lines


def _c(x, spec: str = ".2f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and x == x else "-"


def _row(variant: str, b: str, kind: str, s: dict) -> str:
    m, cs = s.get("modes", {}), s.get("census", {})

    def wc(mode):
        x = m.get(mode, {})
        return f"{_c(x.get('wall'))}({_c(x.get('cpu'), '.1f')})"

    def pair(a, b_):
        return f"{_c(m.get(a, {}).get('wall'))}/{_c(m.get(b_, {}).get('wall'))}"
    busy = m.get("jit_np_busy", {})
    busy_cell = f"{_c(busy.get('wall'))}({_c(busy.get('busy_ms'), '.0f')})"
    cells = [f"{variant:15s}", f"{b:>4s}", f"{kind + ':' + str(s.get('rows')):12s}", f"{wc('jit_np_idle'):>12s}",
             f"{wc('jit_np_inflight'):>12s}", f"{busy_cell:>10s}", f"{pair('jit_dev_idle', 'jit_dev_inflight'):>11s}",
             f"{pair('compiled_np_idle', 'compiled_np_inflight'):>11s}",
             f"{pair('jit_put_idle', 'jit_put_inflight'):>11s}",
             f"{pair('jit_stable_idle', 'jit_stable_inflight'):>11s}",
             f"{pair('jit_fixed_idle', 'jit_fixed_inflight'):>11s}",
             f"{_c(m.get('jit_np_idle', {}).get('device')):>7s}",
             f"{_c(m.get('jit_np_inflight', {}).get('period')):>7s}"]
    cells += [f"{_c(cs.get(k), 'd'):>{w}s}" for k, w in (("while", 3), ("conditional", 3), ("custom_call", 4),
                                                         ("fusion", 5), ("kernel_like", 5))]
    return "   " + " ".join(cells)


def print_table(report: dict) -> None:
    print(f"\n== dispatch probe  {report['date']}  commit {str(report['commit'])[:12]}  jax {report['jax']}  "
          f"{report.get('nvidia_smi') or ''}")
    print("   ms wall (cpu) of the step's call: idle; infl = the previous step in flight; busy(op ms) = behind an "
          "unrelated op;\n   dev i/f = packed input already on the device (idle/inflight); comp i/f = "
          "jax.stages.Compiled; put i/f = a fresh device_put in each call\n   (the engine with "
          "--no-stable-step-inputs); stable i/f = that put copied into one persistent buffer (the engine's default on "
          "a GPU); fixed i/f = the same input and prev-token buffers every call; "
          "device = call + block; period = pipelined ms per step; census: while, conditional, custom-call, fusion, "
          "kernel-like ops")
    print(f"   {'variant':15s} {'B':>4s} {'step:rows':12s} {'idle':>12s} {'infl':>12s} {'busy(op)':>10s} "
          f"{'dev i/f':>11s} {'comp i/f':>11s} {'put i/f':>11s} {'stable i/f':>11s} {'fixed i/f':>11s} "
          f"{'device':>7s} {'period':>7s} {'whl':>3s} "
          f"{'cnd':>3s} {'cc':>4s} {'fus':>5s} {'kern':>5s}")
    for v in report["variants"]:
        r = v.get("result") or {}
        if not r.get("batches"):
            why = v.get("skipped") or f"rc {v.get('rc')}{' cut' if v.get('timed_out') else ''}, no batch measured"
            print(f"   {v['name']:15s} {why}")
            continue
        if v.get("rc") not in (0, None):
            print(f"   {v['name']:15s} rc {v['rc']}{' (cut by its time share)' if v.get('timed_out') else ''}: "
                  "partial")
        for b, row in r["batches"].items():
            for kind in ("decode", "prefill"):
                if row.get(kind):
                    print(_row(v["name"], b, kind, row[kind]))
            f_ = (row.get("decode") or {}).get("floors")
            if f_:
                print(f"   {'':20s} floors: trivial op idle {_c(f_['trivial_idle']['wall'], '.3f')} / behind the step "
                      f"{_c(f_['trivial_inflight']['wall'], '.3f')}; with {f_['param_leaves']} param leaves "
                      f"{_c(f_['trivial_params_idle']['wall'], '.3f')}; device_put(packed) idle "
                      f"{_c(f_['device_put_idle']['wall'], '.3f')} / in flight "
                      f"{_c(f_['device_put_inflight']['wall'], '.3f')}"
                      + (f"; only {row['decode_seqs']} of {b} decoding" if row.get("decode_seqs", int(b)) < int(b)
                         else ""))
        tr = r.get("trace")
        if tr:
            ins = (tr.get("inside_calls") or {}).get("probe_inflight") or {}
            best = sorted(((k, v_["ms_per_call"]) for evs in ins.values() for k, v_ in evs.items()),
                          key=lambda x: -x[1])[:8]
            text = tr.get("error") or tr.get("skipped") or \
                "; ".join(f"{k[:48]} {ms:.2f}" for k, ms in best) + " (host ms per in-flight call)"
            print(f"   {'':20s} trace B={tr.get('batch')}: {text}")
            for x in [x for x in tr.get("lines", []) if not x["plane"].startswith("/host")][:3]:
                print(f"   {'':20s}   {x['plane'][:30]} | {x['line'][:30]}: {x['events_per_step']:.0f} events/step")
    print("\n   verdict:")
    for line in report.get("interpretation", []):
        print(f"   - {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="default: a random tiny model (vocab 32000) in a temp dir")
    ap.add_argument("--tiny", action="store_true", help="the tiny model, fewer calls (a CPU dry run)")
    ap.add_argument("--batches", default="1,64,256", help="measured in this order (a process cut by its time share "
                                                          "keeps the batches done)")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per mode (after warm-up)")
    ap.add_argument("--prompt-len", default="128,129", help="prompt lengths drawn from [lo, hi): 128 fills 2048-token "
                                                            "prefill steps exactly (two prefill buckets compiled)")
    ap.add_argument("--adapters", type=int, default=12)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--pool-gb", type=float, default=24.0, help="the engine's pool on the GPU; 0: the engine's default "
                                                                "(85%% of the free memory)")
    ap.add_argument("--big-pool-gb", type=float, default=None, help="also run the first variant with this pool (0: "
                                                                    "the engine's default, most of the card: H4) if "
                                                                    "--min-job-s are left")
    ap.add_argument("--min-job-s", type=float, default=90.0)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="NAME=XLA_FLAGS;... one process each, in order")
    ap.add_argument("--no-prefill", dest="prefill", action="store_false", help="skip the prefill steps' probe")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="every variant ends within this many seconds")
    ap.add_argument("--cache-dir", default=None, help="persistent compilation cache (default: a temp dir)")
    ap.add_argument("--hlo-out", default=None, help="gzip of the first variant's optimized HLO texts")
    ap.add_argument("--trace-out", default=None, help="gzip of a profiler trace (xplane.pb) of the first variant's "
                                                      "first batch")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    ap.add_argument("--summary", default=None, help="print the table of an existing report and exit")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="default", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.summary:
        print_table(json.loads(Path(args.summary).read_text()))
        return
    if args.tiny:  # short prompts: XLA:CPU takes seconds for a 1024-token prefill of even the tiny model
        args.model_dir, args.calls, args.prompt_len = None, min(args.calls, 15), "16,17"
    if args.child:
        args.deadline = args.deadline or time.time() + 3600
        child(args)
        return
    args.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="dispatch_cache_")
    parent(args)


if __name__ == "__main__":
    main()
