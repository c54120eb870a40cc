"""The S-LoRA traces of ``serving.py`` through a real ``python -m slora_jax.serve``, streamed (``http_client``: plain
httpx for the timed traces, the ``openai`` async client for the warm-up, as a check), beside the in-process engine on
the same trace and NVIDIA aiperf on the same server (issue 13).

    PYTHONPATH=. python benchmarks/http_serving.py --tiny --out http_cpu.json             # embedded demo, CPU
    PYTHONPATH=. python benchmarks/http_serving.py --preset llama-2-7b --n-adapters 2000 --aiperf --out http.json
    PYTHONPATH=. python benchmarks/http_serving.py --url http://127.0.0.1:8000 --model DIR --rates 5,10  # attach

The server is started the way a user starts it (flags this script does not know go to it; ``--preset`` first writes
a random bf16 model dir with a tokenizer and ``--n-adapters`` PEFT dirs). Every trace is ``workload.make_trace`` with
the seeds of ``serving.py``: ``sat`` sends ``--requests`` at 1000 req/s, a number is a set rate for ``--duration`` s,
``x0.7`` is 0.7 times the saturation measured over HTTP in this run. The token-id prompts are the ones
``serving.run_trace`` draws, so the in-process engine (built by the server's own ``build_engine`` in a child process
after the server has exited, with the server's pool size) serves exactly the same requests. Clients run in
``--client-procs`` processes so the client is not what saturates; their CPU share and event-loop lag are reported,
and each trace's share of the server's own counters (``http_server_probe.server_share``). ``--rates-again`` repeats
traces after aiperf (order effects: ours runs first on a server whose host adapter tier is cold).

TTFT is first token minus scheduled arrival; ``itl_ms`` is the per-token gap (a chunk of k tokens after a gap g counts
k gaps of g/k, as the server's histogram); ``tpot_ms`` is per request (last - first token) / (tokens - 1), the
figure aiperf calls inter-token latency. SLO attainment: share of all requests with a first token within ``--slo-s``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from aiperf_run import run_aiperf  # run as python benchmarks/http_serving.py: benchmarks/ is on the path
from common import git_commit
from http_client import HttpRequest, client_init, run_http_trace, summarize
from http_server_probe import (
    kill_own_servers,
    scrape_metrics,
    served_models,
    server_counters,
    server_share,
    startup_phases,
    wait_host_fill,
)
from soak import ServerProcess, device_info
from workload import make_trace

SAT_RATE = 1000.0  # requests/s of a saturation trace (serving.py's)
WARM_ADAPTERS = 4  # the untimed warm-up trace uses the 4 least popular adapters (serving.py's warm trace: 16 requests)
BENCH = Path(__file__).resolve().parent


def trace_requests(trace, adapter_names: list[str], vocab: int) -> list[HttpRequest]:
    """The requests ``serving.run_trace`` makes of ``trace``: the same token ids (its rng, seed 1, drawn in trace
    order), adapter ``adapter_names[r.adapter]``, ``max_tokens`` = output length (served with ignore_eos)."""
    rng = np.random.default_rng(1)
    return [HttpRequest(r.arrival, adapter_names[r.adapter], rng.integers(3, vocab, size=r.prompt_len).tolist(),
                        r.output_len) for r in trace]


def trace_spec(name: str, n: int, rate: float, num: int, seed: int, in_range, out_range) -> dict:
    return dict(name=name, n=n, rate=rate, num=num, seed=seed, in_range=list(in_range), out_range=list(out_range))


def make_spec_trace(spec: dict):
    return make_trace(spec["n"], spec["rate"], spec["num"], alpha=1.0, cv=1.0, in_range=tuple(spec["in_range"]),
                      out_range=tuple(spec["out_range"]), seed=spec["seed"])


# ---------------------------------------------------------------- model and adapters a user would bring


def _tool(*args: str) -> None:
    """A ``python -m slora_jax.tools...`` command, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH.parent), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-m", *args], check=True, env=env, cwd=BENCH.parent)


