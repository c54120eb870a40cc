"""What ``http_serving.py`` reads from a running slora-jax server: its models, its Prometheus counters (the whole
run's, and the share of one trace: server-side TTFT, engine steps and host time per phase, adapter loads), and the
start-up phases from its log."""

from __future__ import annotations

import re
import time

import httpx

# ---------------------------------------------------------------- the server


def scrape_metrics(url: str, api_key: str | None) -> dict[str, float]:
    try:
        text = httpx.get(f"{url}/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {api_key}"} if api_key else {}).text
    except httpx.HTTPError as e:
        return {"error": repr(e)}
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and re.match(r"slora_(requests|compiles|pool_pages|adapter_store|engine_step_failures)", m.group(1)) \
                and not m.group(1).endswith("_created"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


SERVER_COUNTERS = ("slora_time_to_first_token_seconds_sum", "slora_time_to_first_token_seconds_count",
                   "slora_generation_tokens_total", "slora_engine_steps")
# labelled running totals kept per label value ("name.value"): host seconds per phase, steps read back per kind
BY_LABEL = ("slora_engine_host_seconds", "slora_engine_steps_read_back", "slora_engine_wait_seconds",
            "slora_engine_host_bound_steps")


def server_counters(url: str, api_key: str | None) -> dict[str, float]:
    """The server's running totals a trace's share is taken from: TTFT sum and count (handler arrival to the first
    token on the event loop), tokens, engine steps, engine-thread host seconds per phase; {} if unreachable."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {api_key}"} if api_key else {}).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(\w+)(?:\{(?:phase|kind)="(\w+)"\})?\s+(\S+)$', line)
        if m and (m.group(1) in SERVER_COUNTERS or m.group(1) in BY_LABEL):
            out[m.group(1) + (f".{m.group(2)}" if m.group(2) else "")] = float(m.group(3))
        m = re.match(r'^slora_adapters\{tier="host"\}\s+(\S+)$', line)
        if m:  # a gauge, not a running total: server_share reports it at the trace's start and end
            out["adapters_in_host"] = float(m.group(1))
        m = re.match(r'^slora_adapter_load_seconds_(sum|count)\{.*stage="(\w+)".*\}\s+(\S+)$', line)
        if m:  # summed over the adapters: loads that a first token may have waited for
            key = f"adapter_load_{m.group(1)}.{m.group(2)}"
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def wait_host_fill(url: str, api_key: str | None, n_adapters: int, max_s: float, settle_s: float = 6.0,
                   poll_s: float = 1.0) -> dict:
    """Wait until the server's host fill is done: every adapter in host memory, or the count unchanged for
    ``settle_s`` (the host budget is full), or ``max_s`` passed. Why: the fill takes ~45 s after a 7B start with 2000
    S1 adapters, and a saturation trace started before it measures the reads from disk of a just-started server, not
    the steady state S-LoRA's design keeps (every adapter in host memory). Returns what it waited for and saw."""
    t0 = time.monotonic()
    last, since = None, t0
    while True:
        now = time.monotonic()
        count = server_counters(url, api_key).get("adapters_in_host")
        if count is not None and count != last:
            last, since = count, now
        why = ("all" if last is not None and last >= n_adapters else "settled" if now - since >= settle_s
               else "max_s" if now - t0 >= max_s else None)
        if why:
            return {"waited_s": round(now - t0, 1), "adapters_in_host": last, "of": n_adapters, "ended_by": why}
        time.sleep(poll_s)


def by_kind(d: dict) -> dict:
    """Per kind of step read back (prefill, decode): how many, the mean wait for the device, and the share the
    device had finished before the host asked (it idled for part of the host's work)."""
    out = {}
    for kind in ("prefill", "decode"):
        n = d.get(f"slora_engine_steps_read_back.{kind}", 0.0)
        if n:
            wait_s = d.get(f"slora_engine_wait_seconds.{kind}", 0.0)
            out[kind] = {"steps": n, "wait_ms_mean": round(1e3 * wait_s / n, 3),
                         "host_bound_share": round(d.get(f"slora_engine_host_bound_steps.{kind}", 0.0) / n, 4)}
    return out


def server_share(before: dict, after: dict, elapsed_s: float) -> dict:
    """What the server saw of one trace: its mean TTFT (so the client's share of ours is the rest), engine steps,
    the mean step (the GIL the HTTP side takes shows as a longer step than in-process) and host ms per step per
    phase (compare the in-process run's prefill/decode_host_s: dispatch is Python, it stretches first)."""
    if not before or not after:
        return {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k != "adapters_in_host"}
    steps = d.get("slora_engine_steps", 0.0)
    n = d.get("slora_time_to_first_token_seconds_count", 0.0)
    stages = [k.split(".", 1)[1] for k, v in d.items() if k.startswith("adapter_load_count.") and v]
    return {"adapters_in_host": [before.get("adapters_in_host"), after.get("adapters_in_host")],  # host fill
            "ttft_ms_mean": 1e3 * d["slora_time_to_first_token_seconds_sum"] / n if n else None,
            "steps": steps, "step_ms_mean": 1e3 * elapsed_s / steps if steps else None,
            "tokens_per_step": d.get("slora_generation_tokens_total", 0.0) / steps if steps else None,
            "host_ms_per_step": {k.split(".", 1)[1]: round(1e3 * v / steps, 3) for k, v in d.items()
                                 if k.startswith("slora_engine_host_seconds.") and steps},
            "by_kind": by_kind(d),
            "adapter_loads": {stage: {"n": d[f"adapter_load_count.{stage}"],
                                      "ms_mean": 1e3 * d.get(f"adapter_load_sum.{stage}", 0.0)
                                      / d[f"adapter_load_count.{stage}"]} for stage in stages}}


def startup_phases(log_text: str) -> dict:
    """The server's own timings from its log (cli.build_engine's lines)."""
    out = {}
    pats = {"weights_and_pool_s": r"weights loaded and pool allocated in ([\d.]+) s",
            "pool_pages": r"pool: (\d+) pages of", "pool_gib": r"pages of \d+ tokens \(([\d.]+) GiB\)",
            "adapters_registered_s": r"adapters registered in ([\d.]+) s",
            "warmup_compiles": r"warm-up: (\d+) compiles", "warmup_cache_hits": r"\((\d+) from the compilation cache\)",
            "warmup_s": r"from the compilation cache\) in ([\d.]+) s", "ready_s": r"ready in ([\d.]+) s after start"}
    for key, pat in pats.items():
        m = re.search(pat, log_text)
        if m:
            out[key] = float(m.group(1))
    return out


def kill_own_servers() -> None:
    """End the server this process started when its start failed (ServerProcess raised before handing it back)."""
    import psutil

    for child in psutil.Process().children():
        if "slora_jax.serve" in " ".join(child.cmdline()):
            child.kill()


def served_models(url: str, api_key: str | None) -> tuple[str, list[str], int]:
    r = httpx.get(f"{url}/v1/models", timeout=60, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    data = r.json()["data"]
    base = next(m["id"] for m in data if m["parent"] is None)
    return base, sorted(m["id"] for m in data if m["parent"] is not None), data[0]["max_model_len"]
