"""The short tables the H200 calls print last (the run tool returns only the output's tail), and the suite's JSON.

    python3 benchmarks/h200/summary.py suite LOG OUT_JSON WALL_S RC [LEDGER_DIR]
        # the GPU suite's log -> counts, failures, slowest; with LEDGER_DIR (or $SLORA_TEST_COMPILE_LEDGER), the
        # compile ledger tests/compile_ledger.py wrote there -> where the tests' time went to JAX compiles
    python3 benchmarks/h200/summary.py http REPORT.json...             # the HTTP A/B, one row per report
    python3 benchmarks/h200/summary.py bench TABLE.json HOST.json      # decode LoRA table, host time of a step
    python3 benchmarks/h200/summary.py costs LOG "RUN" > tests/gpu_suite_costs.json
        # each test's seconds in a suite log (tests of 1 s or more): tests/xdist_order.py queues the GPU suite by them
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path

COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)\b")
FINAL = re.compile(r"^=*\s*(\d+ \w+.*) in ([\d.]+)s")
DURATION = re.compile(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)")
RESULT = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def by_file(durations: list[dict]) -> list[dict]:
    """Seconds per test file (setup, call and teardown of its tests summed; only what ``--durations`` listed),
    longest first: with ``--dist loadgroup`` most files run whole on one worker, so the longest bounds the wall."""
    files: dict[str, dict] = {}
    for d in durations:
        name = d["test"].split("::")[0]
        f = files.setdefault(name, {"file": name, "s": 0.0, "tests": set()})
        f["s"] += d["s"]
        f["tests"].add(d["test"].split("@")[0])
    out = [{"file": f["file"], "s": round(f["s"], 2), "tests": len(f["tests"])} for f in files.values()]
    return sorted(out, key=lambda f: -f["s"])


def read_durations(lines: list[str]) -> list[dict]:
    """``--durations`` lines of a pytest log: seconds, phase and test id (as xdist reports it), slowest first."""
    return [{"s": float(m.group(1)), "when": m.group(2), "test": m.group(3)}
            for line in lines if (m := DURATION.match(line.strip()))]


def plain_id(test: str) -> str:
    """A test's id without the "@group" suffix xdist's loadgroup puts in its reports (tests/conftest.py makes the
    group a test's file, a file it shares with others, or the test itself: tests/xdist_order.py); the ledger writes
    ids without it."""
    file = test.split("::")[0]
    if test.endswith("@" + file):
        return test[: -len(file) - 1]
    half = len(test) // 2
    if test[half:half + 1] == "@" and test[:half] == test[half + 1:]:
        return test[:half]
    return test


LEDGER_SUMS = ("compiles", "compile_s", "eager_n", "eager_s", "trace_n", "trace_s", "lower_n", "lower_s",
               "cache_hits", "busy_s", "wall_s", "cpu_s")
LEDGER_COUNTS = ("compiles", "eager_n", "trace_n", "lower_n", "cache_hits")


def worker_timeline(records: list[dict]) -> dict | None:
    """Seconds after the suite's start ($SUITE_START_EPOCH, else the first worker's start) at which the workers'
    processes started, their first tests began and their last tests ended, as [earliest, latest] over workers:
    the start-up and the tail that no test's duration shows."""
    per: dict[str, dict] = {}
    for r in records:
        w = per.setdefault(r.get("worker", "?"), {"spawn": None, "first": None, "last": None})
        if r.get("test") == "<worker start>":
            w["spawn"] = r.get("process_start") or r.get("configured")
        elif r.get("start") is not None:
            w["first"] = r["start"] if w["first"] is None else min(w["first"], r["start"])
            w["last"] = r["end"] if w["last"] is None else max(w["last"], r["end"])
    if any(name.startswith("gw") for name in per):  # xdist: the controller ("main") runs no test
        per.pop("main", None)
    spawns = [w["spawn"] for w in per.values() if w["spawn"]]
    env = os.environ.get("SUITE_START_EPOCH", "")
    zero = float(env) if env.replace(".", "", 1).isdigit() else (min(spawns) if spawns else None)
    if zero is None:
        return None

    def span(key: str) -> list | None:
        vals = [w[key] - zero for w in per.values() if w[key]]
        return [round(min(vals), 1), round(max(vals), 1)] if vals else None

    return {"workers": len(per), "from": "SUITE_START_EPOCH" if env else "first worker start",
            "spawned_s": span("spawn"), "first_test_s": span("first"), "last_end_s": span("last")}


