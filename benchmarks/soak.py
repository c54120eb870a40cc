"""Soak test of the HTTP server (issue 18): a real ``python -m slora_jax.serve`` process under a long, mixed load.

    PYTHONPATH=. python benchmarks/soak.py --duration-s 600 --rate-x 1.5 --out soak.json      # embedded demo, CPU
    PYTHONPATH=. python benchmarks/soak.py --duration-s 300 --model /models/llama --adapter-dir /adapters \\
        --pool-gb 40 --output-len 16,128 --out soak_gpu.json                                 # flags it does not know
                                                                                             # go to the server

Unit and corpus tests check each failure once on a fresh server; only time and mixing show leaks (RSS, KV pages,
host adapter bytes), hangs, 500s, greedy outputs that drift, or a drain that cuts requests. This script starts the
server (with no --model, the embedded demo), measures a saturation rate in a short closed-loop burst, then for
``--duration-s`` sends, at ``--rate`` valid requests/s (or ``--rate-x`` times saturation) with at most
``--concurrency`` clients in flight (an arrival that finds every client busy is skipped and counted):

* valid completions and chats over the served adapters (power-law popularity, Gamma arrivals: workload.py), streamed
  and not, each answer checked (finish reason, token count, ``[DONE]``, no error event);
* bad requests, each expecting one status (wrong types, out-of-range values, oversized and slow bodies, unknown or
  malformed model names, lone surrogates, bodies that are not JSON), in proportion to the valid ones;
* cancelled requests (the client disconnects mid-stream or while waiting for a whole answer);
* a churn loop: load / use / unload copies of served adapters through /v1/load_lora_adapter and
  /v1/unload_lora_adapter, plus bad adapter dirs, names and paths that must be refused with their 4xx;
* fixed greedy probes at the start, every ``--probe-every-s`` and at the end, whose tokens must not change.

Then it waits for the server to go idle, checks the pool (KV pages back to their start) and host adapter bytes,
sends SIGTERM with requests open and checks the drain. It writes ``--out`` (JSON), prints a table, and exits 1 if
an acceptance check fails: no 5xx (seen by a client, or counted in the server's /metrics), nothing lost or hung
(every request has a client deadline), every refusal with its expected status, probes unchanged, KV pages back to
start, host adapter bytes within the adapters' size, server RSS growth within ``--rss-growth-mb``, no compiles after
warm-up, churned copies answering as their originals, no errors in the server log, and a clean drain within the
grace period.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from common import git_commit  # run as python benchmarks/soak.py: benchmarks/ is on the path
from workload import make_trace

FLUSH_S = 5.0  # the server's time for answers after the grace period (slora_jax.serve.shutdown.FLUSH_S)
MIX = {"valid": 80, "bad": 12, "cancel": 7, "slow": 1}  # shares of arrivals; --rate counts only "valid"
MAX_SLOW = 2  # slow-body / slow-header clients at once (each holds a connection for the server's timeout)
WORDS = ("the quick brown fox jumps over a lazy dog while adapters page through the pool and tokens stream out "
         "of every batch soak test server engine café naïve 日本語 ünïcödé").split()
PROBE_PROMPT = "The quick brown fox"
MAX_PROBLEMS = 100  # problem details kept in the JSON (all are counted)


# ---------------------------------------------------------------- flags


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)  # a server flag must never be taken for a prefix of ours
    ap.add_argument("--out", default=None, help="JSON report")
    ap.add_argument("--duration-s", type=float, default=600.0, help="length of the soak phase")
    ap.add_argument("--rate", type=float, default=None, help="valid requests/s (others come on top, see MIX)")
    ap.add_argument("--rate-x", type=float, default=1.5, help="without --rate: this times the saturation rate")
    ap.add_argument("--saturation-s", type=float, default=30.0, help="closed-loop burst that measures saturation")
    ap.add_argument("--concurrency", type=int, default=64, help="clients in flight at most (burst and soak)")
    ap.add_argument("--request-timeout-s", type=float, default=120.0, help="client deadline; past it = hung")
    ap.add_argument("--probe-every-s", type=float, default=60.0)
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--churn-every-s", type=float, default=3.0, help="pause between adapter churn cycles")
    ap.add_argument("--sample-every-s", type=float, default=5.0, help="RSS and /metrics sampling period")
    ap.add_argument("--prompt-len", default="8,64", help="words per prompt, uniform in [lo, hi]")
    ap.add_argument("--output-len", default="4,32", help="max_tokens, uniform in [lo, hi]")
    ap.add_argument("--alpha", type=float, default=1.0, help="power-law exponent of adapter popularity")
    ap.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of inter-arrival gaps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-growth-mb", type=float, default=64.0,
                    help="bound on server RSS growth from the soak's start to its end, less host adapter bytes")
    ap.add_argument("--shutdown-requests", type=int, default=8, help="requests open when SIGTERM is sent")
    ap.add_argument("--startup-timeout-s", type=float, default=1200.0)
    ap.add_argument("--churn-source", type=Path, default=None,
                    help="adapter dirs to copy for churn (default: the first --adapter-dir, --lora-modules, or the "
                         "demo's)")
    ap.add_argument("--server-log", type=Path, default=None, help="keep the server's output here")
    args, server_args = ap.parse_known_args(argv)
    server_args = [a for a in server_args if a != "--"]
    sp = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # the server flags the soak must know
    sp.add_argument("--model", type=Path)
    sp.add_argument("--adapter-dir", type=Path, action="append", default=[])
    sp.add_argument("--lora-modules", nargs="+", default=[])
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=None)
    sp.add_argument("--api-key", default=os.environ.get("SLORA_JAX_API_KEY"))
    sp.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    sp.add_argument("--max-prompt-chars", type=int, default=None)
    sp.add_argument("--header-timeout-s", type=float, default=10.0)
    sp.add_argument("--body-timeout-s", type=float, default=30.0)
    sp.add_argument("--shutdown-grace-s", type=float, default=30.0)
    sp.add_argument("--no-warmup", action="store_true")
    srv, _ = sp.parse_known_args(server_args)
    if srv.port is None:
        server_args += ["--port", "0"]  # a free port; the ready line says which
    args.prompt_range = tuple(int(x) for x in args.prompt_len.split(","))
    args.output_range = tuple(int(x) for x in args.output_len.split(","))
    return args, server_args, srv


# ---------------------------------------------------------------- the server process


class ServerProcess:
    """``python -m slora_jax.serve`` with its output in a log file; the URL comes from its ready line."""

    def __init__(self, server_args: list[str], allowed: Path, log_path: Path, timeout_s: float):
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "slora_jax.serve", *server_args, "--allowed-adapter-dir", str(allowed)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                          env.get("PYTHONPATH")]))
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        self.url = self._wait_ready(timeout_s)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            found = re.search(r"slora-jax ready: (http://\S+)/v1", self.log_text())
            if found:
                url = found.group(1)
                for _ in range(100):
                    with contextlib.suppress(httpx.HTTPError):
                        if httpx.get(url + "/health", timeout=5).status_code == 200:
                            return url
                    time.sleep(0.1)
                raise RuntimeError("the server logged its ready line but /health never answered 200")
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s:\n{self.log_text()[-4000:]}")

    def rss_mb(self) -> float | None:
        """Resident memory of the server (``/proc``; psutil where there is no /proc)."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        try:
            import psutil

            return psutil.Process(self.pid).memory_info().rss / 2**20
        except Exception:  # noqa: BLE001 (gone, or no psutil)
            return None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_problems(self) -> list[str]:
        """Lines of the server log that report errors (tracebacks, ERROR, CRITICAL)."""
        return [line for line in self.log_text().splitlines()
                if re.search(r"Traceback|\bERROR\b|\bCRITICAL\b|Exception", line)]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()


