"""NVIDIA aiperf, a load generator nobody here wrote, against a running slora-jax server with our trace's workload.

    PYTHONPATH=. python benchmarks/aiperf_run.py --url http://127.0.0.1:8000 --model DIR --n-adapters 2000 \\
        --rate 1000 --requests 800 --out aiperf.json                  # aiperf's own prompts, lengths and arrivals
    ... --mode trace                                                  # aiperf replays our exact requests

Two ways, both streamed ``/v1/completions`` with ``ignore_eos`` and the server's token counts (``usage``):

* ``synthetic`` (default): aiperf makes the workload. Lengths: ``--isl``/``--osl`` with ``--random-range-ratio``, a
  uniform window (vLLM's rule) as close to U[lo, hi] as its integer rounding allows (aiperf takes the tokenizer's
  special tokens, here BOS, off the prompt mean); arrivals: ``--arrival-pattern gamma`` with smoothness 1/cv^2 at
  the trace's rate (cv 1 = Poisson); adapters: ``--model-selection-strategy random`` over the trace's own adapter
  sequence, which gives our power law (aiperf's ``weighted`` strategy is validated but not implemented in 0.13, and
  a uniform pick over 2000 names would be a different, flatter workload). Prompts are aiperf's text, cut to length
  with the model's tokenizer.
* ``trace``: a ``single_turn`` JSONL of our requests (timestamp, token-id prompt, adapter, max_tokens in each turn's
  ``extra``), replayed with ``--fixed-schedule``: the same requests as ours, timed and measured by aiperf.

What aiperf measures differently from ``http_serving.py``: TTFT from when its worker sent the request (ours: from the
scheduled arrival, so our client's send lag counts against us); ``inter_token_latency`` per request,
(latency - TTFT) / (tokens - 1), averaged over requests (ours ``tpot_ms``; our ``itl_ms`` is per token gap);
``request_throughput`` = completed requests / benchmark duration, first request sent to last response
(ours: trace start to last token). aiperf runs its own worker processes (``--max-workers``) and a warm-up of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

EXPORT = "profile_export_aiperf.json"


def range_ratio(lo: int, hi: int) -> tuple[int, float]:
    """(mean, ratio) whose vLLM-style window [floor(mean*(1-r)), ceil(mean*(1+r))] is [lo, hi] (hi + 1 when
    hi - lo is odd: the window is symmetric about an integer mean). The ratio sits a hair under the exact one so
    float rounding cannot widen the window."""
    mean = (lo + hi + 1) // 2
    return mean, max(0.0, (mean - lo) / mean - 1e-9)


def write_trace_dataset(path: Path, requests) -> Path:
    """Our requests as aiperf ``single_turn`` lines: each turn's ``extra`` overrides the body aiperf would build."""
    with open(path, "w") as f:
        for r in requests:
            extra = {"model": r.adapter, "prompt": r.prompt_ids, "max_tokens": r.max_tokens, "ignore_eos": True}
            f.write(json.dumps({"text": "x", "timestamp": r.arrival * 1e3, "extra": extra}) + "\n")
    return path


def aiperf_command(url: str, requests, spec: dict, mode: str, tokenizer: str, artifact_dir: Path,
                   python: str = sys.executable, api_key: str | None = None, workers: int | None = None,
                   warmup: int = 8, cv: float = 1.0) -> list[str]:
    cmd = [python, "-m", "aiperf", "profile", "--url", url, "--endpoint-type", "completions", "--streaming",
           "--tokenizer", tokenizer, "--use-server-token-count", "--extra-inputs", json.dumps({"ignore_eos": True}),
           "--artifact-dir", str(artifact_dir), "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
           "--random-seed", "0", "--request-timeout-seconds", "900"]
    if api_key:
        cmd += ["--api-key", api_key]
    if workers:
        cmd += ["--max-workers", str(workers)]
    if mode == "trace":
        data = write_trace_dataset(artifact_dir / "trace.jsonl", requests)
        return cmd + ["-m", requests[0].adapter, "--custom-dataset-type", "single_turn", "--input-file", str(data),
                      "--fixed-schedule", "--fixed-schedule-auto-offset", "--request-count", str(len(requests))]
    isl, isl_r = range_ratio(*spec["in_range"])
    osl, osl_r = range_ratio(*spec["out_range"])
    ratio = json.dumps({"input": isl_r, "output": osl_r})
    return cmd + ["-m", ",".join(r.adapter for r in requests), "--model-selection-strategy", "random",
                  "--request-rate", f"{spec['rate']:g}", "--arrival-pattern", "gamma",
                  "--arrival-smoothness", f"{1.0 / (cv * cv):g}", "--request-count", str(len(requests)),
                  "--isl", str(isl), "--osl", str(osl), "--random-range-ratio", ratio,
                  "--warmup-request-count", str(warmup)]


