#!/usr/bin/env bash
# One H200 call: where the engine thread's host time goes in a prefill step's scheduling (session 8: ~17 ms of
# Scheduler.schedule per prefill step on S1 n=2000 at saturation, 22% of the in-process run). Runs
# benchmarks/engine_profile.py on the 7B model with 2000 rank-8 adapters (q,k,v,o, as call_bench.sh / call_http.sh
# write them under $WORK; written here first if missing, ~30 s), the engine built by the server's build_engine with
# its GPU defaults (max batch 256, max-loras 256, XLA_PYTHON_CLIENT_MEM_FRACTION 0.95, pool 0.85 of what is free
# after the weights): the untimed warm-up trace, then the S1 sat trace (800 requests) twice: wall-clock timers on the
# admission sub-phases, then cProfile inside Scheduler.schedule and the step dispatch. ~3-5 min: start ~30 s with
# call_http.sh's compilation cache in $WORK/cache, ~110 s cold; warm-up trace ~15 s; each pass ~35-45 s.
# Run tool: timeout_s 600, carry [".whl"], command `bash benchmarks/h200/call_profile.sh`.
# $OUT: <date>_engine_profile_h200.json, profile.log, engine_profile_{schedule_prefill,dispatch_prefill,
# schedule_decode}.prof (pstats: python3 -m pstats FILE). The reply's tail: the sub-phase table, the cProfile tops
# and the answer table ((a) host-read waits, (b) device dispatches, (c) the rest, per prefill schedule).
#   WORK=/root/http-bench  model, adapters and the compilation cache (call_http.sh's)
#   PROFILE_ARGS="..."     more flags for engine_profile.py or the server (e.g. "--passes timers", "--max-loras 64")
#   H200_DRY=1 PRESET=tiny N_ADAPTERS=32 WORK=/tmp/ep-work   a dry run on the CPU (engine_profile.py --tiny)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=benchmarks/h200/setup.sh
source benchmarks/h200/setup.sh || exit 1
WORK=${WORK:-/root/http-bench}
export SLORA_JAX_CACHE_DIR=${SLORA_JAX_CACHE_DIR:-$WORK/cache}  # call_http.sh's: warm when a call 3 ran before
PRESET=${PRESET:-llama-2-7b}
dry=()
if [ -n "${H200_DRY:-}" ]; then dry=(--tiny); fi
read -r -a extra <<<"${PROFILE_ARGS:-}"
report=$OUT/${DATE}_engine_profile_h200.json
mkdir -p "$WORK"

limit=$(( $(left) - 20 ))
echo "== engine profile: $PRESET, ${N_ADAPTERS:-2000} adapters under $WORK, limit $limit s; $(nvidia-smi \
--query-gpu=memory.used --format=csv,noheader 2>/dev/null || echo '?') in use"
# --budget-s: the trace loop stops 40 s before the limit, so the report of what was measured is still written
timeout -k 10 "$limit" python3 benchmarks/engine_profile.py --preset "$PRESET" --work-dir "$WORK" \
    --n-adapters "${N_ADAPTERS:-2000}" --distinct-adapters 20 --budget-s $((limit - 40)) --out "$report" \
    --prof-dir "$OUT" "${dry[@]}" "${extra[@]}" >"$OUT/profile.log" 2>&1
rc=$?
# the short tables (the log has progress bars): errors, the passes, sub-phases, cProfile tops, the answer
grep -E "^(device|timers pass|cprofile pass|skip)|Traceback|Error|error:" "$OUT/profile.log" | cut -c1-300 | tail -n 12
awk '/^-- sub-phases/ {n = 18} /^-- schedule_prefill/ {n = 22} /^-- dispatch_prefill/ {n = 14}
     /^-- schedule_decode/ {n = 8} /^== engine profile/ {n = 100} n > 0 {print substr($0, 1, 200); n--}' \
    "$OUT/profile.log"
echo "== call done, $(left) s left: engine_profile rc=$rc$([ $rc -eq 124 ] && echo ' (cut by the limit)')"