def device_info() -> dict:
    """Device and jax version from a child process (this one never imports jax: it must not hold the GPU)."""
    code = ("import json, jax; d = jax.devices()[0]; "
            "print('INFO' + json.dumps({'device': d.device_kind, 'platform': d.platform, 'jax': jax.__version__}))")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        line = next(x for x in out.stdout.splitlines() if x.startswith("INFO"))
        return json.loads(line[4:])
    except Exception as e:  # noqa: BLE001
        return {"device": "unknown", "jax": "unknown", "error": repr(e)}


# ---------------------------------------------------------------- adapters for the churn loop


def adapter_sources(args, srv) -> list[Path]:
    """Served adapter dirs whose copies the churn loop loads: they fit the base model by construction."""
    roots = [args.churn_source] if args.churn_source else list(srv.adapter_dir)
    dirs = [p for root in roots for p in sorted(Path(root).expanduser().iterdir())
            if (p / "adapter_config.json").is_file()]
    dirs += [Path(item.partition("=")[2]).expanduser() for item in srv.lora_modules]
    if not dirs and srv.model is None:
        from slora_jax.serve.demo import DEMO_ADAPTERS, cache_root  # no jax: only paths

        root = cache_root() / "demo" / f"adapters-{DEMO_ADAPTERS}"
        dirs = sorted(p for p in root.iterdir() if (p / "adapter_config.json").is_file())
    if not dirs:
        raise SystemExit("no adapter dirs to copy for the churn loop: give --churn-source DIR")
    return dirs


def _edit_config(path: Path, **changes) -> None:
    conf = json.loads((path / "adapter_config.json").read_text())
    conf.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(conf))  # NaN is written as NaN: JSON parsers accept it


def _nan_weight(path: Path) -> None:
    """Set the first element of the first tensor to NaN, editing the safetensors bytes in place."""
    f = path / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    name = next(k for k in sorted(header) if k != "__metadata__")
    nan = {"F32": struct.pack("<f", float("nan")), "F16": b"\x00\x7e", "BF16": b"\xc0\x7f",
           "F64": struct.pack("<d", float("nan"))}[header[name]["dtype"]]
    start = 8 + n + header[name]["data_offsets"][0]
    data[start:start + len(nan)] = nan
    f.write_bytes(bytes(data))


def _truncate(which: str, keep) -> Callable:
    def make(path: Path) -> None:
        f = path / which
        data = f.read_bytes()
        f.write_bytes(data[:keep(len(data))])
    return make


def _link_out(outside: Path, which: str | None):
    """The adapter dir (``which`` None) or one of its files is a symlink to a copy outside the allowed dirs."""
    def make(path: Path) -> None:
        target = outside / path.name
        shutil.copytree(path, target)
        if which is None:
            shutil.rmtree(path)
            os.symlink(target, path)
        else:
            (path / which).unlink()
            os.symlink(target / which, path / which)
    return make


