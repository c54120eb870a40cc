"""Where the engine thread's host time goes in a prefill step's scheduling (admission: KV pages, adapter acquisition
from the adapter store: host reads, staging, pool writes), on the S1 saturation trace of ``http_serving.py``'s
in-process engine (session 8 on the H200: ~17 ms of ``Scheduler.schedule`` per prefill step, 22% of the run).

    PYTHONPATH=. python benchmarks/engine_profile.py --tiny --out profile_cpu.json                  # CPU, tiny model
    PYTHONPATH=. python benchmarks/engine_profile.py --preset llama-2-7b --work-dir /root/http-bench --out p.json

The engine is built by the server's own ``build_engine`` (the server's defaults: on a GPU max batch 256, max-loras
256, JAX's share of the card 0.95 and the pool 0.85 of what is free after the weights); flags this script does not
know go to it (e.g. ``--max-loras 64``). After the untimed warm-up trace of ``http_serving.py`` the saturation trace
runs once per pass, nothing in ``slora_jax`` changed (methods wrapped from outside, restored after the pass):

* ``timers``: wall-clock timers around the admission sub-phases (adapter store acquire / make room / evict / load,
  host-tier ``rows_now`` and ``take_staged`` waits, inline staging, the pool's jitted page scatter and table update,
  KV page allocation, host-tier lock waits), each attributed to the step phase it ran in (schedule / dispatch /
  prefetch / add); device dispatches split by whether the previous step was still running on the device, and
  flagged when that step was done by the time the dispatch returned (a dispatch that blocked on it). Per schedule
  call: wall, the engine thread's CPU time (wall - CPU = blocked or waiting for the GIL), reads in flight.
* ``cprofile``: cProfile only inside ``Scheduler.schedule`` (one profile per call, merged per plan kind) and inside
  the step dispatch (one profile per kind); the top functions by cumulative time. No timers in this pass, so the
  profile names real functions; its schedule seconds show cProfile's overhead.

The second pass finds the host tier as the first left it (warmer): compare the passes' store counters.
The answer printed last: of the mean prefill schedule, (a) waiting for host reads of adapter files (and for IO-thread
staging), (b) device dispatches (device_put of inline staging, page scatter, table update), (c) the rest (Python).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import datetime
import importlib.util
import json
import os
import pstats
import sys
import threading
import time
from pathlib import Path

from common import git_commit  # run as python benchmarks/engine_profile.py: benchmarks/ is on the path
from http_serving import ADAPTER_SETS, SAT_RATE, WARM_ADAPTERS, make_spec_trace, prepare_preset, trace_spec

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


# ---------------------------------------------------------------- wall-clock timers (pass "timers")


class Timers:
    """Sub-phase timers keyed by (phase, name, variant); thread-safe (IO threads record under phase "io")."""

    def __init__(self, engine):
        self.engine = engine
        self.main = threading.get_ident()  # the engine thread: run_trace drives the engine on this one
        self.phase: str | None = None
        self.call: dict | None = None  # the schedule call being timed
        self.calls: list[dict] = []
        self.stats: dict[tuple, list] = {}  # key -> [count, total_s, max_s]
        self.blocked: collections.Counter = collections.Counter()  # device dispatches: busy before, done after
        self._lock = threading.Lock()
        self._restore: list = []
        self._inline = False  # set by a read run inline on the engine thread (inside rows_now)

    # -- recording
    def add(self, name: str, seconds: float, variant: str = "", phase: str | None = None) -> None:
        on_main = threading.get_ident() == self.main
        phase = phase or ((self.phase or "other") if on_main else "io")
        key = (phase, name, variant)
        with self._lock:
            s = self.stats.get(key)
            if s is None:
                s = self.stats[key] = [0, 0.0, 0.0]
            s[0] += 1
            s[1] += seconds
            s[2] = max(s[2], seconds)
        if on_main and self.call is not None and phase == "schedule":
            key = name + (":" + variant if variant else "")
            self.call[key] = self.call.get(key, 0.0) + seconds

    def device_busy(self) -> bool:
        """The most recently dispatched step is still running on the device."""
        inflight = self.engine._inflight
        return inflight is not None and not inflight[2].is_ready()

    # -- wrapping
    def wrap(self, obj, attr: str, name: str, how: str = "plain") -> None:
        """Replace ``obj.attr`` (an instance attribute, or a module global) by a timed call of it."""
        orig = getattr(obj, attr)
        had = attr in vars(obj)
        timers = self

        if how == "device":  # a device dispatch: was the previous step still running, and is it done after?
            def timed(*a, **k):
                if threading.get_ident() != timers.main:
                    t0 = time.perf_counter()
                    try:
                        return orig(*a, **k)
                    finally:
                        timers.add(name, time.perf_counter() - t0)
                busy = timers.device_busy()
                t0 = time.perf_counter()
                try:
                    return orig(*a, **k)
                finally:
                    dt = time.perf_counter() - t0
                    timers.add(name, dt, "busy" if busy else "idle")
                    if busy and not timers.device_busy():
                        timers.blocked[(timers.phase, name)] += 1
        elif how == "rows_now":  # host rows: cached, or a read (inline on this thread, or waited for on an IO thread)
            host = self.engine.store.host

            def timed(name_, *a, **k):
                cached = name_ in host._host
                timers._inline = False
                t0 = time.perf_counter()
                try:
                    return orig(name_, *a, **k)
                finally:
                    variant = "cached" if cached else "read_inline" if timers._inline else "read_wait_io"
                    timers.add(name, time.perf_counter() - t0, variant)
        elif how == "take_staged":  # staged pages: ready, waited for (IO thread still copying), or none
            staging = self.engine.store.host._staging

            def timed(name_, rows, wait, *a, **k):
                st = staging._staged.get(name_)
                pending = st is not None and st.claimed and not st.future.done()
                t0 = time.perf_counter()
                out = None
                try:
                    out = orig(name_, rows, wait, *a, **k)
                    return out
                finally:
                    variant = ("none" if out is None else "waited" if pending and wait else "ready")
                    timers.add(name, time.perf_counter() - t0, variant)
        elif how == "run_load":  # a host read: on an IO thread, or inline on the engine thread (rows_now)
            def timed(load, inline=False):
                if inline:
                    timers._inline = True
                t0 = time.perf_counter()
                try:
                    return orig(load, inline)
                finally:
                    timers.add(name, time.perf_counter() - t0, "inline" if inline else "")
        else:
            def timed(*a, **k):
                t0 = time.perf_counter()
                try:
                    return orig(*a, **k)
                finally:
                    timers.add(name, time.perf_counter() - t0)
        setattr(obj, attr, timed)
        self._restore.append((obj, attr, orig, had))

    def wrap_lock(self, owner, attr: str, name: str) -> None:
        """Time the engine thread's waits for a lock (contention with the IO threads)."""
        lock = getattr(owner, attr)
        timers = self

        class TimedLock:
            def __enter__(self):
                if threading.get_ident() != timers.main:
                    return lock.__enter__()
                if lock.acquire(blocking=False):
                    return True
                t0 = time.perf_counter()
                lock.acquire()
                timers.add(name, time.perf_counter() - t0)
                return True

            def __exit__(self, *exc):
                lock.release()

            def acquire(self, *a, **k):
                return lock.acquire(*a, **k)

            def release(self):
                lock.release()

        setattr(owner, attr, TimedLock())
        self._restore.append((owner, attr, lock, True))

    def restore(self) -> None:
        for obj, attr, orig, had in reversed(self._restore):
            if had:
                setattr(obj, attr, orig)
            else:
                delattr(obj, attr)
        self._restore.clear()


