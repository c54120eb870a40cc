#!/usr/bin/env bash
# Call 3a / 3b of the H200 runbook (README.md beside this): the HTTP A/B of `--engine-process`, S1 n=2000 on the 7B
# model through `benchmarks/http_serving.py` (NOTES.md, "2026-12-01 (session 7): the engine in its own process").
#   bash benchmarks/h200/call_http.sh ep       # 3a: --engine-process; ~6 min on a machine where call 2 wrote the
#                                              #     model (server cold start ~130 s: JAX's cache is empty)
#   bash benchmarks/h200/call_http.sh thread   # 3b: the control, engine thread in the server; ~3 min (restart
#                                              #     from the cache ~37 s, no in-process run: 3a's is the reference)
#   bash benchmarks/h200/call_http.sh ep thread  # both in one call: ~9.5 min, only if the call may take 600 s
# Each mode: http_serving.py --preset llama-2-7b --n-adapters 2000 --distinct-adapters 20 --work-dir $WORK, our
# traces sat and x0.7 (RATES), then the in-process engine on the sat trace when no earlier report on this machine has
# it (INPROC=1 / INPROC=0 force it on / off); the model and adapters are written first if $WORK lacks them (~30 s:
# a fresh machine needs no separate prepare call), and the server's first start fills JAX's compilation cache
# (~/.cache/slora_jax) for the later ones. Budgets come from the time left in the call (CALL_LIMIT_S, 575 s).
# Run tool: timeout_s 600, carry [".whl"]. $OUT per mode: <date>_http_serving_h200_engine_{process,thread}.json,
# http_<mode>.log (the script's output), server_<mode>.log; in_process.log once. HTTP_ARGS: more flags (ours or the
# server's).
#   AIPERF=1 bash benchmarks/h200/call_http.sh ep   # + NVIDIA aiperf at saturation on the same server, after our
#       traces (issue 13: a third-party client within 10% of ours; one mode per call). Needs `wheels.sh --aiperf`
#       here (.whl/aiperf; installed there into a site of its own by setup.sh's setup_aiperf, ~10 s); prints aiperf
#       / ours and writes $OUT/aiperf_<mode>.log. ~+75 s: ~480 s of the 575 on a fresh machine with the in-process
#       run. aiperf starts only while the in-process reserve (130 s; 60 s without an in-process run) is left; the
#       in-process run then starts only with >= 100 s left, else it is skipped (JSON: "budget"): aiperf goes first.
#       aiperf not installable or not importing there: said, and the call goes on without it.
#       AIPERF_PYTHON=PATH: a Python that has aiperf (no install; e.g. a venv on a dev box).
#   ADAPTER_SET=S2 (or all7) bash benchmarks/h200/call_http.sh ep   # S-LoRA's S2 adapters (ranks 64,32,16,8) or
#       rank 8 on all 7 projections instead of S1 (written first: ~1-2 min more); the report's name ends _S2 / _all7
#   ADAPTER_SETS="S1 all7" bash benchmarks/h200/call_http.sh ep   # several sets one after the other in one call, on
#       one machine (issue 14's ratios); SET:N takes N adapters instead of N_ADAPTERS (S2:5 is S2 n=5; its report
#       ends _S2_n5). Each gets the time the ones before it left (a set that would start with < 120 s is skipped)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=benchmarks/h200/setup.sh
source benchmarks/h200/setup.sh || exit 1
WORK=${WORK:-/root/http-bench}
# A cache of its own (the server's, the engine process's and the in-process engine's steps): not whatever the test
# suite's servers left in ~/.cache/slora_jax: on CPU a step JAX loaded from its persistent cache, saved into the
# executable store, fails at its first run after the next load ("NOT_FOUND: Function ... not found"; README.md).
export SLORA_JAX_CACHE_DIR=${SLORA_JAX_CACHE_DIR:-$WORK/cache}
PRESET=${PRESET:-llama-2-7b}
mkdir -p "$WORK/reports"
[ $# -gt 0 ] || set -- ep
read -r -a extra <<<"${HTTP_ARGS:-}"
if [ -n "${H200_DRY:-}" ]; then extra+=(--tiny); fi
if [ -n "${AIPERF:-}" ]; then
    if [ -n "${AIPERF_PYTHON:-}" ]; then
        AIPERF_PY=$AIPERF_PYTHON
    elif ! setup_aiperf; then
        AIPERF_PY=""
        echo "== aiperf: not usable here; the call goes on without it"
    fi
    [ -n "$AIPERF_PY" ] && extra+=(--aiperf --aiperf-python "$AIPERF_PY")
fi

sets=${ADAPTER_SETS:-${ADAPTER_SET:-}}
for entry in ${sets:-S1}; do
    adapter_set=${entry%%:*}
    n_adapters=${N_ADAPTERS:-2000}
    [ "$entry" != "$adapter_set" ] && n_adapters=${entry#*:}
    suffix=""
    [ -n "$sets" ] && suffix=_$adapter_set
    [ "$n_adapters" != 2000 ] && [ -n "$sets" ] && suffix=${suffix}_n$n_adapters
    for mode in "$@"; do
        case "$mode" in
            ep) name=engine_process; flag=(--engine-process) ;;
            thread) name=engine_thread; flag=(--no-engine-process) ;;  # the command's default is the engine process
            *) echo "call_http.sh: mode '$mode' is neither ep nor thread" >&2; exit 2 ;;
        esac
        have_inproc=$(python3 -c "import glob, json, sys
print(''.join('y' for p in glob.glob(sys.argv[1] + '/reports/*.json') if json.load(open(p)).get('in_process', {}).get('results')))" "$WORK")
        case "${INPROC:-auto}" in
            1) inproc=sat ;;
            0) inproc="" ;;
            *) if [ -n "$have_inproc" ]; then inproc=""; else inproc=sat; fi ;;
        esac
        L=$(left)
        budget=$((L - 40)); reserve=0
        [ -n "$inproc" ] && reserve=130
        if [ "$budget" -lt 120 ]; then echo "== $mode: skipped, only $L s left in this call"; continue; fi
        report=$OUT/${DATE}_http_serving_h200_$name$suffix.json
        rm -f "$WORK/in_process.log" "$WORK/server.log"
        echo "== $mode $adapter_set n=$n_adapters: budget $budget s, reserve $reserve s, in-process '${inproc}', aiperf \
'$([ -n "${AIPERF_PY:-}" ] && echo sat)', $(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null || echo '?') in use"
        timeout -k 15 $((L - 15)) python3 benchmarks/http_serving.py --preset "$PRESET" --n-adapters "$n_adapters" \
            --distinct-adapters 20 --adapter-set "$adapter_set" --work-dir "$WORK" --rates "${RATES:-sat,x0.7}" --in-process-rates "$inproc" \
            --budget-s "$budget" --reserve-s "$reserve" --in-process-min-s 100 --out "$report" "${flag[@]}" "${extra[@]}" \
            >"$OUT/http_$mode$suffix.log" 2>&1
        rc=$?
        grep -E "^(device|server|http|openai|in-process|skip|aiperf)|Error|error:" "$OUT/http_$mode$suffix.log" | cut -c1-220 | tail -n 12
        if [ -n "${AIPERF_PY:-}" ] && [ -f "$report" ]; then  # issue 13: a client nobody here wrote, within 10% of ours
            python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
