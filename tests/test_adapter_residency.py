"""The adapter residency API (issue 16 item 7): where each adapter is (GET /v1/adapters), explicit pins (POST
/v1/adapters/pin, /unpin), and the per-adapter Prometheus series with their bound on label cardinality.

The server runs a small pool (3 adapter slots), so a few sequential requests evict adapters; each test uses adapters
of its own, so the tiers it sees are caused by its own requests.
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from random_lora import random_adapter
from server_fixtures import BASE_NAME, start_server
from store_helpers import QKVO

from slora_jax.engine.adapter_store import NoRoom
from slora_jax.lora.peft import AdapterError
from slora_jax.lora.sources import AdapterSource, InMemorySource
from slora_jax.serve.metrics import MIXES, OTHER, AdapterLabels, ServerMetrics

API_KEY = "residency-key"
N_ADAPTERS = 16
LABELS = 6  # the server's per-adapter label bound (set before any request): fewer than the adapters used here
SLOTS = 3


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("residency"), n_adapters=N_ADAPTERS, api_key=API_KEY,
                          ranks=(4, 8), num_pages=96, max_loras=SLOTS, max_model_len=128, max_prefill_tokens=128)
    server.server.app.state.ctx.metrics.adapter_labels = AdapterLabels(LABELS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120) as client:
        yield client


def states(http, tier: str | None = None) -> dict[str, dict]:
    r = http.get("/v1/adapters", params={} if tier is None else {"tier": tier})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    return {a["name"]: a for a in body["data"]}


def complete(http, model: str, max_tokens: int = 2) -> dict:
    r = http.post("/v1/completions", json={"model": model, "prompt": "Hello there", "max_tokens": max_tokens,
                                          "temperature": 0, "ignore_eos": True})  # a random adapter may pick EOS
    assert r.status_code == 200, r.text
    return r.json()


def pin(http, name: str, action: str = "pin") -> httpx.Response:
    return http.post(f"/v1/adapters/{action}", json={"lora_name": name})


def metric_values(http, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of one metric: label pairs -> value."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            pairs = tuple(tuple(p.split("=", 1)) for p in labels.split(","))
            out[tuple((k, v.strip('"')) for k, v in pairs)] = float(value)
    return out


# ---- where adapters are -------------------------------------------------------------------------------------------


def test_every_adapter_is_listed_with_its_shape_and_books(srv, http):
    listed = states(http)
    assert sorted(listed) == sorted(srv.adapters)
    page_bytes = srv.engine.pool.page_bytes
    for i, name in enumerate(srv.adapters):
        a = listed[name]
        assert a["rank"] == (4, 8)[i % 2]
        assert a["targets"] and set(a["targets"]) <= {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"}
        assert a["pages"] > 0 and a["bytes"] == a["pages"] * page_bytes
        assert a["error"] is None and a["tier"] in ("device", "host", "disk")
    assert listed[srv.adapters[1]]["targets"] == ["q_proj", "v_proj"]  # TARGETS[1] of server_fixtures


def test_tiers_move_disk_host_device_and_back_to_host_on_eviction(srv, http):
    a, others = srv.adapters[0], srv.adapters[1:1 + SLOTS]
    before = states(http)[a]
    assert before["tier"] == "disk" and before["loads"] == 0 and before["last_used"] is None
    assert before["load_seconds"]["pool"] == {"count": 0, "mean": None, "last": None}
    t0 = time.time()
    complete(http, a)
    srv.wait_idle()
    after = states(http)[a]
    assert after["tier"] == "device" and after["loads"] == 1 and after["evictions"] == 0
    assert t0 <= after["last_used"] <= time.time()
    pool, host = after["load_seconds"]["pool"], after["load_seconds"]["host"]
    assert pool["count"] == 1 and pool["mean"] == pool["last"] > 0
    assert host["count"] == 1 and host["mean"] == host["last"] > 0
    assert after["pinned"] is False and after["request_pins"] == 0 and after["explicit_pins"] == 0
    assert a in states(http, "device") and a not in states(http, "host") and a not in states(http, "disk")

    for name in others:  # SLOTS other adapters through SLOTS slots: the least recently used, a, goes
        complete(http, name)
    srv.wait_idle()
    evicted = states(http)[a]
    assert evicted["tier"] == "host" and evicted["evictions"] == 1 and evicted["loads"] == 1
    assert a in states(http, "host")
    assert set(states(http, "device")) == set(others)


def test_tier_filter_rejects_unknown_tiers(http):
    for bad in ("pool", "", "DEVICE"):
        r = http.get("/v1/adapters", params={"tier": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tier", bad


# ---- explicit pins ------------------------------------------------------------------------------------------------


def test_pin_keeps_an_adapter_resident_through_pressure_until_unpinned(srv, http):
    pinned, pressure = srv.adapters[4], srv.adapters[5:5 + 2 * SLOTS]
    r = pin(http, pinned)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "pinned" and body["name"] == pinned and body["tier"] == "device"
    assert body["explicit_pins"] == 1 and body["request_pins"] == 0 and body["pinned"] is True
    assert pin(http, pinned).json()["explicit_pins"] == 2  # pins are counted
    try:
        evictions_before = sum(s["evictions"] for s in states(http).values())
        for name in pressure:
            complete(http, name)
        srv.wait_idle()
        now = states(http)
        assert sum(s["evictions"] for s in now.values()) >= evictions_before + len(pressure) - (SLOTS - 1)
        assert now[pinned]["tier"] == "device" and now[pinned]["evictions"] == 0 and now[pinned]["loads"] == 1
        assert now[pinned]["explicit_pins"] == 2 and now[pinned]["pinned"]
        assert srv.stats()["adapters"]["explicit_pins"] == 2
        complete(http, pinned)  # a request on a pinned adapter uses it where it is
        assert states(http)[pinned]["loads"] == 1
    finally:
        first = pin(http, pinned, "unpin").json()
        second = pin(http, pinned, "unpin").json()
    assert first["status"] == "unpinned" and first["explicit_pins"] == 1 and first["pinned"]
    assert second["explicit_pins"] == 0 and not second["pinned"] and second["tier"] == "device"  # stays, as a cache

    for name in pressure[:SLOTS]:  # unpinned, it is evicted like any other
        complete(http, name)
    srv.wait_idle()
    assert states(http)[pinned]["tier"] == "host"


def test_pin_refusals(srv, http):
    assert pin(http, "no-such-adapter").status_code == 404
    assert pin(http, "no-such-adapter", "unpin").status_code == 404
    assert pin(http, BASE_NAME).status_code == 400
    free = srv.adapters[12]
    r = pin(http, free, "unpin")
    assert r.status_code == 409 and "no explicit pin" in r.json()["error"]["message"]
    first, second, third = srv.adapters[12:15]
    assert pin(http, first).status_code == 200
    assert pin(http, second).status_code == 200
    try:
        r = pin(http, third)  # explicit pins always leave requests one slot
        assert r.status_code == 409 and "leave a slot" in r.json()["error"]["message"], r.text
        assert states(http)[third]["explicit_pins"] == 0
        complete(http, third)  # and that slot serves the others
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": first})
        assert r.status_code == 409 and "explicit pin" in r.json()["error"]["message"]
    finally:
        for name in (first, second):
            assert pin(http, name, "unpin").status_code == 200
    assert states(http)[third]["explicit_pins"] == 0


class _FailingRead(AdapterSource):
    """Registers fine (its rank table is real); every read of its weights fails."""

    def __init__(self, inner: AdapterSource):
        self.inner = inner

    def rank_table(self, name, model_cfg, max_rank):
        return self.inner.rank_table(name, model_cfg, max_rank)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        raise AdapterError(name, "injected: its weights cannot be read")


def test_an_adapter_that_cannot_be_loaded_is_refused_and_listed_with_its_reason(srv, http):
    rng = np.random.default_rng(7)
    source = _FailingRead(InMemorySource(random_adapter(srv.engine.cfg, rng, "broken", ranks=(4,), targets=QKVO)))
    srv.engine.register_adapter("broken", source)  # thread-safe
    try:
        assert states(http)["broken"]["error"] is None  # not known to be broken until read
        r = pin(http, "broken")
        assert r.status_code == 409 and "injected" in r.json()["error"]["message"]
        listed = states(http)["broken"]
        assert "injected" in listed["error"] and listed["tier"] == "disk" and listed["explicit_pins"] == 0
    finally:
        srv.call(lambda: srv.engine.unregister_adapter("broken"))


# ---- metrics ------------------------------------------------------------------------------------------------------


def test_per_adapter_series_appear_within_the_label_bound(srv, http):
    for name in srv.adapters[:LABELS + 3]:  # more adapters than labels: some are counted as "other"
        complete(http, name, max_tokens=3)
    srv.wait_idle()
    requests = metric_values(http, "slora_adapter_requests_total")
    labels = {dict(k)["adapter"] for k in requests}
    assert OTHER in labels and len(labels - {OTHER}) == LABELS and labels - {OTHER} <= set(srv.adapters)
    for metric in ("slora_adapter_generation_tokens_total", "slora_adapter_pool_loads_total",
                   "slora_adapter_evictions_total", "slora_adapter_load_seconds_count"):
        got = {dict(k)["adapter"] for k in metric_values(http, metric)}
        assert got and got <= labels, metric
    stages = {dict(k)["stage"] for k in metric_values(http, "slora_adapter_load_seconds_count")}
    assert stages == {"pool", "host"}

    before_requests, before_tokens = (sum(metric_values(http, m).values()) for m in
                                      ("slora_adapter_requests_total", "slora_adapter_generation_tokens_total"))
    used = [complete(http, name, max_tokens=3) for name in srv.adapters[-3:]]
    assert sum(metric_values(http, "slora_adapter_requests_total").values()) == before_requests + 3
    assert (sum(metric_values(http, "slora_adapter_generation_tokens_total").values())
            == before_tokens + sum(u["usage"]["completion_tokens"] for u in used))
    complete(http, BASE_NAME)  # the base model is not an adapter: no per-adapter series moves
    assert sum(metric_values(http, "slora_adapter_requests_total").values()) == before_requests + 3

    # the per-adapter loads agree with the adapters' own books
    loads = sum(s["loads"] for s in states(http).values())
    assert sum(metric_values(http, "slora_adapter_pool_loads_total").values()) == loads
    assert ((("stat", "explicit_pins"),) in metric_values(http, "slora_adapter_store"))


def test_label_bound_is_sticky_and_counts_everything():
    metrics = ServerMetrics(max_adapter_labels=2)
    names = [f"a{i}" for i in range(5)] + [OTHER]
    for name in names:
        metrics.adapter_requests.labels(metrics.adapter_labels.grant(name)).inc()
        metrics.adapter_event(name, "pool_load", 0.01)
        metrics.adapter_event(name, "eviction", None)
        metrics.adapter_event(name, "host_read", 0.002)
    metrics.adapter_event("never-requested", "pool_load", 0.5)
    assert metrics.adapter_labels.grant("a4") == OTHER and metrics.adapter_labels.grant("a0") == "a0"
    text = metrics.render()[0].decode()
    for metric, total in (("slora_adapter_requests_total", 6), ("slora_adapter_pool_loads_total", 7),
                          ("slora_adapter_evictions_total", 6)):
        samples = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(metric + "{")}
        assert set(samples) == {"a0", "a1", OTHER}, metric
        assert sum(samples.values()) == total and samples["a0"] == 1, metric
    assert 'slora_adapter_load_seconds_count{adapter="other",stage="pool"} 5.0' in text


def test_every_mix_counts_under_one_label_and_takes_no_own_label():
    """Clients sending ever new mix weights must not use up the own labels of the adapters requested after them."""
    metrics = ServerMetrics(max_adapter_labels=2)
    labels = metrics.adapter_labels
    mixes = [f"mix:{i:016x}" for i in np.random.default_rng().integers(0, 2**62, size=5)]
    assert {labels.grant(m) for m in mixes} == {MIXES} and {labels.label(m) for m in mixes} == {MIXES}
    assert labels.grant("a0") == "a0" and labels.grant(MIXES) == OTHER and labels.grant("a1") == "a1"
    assert labels.grant("a2") == OTHER and len(labels) == 2


# ---- the API key --------------------------------------------------------------------------------------------------


def test_the_api_key_protects_the_residency_endpoints(srv):
    name = srv.adapters[15]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with httpx.Client(base_url=srv.url, headers=headers, timeout=60) as anon:
            assert anon.get("/v1/adapters").status_code == 401
            assert anon.post("/v1/adapters/pin", json={"lora_name": name}).status_code == 401
            assert anon.post("/v1/adapters/unpin", json={"lora_name": name}).status_code == 401
    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60) as client:
        assert states(client)[name]["explicit_pins"] == 0  # the refused pin did nothing


# ---- a failure that may pass (last of the server's tests: its adapter's pool load stays in the metrics) ----------


class _AwayRead(_FailingRead):
    """Reads fail while ``away`` (its disk unreachable: a failure that may pass), then succeed."""

    away = True

    def load_rows(self, name, model_cfg, max_rank, dtype):
        if self.away:
            raise AdapterError(name, "injected: its disk is away", retry_after_s=30.0)
        return self.inner.load_rows(name, model_cfg, max_rank, dtype)


def test_an_adapter_whose_read_may_pass_answers_503_then_serves_after_its_wait(srv, http):
    rng = np.random.default_rng()
    source = _AwayRead(InMemorySource(random_adapter(srv.engine.cfg, rng, "away", ranks=(4,), targets=QKVO)))
    srv.engine.register_adapter("away", source)
    failures = srv.engine.store.host._errors  # noqa: SLF001 - the test moves the failure record's clock
    now, clock = [time.monotonic()], failures._clock  # noqa: SLF001
    failures._clock = lambda: now[0]  # noqa: SLF001
    try:
        body = {"model": "away", "prompt": "Hello there", "max_tokens": 2}
        for _ in range(2):  # the failed read, then its recorded failure: the server's fault both times, not the
            r = http.post("/v1/completions", json=body)  # request's
            assert r.status_code == 503 and "disk is away" in r.json()["error"]["message"], r.text
            assert r.headers["retry-after"] == "30"  # openai's client waits that long before its retry
        assert "disk is away" in states(http)["away"]["error"]
        source.away = False
        now[0] += 31  # past its wait: the next use reads it again
        assert states(http)["away"]["error"] is None
        assert complete(http, "away")["choices"][0]["finish_reason"] == "length"
        assert complete(http, BASE_NAME)["choices"]  # the server kept serving throughout
    finally:
        failures._clock = clock  # noqa: SLF001
        srv.call(lambda: srv.engine.unregister_adapter("away"))


# ---- the store's rules, without a server --------------------------------------------------------------------------


def test_store_pin_refuses_what_would_starve_requests_and_what_does_not_fit_now(make_store, tiny_cfg, rng):
    store = make_store(num_pages=64, max_slots=4)
    for name in ("a", "b", "c"):
        store.register(name, random_adapter(tiny_cfg, rng, name, ranks=(4,), targets=QKVO))  # 7 pages each
    with pytest.raises(NoRoom, match="leave a slot"):
        store.pin("a", keep_free_pages=64 - 6)  # its 7 pages would leave fewer than 58 to the others
    assert store.states(names=["a"])[0]["explicit_pins"] == 0
    assert store.pin("a", keep_free_pages=64 - 7) == 1
    taken = store.pool.alloc_kv_pages(store.pool.num_free_pages, owner="kv")  # KV fills the pool
    with pytest.raises(NoRoom):
        store.pin("b")
    assert not store.is_resident("b") and store.states(names=["b"])[0]["explicit_pins"] == 0
    assert not store.reclaim_pages(1)  # the pinned adapter is not evictable
    store.pool.free_kv_pages(taken, owner="kv")
    assert store.pin("b") == 1 and store.states(names=["b"])[0]["tier"] == "device"
    assert store.stats()["explicit_pins"] == 2
    assert store.unpin("a") == 0 and store.pin_count("a") == 0
    with pytest.raises(ValueError, match="no explicit pin"):
        store.unpin("a")