def read_export(artifact_dir: Path) -> dict:
    """aiperf's summary in our keys (times in ms as aiperf gives them; throughput per second)."""
    d = json.loads((artifact_dir / EXPORT).read_text())

    def avg(key):
        return (d.get(key) or {}).get("avg")

    def stats(key):
        m = d.get(key)
        return {k: m.get(k) for k in ("mean", "avg", "p50", "p90", "p99", "max") if k in m} if m else None

    ttft = avg("time_to_first_token")
    return {
        "aiperf_version": d.get("aiperf_version"), "throughput_req_s": avg("request_throughput"),
        "throughput_tok_s": avg("output_token_throughput"), "finished": avg("completed_request_count"),
        "requests": avg("request_count"), "duration_s": avg("benchmark_duration"),
        "mean_first_token_s": ttft / 1e3 if ttft is not None else None,
        "ttft_ms": stats("time_to_first_token"), "itl_ms": stats("inter_token_latency"),
        "inter_chunk_ms": stats("inter_chunk_latency"), "latency_ms": stats("request_latency"),
        "isl": stats("input_sequence_length"), "osl": stats("output_sequence_length"),
        "error_rate_pct": avg("request_error_rate"), "errors": d.get("error_summary") or [],
        "was_cancelled": d.get("was_cancelled"), "is_complete": d.get("is_complete"),
    }


def run_aiperf(url: str, requests, spec: dict, mode: str, tokenizer: str, artifact_dir: Path,
               python: str = sys.executable, api_key: str | None = None, timeout_s: float = 600.0,
               workers: int | None = None) -> dict:
    """Run aiperf once (its output in ``artifact_dir``) and return its figures, or the reason it gave none."""
    artifact_dir = Path(artifact_dir)
    artifact_dir.mkdir(parents=True, exist_ok=True)
    cmd = aiperf_command(url, requests, spec, mode, tokenizer, artifact_dir, python, api_key, workers)
    # a local tokenizer dir loads with no network; aiperf 0.13 in HF offline mode looks local paths up in the hub cache
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    t = time.monotonic()
    log = artifact_dir / "aiperf_stdout.log"
    try:
        with open(log, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    out = {"mode": mode, "spec": spec, "wall_s": time.monotonic() - t, "rc": rc,
           "command": " ".join(c if len(c) < 200 else c[:60] + f"...({len(c)} chars)" for c in cmd)}
    if (artifact_dir / EXPORT).exists() and rc == 0:
        out |= read_export(artifact_dir)
    else:
        out["error"] = f"aiperf exit {rc}"
        out["log_tail"] = log.read_text(errors="replace")[-3000:]
    return out


def main() -> None:
    from http_server_probe import served_models
    from http_serving import make_spec_trace, trace_requests, trace_spec

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True, help="model dir: vocabulary and tokenizer")
    ap.add_argument("--n-adapters", type=int, default=None, help="adapters in the trace (default: all served)")
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--in-range", default="8,512")
    ap.add_argument("--out-range", default="8,512")
    ap.add_argument("--seed", type=int, default=0, help="trace seed (serving.py: 0 saturation, 99 set rate)")
    ap.add_argument("--mode", default="synthetic", choices=["synthetic", "trace"])
    ap.add_argument("--python", default=sys.executable, help="the Python that has aiperf")
    ap.add_argument("--api-key", default=os.environ.get("SLORA_JAX_API_KEY"))
    ap.add_argument("--artifact-dir", type=Path, default=Path("aiperf-artifacts"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    url = args.url.rstrip("/")
    _, names, _ = served_models(url, args.api_key)
    names = names[:args.n_adapters] if args.n_adapters else names
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    spec = trace_spec("aiperf", len(names), args.rate, args.requests, args.seed,
                      [int(x) for x in args.in_range.split(",")], [int(x) for x in args.out_range.split(",")])
    reqs = trace_requests(make_spec_trace(spec), names, vocab)
    res = run_aiperf(url, reqs, spec, args.mode, args.model, args.artifact_dir, args.python, args.api_key)
    print(json.dumps({k: v for k, v in res.items() if k != "log_tail"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