def bad_adapter_dirs(outside: Path) -> list[tuple[str, Callable, int]]:
    """(dir name, how to break a good copy, status its load must get)."""
    cfg, weights = "adapter_config.json", "adapter_model.safetensors"
    return [
        ("bad-config-truncated", _truncate(cfg, lambda n: n // 2), 400),
        ("bad-config-empty", _truncate(cfg, lambda n: 0), 400),
        ("bad-config-list", lambda p: (p / cfg).write_text("[1, 2]"), 400),
        ("bad-config-missing", lambda p: (p / cfg).unlink(), 400),
        ("bad-r-zero", lambda p: _edit_config(p, r=0), 400),
        ("bad-r-string", lambda p: _edit_config(p, r="8"), 400),
        ("bad-r-huge", lambda p: _edit_config(p, r=10**6), 400),
        ("bad-alpha-nan", lambda p: _edit_config(p, lora_alpha=float("nan")), 400),
        ("bad-peft-type", lambda p: _edit_config(p, peft_type="PREFIX_TUNING"), 400),
        ("bad-dora", lambda p: _edit_config(p, use_dora=True), 400),
        ("bad-targets-unknown", lambda p: _edit_config(p, target_modules=["q_proj", "w_pack"]), 400),
        ("bad-targets-catastrophic-regex", lambda p: _edit_config(p, target_modules="(.|.)*X"), 400),
        ("bad-weights-truncated", _truncate(weights, lambda n: n - 100), 400),
        ("bad-weights-empty", _truncate(weights, lambda n: 0), 400),
        ("bad-weights-missing", lambda p: (p / weights).unlink(), 400),
        ("bad-weights-garbage", lambda p: (p / weights).write_bytes(b"\x00\x01not safetensors" * 10), 400),
        ("bad-weights-nan", _nan_weight, 400),
        ("bad-dir-symlinked-out", _link_out(outside, None), 403),
        ("bad-weights-symlinked-out", _link_out(outside, weights), 403),
    ]


def prepare_adapters(sources: list[Path], allowed: Path, outside: Path, n_good: int = 4) -> tuple[dict, list]:
    """Copies of served adapters (``good-i``) and broken ones under the allowed dir; returns ({good copy: the name
    its original is served under, if from an adapter dir}, [(bad name, expected status)])."""
    good = {}
    for i, src in enumerate(sources[:n_good]):
        shutil.copytree(src, allowed / f"good-{i}", symlinks=False)
        good[f"good-{i}"] = src.name
    shutil.copytree(sources[0], outside / "good-outside")
    bad = []
    for name, make, status in bad_adapter_dirs(outside):
        shutil.copytree(sources[0], allowed / name)
        make(allowed / name)
        bad.append((name, status))
    return good, bad


def weight_bytes(dirs: list[Path]) -> int:
    return sum((d / "adapter_model.safetensors").stat().st_size for d in dirs
               if (d / "adapter_model.safetensors").is_file())


# ---------------------------------------------------------------- bad request bodies


def bad_cases(base: str, adapter: str, max_len: int, srv) -> list[tuple[str, str, str, object, int]]:
    """(case, method, path, body, expected status). A dict body is sent as JSON the way a hostile client may (NaN,
    Infinity and lone surrogates included); bytes as they are; None as no body."""
    prompt_chars = srv.max_prompt_chars or 32 * max_len
    comp = {"model": adapter, "prompt": "Hello there", "max_tokens": 4}
    chat = {"model": adapter, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
    nan, inf = float("nan"), float("inf")
    cases = []
    for field, value, status, label in [
        ("max_tokens", "lots", 400, "string"), ("max_tokens", 0, 400, "zero"), ("max_tokens", -1, 400, "negative"),
        ("max_tokens", 2**63, 400, "2^63"), ("max_tokens", 10**7, 400, "beyond-context"),
        ("temperature", -1, 400, "negative"), ("temperature", nan, 400, "nan"), ("temperature", inf, 400, "inf"),
        ("temperature", 1e308, 400, "1e308"), ("top_p", 0, 400, "zero"), ("top_p", 2, 400, "two"),
        ("top_p", "x", 400, "string"), ("top_k", -2, 400, "minus-two"), ("top_k", 1.5, 400, "float"),
        ("seed", -1, 400, "negative"), ("seed", 2**64, 400, "2^64"), ("stop", 5, 400, "int"),
        ("stop", ["s"] * 65, 400, "too-many"), ("stop", "\ud800", 400, "lone-surrogate"),
        ("stop_token_ids", [10**9], 400, "beyond-vocab"), ("stop_token_ids", [-1], 400, "negative"),
        ("n", 2, 400, "two"), ("logprobs", 1, 400, "set"), ("echo", True, 400, "true"), ("best_of", 2, 400, "two"),
        ("presence_penalty", 0.5, 400, "set"), ("logit_bias", {"1": 5}, 400, "set"),
        ("ignore_eos", "maybe", 400, "string"), ("stream", "maybe", 400, "string"),
        ("prompt", None, 400, "null"), ("prompt", "", 400, "empty"), ("prompt", 5, 400, "int"),
        ("prompt", [-1], 400, "negative-id"), ("prompt", [10**9], 400, "id-beyond-vocab"),
        ("prompt", ["a", "b"], 400, "batch"), ("prompt", "\ud800", 400, "lone-surrogate"),
        ("prompt", ["ok", "\udfff"], 400, "lone-surrogate-in-list"),
        ("prompt", "x" * (prompt_chars + 1), 400, "over-char-limit"), ("prompt", [5] * (max_len + 1), 400,
                                                                         "over-context"),
        ("model", "no-such-adapter-soak", 404, "unknown"), ("model", 5, 400, "int"), ("model", None, 400, "null"),
        ("model", "m" * 2000, 400, "too-long"), ("model", "\ud800", 400, "lone-surrogate"),
    ]:
        cases.append((f"completion-{field}-{label}", "POST", "/v1/completions", {**comp, field: value}, status))
    for field, value, status, label in [
        ("messages", [], 400, "empty"), ("messages", "x", 400, "string"), ("messages", [5], 400, "int-message"),
        ("messages", [{"content": "x"}], 400, "no-role"), ("messages", [{"role": "user", "content": 5}], 400,
                                                            "int-content"),
        ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
         400, "image-part"),
        ("messages", [{"role": "user", "content": [{"type": "text", "text": 5}]}], 400, "int-text-part"),
        ("messages", [{"role": "user", "content": "\ud800"}], 400, "lone-surrogate"),
        ("messages", [{"role": "user", "content": "x" * (prompt_chars + 1)}], 400, "over-char-limit"),
        ("max_completion_tokens", 0, 400, "zero"), ("tools", [{"type": "function", "function": {"name": "f"}}],
                                                    400, "set"),
        ("logprobs", True, 400, "set"), ("model", "no-such-adapter-soak", 404, "unknown"),
    ]:
        cases.append((f"chat-{field}-{label}", "POST", "/v1/chat/completions", {**chat, field: value}, status))
    cases += [
        ("chat-max-tokens-disagree", "POST", "/v1/chat/completions", {**chat, "max_completion_tokens": 3}, 400),
        ("completion-no-model", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, 400),
        ("body-empty", "POST", "/v1/completions", b"", 400),
        ("body-truncated", "POST", "/v1/completions", b'{"model": "x", "prompt": ', 400),
        ("body-array", "POST", "/v1/chat/completions", b"[]", 400),
        ("body-invalid-utf8", "POST", "/v1/completions", b'{"model": "x", "prompt": "\xff\xfe"}', 400),
        ("body-deep-nesting", "POST", "/v1/completions",
         b'{"model": "x", "prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}", 400),
        ("body-huge-int", "POST", "/v1/completions", b'{"model": "x", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}",
         400),
        ("body-oversized", "POST", "/v1/completions", "oversized", 413),
        ("body-oversized-chunked", "POST", "/v1/completions", "oversized-chunked", 413),
        ("method-get-completions", "GET", "/v1/completions", None, 405),
        ("route-unknown", "POST", "/v1/nothing-here", {"x": 1}, 404),
    ]
    return cases


# ---------------------------------------------------------------- the record


def pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


class Record:
    """Outcomes of every request by phase and kind, refusals by case and status, and every problem."""

    PROBLEMS = ("5xx", "lost", "hung", "unexpected")

    def __init__(self):
        self.outcomes = collections.defaultdict(collections.Counter)  # "phase/kind" -> outcome -> n
        self.rejects = collections.defaultdict(collections.Counter)  # case -> status -> n
        self.reject_status = collections.Counter()
        self.latency = collections.defaultdict(list)  # "phase/stream|whole" -> seconds
        self.ttft = collections.defaultdict(list)  # "phase" -> seconds (streams)
        self.tokens = collections.Counter()  # phase -> completion tokens of valid requests
        self.skipped = collections.Counter()  # kind -> arrivals that found every client busy
        self.problem_counts = collections.Counter()  # "phase/what" -> n
        self.problems: list[dict] = []
        self.t0 = time.monotonic()

    def count(self, phase: str, kind: str, outcome: str) -> None:
        self.outcomes[f"{phase}/{kind}"][outcome] += 1

    def problem(self, phase: str, kind: str, what: str, detail) -> None:
        self.count(phase, kind, what)
        self.problem_counts[f"{phase}/{what}"] += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append({"t": round(time.monotonic() - self.t0, 2), "phase": phase, "kind": kind,
                                  "what": what, "detail": str(detail)[:500]})

    def n_problems(self, what: str, phases=None) -> int:
        return sum(n for key, n in self.problem_counts.items()
                   if key.endswith("/" + what) and (phases is None or key.split("/")[0] in phases))


# ---------------------------------------------------------------- the client side


def error_of(r: httpx.Response) -> tuple[int | None, str]:
    try:
        err = r.json()["error"]
        return err.get("code"), str(err.get("message", ""))
    except Exception:  # noqa: BLE001
        return None, r.text[:200]


def token_count(event: dict) -> int:
    ch = (event.get("choices") or [{}])[0]
    return len(ch.get("token_ids") or [])


def has_text(event: dict) -> bool:
    ch = (event.get("choices") or [{}])[0]
    return bool(ch.get("token_ids") or ch.get("text") or (ch.get("delta") or {}).get("content"))


class Soak:
    def __init__(self, args, srv, url: str, record: Record, models: list[str], base: str, max_len: int):
        self.args, self.srv, self.url, self.rec = args, srv, url, record
        self.base, self.max_len = base, max_len
        self.adapters = models  # served adapters, most popular first
        headers = {"Authorization": f"Bearer {srv.api_key}"} if srv.api_key else {}
        self.headers = headers
        limits = httpx.Limits(max_connections=args.concurrency + 16, max_keepalive_connections=args.concurrency + 16)
        self.client = httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                        timeout=httpx.Timeout(args.request_timeout_s, connect=30))
        self.rng = np.random.default_rng(args.seed + 1)
        self.sem = asyncio.Semaphore(args.concurrency)
        self.slow_sem = asyncio.Semaphore(MAX_SLOW)
        self.cases = bad_cases(base, self.adapters[0], max_len, srv)
        self.case_i = 0
        self.in_flight = 0

    async def close(self) -> None:
        await self.client.aclose()

    # ---- valid requests ---------------------------------------------------------------------------------------

    def valid_body(self, model: str, prompt_words: int, max_tokens: int) -> tuple[str, dict]:
        rng = self.rng
        words = " ".join(rng.choice(WORDS, size=max(1, prompt_words // 2)))
        body = {"model": model, "max_tokens": int(max_tokens), "ignore_eos": bool(rng.random() < 0.8)}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, top_p=0.9, seed=int(rng.integers(2**31)))
        if rng.random() < 0.5:
            body["stream"] = True
            body["return_token_ids"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.4:
            return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words}]}
        prompt = words if rng.random() < 0.5 else [int(x) for x in rng.integers(3, 500, size=max(1, prompt_words))]
        return "/v1/completions", {**body, "prompt": prompt}

    async def valid(self, phase: str, kind: str, path: str, body: dict) -> bool:
        """Send one valid request and check its answer; True if it was served in full."""
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.args.request_timeout_s):
                if body.get("stream"):
                    return await self._valid_stream(phase, kind, path, body, t0)
                r = await self.client.post(path, json=body)
                if not self._status_ok(phase, kind, r):
                    return False
                data = r.json()
                choice, usage = data["choices"][0], data["usage"]
                if not self._tokens_ok(phase, kind, body, choice["finish_reason"], usage["completion_tokens"]):
                    return False
                self.rec.latency[f"{phase}/whole"].append(time.monotonic() - t0)
                self.rec.tokens[phase] += usage["completion_tokens"]
                self.rec.count(phase, kind, "ok")
                return True
        except TimeoutError:
            self.rec.problem(phase, kind, "hung", f"no answer within {self.args.request_timeout_s} s: {path} "
                             f"{json.dumps(body)[:200]}")
        except httpx.TimeoutException as e:
            self.rec.problem(phase, kind, "hung", f"{type(e).__name__}: {path} {json.dumps(body)[:200]}")
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            self.rec.problem(phase, kind, "lost", f"{type(e).__name__}: {e}: {path} {json.dumps(body)[:200]}")
        return False

    def _status_ok(self, phase: str, kind: str, r: httpx.Response) -> bool:
        if r.status_code == 200:
            return True
        _, message = error_of(r)
        if r.status_code == 429:
            self.rec.count(phase, kind, "busy-429")
        elif r.status_code >= 500:
            self.rec.problem(phase, kind, "5xx", f"{r.status_code}: {message}")
        else:
            self.rec.problem(phase, kind, "unexpected", f"{r.status_code}: {message}")
        return False

    def _tokens_ok(self, phase, kind, body, finish_reason, n_tokens) -> bool:
        exact = body["ignore_eos"]
        ok = (finish_reason == "length" and n_tokens == body["max_tokens"]) if exact else (
            finish_reason in ("stop", "length") and 0 <= n_tokens <= body["max_tokens"])
        if not ok:
            self.rec.problem(phase, kind, "unexpected", f"finish {finish_reason!r} after {n_tokens} tokens "
                             f"(max_tokens {body['max_tokens']}, ignore_eos {exact})")
        return ok

    async def _valid_stream(self, phase, kind, path, body, t0) -> bool:
        async with self.client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return self._status_ok(phase, kind, r)
            first, n_tokens, finish, usage, done, error = None, 0, None, None, False, None
            async for line in r.aiter_lines():
                if not line:
                    continue
                if done:
                    raise ValueError(f"data after [DONE]: {line[:100]}")
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    error = event["error"]
                    continue
                if first is None and has_text(event):
                    first = time.monotonic() - t0
                n_tokens += token_count(event)
                if event.get("usage"):
                    usage = event["usage"]
                for ch in event.get("choices") or []:
                    finish = ch.get("finish_reason") or finish
        if error is not None:
            what = "5xx" if int(error.get("code") or 500) >= 500 else "unexpected"
            self.rec.problem(phase, kind, what, f"stream error event {error}")
            return False
        if not done:
            self.rec.problem(phase, kind, "lost", f"stream ended without [DONE] after {n_tokens} tokens")
            return False
        if usage is not None and usage["completion_tokens"] != n_tokens:
            self.rec.problem(phase, kind, "unexpected", f"usage says {usage['completion_tokens']} tokens, the "
                             f"stream carried {n_tokens}")
            return False
        if not self._tokens_ok(phase, kind, body, finish, n_tokens):
            return False
        self.rec.latency[f"{phase}/stream"].append(time.monotonic() - t0)
        if first is not None:
            self.rec.ttft[phase].append(first)
        self.rec.tokens[phase] += n_tokens
        self.rec.count(phase, kind, "ok")
        return True

    # ---- bad requests -----------------------------------------------------------------------------------------

    async def bad(self, phase: str, case) -> None:
        name, method, path, body, expected = case
        kind = "bad"
        headers = {"Content-Type": "application/json"}
        if isinstance(body, dict) and "stream" not in body and self.rng.random() < 0.5:
            body = {**body, "stream": True}  # the same refusal when the client asked for a stream
        if body == "oversized":
            content = b'{"prompt": "' + b"x" * self.srv.max_body_bytes + b'"}'
        elif body == "oversized-chunked":
            async def chunks():
                for _ in range(self.srv.max_body_bytes // 65536 + 2):
                    yield b"x" * 65536
            content = chunks()
        elif isinstance(body, dict):
            content = json.dumps(body).encode()
        else:
            content = body
        try:
            async with asyncio.timeout(self.args.request_timeout_s):
                r = await self.client.request(method, path, content=content, headers=headers)
        except TimeoutError:
            self.rec.problem(phase, kind, "hung", f"{name}: no answer within {self.args.request_timeout_s} s")
            return
        except httpx.TimeoutException as e:
            self.rec.problem(phase, kind, "hung", f"{name}: {type(e).__name__}")
            return
        except httpx.HTTPError as e:
            self.rec.problem(phase, kind, "lost", f"{name}: {type(e).__name__}: {e}")
            return
        self.rec.rejects[name][r.status_code] += 1
        self.rec.reject_status[r.status_code] += 1
        code, message = error_of(r)
        if r.status_code >= 500:
            self.rec.problem(phase, kind, "5xx", f"{name}: {r.status_code}: {message}")
        elif r.status_code != expected or code != expected or not message.strip():
            self.rec.problem(phase, kind, "unexpected", f"{name}: expected {expected}, got {r.status_code}: "
                             f"{message[:200]}")
        else:
            self.rec.count(phase, kind, "refused-as-expected")

    async def slow(self, phase: str) -> None:
        """A client that sends half a request and stalls: the server must answer 408 and close."""
        slow_body = self.rng.random() < 0.5
        name, wait = ("slow-body", self.srv.body_timeout_s) if slow_body else ("slow-headers",
                                                                                self.srv.header_timeout_s)
        host, port = httpx.URL(self.url).host, httpx.URL(self.url).port
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        payload = head + b"Content-Length: 200\r\n\r\n" + b'{"model": "tiny' if slow_body else head
        got = b""
        writer = None
        try:
            async with asyncio.timeout(wait + 30):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(payload)
                await writer.drain()
                while chunk := await reader.read(65536):
                    got += chunk
        except TimeoutError:
            self.rec.problem(phase, "slow", "hung", f"{name}: not answered or closed within {wait + 30:.0f} s")
            return
        except OSError as e:
            if not got:
                self.rec.problem(phase, "slow", "lost", f"{name}: {type(e).__name__}: {e}")
                return
        finally:
            if writer is not None:
                writer.close()
        status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else None
        self.rec.rejects[name][status] += 1
        self.rec.reject_status[status] += 1
        if status != 408:
            self.rec.problem(phase, "slow", "5xx" if (status or 0) >= 500 else "unexpected",
                             f"{name}: expected 408, got {got[:200]!r}")
        else:
            self.rec.count(phase, "slow", "refused-as-expected")

    # ---- cancelled requests ----------------------------------------------------------------------------------

    async def cancel(self, phase: str, path: str, body: dict) -> None:
        """Disconnect mid-stream after 0-3 events, or while waiting for a whole answer (a third of them within 20 ms,
        often before the server has read the body)."""
        kind = "cancel"
        body = {**body, "max_tokens": self.args.output_range[1], "ignore_eos": True}
        try:
            async with asyncio.timeout(self.args.request_timeout_s):
                if body.get("stream"):
                    after = int(self.rng.integers(0, 4))
                    async with self.client.stream("POST", path, json=body) as r:
                        if r.status_code != 200:
                            await r.aread()
                            self._status_ok(phase, kind, r)
                            return
                        if after == 0:
                            self.rec.count(phase, kind, "cancelled-at-headers")
                            return  # leaving the block closes the connection before the first event
                        seen = 0
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                seen += 1
                                if line == "data: [DONE]":
                                    self.rec.count(phase, kind, "finished-first")
                                    return
                                if seen >= after:
                                    break  # leaving the block closes the connection mid-stream
                        else:
                            self.rec.problem(phase, kind, "lost", "stream ended without [DONE]")
                            return
                    self.rec.count(phase, kind, "cancelled-mid-stream")
                    return
                wait = float(self.rng.uniform(0.001, 0.02) if self.rng.random() < 1 / 3 else
                             self.rng.uniform(0.02, 0.3))
                try:
                    async with asyncio.timeout(wait):
                        r = await self.client.post(path, json=body)
                except TimeoutError:
                    self.rec.count(phase, kind, "cancelled-waiting")
                    return
                if self._status_ok(phase, kind, r):
                    self.rec.count(phase, kind, "finished-first")
        except TimeoutError:
            self.rec.problem(phase, kind, "hung", f"no answer within {self.args.request_timeout_s} s")
        except httpx.TimeoutException as e:
            self.rec.problem(phase, kind, "hung", f"{type(e).__name__}")
        except (httpx.HTTPError, ValueError) as e:
            self.rec.problem(phase, kind, "lost", f"{type(e).__name__}: {e}")

    # ---- probes ----------------------------------------------------------------------------------------------

    def probe_specs(self) -> list[tuple[str, dict]]:
        common = {"max_tokens": self.args.probe_tokens, "temperature": 0, "ignore_eos": True,
                  "return_token_ids": True}
        mid = self.adapters[len(self.adapters) // 2]
        return [
            ("/v1/completions", {**common, "model": self.base, "prompt": PROBE_PROMPT}),
            ("/v1/completions", {**common, "model": self.adapters[0], "prompt": list(range(5, 21))}),
            ("/v1/chat/completions", {**common, "model": mid, "messages": [
                {"role": "user", "content": "Tell me about soak tests."}]}),
            ("/v1/completions", {**common, "model": self.adapters[-1], "prompt": PROBE_PROMPT, "stream": True}),
        ]

    async def greedy(self, path: str, body: dict) -> list[int] | str:
        """The greedy tokens of one request, or why there are none."""
        try:
            async with asyncio.timeout(self.args.request_timeout_s):
                if body.get("stream"):
                    ids = []
                    async with self.client.stream("POST", path, json=body) as r:
                        if r.status_code != 200:
                            return f"status {r.status_code}: {(await r.aread())[:200]!r}"
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                event = json.loads(line[6:])
                                if "error" in event:
                                    return f"error event {event['error']}"
                                ids += (event["choices"][0] if event["choices"] else {}).get("token_ids") or []
                    return ids
                r = await self.client.post(path, json=body)
                if r.status_code != 200:
                    return f"status {r.status_code}: {r.text[:200]}"
                return r.json()["choices"][0]["token_ids"]
        except (TimeoutError, httpx.HTTPError, ValueError, KeyError) as e:
            return f"{type(e).__name__}: {e}"

    async def probe(self, label: str) -> dict:
        t = round(time.monotonic() - self.rec.t0, 1)
        outs = await asyncio.gather(*(self.greedy(p, b) for p, b in self.probe_specs()))
        return {"label": label, "t": t, "in_flight": self.in_flight, "tokens": outs}

    # ---- metrics ---------------------------------------------------------------------------------------------

    async def metrics(self) -> dict[str, float] | None:
        try:
            r = await self.client.get("/metrics", timeout=30)
        except httpx.HTTPError:
            return None
        out = {}
        for line in r.text.splitlines():
            m = re.match(r"^(\w+)(\{[^}]*\})?\s+(\S+)$", line)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out


def metric_summary(m: dict[str, float] | None) -> dict:
    """The figures of one /metrics scrape the soak checks."""
    if m is None:
        return {"error": "no /metrics"}

    def get(key, default=None):
        return m.get(key, default)

    statuses, by_endpoint = collections.Counter(), collections.defaultdict(dict)
    for key, v in m.items():
        found = re.match(r'slora_requests_total\{endpoint="([^"]*)",status="(\d+)"\}', key)
        if found:
            statuses[found.group(2)] += int(v)
            by_endpoint[found.group(1)][found.group(2)] = int(v)
    return {
        "pages_kv": get('slora_pool_pages{kind="kv"}'), "pages_adapter": get('slora_pool_pages{kind="adapter"}'),
        "pages_free": get('slora_pool_pages{kind="free"}'), "host_bytes": get('slora_adapter_store{stat="host_bytes"}'),
        "adapters_host": get('slora_adapters{tier="host"}'), "adapters_pool": get('slora_adapters{tier="pool"}'),
        "adapters_registered": get('slora_adapters{tier="disk"}'), "running": get("slora_requests_running"),
        "waiting": get("slora_requests_waiting"), "compiles_since_warmup": get("slora_compiles_since_warmup"),
        "step_failures": get("slora_engine_step_failures"), "steps": get("slora_engine_steps"),
        "http_status": dict(sorted(statuses.items())), "http_status_by_endpoint": dict(sorted(by_endpoint.items())),
        "finish": {k.split('"')[1]: int(v) for k, v in m.items() if k.startswith("slora_request_finish_total{")},
    }


# ---------------------------------------------------------------- phases


async def saturation(soak: Soak, seconds: float) -> dict:
    """Closed loop: ``--concurrency`` clients send valid requests back to back; served requests per second."""
    args, rec = soak.args, soak.rec
    trace = make_trace(len(soak.adapters), 1.0, 100_000, alpha=args.alpha, in_range=args.prompt_range,
                       out_range=args.output_range, seed=args.seed + 7)
    it = iter(trace)
    served = 0
    t0 = time.monotonic()
    end = t0 + seconds

    async def worker():
        nonlocal served
        while time.monotonic() < end:
            req = next(it)
            path, body = soak.valid_body(soak.adapters[req.adapter], req.prompt_len, req.output_len)
            if await soak.valid("saturation", "valid", path, body):
                served += 1

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.monotonic() - t0
    lat = rec.latency["saturation/whole"] + rec.latency["saturation/stream"]
    return {"served": served, "elapsed_s": round(elapsed, 2), "rate_req_s": served / elapsed,
            "tokens_s": rec.tokens["saturation"] / elapsed, "latency_p50_s": pct(lat, 50),
            "concurrency": args.concurrency}


async def churn_loop(soak: Soak, good: dict[str, str], bad: list[tuple[str, int]], end: float, outcomes: dict,
                     greedy_by_copy: dict) -> None:
    """Load a copy under a name, use it (its greedy tokens must be its original's: same weights), unload it, check
    it is gone; between cycles, one bad adapter action. ``good``: copy dir -> the served adapter it copies."""
    rec, phase = soak.rec, "soak"
    copies = list(good)
    actions = [("load", name, name, status) for name, status in bad] + [
        ("load", "churn-dotdot", "../outside/good-outside", 403), ("load", "churn-etc", "/etc", 403),
        ("load", "churn-nul-path", "a\x00b", 400), ("load", "churn-long-path", "x" * 5000, 400),
        ("load", "churn-missing-dir", "no-such-dir-here", 400),
        ("load", "a\tb", copies[0], 400), ("load", soak.base, copies[0], 400), ("load", "\ud800", copies[0], 400),
        ("load", "", copies[0], 400), ("load", soak.adapters[0], copies[0], 400),  # taken name
        ("unload", "no-such-adapter-soak", None, 404), ("unload", soak.base, None, 400), ("unload", 5, None, 400),
    ]
    body = {"max_tokens": soak.args.probe_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "prompt": PROBE_PROMPT}

    async def admin(path: str, payload: dict, expected: int, case: str) -> int | None:
        try:
            async with asyncio.timeout(soak.args.request_timeout_s):
                r = await soak.client.post(path, content=json.dumps(payload).encode(),
                                           headers={"Content-Type": "application/json"})
        except (TimeoutError, httpx.TimeoutException):
            rec.problem(phase, "churn", "hung", f"{case}: {path} {str(payload)[:200]}")
            return None
        except httpx.HTTPError as e:
            rec.problem(phase, "churn", "lost", f"{case}: {type(e).__name__}: {e}")
            return None
        outcomes[case][r.status_code] += 1
        if r.status_code != 200:
            rec.rejects[case][r.status_code] += 1
            rec.reject_status[r.status_code] += 1
        if r.status_code >= 500:
            rec.problem(phase, "churn", "5xx", f"{case}: {r.status_code} {error_of(r)[1]}")
        elif r.status_code != expected:
            rec.problem(phase, "churn", "unexpected", f"{case}: expected {expected}, got {r.status_code}: "
                        f"{error_of(r)[1][:300]}")
        else:
            rec.count(phase, "churn", f"{'ok' if expected == 200 else 'refused-as-expected'}")
        return r.status_code

    originals = {copy: await soak.greedy("/v1/completions", {**body, "model": orig}) for copy, orig in good.items()
                 if orig in soak.adapters}
    cycle = 0
    while time.monotonic() < end and cycle < 100_000:
        copy = copies[cycle % len(copies)]
        name = f"soak-churn-{cycle % 3}"
        if await admin("/v1/load_lora_adapter", {"lora_name": name, "lora_path": copy}, 200, "load-good") == 200:
            tokens = await soak.greedy("/v1/completions", {**body, "model": name})
            if isinstance(tokens, str):
                rec.problem(phase, "churn", "5xx" if "status 5" in tokens else "unexpected",
                            f"request to freshly loaded {name} ({copy}): {tokens}")
            else:
                greedy_by_copy.setdefault(copy, collections.Counter())[tuple(tokens)] += 1
                rec.count(phase, "churn", "used")
                if copy in originals and tokens != originals[copy]:
                    rec.problem(phase, "churn", "unexpected", f"{name} (a copy of {good[copy]}) gave {tokens}, the "
                                f"original {originals[copy]}")
            for _ in range(20):  # 409 while a request still pins it: retry a few times
                status = await admin("/v1/unload_lora_adapter", {"lora_name": name}, 200, "unload-good")
                if status != 409:
                    break
                await asyncio.sleep(0.5)
            gone = await soak.greedy("/v1/completions", {**body, "model": name})
            if not (isinstance(gone, str) and gone.startswith("status 404")):
                rec.problem(phase, "churn", "unexpected", f"{name} after its unload: {gone}")
        verb, lname, lpath, expected = actions[cycle % len(actions)]
        if verb == "load":
            await admin("/v1/load_lora_adapter", {"lora_name": lname, "lora_path": lpath}, expected,
                        f"load-{lname if lname.startswith(('bad-', 'churn-')) else repr(lname)[:40]}")
        else:
            await admin("/v1/unload_lora_adapter", {"lora_name": lname}, expected, f"unload-{str(lname)[:40]}")
        cycle += 1
        await asyncio.sleep(soak.args.churn_every_s)
    outcomes["cycles"] = cycle


async def soak_phase(soak: Soak, rate: float, proc: ServerProcess | None, good, bad, first_probe) -> dict:
    """Open-loop arrivals for ``--duration-s`` with churn, probes and sampling alongside."""
    args, rec = soak.args, soak.rec
    total_rate = rate * sum(MIX.values()) / MIX["valid"]
    n = int(total_rate * args.duration_s) + 1
    trace = make_trace(len(soak.adapters), total_rate, n, alpha=args.alpha, cv=args.cv, in_range=args.prompt_range,
                       out_range=args.output_range, seed=args.seed)
    kinds = list(MIX)
    weights = np.array([MIX[k] for k in kinds], float)
    kind_of = np.random.default_rng(args.seed + 2).choice(kinds, size=n, p=weights / weights.sum())
    t0 = time.monotonic()
    end = t0 + args.duration_s
    samples, probes = [], []
    churn_outcomes = collections.defaultdict(collections.Counter)
    greedy_by_copy: dict = {}
    sent = collections.Counter()
    tasks: set[asyncio.Task] = set()

    async def run_one(kind: str, req) -> None:
        try:
            soak.in_flight += 1
            model = soak.adapters[req.adapter] if soak.rng.random() > 0.05 else soak.base
            path, body = soak.valid_body(model, req.prompt_len, req.output_len)
            if kind == "valid":
                await soak.valid("soak", "valid", path, body)
            elif kind == "cancel":
                await soak.cancel("soak", path, body)
            elif kind == "slow":
                async with soak.slow_sem:
                    await soak.slow("soak")
            else:
                case = soak.cases[soak.case_i % len(soak.cases)]
                soak.case_i += 1
                await soak.bad("soak", case)
        finally:
            soak.in_flight -= 1
            soak.sem.release()

    async def dispatch():
        for req, kind in zip(trace, kind_of, strict=True):
            at = t0 + req.arrival
            if at >= end:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if kind == "slow" and soak.slow_sem.locked():
                kind = "bad"
            if soak.sem.locked():
                rec.skipped[kind] += 1
                continue
            await soak.sem.acquire()
            sent[kind] += 1
            task = asyncio.create_task(run_one(kind, req))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def sample():
        while time.monotonic() < end:
            m = metric_summary(await soak.metrics())
            samples.append({"t": round(time.monotonic() - t0, 1), "rss_mb": proc.rss_mb() if proc else None,
                            "in_flight": soak.in_flight, **{k: m.get(k) for k in (
                                "pages_kv", "pages_adapter", "host_bytes", "running", "waiting")}})
            if proc is not None and not proc.alive():
                rec.problem("soak", "server", "lost", f"the server exited with {proc.proc.returncode}")
                return
            await asyncio.sleep(min(args.sample_every_s, max(0.0, end - time.monotonic())))

    async def probe_loop():
        next_at = t0 + args.probe_every_s
        while next_at < end - 1:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            probes.append(await soak.probe(f"t+{next_at - t0:.0f}s"))
            ok = sum(v["ok"] for k, v in rec.outcomes.items() if k.startswith("soak/"))
            print(f"  t+{next_at - t0:4.0f} s: {sum(sent.values())} sent, {ok} served, {dict(rec.problem_counts)} "
                  f"problems, rss {proc.rss_mb() if proc else '-'} MB, probe equal to start: "
                  f"{probes[-1]['tokens'] == first_probe}", flush=True)
            next_at += args.probe_every_s

    await asyncio.gather(dispatch(), sample(), probe_loop(),
                         churn_loop(soak, good, bad, end, churn_outcomes, greedy_by_copy))
    if tasks:  # requests still running at the end: each has its own deadline, so this ends
        await asyncio.wait(set(tasks), timeout=args.request_timeout_s + 60)
    return {"rate_valid_req_s": rate, "rate_total_req_s": total_rate, "arrivals": n, "sent": dict(sent),
            "skipped_all_clients_busy": dict(rec.skipped), "elapsed_s": round(time.monotonic() - t0, 1),
            "samples": samples, "probes": probes,
            "churn": {"cycles": churn_outcomes.pop("cycles", 0),
                      "outcomes": {k: dict(v) for k, v in churn_outcomes.items()},
                      "greedy_outputs_per_copy": {k: len(v) for k, v in greedy_by_copy.items()}}}


async def wait_idle(soak: Soak, start: dict, timeout_s: float = 120.0) -> tuple[dict, float]:
    """Poll /metrics until nothing runs or waits and KV pages are back at their start (or the timeout)."""
    t0 = time.monotonic()
    m = {}
    while time.monotonic() - t0 < timeout_s:
        m = metric_summary(await soak.metrics())
        if m.get("running") == 0 and m.get("waiting") == 0 and m.get("pages_kv") == start.get("pages_kv"):
            break
        await asyncio.sleep(1.0)
    return m, time.monotonic() - t0


async def shutdown_phase(soak: Soak, proc: ServerProcess, grace_s: float) -> dict:
    """Open requests, SIGTERM, and what each open request and a new one get; how long the exit takes."""
    args = soak.args
    outcomes = collections.Counter()
    started = [asyncio.Event() for _ in range(args.shutdown_requests)]
    base_body = {"model": soak.adapters[0], "prompt": PROBE_PROMPT, "ignore_eos": True, "temperature": 0}
    long = max(args.output_range[1], soak.max_len - 64)
    short = min(long, 4 * args.output_range[1])

    async def open_request(i: int) -> str:
        """Even: a stream; odd: a whole answer. Half of each as long as the context allows: on a slow device they
        outlast the grace period and must end with an error, the others finish."""
        stream = i % 2 == 0
        body = {**base_body, "max_tokens": long if i % 4 >= 2 else short}
        try:
            async with asyncio.timeout(grace_s + FLUSH_S + 60):
                if not stream:
                    task = asyncio.ensure_future(soak.client.post("/v1/completions", json=body))
                    await asyncio.sleep(0.1)
                    started[i].set()
                    r = await task
                    if r.status_code == 200:
                        return "whole-completed"
                    code, message = error_of(r)
                    return "whole-503" if r.status_code == 503 else f"whole-status-{r.status_code}: {message[:100]}"
                async with soak.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    if r.status_code != 200:
                        return f"stream-status-{r.status_code}"
                    error, done = None, False
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            started[i].set()
                            event = json.loads(line[6:])
                            error = event.get("error") or error
                    if done:
                        return "stream-completed" if error is None else f"stream-error-{error.get('code')}"
                    return "stream-cut"
        except (TimeoutError, httpx.TimeoutException):
            return "hung"
        except httpx.HTTPError as e:
            return f"lost-{type(e).__name__}"
        finally:
            started[i].set()

    tasks = [asyncio.ensure_future(open_request(i)) for i in range(args.shutdown_requests)]
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(60):
            await asyncio.gather(*(e.wait() for e in started))
    in_flight = sum(not t.done() for t in tasks)
    t_signal = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.3)
    try:  # a new request while draining: 503, or refused once the server is gone
        async with httpx.AsyncClient(base_url=soak.url, headers=soak.headers, timeout=10) as fresh:
            new_status = (await fresh.post("/v1/completions", json={**base_body, "max_tokens": 2})).status_code
    except httpx.HTTPError as e:
        new_status = f"closed ({type(e).__name__})"
    for outcome in await asyncio.gather(*tasks):
        outcomes[outcome] += 1
    exit_code = None
    deadline = t_signal + grace_s + FLUSH_S + 60
    while time.monotonic() < deadline and exit_code is None:
        exit_code = proc.proc.poll()
        await asyncio.sleep(0.1)
    exit_s = time.monotonic() - t_signal
    bound = grace_s + FLUSH_S + 10
    clean = {"stream-completed", "whole-completed", "stream-error-503", "whole-503"}
    return {"open_at_signal": in_flight, "outcomes": dict(outcomes), "new_request_status": new_status,
            "exit_code": exit_code, "exit_s": round(exit_s, 2), "grace_s": grace_s, "exit_bound_s": bound,
            "ok": exit_code == 0 and exit_s <= bound and set(outcomes) <= clean and (
                new_status == 503 or str(new_status).startswith("closed"))}


# ---------------------------------------------------------------- main


def checks_of(report: dict, rec: Record, args) -> dict:
    start, end = report["metrics_start"], report["metrics_end"]
    before_shutdown = ("saturation", "soak", "probe")
    probes = report["probes"]
    first = probes[0]["tokens"] if probes else None
    rss = report["rss"]
    churn = report["soak"].get("churn", {})
    host_end = end.get("host_bytes")
    checks = {
        "zero_5xx_seen_by_clients": rec.n_problems("5xx", before_shutdown) == 0,
        "zero_5xx_counted_by_server": not any(int(s) >= 500 for s in end.get("http_status", {})),
        "zero_lost": rec.n_problems("lost") == 0,
        "zero_hung": rec.n_problems("hung") == 0,
        "refusals_as_expected": rec.n_problems("unexpected") == 0,
        "probes_unchanged": bool(probes) and all(not isinstance(t, str) for t in first) and all(
            p["tokens"] == first for p in probes),
        "kv_pages_back_to_start": end.get("pages_kv") is not None and end.get("pages_kv") == start.get("pages_kv"),
        "host_adapter_bytes_bounded": host_end is not None and host_end <= report["host_bytes_bound"],
        "rss_growth_within_bound": rss["growth_less_host_mb"] is not None and
        rss["growth_less_host_mb"] <= args.rss_growth_mb,
        "no_compiles_after_warmup": end.get("compiles_since_warmup") == start.get("compiles_since_warmup"),
        "churn_greedy_stable": all(n == 1 for n in churn.get("greedy_outputs_per_copy", {}).values()),
        "shutdown_clean": report["shutdown"].get("ok", False),
        "server_log_clean": not report["server_log_problems"],
    }
    return checks


def summarize_rss(samples: list[dict], duration_s: float, idle_start: float | None, idle_end: float | None) -> dict:
    """RSS growth under load: the median of the soak's last minute less that of its first (single samples swing by
    tens of MB as batches come and go), less the growth of host adapter bytes over the same windows."""
    window = min(60.0, duration_s / 4)
    first = [s for s in samples if s["t"] <= window and s.get("rss_mb") is not None]
    last = [s for s in samples if s["t"] >= duration_s - window and s.get("rss_mb") is not None]
    if not first or not last:
        return {"growth_less_host_mb": None, "idle_start_mb": idle_start, "idle_end_mb": idle_end}

    def median(rows, key):
        return float(np.median([r[key] or 0 for r in rows]))

    growth = median(last, "rss_mb") - median(first, "rss_mb")
    host_growth = (median(last, "host_bytes") - median(first, "host_bytes")) / 2**20
    series = [(s["t"], s["rss_mb"]) for s in samples if s.get("rss_mb") is not None]
    half = np.array(series[len(series) // 2:])
    slope = float(np.polyfit(half[:, 0] / 60, half[:, 1], 1)[0]) if len(half) >= 4 else None
    return {"window_s": window, "first_window_mb": median(first, "rss_mb"), "last_window_mb": median(last, "rss_mb"),
            "growth_mb": growth, "host_bytes_growth_mb": host_growth,
            "growth_less_host_mb": growth - max(0.0, host_growth), "peak_mb": max(r for _, r in series),
            "second_half_slope_mb_per_min": slope, "idle_start_mb": idle_start, "idle_end_mb": idle_end}


async def run(args, server_args, srv) -> int:
    record = Record()
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "git_commit": git_commit(),
              "python": sys.version.split()[0]}
    report |= device_info()
    work = Path(tempfile.mkdtemp(prefix="slora-soak-"))
    allowed, outside = work / "allowed", work / "outside"
    allowed.mkdir()
    outside.mkdir()
    log_path = args.server_log or work / "server.log"
    print(f"device {report.get('device')}  jax {report.get('jax')}  commit {report['git_commit'][:12]}", flush=True)
    t_start = time.monotonic()
    proc = ServerProcess(server_args, allowed, log_path, args.startup_timeout_s)
    report["startup_s"] = round(time.monotonic() - t_start, 1)
    soak = None
    try:
        sources = adapter_sources(args, srv)
        good, bad = prepare_adapters(sources, allowed, outside)
        async with httpx.AsyncClient(base_url=proc.url, timeout=30,
                                     headers={"Authorization": f"Bearer {srv.api_key}"} if srv.api_key else {}) as c:
            listed = (await c.get("/v1/models")).json()["data"]
        base = next(m["id"] for m in listed if m["parent"] is None)
        adapters = [m["id"] for m in listed if m["parent"] is not None]
        max_len = listed[0]["max_model_len"]
        soak = Soak(args, srv, proc.url, record, adapters, base, max_len)
        print(f"server ready in {report['startup_s']} s at {proc.url}: {len(adapters)} adapters, base {base!r}, "
              f"max_model_len {max_len}", flush=True)
        report["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()} | {
            "server_args": server_args, "mix": MIX, "max_slow_clients": MAX_SLOW, "adapters_served": len(adapters),
            "base_model": base, "max_model_len": max_len, "churn_copies": good, "bad_adapter_dirs": dict(bad),
            "bad_request_cases": len(soak.cases)}
        report["metrics_start"] = metric_summary(await soak.metrics())
        probes = [await soak.probe("start")]

        print(f"saturation: {args.saturation_s:.0f} s closed loop, {args.concurrency} clients", flush=True)
        report["saturation"] = await saturation(soak, args.saturation_s)
        rate = args.rate or args.rate_x * report["saturation"]["rate_req_s"]
        print(f"saturation {report['saturation']['rate_req_s']:.2f} req/s; soak at {rate:.2f} valid req/s for "
              f"{args.duration_s:.0f} s", flush=True)
        await wait_idle(soak, report["metrics_start"])
        rss_start = proc.rss_mb()
        report["soak"] = await soak_phase(soak, rate, proc, good, bad, probes[0]["tokens"])
        probes += report["soak"].pop("probes")
        print("soak over: waiting for the server to go idle", flush=True)
        # the churn loop unloads what it loads; a name left loaded by a failed unload goes now
        for i in range(3):
            with contextlib.suppress(httpx.HTTPError):
                await soak.client.post("/v1/unload_lora_adapter", json={"lora_name": f"soak-churn-{i}"})
        report["metrics_end"], idle_s = await wait_idle(soak, report["metrics_start"])
        report["idle_wait_s"] = round(idle_s, 1)
        probes.append(await soak.probe("end"))
        report["probes"] = probes
        report["rss"] = summarize_rss(report["soak"]["samples"], args.duration_s, rss_start, proc.rss_mb())
        served_dirs = [p for root in srv.adapter_dir for p in Path(root).expanduser().iterdir()] + sources
        report["host_bytes_bound"] = 2 * weight_bytes(list(dict.fromkeys(served_dirs)))  # a float32 copy of bf16
        report["shutdown"] = await shutdown_phase(soak, proc, srv.shutdown_grace_s)
    except Exception as e:
        record.problem("harness", "soak", "lost", f"the soak stopped: {type(e).__name__}: {e}")
        report.setdefault("shutdown", {"ok": False})
        raise
    finally:
        if soak is not None:
            await soak.close()
        proc.close()
        report["server_log_problems"] = proc.log_problems()[:50]
        report["requests"] = {k: dict(v) for k, v in sorted(record.outcomes.items())}
        report["rejects_by_case"] = {k: {str(s): n for s, n in v.items()} for k, v in sorted(record.rejects.items())}
        report["rejects_by_status"] = {str(k): v for k, v in sorted(record.reject_status.items(), key=str)}
        report["problem_counts"] = dict(record.problem_counts)
        report["problems"] = record.problems
        for phase in ("saturation", "soak"):
            lat = record.latency[f"{phase}/whole"] + record.latency[f"{phase}/stream"]
            report.setdefault("latency", {})[phase] = {
                "n": len(lat), "p50_s": pct(lat, 50), "p99_s": pct(lat, 99),
                "ttft_n": len(record.ttft[phase]), "ttft_p50_s": pct(record.ttft[phase], 50),
                "ttft_p99_s": pct(record.ttft[phase], 99), "completion_tokens": record.tokens[phase]}
        if "metrics_end" in report and "rss" in report:
            report["checks"] = checks_of(report, record, args)
        else:
            report["checks"] = {"completed": False}
        report["passed"] = all(report["checks"].values())
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1, default=str)
        print_table(report)
        shutil.rmtree(work, ignore_errors=True)
    return 0 if report["passed"] else 1


def print_table(report: dict) -> None:
    print()
    for key in ("requests", "rejects_by_status"):
        print(f"{key}:")
        for k, v in report.get(key, {}).items():
            print(f"  {k:24s} {v}")
    for phase, lat in report.get("latency", {}).items():
        fmt = (lambda x: f"{x:.3f}" if x is not None else "-")
        print(f"latency {phase:10s} n={lat['n']:6d} p50 {fmt(lat['p50_s'])} s  p99 {fmt(lat['p99_s'])} s  "
              f"ttft p50 {fmt(lat['ttft_p50_s'])} s  p99 {fmt(lat['ttft_p99_s'])} s")
    if "rss" in report:
        r = report["rss"]
        if r["growth_less_host_mb"] is not None:
            print(f"server RSS under load {r['first_window_mb']:.0f} -> {r['last_window_mb']:.0f} MB (medians of the "
                  f"first and last {r['window_s']:.0f} s; peak {r['peak_mb']:.0f}), growth less host adapter bytes "
                  f"{r['growth_less_host_mb']:.1f} MB; idle {r['idle_start_mb']:.0f} -> {r['idle_end_mb']:.0f} MB")
    for key in ("metrics_start", "metrics_end"):
        m = report.get(key, {})
        print(f"{key}: kv pages {m.get('pages_kv')}, adapter pages {m.get('pages_adapter')}, host bytes "
              f"{m.get('host_bytes')}")
    if report.get("shutdown"):
        print(f"shutdown: {report['shutdown']}")
    for p in report.get("problems", [])[:10]:
        print(f"  problem: {p}")
    print("checks:")
    for k, v in report.get("checks", {}).items():
        print(f"  {'ok  ' if v else 'FAIL'} {k}")
    print("PASSED" if report.get("passed") else "FAILED")


def main() -> None:
    args, server_args, srv = parse_args()
    try:
        code = asyncio.run(run(args, server_args, srv))
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