def install_timers(engine) -> Timers:
    """Timers on the admission path (scheduler.py, adapter_store.py, host_tier.py, device_staging.py, pool.py)."""
    import slora_jax.engine.pool as pool_module

    t = Timers(engine)
    sched, store, host, pool = engine.scheduler, engine.store, engine.store.host, engine.pool
    # the step phases (Engine.step's schedule / dispatch / prefetch), and add_request's own prefetch
    orig_schedule = sched.schedule

    def schedule():
        t.phase = "schedule"
        call = t.call = {"reads_in_flight": len(host._loads), "misses0": store._counts["misses"],
                         "loads0": store._counts["loads"]}
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            plan = orig_schedule()
        finally:
            call["wall"] = time.perf_counter() - t0
            call["cpu"] = time.thread_time() - c0
            t.phase, t.call = None, None
        call["kind"] = plan.kind if plan is not None else "none"
        call["seqs"] = len(plan.seqs) if plan is not None else 0
        call["misses"] = store._counts["misses"] - call.pop("misses0")
        call["loads"] = store._counts["loads"] - call.pop("loads0")
        t.calls.append(call)
        t.add("Scheduler.schedule", call["wall"], call["kind"], phase="step")
        return plan

    sched.schedule = schedule
    t._restore.append((sched, "schedule", orig_schedule, False))
    for attr, phase in (("_dispatch", "dispatch"), ("_prefetch_head", "prefetch"), ("add_request", "add")):
        orig = getattr(engine, attr)

        def phased(*a, _orig=orig, _phase=phase, _attr=attr, **k):
            outer = t.phase
            t.phase = _phase if outer is None else f"{outer}/{_phase}"
            if _attr == "_dispatch":
                t.phase += "_" + a[0].kind
            t0 = time.perf_counter()
            try:
                return _orig(*a, **k)
            finally:
                t.add("Engine." + _attr, time.perf_counter() - t0, phase="step" if outer is None else outer)
                t.phase = outer

        setattr(engine, attr, phased)
        t._restore.append((engine, attr, orig, False))
    # inside admission (and prefetch): inclusive timers, nested as the calls nest
    for attr in ("_admit", "_reserve_decode_pages", "reclaim_pages", "obtainable_pages"):
        t.wrap(sched, attr, "Scheduler." + attr)
    for attr in ("acquire", "release", "pages_needed_to_load", "_make_room", "_evict", "_load", "prefetch",
                 "read_ahead"):
        t.wrap(store, attr, "AdapterStore." + attr)
    for attr in ("fetch", "usable_pages", "pages_to_load", "ready_to_load", "rows_or_read", "stage", "read_ahead"):
        t.wrap(host, attr, "HostTier." + attr)
    t.wrap(host, "rows_now", "HostTier.rows_now", "rows_now")
    t.wrap(host, "take_staged", "HostTier.take_staged", "take_staged")
    t.wrap(host, "_run_load", "HostTier._run_load (read)", "run_load")
    t.wrap(host._staging, "stage_or_none", "DeviceStaging.stage_or_none (IO-thread staging)")
    for attr in ("load_adapter", "unload_adapter", "alloc_kv_pages", "free_kv_pages"):
        t.wrap(pool, attr, "PagedPool." + attr)
    t.wrap(pool, "stage", "PagedPool.stage (device_put)", "device")
    t.wrap(pool, "_write_pages", "pool._write_pages (scatter)", "device")
    t.wrap(pool_module, "_set_slot", "pool._set_slot (table)", "device")
    # a lock swapped while no IO thread holds it (between traces): the host tier and its staging share it
    host_lock = host._lock
    t.wrap_lock(host, "_lock", "host-tier lock wait")
    host._staging.lock = host._lock
    t._restore.append((host._staging, "lock", host_lock, True))
    return t


