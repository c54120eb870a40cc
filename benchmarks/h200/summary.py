"""The short tables the H200 calls print last (the run tool returns only the output's tail), and the suite's JSON.

    python3 benchmarks/h200/summary.py suite LOG OUT_JSON WALL_S RC   # the GPU suite's log -> counts, failures, slowest
    python3 benchmarks/h200/summary.py http REPORT.json...             # the HTTP A/B, one row per report
    python3 benchmarks/h200/summary.py bench TABLE.json HOST.json      # decode LoRA table, host time of a step
"""

from __future__ import annotations

import datetime
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


def suite(log_path: str, out_path: str, wall_s: str, rc: str) -> None:
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
    durations = [{"s": float(m.group(1)), "when": m.group(2), "test": m.group(3)}
                 for line in text if (m := DURATION.match(line.strip()))]
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "what": "GPU suite (.ci/gpu-suite)",
              "git_commit": os.environ.get("SLORA_GIT_COMMIT", "unknown"), "workers": os.environ.get("WORKERS"),
              "exit_code": int(rc), "timed_out": int(rc) in (124, 137), "wall_s": float(wall_s),
              "pytest_s": float(final.group(2)) if final else None, "counts": counts, "failures": failures,
              "slowest": durations[:25], "by_file": by_file(durations)[:20], "device": os.environ.get("GPU_NAME", "")}
    Path(out_path).write_text(json.dumps(report, indent=1))
    print(f"\n== GPU suite  {report['date'][:19]}Z  commit {report['git_commit'][:12]}  workers {report['workers']}")
    print(f"   exit {rc}{' (TIMED OUT: counts are partial)' if report['timed_out'] else ''}  wall {float(wall_s):.0f} s"
          f"  pytest {report['pytest_s'] or float('nan'):.0f} s")
    print("   " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    for f in failures[:30]:
        print(f"   {f}")
    for d in durations[:10]:
        print(f"   {d['s']:7.1f} s  {d['when']:8s} {d['test']}")
    for f in report["by_file"][:8]:  # a file runs on one worker: the longest bounds the suite's wall time
        print(f"   {f['s']:7.1f} s  file     {f['file']} ({f['tests']} tests)")
    print(f"   -> {out_path}")


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
        suite(*sys.argv[2:6])
    elif len(sys.argv) == 4 and sys.argv[1] == "bench":
        bench(*sys.argv[2:4])
    elif len(sys.argv) >= 3 and sys.argv[1] == "http":
        http(sys.argv[2:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