ours = next((r for r in d.get("http", []) if r.get("as") == "sat"), None)
ai = next((r for r in d.get("aiperf") or [] if r.get("as") == "sat"), None)
ip = next((r for r in d.get("in_process", {}).get("results", []) if r.get("rate") == 1000.0), None)
def f(r, k="throughput_req_s"):
    return f"{r[k]:.2f}" + (" (cut by the budget)" if r.get("cut_by_budget") else "") if r and r.get(k) is not None else "-"
tok = "throughput_tok_s"
ratio = ai["throughput_req_s"] / ours["throughput_req_s"] if ours and ai and ai.get("throughput_req_s") else None
line = (f"== {sys.argv[2]}: aiperf sat {f(ai)} req/s ({f(ai, tok)} tok/s), ours {f(ours)} ({f(ours, tok)}), "
        f"in-process {f(ip)}; aiperf / ours ")
if ratio:
    line += f"{ratio:.3f} (issue 13, within 10%: " + ("yes)" if abs(ratio - 1) <= 0.1 else "NO)")
elif ai:
    line += "-; aiperf: " + str(ai.get("error")) + " " + repr((ai.get("log_tail") or "")[-300:])
else:
    line += "-; aiperf did not run (budget?)"
print(line)' "$report" "$mode"
            # aiperf's own log, when one mode runs (two modes already write 7 files)
            [ $# -eq 1 ] && [ -f "$WORK/aiperf-sat/aiperf_stdout.log" ] && cp "$WORK/aiperf-sat/aiperf_stdout.log" "$OUT/aiperf_$mode$suffix.log"
        fi
        echo "== $mode: exit $rc$([ $rc -eq 124 ] && echo ' (cut by the limit)')"
        cp "$WORK/server.log" "$OUT/server_$mode$suffix.log" 2>/dev/null
        [ -f "$WORK/in_process.log" ] && cp "$WORK/in_process.log" "$OUT/in_process.log"
        [ -f "$report" ] && cp "$report" "$WORK/reports/"
    done
done
# every report on this machine (3a's too, when 3b runs in a later call on the same warm machine)
python3 benchmarks/h200/summary.py http "$WORK"/reports/*.json
echo "== call done, $(left) s left"
