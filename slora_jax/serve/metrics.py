"""Prometheus metrics of the server, in a registry of its own (several apps in one process never collide).

Counters and histograms are updated as requests flow; gauges (queue, batch, adapters per tier, pool split, compiles,
prefix cache, deadline aborts) are refreshed from ``engine.stats()`` at scrape time, so they are exact when read and
cost nothing between scrapes.

Per-adapter series (requests, tokens, pool loads, evictions, load seconds) are labelled by adapter with a bound on
cardinality (:class:`AdapterLabels`): thousands of adapters must not mean thousands of series per metric.
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..lora.mixes import MIX_PREFIX

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)

# AdapterStore.stats() key names for each tier, first match wins (the store reports counts per tier).
_TIER_KEYS = {
    "pool": ("resident", "pool"),
    "host": ("in_host", "host"),
    "disk": ("registered", "disk"),  # every registered adapter has its source (disk) copy
}
# AdapterStore.stats() counters worth exporting as they are.
_STORE_STATS = ("pinned", "explicit_pins", "loading", "failed", "hits", "misses", "evictions", "loads",
                "prefetch_loads", "staged_loads", "host_loads", "host_evictions", "load_errors", "host_bytes",
                "resident_pages")
# Seconds of an adapter's read from its source (stage "host") or pool load (stage "pool").
_LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MAX_ADAPTER_LABELS = 64  # adapters with a label of their own in the per-adapter series; the rest are OTHER
OTHER = "other"
MIXES = "mix"  # every adapter mix (``mix:...``): clients sending new weights must not use up the own labels
# PrefixCache.stats() entries (its counters appear once they move: exported as 0 until then while the cache is on).
_PREFIX_STATS = ("cached_pages", "unused_pages", "hit_pages", "miss_pages", "inserted", "evicted")


def _number(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, list | tuple | set | dict):
        return float(len(v))
    return None


class AdapterLabels:
    """The adapter label of the per-adapter series. The first ``limit`` adapters that requests name get a label of
    their own, for the life of the server; every other adapter (and one named like :data:`OTHER` or :data:`MIXES`) is
    counted under ``OTHER``, and every mix under :data:`MIXES`. Labels never move, so every series only grows: had
    the most used ``limit`` adapters been relabelled as use shifts, an adapter leaving ``OTHER`` would make
    ``OTHER``'s counters fall. Thread-safe."""

    def __init__(self, limit: int = MAX_ADAPTER_LABELS):
        self.limit = limit
        self._own: set[str] = set()
        self._lock = threading.Lock()

    def grant(self, name: str) -> str:
        """``name``'s label, giving it one of its own while fewer than ``limit`` adapters have one."""
        if name in self._own:
            return name
        if name.startswith(MIX_PREFIX):
            return MIXES
        with self._lock:
            if name not in (OTHER, MIXES) and len(self._own) < self.limit:
                self._own.add(name)
                return name
        return OTHER

    def label(self, name: str) -> str:
        return name if name in self._own else MIXES if name.startswith(MIX_PREFIX) else OTHER

    def __len__(self) -> int:
        return len(self._own)