def timers_report(t: Timers) -> dict:
    rows = [{"phase": p, "name": n, "variant": v, "count": c, "total_s": tot, "mean_ms": 1e3 * tot / c,
             "max_ms": 1e3 * mx} for (p, n, v), (c, tot, mx) in t.stats.items()]
    rows.sort(key=lambda r: -r["total_s"])
    pre = [c for c in t.calls if c["kind"] == "prefill"]

    def total(calls, key):
        return sum(c.get(key, 0.0) for c in calls)

    n = max(len(pre), 1)
    wall, cpu = total(pre, "wall"), total(pre, "cpu")
    read_keys = ("HostTier.rows_now:read_inline", "HostTier.rows_now:read_wait_io")
    reads = sum(total(pre, k) for k in read_keys)
    stage_wait = total(pre, "HostTier.take_staged:waited")
    device_keys = [f"{n_}:{v}" for n_ in ("PagedPool.stage (device_put)", "pool._write_pages (scatter)",
                                          "pool._set_slot (table)") for v in ("busy", "idle")]
    device = sum(total(pre, k) for k in device_keys)
    device_busy = sum(total(pre, k) for k in device_keys if k.endswith("busy"))
    lock = total(pre, "host-tier lock wait")
    waited = [c for c in pre if any(c.get(k, 0.0) > 0 for k in read_keys)]
    waits = sorted(sum(c.get(k, 0.0) for k in read_keys) for c in waited)
    answer = {
        "prefill_schedules": len(pre), "schedule_s": wall, "schedule_ms_mean": 1e3 * wall / n,
        "schedule_cpu_s": cpu, "off_cpu_s": wall - cpu,
        "a_host_read_wait_s": reads, "a_host_read_wait_ms_per_schedule": 1e3 * reads / n,
        "a_read_inline_s": total(pre, read_keys[0]), "a_read_wait_io_s": total(pre, read_keys[1]),
        "a_staging_wait_s": stage_wait, "a_staging_wait_ms_per_schedule": 1e3 * stage_wait / n,
        "b_device_dispatch_s": device, "b_device_dispatch_ms_per_schedule": 1e3 * device / n,
        "b_device_dispatch_busy_s": device_busy,
        "b_by_op_s": {k: total(pre, k) for k in device_keys},
        "lock_wait_s": lock,
        "c_rest_s": wall - reads - stage_wait - device - lock,
        "c_rest_ms_per_schedule": 1e3 * (wall - reads - stage_wait - device - lock) / n,
        "schedules_that_waited_on_a_read": len(waited),
        "read_wait_ms_per_waiting_schedule": {
            "mean": 1e3 * sum(waits) / len(waits) if waits else None,
            "p50": 1e3 * waits[len(waits) // 2] if waits else None,
            "p90": 1e3 * waits[int(0.9 * (len(waits) - 1))] if waits else None,
            "max": 1e3 * waits[-1] if waits else None},
        "misses_in_prefill_schedules": sum(c["misses"] for c in pre),
        "loads_in_prefill_schedules": sum(c["loads"] for c in pre),
        "reads_in_flight_at_start_mean": sum(c["reads_in_flight"] for c in pre) / n,
        "seqs_per_prefill": sum(c["seqs"] for c in pre) / n,
        "decode_schedules": sum(c["kind"] == "decode" for c in t.calls),
        "decode_schedule_s": sum(c["wall"] for c in t.calls if c["kind"] == "decode"),
    }
    pre_sorted = sorted(c["wall"] for c in pre)
    if pre_sorted:
        answer["schedule_ms_p50_p90_max"] = [1e3 * pre_sorted[len(pre_sorted) // 2],
                                             1e3 * pre_sorted[int(0.9 * (len(pre_sorted) - 1))],
                                             1e3 * pre_sorted[-1]]
    blocked = [{"phase": p, "name": n_, "count": c} for (p, n_), c in t.blocked.items()]
    return {"answer": answer, "subphases": rows, "device_dispatch_busy_then_done": blocked}


# ---------------------------------------------------------------- cProfile (pass "cprofile")


class Profiles:
    """cProfile inside ``Scheduler.schedule`` (a profile per call, merged by plan kind afterwards, since the kind is
    known only once the call returns) and inside ``Engine._dispatch`` (one profile per kind)."""

    def __init__(self, engine):
        self.engine = engine
        self.schedule: dict[str, list[cProfile.Profile]] = collections.defaultdict(list)
        self.schedule_s: collections.Counter = collections.Counter()
        self.dispatch: dict[str, cProfile.Profile] = collections.defaultdict(cProfile.Profile)
        self.dispatch_s: collections.Counter = collections.Counter()
        sched = engine.scheduler
        self.orig_schedule, self.orig_dispatch = sched.schedule, engine._dispatch

        def schedule():
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            try:
                plan = self.orig_schedule()
            finally:
                prof.disable()
            kind = plan.kind if plan is not None else "none"
            self.schedule[kind].append(prof)
            self.schedule_s[kind] += time.perf_counter() - t0
            return plan

        def dispatch(plan, previous):
            prof = self.dispatch[plan.kind]
            t0 = time.perf_counter()
            prof.enable()
            try:
                return self.orig_dispatch(plan, previous)
            finally:
                prof.disable()
                self.dispatch_s[plan.kind] += time.perf_counter() - t0

        sched.schedule, engine._dispatch = schedule, dispatch

    def restore(self) -> None:
        del self.engine.scheduler.schedule
        del self.engine._dispatch

    def stats(self) -> dict[str, pstats.Stats]:
        out = {}
        for kind, profs in self.schedule.items():
            if profs:
                out[f"schedule_{kind}"] = pstats.Stats(*profs)
        for kind, prof in self.dispatch.items():
            out[f"dispatch_{kind}"] = pstats.Stats(prof)
        return out


def short_path(path: str) -> str:
    for root, tag in ((str(ROOT) + os.sep, ""), (os.sep + "site-packages" + os.sep, "site:")):
        i = path.find(root)
        if i >= 0:
            return tag + path[i + len(root):]
    return path


def top_functions(stats: pstats.Stats, n: int) -> list[dict]:
    """The ``n`` functions of most cumulative time: calls, own and cumulative seconds."""
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _callers) in stats.stats.items():
        where = func if file == "~" else f"{short_path(file)}:{line}({func})"
        rows.append({"function": where, "ncalls": nc, "primitive_calls": cc, "tottime_s": tt, "cumtime_s": ct})
    rows.sort(key=lambda r: -r["cumtime_s"])
    return rows[:n]


# ---------------------------------------------------------------- the run


def build(args, server_args: list[str]):
    """The engine as the server builds it (``build_engine``), with the in-process child's environment."""
    from slora_jax.serve.cli import GPU_MEMORY_FRACTION, build_engine, build_parser

    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)  # as cli.main does for the server
    t = time.monotonic()
    engine, _, _ = build_engine(build_parser().parse_args(server_args))
    return engine, time.monotonic() - t