def compile_ledger(ledger_dir: str, durations: list[dict], files: list[dict]) -> dict | None:
    """The compile ledger (a JSON line per test and pytest process, tests/compile_ledger.py) summed: the suite's compile
    seconds and count by phase, the 25 tests with the most compile seconds beside their ``--durations`` wall time,
    compile seconds of the longest files, and the functions that took the most. ``compile_s`` is the backend
    compile (XLA, Triton, ptxas) summed over threads; ``busy_s`` the wall time with at least one compile running;
    ``eager_*`` the compiles named after one jax.numpy / lax / nn / random function (an op called outside a jit)."""
    paths = sorted(Path(ledger_dir).glob("*.jsonl")) if Path(ledger_dir).is_dir() else []
    if not paths:
        return None
    records, bad = [], 0
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line cut when a worker was killed
                bad += 1
    timeline = worker_timeline(records)
    records = [r for r in records if r.get("test") != "<worker start>"]
    zero = {k: 0 if k in LEDGER_COUNTS else 0.0 for k in LEDGER_SUMS}
    phases: dict[str, dict] = {}
    tests: dict[str, dict] = {}
    fns: dict[str, list] = {}
    for r in records:
        test = plain_id(r.get("test", "?"))
        t = tests.setdefault(test, {"test": test, **zero, "by_phase": {}, "fns": {}})
        for when, v in (r.get("phases") or {}).items():
            ph = phases.setdefault(when, dict(zero))
            for k in LEDGER_SUMS:
                ph[k] += v.get(k) or 0
                t[k] += v.get(k) or 0
            t["by_phase"][when] = round(t["by_phase"].get(when, 0.0) + v.get("compile_s", 0), 2)
        for name, n, secs in r.get("fns", []):
            f = fns.setdefault(name, [0, 0.0, 0])
            f[0], f[1], f[2] = f[0] + n, f[1] + secs, f[2] + 1
            tf = t["fns"].setdefault(name, [0, 0.0])
            tf[0], tf[1] = tf[0] + n, tf[1] + secs
    walls: dict[str, dict] = {}
    for d in durations:
        w = walls.setdefault(plain_id(d["test"]), {})
        w[d["when"]] = w.get(d["when"], 0.0) + d["s"]

    def rounded(d: dict) -> dict:
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in d.items()}

    total = rounded({k: sum(ph[k] for w, ph in phases.items() if w != "outside") for k in LEDGER_SUMS})
    by_phase = {w: rounded({**ph, "durations_s": sum(d["s"] for d in durations if d["when"] == w)})
                for w, ph in phases.items()}
    top = []
    for t in sorted(tests.values(), key=lambda t: -t["compile_s"])[:25]:
        w = walls.get(t["test"], {})
        row = rounded({k: t[k] for k in ("test", "compile_s", "compiles", "eager_n", "eager_s", "trace_s", "lower_s",
                                         "busy_s", "cpu_s")})
        row["wall_s"] = round(sum(w.values()), 2) if w else round(t["wall_s"], 2)
        row["wall_from"] = "durations" if w else "ledger"
        row["durations"] = {k: round(v, 2) for k, v in w.items()}
        row["compile_s_by_phase"] = t["by_phase"]
        row["top_fns"] = [[name, n, round(secs, 2)] for name, (n, secs) in
                          sorted(t["fns"].items(), key=lambda kv: -kv[1][1])[:5]]
        top.append(row)
    per_file: dict[str, dict] = {}
    for t in tests.values():
        f = per_file.setdefault(t["test"].split("::")[0], dict(zero))
        for k in LEDGER_SUMS:
            f[k] += t[k]
    file_rows = [rounded({"file": f["file"], "s": f["s"], "tests": f["tests"],
                          **{k: per_file.get(f["file"], zero)[k] for k in ("compile_s", "compiles", "eager_s",
                                                                          "busy_s", "cpu_s")}}) for f in files[:20]]
    return {"ledger_dir": ledger_dir, "files": len(paths), "records": len(records), "bad_lines": bad,
            "tests": len(tests), "durations_s": round(sum(d["s"] for d in durations), 2), "total": total,
            "by_phase": by_phase, "top_tests": top, "by_file": file_rows, "timeline": timeline,
            "top_fns": [{"fn": name, "compiles": n, "s": round(secs, 2), "tests": nt}
                        for name, (n, secs, nt) in sorted(fns.items(), key=lambda kv: -kv[1][1])[:25]]}