def ensure_tokenizer(model: Path) -> bool:
    """Give a synthetic model dir a tokenizer (aiperf sends text); False if it had one."""
    from slora_jax.tools.tokenizer import has_tokenizer

    if has_tokenizer(model):
        return False
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    _tool("slora_jax.tools.tokenizer", "--out", str(model), "--vocab-size", str(vocab))
    return True


ADAPTER_SETS = {  # --adapter-set: S-LoRA's settings (ranks round-robin, targets)
    "S1": ("8", "q_proj,k_proj,v_proj,o_proj"),
    "S2": ("64,32,16,8", "q_proj,k_proj,v_proj,o_proj"),
    "all7": ("8", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
}


def prepare_preset(preset: str, work: Path, n_adapters: int, distinct: int, ranks: str = "8",
                   targets: str = ADAPTER_SETS["S1"][1]) -> tuple[Path, Path, dict]:
    """A random model dir (bf16 safetensors shards and a tokenizer) and ``n_adapters`` PEFT dirs (``ranks`` taken
    round-robin, LoRA on ``targets``) under ``work``, written by the synth tool and reused when present: only
    ``distinct`` weight files are written, the other dirs hard-link them (2000 distinct 7B rank-8 files would be
    34 GB), and the server still reads, checks, converts and loads every adapter by its own name. ``distinct`` is
    rounded up to a multiple of the ranks' count, so a linked dir has the rank its name's turn gives. Returns the
    dirs and the seconds each write took."""
    work.mkdir(parents=True, exist_ok=True)
    n_ranks = len(ranks.split(","))
    distinct = -(-distinct // n_ranks) * n_ranks
    kind = "" if targets == ADAPTER_SETS["S1"][1] else "-all7" if targets == ADAPTER_SETS["all7"][1] else \
        "-" + targets.replace("_proj", "").replace(",", "")
    model = work / f"model-{preset}"
    adapters = work / f"adapters-{preset}-r{ranks.replace(',', '_')}{kind}-n{n_adapters}-k{distinct}"
    times = {}
    for path, key, args in (
            (model, "write_model_s", ("model", "--preset", preset, "--dtype", "bfloat16")),
            (adapters, "write_adapters_s", ("adapters", "--model", str(model), "-n", str(n_adapters), "--ranks",
                                            ranks, "--targets", targets, "--distinct", str(distinct),
                                            "--dtype", "bfloat16"))):
        if not path.exists():
            t = time.monotonic()
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=work))  # renamed when whole
            _tool("slora_jax.tools.synth", *args, "--out", str(tmp))
            if key == "write_model_s":
                ensure_tokenizer(tmp)
            tmp.rename(path)
            times[key] = time.monotonic() - t
            print(f"{key} {times[key]:.0f} s: {path}", flush=True)
    return model, adapters, times


# ---------------------------------------------------------------- the in-process engine (a child process)


def in_process_child(spec_path: str, out_path: str) -> None:
    """Build the engine exactly as the server does (``build_engine`` on the same flags), then replay the traces with
    ``serving.run_trace``. Runs in its own process, after the server has exited and freed the device."""
    import logging

    spec = json.loads(Path(spec_path).read_text())
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # benchmarks/ off the path, as for the server: transformers probes for a package named 'kernels' and would
    # run benchmarks/kernels.py
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    from slora_jax.engine import compile_counter
    from slora_jax.serve.cli import GPU_MEMORY_FRACTION, build_engine, build_parser

    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)  # as cli.main does for the server
    t = time.monotonic()
    budget_end = t + spec["budget_s"]  # from the child's start: the engine's build counts against the caller's budget
    engine, _, _ = build_engine(build_parser().parse_args(spec["server_args"]))
    startup_s = time.monotonic() - t
    import jax

    # serving.py after the backend is up, so its XLA defaults cannot differ from the server's
    serving_spec = importlib.util.spec_from_file_location("serving", BENCH / "serving.py")
    serving = importlib.util.module_from_spec(serving_spec)
    serving_spec.loader.exec_module(serving)
    run_trace = serving.run_trace

    names, vocab = spec["adapters"], spec["vocab"]
    run_trace(engine, "warm", make_spec_trace(spec["warm"]), names[-WARM_ADAPTERS:], vocab, budget_end)
    results = []
    for s in spec["traces"]:
        res, _ = run_trace(engine, s["name"], make_spec_trace(s), names[:s["n"]], vocab, budget_end, spec["slo_s"])
        res.update(rate=s["rate"], n_adapters=s["n"])
        results.append(res)
        print("in-process " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()
                                          if not isinstance(v, dict)}), flush=True)
    out = {"startup_s": startup_s, "device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
           "compiles": compile_counter.compile_count(), "cache_hits": compile_counter.cache_hits(),
           "compiles_after_warmup": engine.compiles_since_warmup(), "pool": engine.stats()["pool"],
           "results": results}
    Path(out_path).write_text(json.dumps(out, indent=1, default=str))