def load_serving():
    """serving.py (its ``run_trace``) after the backend is up, so its XLA defaults cannot differ from the server's."""
    spec = importlib.util.spec_from_file_location("serving", BENCH / "serving.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summary_of(res: dict) -> dict:
    keep = ("trace", "requests", "finished", "elapsed_s", "throughput_req_s", "throughput_tok_s",
            "mean_first_token_s", "cut_by_budget", "store", "prefill_steps", "prefill_host_s", "decode_steps",
            "decode_host_s")
    return {k: res[k] for k in keep if k in res}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)  # a server flag must never be taken for a prefix of ours
    ap.add_argument("--out", default=None, help="JSON report")
    ap.add_argument("--prof-dir", type=Path, default=None, help="also write the merged cProfile stats (.prof) here")
    ap.add_argument("--preset", default=None, help="model preset written with its adapters if missing (llama-2-7b)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/slora-http-bench"))
    ap.add_argument("--n-adapters", type=int, default=None, help="adapters written and in the trace (2000; --tiny 32)")
    ap.add_argument("--distinct-adapters", type=int, default=None, help="distinct weight files (20; --tiny 8)")
    ap.add_argument("--adapter-set", default="S1", choices=sorted(ADAPTER_SETS), help="as http_serving.py's")
    ap.add_argument("--requests", type=int, default=None, help="requests of the saturation trace (800; --tiny 48)")
    ap.add_argument("--in-range", default=None, help="prompt tokens lo,hi (8,512; --tiny 8,64)")
    ap.add_argument("--out-range", default=None, help="output tokens lo,hi (8,512; --tiny 8,64)")
    ap.add_argument("--passes", default="timers,cprofile", help="timers, cprofile, or both in this order")
    ap.add_argument("--top", type=int, default=25, help="functions listed per profile")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop the trace loop after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="CPU: tiny preset, 32 adapters, 8 slots, short lengths")
    args, server_args = ap.parse_known_args(argv)
    tiny = args.tiny
    args.preset = args.preset or ("tiny" if tiny else "llama-2-7b")
    args.n_adapters = args.n_adapters or (32 if tiny else 2000)
    args.distinct_adapters = args.distinct_adapters or (8 if tiny else 20)
    args.requests = args.requests or (48 if tiny else 800)
    lo_hi = "8,64" if tiny else "8,512"
    args.in_range = [int(x) for x in (args.in_range or lo_hi).split(",")]
    args.out_range = [int(x) for x in (args.out_range or lo_hi).split(",")]
    server_args = [a for a in server_args if a != "--"]
    if tiny and "--max-loras" not in server_args:  # fewer slots than adapters: misses and evictions on CPU too
        server_args += ["--max-loras", "8"]
    return args, server_args