def print_compile(c: dict | None, ledger_dir: str) -> None:
    """Eight lines at most: totals, phases, the four tests with the most compile seconds, files, functions."""
    if c is None:
        print(f"   compile ledger: nothing in {ledger_dir}")
        return
    t = c["total"]
    print(f"   compile: {t['compiles']:.0f} backend compiles {t['compile_s']:.0f} s (eager ops {t['eager_n']:.0f} / "
          f"{t['eager_s']:.0f} s), busy {t['busy_s']:.0f} s, trace {t['trace_s']:.0f} s, lower {t['lower_s']:.0f} s;"
          f" tests {c['durations_s']:.0f} s (cpu {t['cpu_s']:.0f} s), {c['tests']} tests, {c['files']} ledger files")
    print("   compile by phase (compile/busy/durations s): " + "  ".join(
        f"{w} {ph['compile_s']:.0f}/{ph['busy_s']:.0f}/{ph['durations_s']:.0f}" for w, ph in c["by_phase"].items()))
    for r in c["top_tests"][:4]:
        print(f"   compile {r['compile_s']:6.1f} s of {r['wall_s']:6.1f} s, {r['compiles']:4d} ({r['eager_n']:4d} "
              f"eager)  {r['test'][:120]}")
    print("   files compile/s: " + ", ".join(f"{f['file'].rsplit('/', 1)[-1]} {f['compile_s']:.0f}/{f['s']:.0f}"
                                             for f in c["by_file"][:7]))
    if tl := c.get("timeline"):
        print(f"   workers ({tl['workers']}, s after {tl['from']}): spawned {tl['spawned_s']}, first test "
              f"{tl['first_test_s']}, last test ended {tl['last_end_s']}")
    print("   fns: " + ", ".join(f"{f['fn'][:40]} {f['compiles']}x {f['s']:.0f} s" for f in c["top_fns"][:6]))


def jax_version() -> str | None:
    try:
        return importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        return None