class ServerMetrics:
    def __init__(self, prefix: str = "slora", max_adapter_labels: int = MAX_ADAPTER_LABELS):
        self.registry = r = CollectorRegistry(auto_describe=True)
        p = prefix
        self.adapter_labels = AdapterLabels(max_adapter_labels)
        own = f"own label for the first {max_adapter_labels} adapters requested, the rest '{OTHER}'"
        self.adapter_requests = Counter(f"{p}_adapter_requests", f"Requests accepted, by adapter ({own})", ["adapter"],
                                        registry=r)
        self.adapter_tokens = Counter(f"{p}_adapter_generation_tokens", f"Tokens generated, by adapter ({own})",
                                      ["adapter"], registry=r)
        self.adapter_loads = Counter(f"{p}_adapter_pool_loads", f"Loads into the device pool, by adapter ({own})",
                                     ["adapter"], registry=r)
        self.adapter_evictions = Counter(f"{p}_adapter_evictions", f"Evictions from the device pool, by adapter "
                                         f"({own})", ["adapter"], registry=r)
        self.adapter_load_seconds = Histogram(
            f"{p}_adapter_load_seconds", f"Seconds of reads from the source (stage host) and of pool loads (stage "
            f"pool, host time), by adapter ({own})", ["adapter", "stage"], buckets=_LOAD_BUCKETS, registry=r)
        self.requests = Counter(f"{p}_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter(f"{p}_request_finish", "Generation requests finished, by finish reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generated_tokens = Counter(f"{p}_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{p}_time_per_output_token_seconds", "Time between consecutive output tokens",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}_request_latency_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge(f"{p}_requests_waiting", "Requests queued for admission", registry=r)
        self.running = Gauge(f"{p}_requests_running", "Requests in the running batch", registry=r)
        self.adapters = Gauge(f"{p}_adapters", "Adapters per tier (pool = resident on device)", ["tier"], registry=r)
        self.pool_pages = Gauge(f"{p}_pool_pages", "Pages of the unified pool by use", ["kind"], registry=r)
        self.pool_fraction = Gauge(f"{p}_pool_fraction", "Fraction of pool pages by use (kv, adapter, free)",
                                   ["kind"], registry=r)
        self.pool_live_bytes = Gauge(f"{p}_pool_live_bytes", "Bytes of the pool holding live data, by use",
                                     ["kind"], registry=r)
        self.pool_utilisation = Gauge(f"{p}_pool_utilisation", "Live bytes / pool bytes", registry=r)
        self.pool_bytes = Gauge(f"{p}_pool_bytes", "Size of the unified pool in bytes", registry=r)
        self.compiles = Gauge(f"{p}_compiles", "XLA compilations since start", registry=r)
        self.compiles_since_warmup = Gauge(f"{p}_compiles_since_warmup", "Compilations after warm-up (want 0)",
                                           registry=r)
        self.adapter_store = Gauge(f"{p}_adapter_store", "Adapter store counters (hits, misses, evictions, loads, "
                                   "pinned, host_bytes, ...)", ["stat"], registry=r)
        self.prefix_cache = Gauge(f"{p}_prefix_cache", "Prefix cache pages (cached_pages, unused_pages) and page "
                                  "counters since start (hit_pages, miss_pages, inserted, evicted); absent when "
                                  "prefix caching is off", ["stat"], registry=r)
        self.deadline_aborts = Gauge(f"{p}_deadline_aborts", "Requests taken out of the waiting queue by early abort "
                                     "since start (their first-token deadline could no longer be met)", registry=r)
        self.steps = Gauge(f"{p}_engine_steps", "Engine steps taken", registry=r)
        self.step_failures = Gauge(f"{p}_engine_step_failures", "Engine steps that raised", registry=r)
        self.host_seconds = Gauge(f"{p}_engine_host_seconds", "Engine-thread seconds since start, summed per step "
                                  "phase (schedule, dispatch, prefetch, wait, append); little 'wait' = the host sets "
                                  "the pace", ["phase"], registry=r)
        self.steps_read = Gauge(f"{p}_engine_steps_read_back", "Engine steps read back, per kind (prefill, decode)",
                                ["kind"], registry=r)
        self.wait_seconds = Gauge(f"{p}_engine_wait_seconds", "Engine-thread seconds waiting for the device, per kind "
                                  "of the step it waited for", ["kind"], registry=r)
        self.host_bound = Gauge(f"{p}_engine_host_bound_steps", "Steps, per kind, the device had finished before the "
                                "host asked (waited < 0.5 ms): the device idled for part of the host's work",
                                ["kind"], registry=r)

    def refresh(self, stats: dict, step_failures: int = 0) -> None:
        """Set the gauges from ``engine.stats()``; missing keys leave a gauge as it was."""
        for gauge, key in ((self.waiting, "waiting"), (self.running, "running"), (self.steps, "steps"),
                           (self.compiles, "compiles"), (self.compiles_since_warmup, "compiles_since_warmup"),
                           (self.deadline_aborts, "deadline_aborts")):
            v = _number(stats.get(key))
            if v is not None:
                gauge.set(v)
        self.step_failures.set(step_failures)
        for phase, seconds in (stats.get("step_seconds") or {}).items():
            self.host_seconds.labels(phase).set(seconds)
        for kind, counts in (stats.get("steps_by_kind") or {}).items():
            self.steps_read.labels(kind).set(counts["steps"])
            self.wait_seconds.labels(kind).set(counts["wait_s"])
            self.host_bound.labels(kind).set(counts["host_bound"])
        pool = stats.get("pool") or {}
        for kind, key in (("kv", "pages_kv"), ("adapter", "pages_adapter"), ("free", "pages_free")):
            if key in pool:
                self.pool_pages.labels(kind).set(pool[key])
        n_pages = pool.get("num_pages")
        if n_pages:
            for kind, key in (("kv", "pages_kv"), ("adapter", "pages_adapter"), ("free", "pages_free")):
                if key in pool:
                    self.pool_fraction.labels(kind).set(pool[key] / n_pages)
        for kind, key in (("kv", "kv_live_bytes"), ("adapter", "adapter_live_bytes")):
            if key in pool:
                self.pool_live_bytes.labels(kind).set(pool[key])
        if "utilisation" in pool:
            self.pool_utilisation.set(pool["utilisation"])
        if "pool_bytes" in pool:
            self.pool_bytes.set(pool["pool_bytes"])
        adapters = stats.get("adapters") or {}
        for tier, keys in _TIER_KEYS.items():
            for key in keys:
                v = _number(adapters.get(key))
                if v is not None:
                    self.adapters.labels(tier).set(v)
                    break
        for key in _STORE_STATS:
            v = _number(adapters.get(key))
            if v is not None:
                self.adapter_store.labels(key).set(v)
        prefix = stats.get("prefix_cache") or {}
        if prefix:  # empty: prefix caching is off
            for key in _PREFIX_STATS:
                v = _number(prefix.get(key, 0))
                if v is not None:
                    self.prefix_cache.labels(key).set(v)

    def adapter_event(self, name: str, event: str, seconds: float | None) -> None:
        """The engine's adapter events (``Engine.watch_adapters``; engine thread and IO threads)."""
        label = self.adapter_labels.label(name)
        if event == "pool_load":
            self.adapter_loads.labels(label).inc()
            self.adapter_load_seconds.labels(label, "pool").observe(seconds)
        elif event == "eviction":
            self.adapter_evictions.labels(label).inc()
        elif event == "host_read":
            self.adapter_load_seconds.labels(label, "host").observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
