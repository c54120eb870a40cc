"""The opt-in compile ledger: with SLORA_TEST_COMPILE_LEDGER=<dir> (tests/conftest.py registers it), each pytest
process (each xdist worker) appends one JSON line per test to <dir>/<worker>.<pid>.jsonl, saying how much of the
test's setup, call and teardown went to JAX compiles (benchmarks/h200/summary.py suite sums them beside the
durations)."""

from __future__ import annotations

import os

import jax
import pytest

# JAX's monitoring events (jax/_src/dispatch.py, the same names in 0.10.2 and 0.11.2): tracing a jit to a jaxpr,
# lowering it to an MLIR module (a Pallas kernel's own lowering included), and the backend compile (XLA's passes,
# the Triton kernels' compiles and ptxas on a GPU; a persistent-cache hit is also one, a short one).
_LEDGER_EVENTS = {"/jax/core/compile/backend_compile_duration": "compile",
                  "/jax/core/compile/jaxpr_trace_duration": "trace",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower"}
_LEDGER_COMPILE = "/jax/core/compile/backend_compile_duration"
_LEDGER_HIT = "/jax/compilation_cache/cache_hits"


def _process_start() -> float | None:
    """When this process started, epoch seconds (Linux: /proc), so the ledger shows a worker's start-up."""
    try:
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        with open("/proc/self/stat") as f:
            ticks = float(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def _by_secs(fns: dict[str, list]) -> list[list]:
    """Every function compiled, as [name, compiles, seconds], costliest first."""
    return [[name, n, round(s, 4)] for name, (n, s) in sorted(fns.items(), key=lambda kv: -kv[1][1])]


class CompileLedger:
    """The compile ledger's pytest plugin and JAX listener. A compile counts toward the test phase running when it
    ends, whichever thread it ran on (engines compile warm-ups on threads of their own), so a phase's compile seconds
    may exceed its wall time; ``busy_s`` is the wall time in which at least one compile ran. Compiles in processes a
    test starts (servers, engine processes) are not seen. Every failure here is swallowed: it must never fail a test."""

    def __init__(self, directory: str):
        import threading
        import time

        self._time = time
        self._lock = threading.Lock()
        self._worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self._path = os.path.join(directory, f"{self._worker}.{os.getpid()}.jsonl")
        os.makedirs(directory, exist_ok=True)
        self._file = None
        self._test = None  # the running test's id (without xdist's "@group" suffix), its phases so far
        self._phases: dict[str, dict] = {}
        self._outside = self._bucket()  # collection, imports, between tests
        self._cur = self._outside
        # The names an eager call of one jax.numpy / lax / nn / random function compiles under ("jit(multiply)"):
        # outside a jit each such call is a compile of its own, per shape and dtype.
        mods = (jax.numpy, jax.lax, jax.nn, jax.random)
        self._ops = {n for mod in mods for n in dir(mod) if not n.startswith("__")}
        self._ops |= {getattr(v, "name", "") for k, v in vars(jax.lax).items() if k.endswith("_p")}
        self._write({"test": "<worker start>", "worker": self._worker, "process_start": _process_start(),
                     "configured": self._time.time()})
        self._started = None  # the running test's first hook, epoch seconds
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_time_span_listener(self._on_span)
        jax.monitoring.register_event_listener(self._on_event)

    def _bucket(self) -> dict:
        return {"t0": self._time.perf_counter(), "c0": self._time.process_time(), "w0": self._time.time(),
                "compiles": 0, "compile_s": 0.0, "eager_n": 0, "eager_s": 0.0, "trace_n": 0, "trace_s": 0.0,
                "lower_n": 0, "lower_s": 0.0, "cache_hits": 0, "spans": [], "fns": {}}

    def _is_op(self, name: str) -> bool:
        inner = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
        return inner.lstrip("_") in self._ops

    def _on_duration(self, event: str, secs: float, **kwargs) -> None:
        try:
            kind = _LEDGER_EVENTS.get(event)
            if kind is None:
                return
            with self._lock:
                b = self._cur
                if kind != "compile":
                    b[kind + "_n"] += 1
                    b[kind + "_s"] += secs
                    return
                name = str(kwargs.get("fun_name", "?"))
                b["compiles"] += 1
                b["compile_s"] += secs
                f = b["fns"].setdefault(name, [0, 0.0])
                f[0] += 1
                f[1] += secs
                if self._is_op(name):
                    b["eager_n"] += 1
                    b["eager_s"] += secs
        except Exception:  # noqa: BLE001  (inside JAX's compile path: never raise)
            pass

    def _on_span(self, event: str, start: float, end: float, **kwargs) -> None:
        try:
            if event == _LEDGER_COMPILE:
                with self._lock:
                    self._cur["spans"].append((start, end))
        except Exception:  # noqa: BLE001
            pass

    def _on_event(self, event: str, **kwargs) -> None:
        try:
            if event == _LEDGER_HIT:
                with self._lock:
                    self._cur["cache_hits"] += 1
        except Exception:  # noqa: BLE001
            pass

    def _close(self, b: dict) -> dict:
        """The phase's record: its wall and process CPU seconds, the compile sums, the busy time of its spans."""
        now, w1 = self._time.perf_counter(), self._time.time()
        busy, edge = 0.0, b["w0"]
        for s, e in sorted(b["spans"]):
            s, e = max(s, edge), min(e, w1)
            if e > s:
                busy, edge = busy + e - s, e
        out = {"wall_s": now - b["t0"], "cpu_s": self._time.process_time() - b["c0"], "busy_s": busy}
        out.update((k, v) for k, v in b.items() if k not in ("t0", "c0", "w0", "spans", "fns"))
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
        out["fns"] = b["fns"]
        return out

    def _enter(self, item, when: str) -> None:
        try:
            nodeid = item.nodeid
            mark = item.get_closest_marker("xdist_group")
            group = (mark.args[0] if mark.args else mark.kwargs.get("name")) if mark else None
            if group and nodeid.endswith(f"@{group}"):
                nodeid = nodeid[: -len(group) - 1]
            with self._lock:
                if self._test is not None and self._test[0] != nodeid:
                    self._flush_locked()  # a test whose logfinish never came
                if self._test is not None and self._cur is not self._outside:
                    self._phases[self._test[1]] = self._close(self._cur)
                if self._test is None:
                    self._started = self._time.time()
                self._test = (nodeid, when)
                self._cur = self._bucket()
        except Exception:  # noqa: BLE001
            pass

    def _flush_locked(self) -> None:
        if self._test is None:
            return
        if self._cur is not self._outside:
            self._phases[self._test[1]] = self._close(self._cur)
        fns: dict[str, list] = {}
        for ph in self._phases.values():
            for name, (n, s) in ph.pop("fns").items():
                f = fns.setdefault(name, [0, 0.0])
                f[0] += n
                f[1] += s
        self._write({"test": self._test[0], "worker": self._worker, "phases": self._phases, "fns": _by_secs(fns),
                     "start": self._started, "end": self._time.time()})
        self._test, self._phases, self._cur = None, {}, self._outside

    def _write(self, record: dict) -> None:
        import json

        try:
            if self._file is None:
                self._file = open(self._path, "a", buffering=1)  # noqa: SIM115  (kept open; one line per test)
            self._file.write(json.dumps(record) + "\n")
        except (OSError, TypeError, ValueError):
            pass

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        self._enter(item, "setup")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item):
        self._enter(item, "call")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item, nextitem):
        self._enter(item, "teardown")

    def pytest_runtest_logfinish(self, nodeid, location):
        try:
            with self._lock:
                self._flush_locked()
        except Exception:  # noqa: BLE001
            pass

    def pytest_sessionfinish(self, session):
        try:
            with self._lock:
                self._flush_locked()
                b = self._outside
                if b["compiles"] or b["trace_n"]:
                    rec = self._close(b)
                    self._write({"test": "<outside tests>", "worker": self._worker, "phases": {"outside": rec},
                                 "fns": _by_secs(rec.pop("fns"))})
                if self._file is not None:
                    self._file.close()
                    self._file = None
        except Exception:  # noqa: BLE001
            pass