def suite(log_path: str, out_path: str, wall_s: str, rc: str, ledger_dir: str | None = None) -> None:
    text = Path(log_path).read_text(errors="replace").splitlines()
    final = next((m for line in reversed(text) if (m := FINAL.match(line.strip()))), None)
    counts = {}
    if final:
        for n, what in COUNT.findall(final.group(1)):
            counts[what.rstrip("s") if what.startswith(("error", "warning")) else what] = int(n)
    else:  # cut before pytest's summary: count the verbose per-test lines seen so far
        for line in text:
            if line.startswith("[gw") and (m := RESULT.search(line)):
                key = m.group(1).lower()
                key = {"error": "error_partial"}.get(key, key + "_partial")
                counts[key] = counts.get(key, 0) + 1
    failures = sorted({line.split(" - ")[0] for line in text if line.startswith(("FAILED ", "ERROR "))})
    if not final:
        failures = sorted({m.group(0) for line in text if line.startswith("[gw") and RESULT.search(line)
                           and (m := re.search(r"(FAILED|ERROR) \S+", line))})
    durations = read_durations(text)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "what": "GPU suite (.ci/gpu-suite)",
              "git_commit": os.environ.get("SLORA_GIT_COMMIT", "unknown"), "workers": os.environ.get("WORKERS"),
              "exit_code": int(rc), "timed_out": int(rc) in (124, 137), "wall_s": float(wall_s),
              "pytest_s": float(final.group(2)) if final else None, "counts": counts, "failures": failures,
              "slowest": durations[:25], "by_file": by_file(durations)[:20], "device": os.environ.get("GPU_NAME", ""),
              "jax_version": jax_version(),
              "gpu_memory_peak_mib": int(os.environ["GPU_MEMORY_PEAK_MIB"]) if os.environ.get(
                  "GPU_MEMORY_PEAK_MIB", "").isdigit() else None}
    ledger_dir = ledger_dir or os.environ.get("SLORA_TEST_COMPILE_LEDGER")
    if ledger_dir:
        try:
            report["compile"] = compile_ledger(ledger_dir, durations, report["by_file"])
        except Exception as e:  # noqa: BLE001  (the suite's counts must still be written)
            report["compile"] = {"error": f"{type(e).__name__}: {e}"}
    Path(out_path).write_text(json.dumps(report, indent=1))
    print(f"\n== GPU suite  {report['date'][:19]}Z  commit {report['git_commit'][:12]}  workers {report['workers']}")
    print(f"   exit {rc}{' (TIMED OUT: counts are partial)' if report['timed_out'] else ''}  wall {float(wall_s):.0f} s"
          f"  pytest {report['pytest_s'] or float('nan'):.0f} s  GPU memory peak {report['gpu_memory_peak_mib']} MiB")
    print("   " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    for f in failures[:30]:
        print(f"   {f}")
    for d in durations[:10]:
        print(f"   {d['s']:7.1f} s  {d['when']:8s} {d['test']}")
    for f in report["by_file"][:8]:  # a file runs on one worker: the longest bounds the suite's wall time
        print(f"   {f['s']:7.1f} s  file     {f['file']} ({f['tests']} tests)")
    if ledger_dir:
        c = report["compile"]
        if c and "error" in c:
            print(f"   compile ledger: {c['error']}")
        else:
            try:
                print_compile(c, ledger_dir)
            except Exception as e:  # noqa: BLE001  (it is in the JSON; the table's last line must still come)
                print(f"   compile ledger: not printed ({type(e).__name__}: {e})")
    print(f"   -> {out_path}")


def costs(log_path: str, run: str) -> None:
    """Seconds per test (setup, call and teardown summed) of one GPU suite log, for the suite's queue order
    (tests/xdist_order.py). Tests under a second are summed per file instead (pytest does not list those under
    5 ms at all)."""
    per: dict[str, float] = {}
    for d in read_durations(Path(log_path).read_text(errors="replace").splitlines()):
        test = plain_id(d["test"])
        per[test] = per.get(test, 0.0) + d["s"]
    tests = {t: round(s, 1) for t, s in sorted(per.items()) if s >= 1.0}
    rest: dict[str, float] = {}  # per file: seconds of its tests under a second
    for t, s in sorted(per.items()):
        if s < 1.0:
            rest[t.split("::")[0]] = round(rest.get(t.split("::")[0], 0.0) + s, 3)
    print(json.dumps({"run": run, "seconds": tests, "rest": rest}, indent=0))


def cell(v, spec: str) -> str:
    """``v`` formatted, or a dash as wide as the column when the run did not measure it."""
    return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(int(re.match(r"\d+", spec).group()))


def http(paths: list[str]) -> None:
    print(f"\n== HTTP A/B  {'report':48s} {'ready':>6s} {'sat r/s':>8s} {'tok/s':>7s} {'ITLp50':>7s} {'step':>6s} "
          f"{'tok/st':>6s} {'disp':>5s} {'TTFT@x0.7':>10s} {'inproc':>7s} {'ratio':>6s} {'err':>4s}")
    sats, ref = [], None
    for p in paths:
        try:
            r = json.loads(Path(p).read_text())
        except (OSError, ValueError) as e:
            print(f"   {Path(p).name}: unreadable ({e})")
            continue
        http_runs = {x["as"]: x for x in r.get("http", [])}
        sat, low = http_runs.get("sat", {}), next((x for k, x in http_runs.items() if k.startswith("x")), {})
        srv = sat.get("server") or {}
        inproc = next((x for x in (r.get("in_process") or {}).get("results", []) if x.get("rate") == 1000.0), {})
        cmp_ = r.get("comparison", {})
        ttft_low = 1e3 * low["mean_first_token_s"] if low.get("mean_first_token_s") else None
        cells = [(r.get("server_startup_s"), "6.0f"), (sat.get("throughput_req_s"), "8.2f"),
                 (sat.get("throughput_tok_s"), "7.0f"), ((sat.get("itl_ms") or {}).get("p50"), "7.1f"),
                 (srv.get("step_ms_mean"), "6.1f"), (srv.get("tokens_per_step"), "6.0f"),
                 ((srv.get("host_ms_per_step") or {}).get("dispatch"), "5.1f"), (ttft_low, "10.1f"),
                 (inproc.get("throughput_req_s"), "7.2f"), (cmp_.get("http_over_in_process_sat"), "6.3f"),
                 (cmp_.get("http_errors"), "4d")]
        print(f"   {Path(p).name[:48]:48s} " + " ".join(cell(v, spec) for v, spec in cells))
        low_srv = low.get("server") or {}
        reads = ((low_srv.get("adapter_loads") or {}).get("host") or {})
        phases = low_srv.get("host_ms_per_step") or {}
        print(f"     x0.7: step {cell(low_srv.get('step_ms_mean'), '1.1f')} ms, schedule "
              f"{cell(phases.get('schedule'), '1.1f')}, dispatch {cell(phases.get('dispatch'), '1.1f')}, host reads "
              f"{cell(reads.get('n'), '1.0f')} ({cell(reads.get('ms_mean'), '1.0f')} ms), adapters in host "
              f"{low_srv.get('adapters_in_host', '-')}, ITL p99 {cell((low.get('itl_ms') or {}).get('p99'), '1.0f')}"
              f" ms; weights+pool {cell((r.get('server_phases') or {}).get('weights_and_pool_s'), '1.1f')} s, "
              f"in-process restart {cell((r.get('in_process') or {}).get('startup_s'), '1.1f')} s")
        kinds = srv.get("by_kind") or {}
        if kinds:  # at sat: did the device wait for the host (wait ~0) after prefill or decode steps?
            print("     sat by kind read back: " + ", ".join(
                f"{kind} {cell(k.get('steps'), '1.0f')} steps, wait {cell(k.get('wait_ms_mean'), '1.1f')} ms, "
                f"host-bound {cell(k.get('host_bound_share'), '1.2f')}" for kind, k in kinds.items()))
        sats.append((Path(p).name, sat.get("throughput_req_s")))
        ref = ref or ((Path(p).name, inproc["throughput_req_s"]) if inproc.get("throughput_req_s") else None)
        if r.get("server_error"):
            print(f"   server error: {r['server_error'][-300:]}")
    if ref:
        print(f"   HTTP sat over the in-process {ref[1]:.2f} req/s of {ref[0]}: "
              + ", ".join(f"{name} {v / ref[1]:.3f}" for name, v in sats if v))
    print("   (ready: server start s; step/disp: server mean step and dispatch ms per step at sat; TTFT in ms; "
          "ratio: HTTP sat / in-process of the same report; a run without in-process: divide by the other's)")


def load(path: str) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        print(f"   {Path(path).name}: not written")
        return None


def bench(table_path: str, host_path: str) -> None:
    print("\n== decode LoRA table (us per layer, all 7 projections; layer loop)")
    if (t := load(table_path)) is not None:
        print(f"   commit {t.get('git_commit', '?')[:12]}  copy {t.get('copy_bandwidth', {}).get('gbps', 0):.0f} GB/s")
        print(f"   {'batch':>5s} {'ranks':12s} {'v1':>7s} {'fused':>7s} {'floor':>7s} {'target':>6s} {'k v1/fu':>7s}")
        for r in t.get("decode_table", []):
            lay = r["layer"]
            print(f"   {r['rows']:5d} {str(r['ranks']):12s} {lay['v1']['us']:7.1f} {lay['auto']['us']:7.1f} "
                  f"{r['floor_us']:7.1f} {cell(r.get('target_us'), '6.0f')} "
                  f"{lay['v1'].get('kernels', 0):3.0f}/{lay['auto'].get('kernels', 0):<3.0f}")
    print("\n== host time of a decode step (ms, median; wall unless marked cpu)")
    if (h := load(host_path)) is not None:
        print(f"   commit {h.get('commit', '?')[:12]}  {h.get('device')}  model {h.get('model')}")
        print(f"   {'B':>4s} {'host':>6s} {'hostcpu':>7s} {'sched':>6s} {'items':>6s} {'build':>6s} {'disp':>6s} "
              f"{'build alone cpu':>15s}")
        for b, r in h.get("ms_median", {}).items():
            print(f"   {b:>4s} {r['host_wall']:6.2f} {r['host_cpu']:7.2f} {r['schedule_wall']:6.2f} "
                  f"{r['items_wall']:6.2f} {r['build_wall']:6.2f} {r['dispatch_wall']:6.2f} {r['build_alone']:15.3f}")


def main() -> None:
    if len(sys.argv) >= 6 and sys.argv[1] == "suite":
        suite(*sys.argv[2:7])
    elif len(sys.argv) == 4 and sys.argv[1] == "bench":
        bench(*sys.argv[2:4])
    elif len(sys.argv) == 4 and sys.argv[1] == "costs":
        costs(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 3 and sys.argv[1] == "http":
        http(sys.argv[2:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
