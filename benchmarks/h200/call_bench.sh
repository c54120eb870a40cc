#!/usr/bin/env bash
# Call 2 of the H200 runbook (README.md beside this): the decode LoRA table and the host time of a decode step on
# the 7B model. ~5-7 min: install + preflight ~15 s; the 7B model dir and 2000 adapter dirs written where
# benchmarks/http_serving.py looks for them (~30 s; kept for call 3 while the machine stays warm, skipped if there);
# `kernels.py --decode-table --table-rows 4` (~75 s; session 6: 62 s + the copy probe); `host_step.py` on the 7B
# model, batches 1,64,256, --no-sync (never run on a GPU before: weights ~20 s + the compiles of 3 batch sizes,
# guessed 2-4 min; it gets what is left of the call). Run tool: timeout_s 600, carry [".whl"], command
# `bash benchmarks/h200/call_bench.sh`. $OUT: <date>_decode_table_h200.json, <date>_host_step_h200.json, bench.log.
#   WORK=/root/http-bench  where the model and adapters go (call_http.sh's default too)
#   BATCHES=1,64,256       host_step.py's batches; TABLE_ROWS=4: kernels.py's table rows
#   H200_DRY=1 PRESET=tiny N_ADAPTERS=8 BATCHES=1 TABLE_ROWS=1   a dry run on the CPU (kernels.py --tiny, 3 steps)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=benchmarks/h200/setup.sh
source benchmarks/h200/setup.sh || exit 1
WORK=${WORK:-/root/http-bench}
PRESET=${PRESET:-llama-2-7b}
dry=(); steps=()
if [ -n "${H200_DRY:-}" ]; then dry=(--tiny); steps=(--steps 3); fi
table=$OUT/${DATE}_decode_table_h200.json
host=$OUT/${DATE}_host_step_h200.json

run_steps() {
    local status=()
    echo "== model and adapters under $WORK ($(left) s left)"
    prepare_model
    status+=("prepare rc=$?")

    echo "== decode LoRA table ($(left) s left)"
    timeout -k 10 200 python3 benchmarks/kernels.py --decode-table --table-rows "${TABLE_ROWS:-4}" --out "$table" \
        "${dry[@]}"
    status+=("decode_table rc=$?")

    local limit=$(( $(left) - 15 ))
    echo "== host step on $WORK/model-$PRESET, batches ${BATCHES:-1,64,256}, limit $limit s"
    timeout -k 10 "$limit" python3 benchmarks/host_step.py --model-dir "$WORK/model-$PRESET" \
        --batches "${BATCHES:-1,64,256}" --no-sync --label h200 --out "$host" "${steps[@]}"
    status+=("host_step rc=$? (124: cut by the limit; its B= lines above are what it measured)")

    python3 benchmarks/h200/summary.py bench "$table" "$host"
    echo "== call 2 done, $(left) s left: ${status[*]}"
}
run_steps 2>&1 | tee "$OUT/bench.log"
