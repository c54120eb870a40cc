"""Start-up as a user meets it: a model dir and adapter dirs on disk, `python -m slora_jax.serve --model DIR
--adapter-dir ADAPTERS` with no tuning flags, timed from launch to a ready /health, cold (empty compilation cache) and
again on restart (the cache filled by the first run). Reads the server's phase log lines (load, pool, adapters,
warm-up) and checks it answers a base and an adapter request each time.

    PYTHONPATH=. python benchmarks/startup.py --preset llama-2-7b --adapters 2000 --distinct 20 --out r.json
    PYTHONPATH=. python benchmarks/startup.py --preset tiny --adapters 20 --out /tmp/s.json       # CPU smoke run

``--then CMD`` runs a shell command while the restarted server is up (``{url}`` and ``{adapters}`` filled in), e.g.
a client benchmark against this very server.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit  # noqa: E402

PHASES = {  # log line -> what it measures
    "weights_s": r"weights loaded and pool allocated in ([\d.]+) s",
    "pool_gib": r"pool: \d+ pages of \d+ tokens \(([\d.]+) GiB\)",
    "adapters_s": r"adapters registered in ([\d.]+) s",
    "warmup_s": r"warm-up: \d+ compiles \(\d+ from the compilation cache\) in ([\d.]+) s",
    "compiles": r"warm-up: (\d+) compiles",
    "cache_hits": r"warm-up: \d+ compiles \((\d+) from the compilation cache\)",
    "ready_logged_s": r"ready in ([\d.]+) s after start",
    "compiled_ahead_s": r"step buckets compiled ahead on \d+ threads in ([\d.]+) s",
    "compile_threads": r"step buckets compiled ahead on (\d+) threads",
}


def synthesize(args) -> dict:
    """Write the model (bf16 shards, as HF writes them) and adapters unless they exist; returns the times taken."""
    times = {}
    model, adapters = Path(args.model_dir), Path(args.adapter_dir)
    synth = [sys.executable, "-m", "slora_jax.tools.synth"]
    if not (model / "config.json").exists():
        t = time.monotonic()
        subprocess.run(synth + ["model", "--preset", args.preset, "--out", str(model), "--dtype", args.dtype],
                       check=True)
        times["write_model_s"] = time.monotonic() - t
    if not adapters.exists():
        t = time.monotonic()
        subprocess.run(synth + ["adapters", "--model", str(model), "--out", str(adapters), "-n", str(args.adapters),
                                "--distinct", str(args.distinct), "--dtype", args.dtype, "--ranks", "8"], check=True)
        times["write_adapters_s"] = time.monotonic() - t
    return times


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def complete(url: str, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": [1, 2, 3, 4, 5], "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    t = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    return {"model": model, "seconds": time.monotonic() - t, "text": out["choices"][0]["text"]}


def launch(args, log_path: Path) -> dict:
    """One server start: launch -> ready, two requests, SIGTERM -> exit. Returns its figures."""
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "slora_jax.serve", "--model", args.model_dir, "--adapter-dir", args.adapter_dir,
           "--port", str(args.port)] + args.server_args
    t0 = time.monotonic()
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    result: dict = {"command": " ".join(cmd)}
    try:
        while get(f"{url}/health")[0] != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
            if time.monotonic() - t0 > args.ready_timeout_s:
                raise RuntimeError(f"not ready after {args.ready_timeout_s} s; see {log_path}")
            time.sleep(0.2)
        result["ready_s"] = time.monotonic() - t0
        models = json.loads(get(f"{url}/v1/models")[1])["data"]
        base, adapter = models[0]["id"], models[1]["id"]
        result["requests"] = [complete(url, base), complete(url, adapter)]
        metrics = get(f"{url}/metrics")[1].decode(errors="replace")
        m = re.search(r"^\w*compiles_since_warmup (\S+)$", metrics, re.M)
        result["compiles_after_warmup"] = float(m.group(1)) if m else None
        if args.then:
            t = time.monotonic()
            cmd_then = args.then.format(url=url, adapters=args.adapter_dir)
            result["then"] = {"command": cmd_then, "rc": subprocess.run(cmd_then, shell=True).returncode,
                              "seconds": time.monotonic() - t}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = log_path.read_text(errors="replace")
    for key, pattern in PHASES.items():
        m = re.search(pattern, text)
        result[key] = float(m.group(1)) if m else None
    result["oom"] = "RESOURCE_EXHAUSTED" in text or "Out of memory" in text
    result["log_tail"] = text.splitlines()[-5:]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--adapters", type=int, default=20)
    ap.add_argument("--distinct", type=int, default=20)
    ap.add_argument("--model-dir", default="/tmp/slora_startup/model")
    ap.add_argument("--adapter-dir", default="/tmp/slora_startup/adapters")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "slora_jax" / "xla"),
                    help="the server's default compilation cache, emptied before the cold start")
    ap.add_argument("--port", type=int, default=8311)
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    ap.add_argument("--then", default=None, help="shell command run against the restarted server")
    ap.add_argument("--logs", default="/tmp/slora_startup")
    ap.add_argument("--out", default=None)
    ap.add_argument("server_args", nargs="*", help="extra server flags after --")
    args = ap.parse_args()

    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "git_commit": git_commit(),
              "preset": args.preset, "adapters": args.adapters, "distinct_adapters": args.distinct,
              **synthesize(args)}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    report["device"] = out or "cpu"
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.cache_dir, ignore_errors=True)
    then, args.then = args.then, None
    report["cold"] = launch(args, logs / "cold.log")
    print(json.dumps({"cold": {k: v for k, v in report["cold"].items() if k != "log_tail"}}), flush=True)
    args.then = then
    report["restart"] = launch(args, logs / "restart.log")
    print(json.dumps({"restart": {k: v for k, v in report["restart"].items() if k != "log_tail"}}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