def print_top(title: str, rows: list[dict], n: int) -> None:
    print(f"\n-- {title}: top {min(n, len(rows))} by cumulative time")
    print(f"   {'ncalls':>8s} {'own s':>8s} {'cum s':>8s}  function")
    for r in rows[:n]:
        print(f"   {r['ncalls']:8d} {r['tottime_s']:8.3f} {r['cumtime_s']:8.3f}  {r['function'][:150]}")


def print_answer(report: dict) -> None:
    a = (report.get("timers") or {}).get("answer")
    if not a:
        print("\n== no timers pass: no answer table")
        return
    n = max(a["prefill_schedules"], 1)

    def ms(s):
        return f"{1e3 * s / n:7.2f} ms {100 * s / max(a['schedule_s'], 1e-12):5.1f}%"

    w = a["read_wait_ms_per_waiting_schedule"]
    wait = (f"{a['schedules_that_waited_on_a_read']} of {a['prefill_schedules']} waited on a read: mean "
            f"{w['mean'] or 0:.1f} ms, p90 {w['p90'] or 0:.1f}, max {w['max'] or 0:.1f}")
    t = report["timers"]["trace"]
    print(f"\n== engine profile  {report['device']}  jax {report['jax_version']}  commit {report['git_commit'][:12]}"
          f"  {t['trace']} {t['finished']}/{t['requests']} in {t['elapsed_s']:.1f} s ({t['throughput_req_s']:.2f} "
          f"req/s)")
    for kind in ("prefill", "decode"):
        print(f"   {kind} {t[kind + '_steps']} steps, host s: " + " ".join(f"{k} {v:.2f}" for k, v in
                                                                     t[kind + "_host_s"].items()))
    print("   store: " + " ".join(f"{k} {v}" for k, v in t["store"].items()))
    p50, p90, mx = a.get("schedule_ms_p50_p90_max") or (0, 0, 0)
    print(f"   prefill Scheduler.schedule: {a['prefill_schedules']} calls, {a['schedule_s']:.3f} s, mean "
          f"{a['schedule_ms_mean']:.2f} ms (p50 {p50:.2f}, p90 {p90:.2f}, max {mx:.1f}); engine thread CPU "
          f"{a['schedule_cpu_s']:.3f} s, off CPU {a['off_cpu_s']:.3f} s")
    print(f"   (a) host read wait     {ms(a['a_host_read_wait_s'])}  (inline {a['a_read_inline_s']:.3f} s, on an IO "
          f"thread {a['a_read_wait_io_s']:.3f} s)")
    print(f"       {wait}")
    print(f"   (a') IO staging wait   {ms(a['a_staging_wait_s'])}")
    print(f"   (b) device dispatch    {ms(a['b_device_dispatch_s'])}  (with the previous step in flight "
          f"{a['b_device_dispatch_busy_s']:.3f} s)")
    for k, v in a["b_by_op_s"].items():
        if v:
            print(f"       {k:40s} {v:8.3f} s")
    print(f"   host-tier lock wait    {ms(a['lock_wait_s'])}")
    print(f"   (c) the rest (Python)  {ms(a['c_rest_s'])}")
    print(f"   in prefill schedules: misses {a['misses_in_prefill_schedules']}, loads "
          f"{a['loads_in_prefill_schedules']}, {a['seqs_per_prefill']:.1f} seqs/prefill, reads in flight at start "
          f"{a['reads_in_flight_at_start_mean']:.1f}")
    blocked = report["timers"]["device_dispatch_busy_then_done"]
    if blocked:
        print("   device dispatches that began with a step in flight and ended with it done: "
              + ", ".join(f"{b['phase']} {b['name']} {b['count']}" for b in blocked))
    cp = report.get("cprofile")
    if cp:
        print("   cProfile pass (profiled s): schedule " + " ".join(f"{k} {v:.3f}" for k, v in cp["schedule_s"].items())
              + ", dispatch " + " ".join(f"{k} {v:.3f}" for k, v in cp["dispatch_s"].items()))