def run_in_process(server_args: list[str], specs: list[dict], names: list[str], vocab: int, args,
                   budget_s: float, work: Path) -> dict:
    spec_path, out_path = work / "in_process_spec.json", work / "in_process.json"
    spec_path.write_text(json.dumps({"server_args": server_args, "traces": specs, "warm": warm_spec(args),
                                     "adapters": names, "vocab": vocab, "slo_s": args.slo_s, "budget_s": budget_s}))
    log = work / "in_process.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, __file__, "--in-process-child", str(spec_path), str(out_path)],
                              stdout=f, stderr=subprocess.STDOUT, timeout=budget_s + 300)
    if proc.returncode != 0 or not out_path.exists():
        return {"error": f"exit {proc.returncode}", "log_tail": log.read_text(errors="replace")[-3000:]}
    return json.loads(out_path.read_text())


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)  # a server flag must never be taken for a prefix of ours
    ap.add_argument("--out", default=None, help="JSON report")
    ap.add_argument("--url", default=None, help="attach to this running server instead of starting one")
    ap.add_argument("--preset", default=None, help="write a random model of this preset (configs/) and adapters")
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "slora-http-bench")
    ap.add_argument("--n-adapters", type=int, default=None, help="adapters in the trace (default: all served; "
                    "with --preset: 2000)")
    ap.add_argument("--distinct-adapters", type=int, default=20, help="--preset: distinct adapter weight files")
    ap.add_argument("--adapter-set", default="S1", choices=sorted(ADAPTER_SETS),
                    help="--preset: the adapters' ranks and targets (S1: rank 8 q,k,v,o; S2: ranks 64,32,16,8 "
                         "round-robin, q,k,v,o; all7: rank 8 on all 7 projections)")
    ap.add_argument("--rates", default="sat,x0.7", help="traces: sat, a rate in req/s, or xF = F times saturation")
    ap.add_argument("--requests", type=int, default=None, help="requests of a saturation trace (800; --tiny 48)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals of a set-rate trace (30)")
    ap.add_argument("--in-range", default=None, help="prompt tokens lo,hi (8,512; --tiny 8,64)")
    ap.add_argument("--out-range", default=None, help="output tokens lo,hi (8,512; --tiny 8,64)")
    ap.add_argument("--slo-s", type=float, default=6.0, help="first-token SLO")
    ap.add_argument("--in-process-rates", default="sat", help="traces for the in-process engine ('' = none)")
    ap.add_argument("--aiperf", action="store_true", help="also run NVIDIA aiperf against the server")
    ap.add_argument("--aiperf-rates", default="sat", help="aiperf runs: sat or xF (of our HTTP saturation)")
    ap.add_argument("--aiperf-mode", default="synthetic", choices=["synthetic", "trace"])
    ap.add_argument("--aiperf-python", default=sys.executable, help="the Python that has aiperf")
    ap.add_argument("--aiperf-first", action="store_true",
                    help="run aiperf before our traces (default after), on the server as the warm-up trace left it")
    ap.add_argument("--rates-again", default="", help="our traces again after aiperf (e.g. sat): order effects")
    ap.add_argument("--client", default="httpx", choices=["httpx", "openai"],
                    help="our timed traces' client: plain httpx SSE (default) or the openai client (the warm-up "
                    "trace always goes through openai, as a check)")
    ap.add_argument("--client-procs", type=int, default=None, help="client processes (default min(8, cpus // 2))")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--startup-timeout-s", type=float, default=1200.0)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no trace after this many seconds")
    ap.add_argument("--reserve-s", type=float, default=200.0,
                    help="seconds of --budget-s kept for the in-process run: HTTP and aiperf runs start before it")
    ap.add_argument("--in-process-min-s", type=float, default=30.0,
                    help="start the in-process run only with this many seconds of --budget-s left (its engine "
                    "build and traces; a trace cut by the budget is no comparison)")
    ap.add_argument("--host-fill-wait-s", type=float, default=90.0,
                    help="after the warm-up trace, wait up to this long for the server's host fill (every adapter "
                    "read into host memory, or the host budget full) before the timed traces; 0: do not wait (the "
                    "method up to session 15, whose saturation runs started with ~900 of 2000 S1 adapters read)")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized defaults (short lengths, few requests)")
    ap.add_argument("--prepare-only", action="store_true",
                    help="write the model and adapters and start the server once (fills the compilation cache), "
                    "then stop: the first of two device calls when one cannot hold a cold start and the runs")
    ap.add_argument("--in-process-child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args, server_args = ap.parse_known_args(argv)
    server_args = [a for a in server_args if a != "--"]
    sp = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # the server flags this script must know
    sp.add_argument("--model", type=Path)
    sp.add_argument("--adapter-dir", type=Path, action="append", default=[])
    sp.add_argument("--api-key", default=os.environ.get("SLORA_JAX_API_KEY"))
    sp.add_argument("--port", type=int, default=None)
    sp.add_argument("--pool-gb", type=float, default=None)
    sp.add_argument("--num-pages", type=int, default=None)
    srv, _ = sp.parse_known_args(server_args)
    lo_hi = "8,64" if args.tiny else "8,512"
    args.in_range = [int(x) for x in (args.in_range or lo_hi).split(",")]
    args.out_range = [int(x) for x in (args.out_range or lo_hi).split(",")]
    args.requests = args.requests or (48 if args.tiny else 800)
    args.duration = args.duration or (20.0 if args.tiny else 30.0)
    args.client_procs = args.client_procs or (1 if args.tiny else max(1, min(8, (os.cpu_count() or 4) // 2)))
    return args, server_args, srv


def warm_spec(args) -> dict:
    """The untimed trace run first on either path: half a saturation trace on 4 adapters, so the first timed trace
    finds every batch and prefill bucket executed once (on CPU a first full-size trace ran at a third of the speed
    of the next one even after serving.py's 16-request warm-up) but its own adapters not yet loaded."""
    return trace_spec("warm", WARM_ADAPTERS, SAT_RATE, max(16, args.requests // 2), 7, args.in_range, args.out_range)


def resolve_rate(token: str, sat: float | None) -> float | None:
    if token == "sat":
        return SAT_RATE
    if token.startswith("x"):
        return float(token[1:]) * sat if sat else None
    return float(token)


def spec_for(token: str, sat: float | None, n: int, args) -> dict | None:
    """serving.py's trace for ``token``: saturation (seed 0, ``--requests``) or a set rate (seed 99, ``--duration``)."""
    rate = resolve_rate(token, sat)
    if rate is None:
        return None
    if token == "sat":
        return trace_spec(f"{args.adapter_set}-n{n}-sat", n, rate, args.requests, 0, args.in_range, args.out_range)
    return trace_spec(f"{args.adapter_set}-n{n}-R{rate:.2f}", n, rate, max(int(rate * args.duration), 20), 99,
                      args.in_range, args.out_range)


def resolve_inputs(args, srv, server_args: list[str], info: dict, report: dict) -> tuple[Path, list[Path]]:
    """The model dir (for the vocabulary and aiperf's tokenizer) and adapter dirs: ``--preset`` writes them, else
    ``--model`` / ``--adapter-dir``, else the embedded demo's."""
    model_dir, adapter_dirs = srv.model, list(srv.adapter_dir)
    if args.preset:
        t = time.monotonic()
        model_dir, adapters, report["prepare"] = prepare_preset(args.preset, args.work_dir, args.n_adapters or 2000,
                                                                args.distinct_adapters, *ADAPTER_SETS[args.adapter_set])
        report["adapter_set"] = args.adapter_set
        adapter_dirs.append(adapters)
        server_args += ["--model", str(model_dir), "--adapter-dir", str(adapters)]
        report["prepare_s"] = time.monotonic() - t
    elif model_dir is None and args.url is None:
        from slora_jax.serve.demo import ensure_demo

        model_dir, demo_adapters = ensure_demo("float32" if info.get("platform") == "cpu" else "bfloat16")
        adapter_dirs.append(demo_adapters)
    if model_dir is None:
        raise SystemExit("--url needs --model DIR (its config.json gives the vocabulary of the token-id prompts)")
    if args.aiperf and args.aiperf_mode == "synthetic" and not args.url:
        report["tokenizer_written"] = ensure_tokenizer(Path(model_dir))  # aiperf sends text
    return Path(model_dir), adapter_dirs


def http_warm(args, pool, url: str, api_key, names: list[str], vocab: int) -> tuple[list, dict, None]:
    """The warm-up trace (untimed, through the openai client: its errors are reported)."""
    warm = trace_requests(make_spec_trace(warm_spec(args)), names[-WARM_ADAPTERS:], vocab)
    # the untimed warm-up goes through the openai client: a check that a user's client reads our streams right
    records, clients = run_http_trace(pool, args.client_procs, url, api_key, warm, args.request_timeout_s,
                                      client_kind="openai")
    check = summarize("warm-openai", records, args.slo_s, clients)
    print_row("openai", check)
    results, specs, sat = [check | {"as": "openai-check"}], {}, None
    return results, specs, sat


def http_traces(args, pool, url: str, api_key, names: list[str], vocab: int, http_end: float, tokens: list[str],
                sat: float | None, results: list, specs: dict, suffix: str = "") -> float | None:
    """Our client on the traces ``tokens`` (sat, rates, xF), results appended as ``token + suffix``."""
    for token in tokens:
        spec = spec_for(token, sat, len(names), args)
        if spec is None or time.monotonic() > http_end:
            print(f"skip {token}: {'no saturation measured' if spec is None else 'budget'}", flush=True)
            continue
        specs[token] = spec
        t, before = time.monotonic(), server_counters(url, api_key)
        records, clients = run_http_trace(pool, args.client_procs, url, api_key,
                                          trace_requests(make_spec_trace(spec), names, vocab), args.request_timeout_s,
                                          client_kind=args.client)
        res = summarize(spec["name"], records, args.slo_s, clients)
        res["server"] = server_share(before, server_counters(url, api_key), res["elapsed_s"])
        results.append(res | {"rate": spec["rate"], "spec": spec, "as": token + suffix,
                              "wall_s": time.monotonic() - t})
        sat = res["throughput_req_s"] if token == "sat" and not suffix else sat
        print_row("http" + suffix, res)
    return sat


AIPERF_MIN_S = 60.0  # an aiperf run at saturation: its start-up and warm-up, then 800 requests at ~20-30 req/s


def aiperf_phase(args, url: str, api_key, names, vocab, model_dir: Path, specs: dict, sat, http_end,
                 budget_end) -> list:
    """aiperf starts while the HTTP phases may (before ``http_end``) and ``AIPERF_MIN_S`` fit in the whole budget;
    it may run past ``http_end`` into the in-process reserve (up to 120 s; the in-process run is then what gives
    way), never past ``budget_end``."""
    results = []
    for token in [x for x in args.aiperf_rates.split(",") if x]:
        spec = specs.get(token) or spec_for(token, sat, len(names), args)
        now = time.monotonic()
        if spec is None or now > http_end or budget_end - now < AIPERF_MIN_S:
            print(f"skip aiperf {token}: {'no saturation measured' if spec is None else 'budget'}", flush=True)
            continue
        res = run_aiperf(url, trace_requests(make_spec_trace(spec), names, vocab), spec, mode=args.aiperf_mode,
                         tokenizer=str(model_dir), artifact_dir=args.work_dir / f"aiperf-{token}",
                         python=args.aiperf_python, api_key=api_key,
                         timeout_s=min(max(120.0, http_end - now), budget_end - now))
        results.append(res | {"as": token})
        print(f"aiperf {token}: " + json.dumps({k: res.get(k) for k in ("throughput_req_s", "throughput_tok_s",
                                                                        "mean_first_token_s", "errors", "error")}),
              flush=True)
    return results


def main(argv=None) -> int:
    args, server_args, srv = parse_args(argv)
    if args.in_process_child:
        in_process_child(*args.in_process_child)
        return 0
    t_start = time.monotonic()
    budget_end = t_start + args.budget_s
    in_tokens = [x for x in args.in_process_rates.split(",") if x] if not (args.url or args.prepare_only) else []
    http_end = budget_end - (args.reserve_s if in_tokens else 0.0)  # HTTP phases leave the in-process run its time
    args.work_dir.mkdir(parents=True, exist_ok=True)
    info = device_info()  # a child process: this one never imports jax (the server and the engine need the device)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "device": info.get("device"),
              "platform": info.get("platform"), "jax_version": info.get("jax"), "git_commit": git_commit(),
              "python": sys.version.split()[0], "argv": sys.argv[1:], "client_procs": args.client_procs,
              "slo_s": args.slo_s, "in_range": args.in_range, "out_range": args.out_range}

    def save() -> None:  # after every phase: a device call cut short still leaves what was measured
        report["wall_s"] = time.monotonic() - t_start
        report["comparison"] = compare(report)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1, default=str))

    print(f"device {report['device']}  jax {report['jax_version']}  commit {report['git_commit'][:12]}", flush=True)
    model_dir, adapter_dirs = resolve_inputs(args, srv, server_args, info, report)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if srv.port is None:
        server_args += ["--port", "0"]
    report.update(server_args=server_args, model_dir=str(model_dir), adapter_dirs=[str(d) for d in adapter_dirs])
    pool = multiprocessing.get_context("spawn").Pool(args.client_procs, initializer=client_init)
    proc, specs = None, {}
    try:
        if args.url:
            url = args.url.rstrip("/")
        else:
            t = time.monotonic()
            try:
                proc = ServerProcess(server_args, adapter_dirs[0] if adapter_dirs else args.work_dir,
                                     args.work_dir / "server.log", args.startup_timeout_s)
            except RuntimeError as e:  # exited or not ready in time: keep what the log says
                kill_own_servers()
                report["server_error"] = str(e)[-3000:]
                report["server_phases"] = startup_phases((args.work_dir / "server.log").read_text(errors="replace"))
                save()
                raise SystemExit(f"server did not start: {str(e)[:300]}") from None
            url = proc.url
            report["server_startup_s"] = time.monotonic() - t
            report["server_phases"] = startup_phases(proc.log_text())
        base, names, max_len = served_models(url, srv.api_key)
        names = names[:args.n_adapters] if args.n_adapters else names
        report.update(base_model=base, n_adapters=len(names), max_model_len=max_len, vocab=vocab)
        print(f"server {url}: base {base!r}, {len(names)} adapters in the trace, ready after "
              f"{report.get('server_startup_s', 0):.0f} s {report.get('server_phases', {})}", flush=True)
        save()
        if not args.prepare_only:
            report["http"], specs, sat = http_warm(args, pool, url, srv.api_key, names, vocab)
            if args.host_fill_wait_s > 0:  # timed traces see the steady state: every adapter the host holds read
                report["host_fill_wait"] = wait_host_fill(url, srv.api_key, len(names), args.host_fill_wait_s)
                print(f"host fill: {report['host_fill_wait']}", flush=True)
            ours = [x for x in args.rates.split(",") if x]
            if args.aiperf and args.aiperf_first:  # aiperf on the server as it is after the warm-up trace
                report["aiperf"] = aiperf_phase(args, url, srv.api_key, names, vocab, model_dir, specs, sat,
                                                http_end, budget_end)
                save()
            sat = http_traces(args, pool, url, srv.api_key, names, vocab, http_end, ours, sat, report["http"], specs)
            save()
            if args.aiperf and not args.aiperf_first:
                report["aiperf"] = aiperf_phase(args, url, srv.api_key, names, vocab, model_dir, specs, sat,
                                                http_end, budget_end)
                save()
            again = [x for x in args.rates_again.split(",") if x]  # ours again after aiperf: order effects
            http_traces(args, pool, url, srv.api_key, names, vocab, http_end, again, sat, report["http"], specs,
                        suffix="-again")
            save()
        if proc is not None:
            report["server_metrics"] = scrape_metrics(url, srv.api_key)
            report["server_log_problems"] = proc.log_problems()[:20]
    finally:
        pool.close()
        if proc is not None:
            proc.close()
    if in_tokens:
        in_args = list(server_args)
        if srv.pool_gb is None and srv.num_pages is None and "pool_pages" in report.get("server_phases", {}):
            in_args += ["--num-pages", str(int(report["server_phases"]["pool_pages"]))]  # the server's very pool
        in_specs = [specs[t] for t in in_tokens if t in specs]
        left = budget_end - time.monotonic()
        if in_specs and left >= args.in_process_min_s:
            print(f"in-process engine on {[s['name'] for s in in_specs]} ...", flush=True)
            t = time.monotonic()
            report["in_process"] = run_in_process(in_args, in_specs, names, vocab, args, left, args.work_dir)
            report["in_process"]["wall_s"] = time.monotonic() - t
            for res in report["in_process"].get("results", []):
                print_row("in-process", res)
        else:
            report["in_process"] = {"skipped": "budget" if in_specs else "no matching HTTP trace"}
    save()
    print(json.dumps(report["comparison"], indent=1), flush=True)
    return 0


def print_row(who: str, r: dict) -> None:
    ttft, itl = r.get("ttft_ms") or {}, r.get("itl_ms") or {}
    print(f"{who:10s} {r['trace']:22s} fin {r['finished']:5d}/{r['requests']:<5d} {r['throughput_req_s']:7.2f} req/s "
          f"{r['throughput_tok_s']:8.0f} tok/s  TTFT mean {1e3 * (r.get('mean_first_token_s') or 0):8.1f} ms "
          f"p99 {ttft.get('p99', float('nan')):8.1f} ms  ITL p50 {itl.get('p50', float('nan')):6.1f}"
          f" ms  SLO {r['slo_attainment']:.2f}  errors {r.get('errors', {})}", flush=True)


def compare(report: dict) -> dict:
    """The issue's acceptance figures, where this run measured them."""
    out = {}
    http = {r["as"]: r for r in report.get("http", [])}
    ours = http.get("sat")
    inproc = next((r for r in report.get("in_process", {}).get("results", [])  # a trace the budget cut: no figure
                   if r["rate"] == SAT_RATE and not r.get("cut_by_budget")), None)
    if ours and inproc:
        out["http_over_in_process_sat"] = ours["throughput_req_s"] / max(inproc["throughput_req_s"], 1e-9)
        out["http_over_in_process_sat_tok"] = ours["throughput_tok_s"] / max(inproc["throughput_tok_s"], 1e-9)
    low = next((r for r in report.get("http", []) if r["as"].startswith("x")), None)
    if low:
        out["ttft_mean_ms_at_" + low["as"]] = (low["mean_first_token_s"] or 0) * 1e3
    out["http_errors"] = sum(sum(r["errors"].values()) for r in report.get("http", []))
    ai = next((r for r in report.get("aiperf", []) if r.get("as") == "sat" and "throughput_req_s" in r), None)
    if ai and ours:
        out["aiperf_over_ours_sat"] = ai["throughput_req_s"] / max(ours["throughput_req_s"], 1e-9)
        out["aiperf_over_ours_sat_tok"] = (ai.get("throughput_tok_s") or 0) / max(ours["throughput_tok_s"], 1e-9)
    again = http.get("sat-again")  # ours after aiperf: the same server state aiperf left
    if again and inproc:
        out["http_again_over_in_process_sat"] = again["throughput_req_s"] / max(inproc["throughput_req_s"], 1e-9)
    if again and ai:
        out["aiperf_over_ours_again_sat"] = ai["throughput_req_s"] / max(again["throughput_req_s"], 1e-9)
    check = http.get("openai-check")
    if check:
        out["openai_check_finished"] = f"{check['finished']}/{check['requests']}"
    return out


if __name__ == "__main__":
    sys.exit(main())