def main(argv=None) -> int:
    args, server_args = parse_args(argv)
    t_start = time.monotonic()
    model_dir, adapter_dir, prepared = prepare_preset(args.preset, args.work_dir, args.n_adapters,
                                                      args.distinct_adapters, *ADAPTER_SETS[args.adapter_set])
    server_args = ["--model", str(model_dir), "--adapter-dir", str(adapter_dir), *server_args]
    # benchmarks/ off the path, as for the server: transformers probes for a package named 'kernels' and would run
    # benchmarks/kernels.py
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    engine, startup_s = build(args, server_args)
    import jax

    serving = load_serving()
    names = sorted(engine.adapter_names())[:args.n_adapters]
    vocab = engine.cfg.vocab_size
    ecfg = engine.ecfg
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "device": jax.devices()[0].device_kind,
              "platform": jax.default_backend(), "jax_version": jax.__version__, "git_commit": git_commit(),
              "python": sys.version.split()[0], "argv": sys.argv[1:], "server_args": server_args,
              "prepare": prepared, "startup_s": startup_s, "n_adapters": len(names),
              "engine": {k: getattr(ecfg, k) for k in ("max_batch_size", "max_loras", "max_prefill_seqs",
                                                       "max_prefill_tokens", "max_model_len", "max_cpu_loras",
                                                       "host_budget_bytes", "max_staged_adapters", "pool_bytes",
                                                       "num_pages", "backend", "dtype", "adapter_read_processes")},
              "pool_pages": engine.pool.num_pages, "cpus": os.cpu_count()}
    print(f"device {report['device']}  jax {jax.__version__}  commit {report['git_commit'][:12]}  engine ready in "
          f"{startup_s:.0f} s, pool {engine.pool.num_pages} pages, {len(names)} adapters, {report['engine']}",
          flush=True)

    def save() -> None:
        report["wall_s"] = time.monotonic() - t_start
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1, default=str))

    budget_end = t_start + args.budget_s
    warm = trace_spec("warm", WARM_ADAPTERS, SAT_RATE, max(16, args.requests // 2), 7, args.in_range, args.out_range)
    t = time.monotonic()
    serving.run_trace(engine, "warm", make_spec_trace(warm), names[-WARM_ADAPTERS:], vocab, budget_end)
    report["warm_s"] = time.monotonic() - t
    sat = trace_spec(f"{args.adapter_set}-n{len(names)}-sat", len(names), SAT_RATE, args.requests, 0, args.in_range,
                     args.out_range)
    report["trace_spec"] = sat
    save()
    def run_sat(probes):
        """The saturation trace with ``probes`` installed on the engine, taken off again however it ends."""
        try:
            return serving.run_trace(engine, sat["name"], make_spec_trace(sat), names, vocab, budget_end)[0]
        finally:
            probes.restore()

    for which in [p for p in args.passes.split(",") if p]:
        if time.monotonic() > budget_end - 10:
            print(f"skip pass {which}: budget", flush=True)
            continue
        engine.clock.total = dict.fromkeys(engine.time_in, 0.0)
        if which == "timers":
            timers = install_timers(engine)
            res = run_sat(timers)
            report["timers"] = timers_report(timers) | {"trace": summary_of(res)}
            print("timers pass: " + json.dumps(summary_of(res)), flush=True)
            rows = report["timers"]["subphases"]
            print(f"\n-- sub-phases (inclusive, nested as called), top 30 of {len(rows)} by total")
            print(f"   {'phase':22s} {'name':44s} {'variant':12s} {'count':>7s} {'total s':>8s} {'mean ms':>8s} "
                  f"{'max ms':>8s}")
            for r in rows[:30]:
                print(f"   {r['phase'][:22]:22s} {r['name'][:44]:44s} {r['variant'][:12]:12s} {r['count']:7d} "
                      f"{r['total_s']:8.3f} {r['mean_ms']:8.3f} {r['max_ms']:8.2f}")
        elif which == "cprofile":
            profiles = Profiles(engine)
            res = run_sat(profiles)
            cp = report["cprofile"] = {"trace": summary_of(res), "schedule_s": dict(profiles.schedule_s),
                                       "schedule_calls": {k: len(v) for k, v in profiles.schedule.items()},
                                       "dispatch_s": dict(profiles.dispatch_s), "top": {}}
            print("cprofile pass: " + json.dumps(summary_of(res)), flush=True)
            for key, stats in profiles.stats().items():
                cp["top"][key] = top_functions(stats, args.top if key != "schedule_none" else 5)
                if args.prof_dir is not None and key in ("schedule_prefill", "dispatch_prefill", "schedule_decode"):
                    args.prof_dir.mkdir(parents=True, exist_ok=True)
                    stats.dump_stats(str(args.prof_dir / f"engine_profile_{key}.prof"))
            for key in ("schedule_prefill", "dispatch_prefill", "schedule_decode"):
                if key in cp["top"]:
                    phase, kind = key.split("_")
                    seconds = cp[f"{phase}_s"].get(kind, 0.0)
                    print_top(f"{key} ({seconds:.3f} s profiled)", cp["top"][key],
                              args.top if key != "schedule_decode" else 10)
        else:
            raise SystemExit(f"unknown pass {which!r} (timers, cprofile)")
        save()
    report["compiles_after_warmup"] = engine.compiles_since_warmup()
    engine.store.close(wait=False)
    save()
    print_answer(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
