#!/usr/bin/env bash
# Why dispatching one engine step costs milliseconds of host time (session 8: 3.2 / 5.7 / 7.2 ms at batch 1 / 64 / 256
# on the 7B): benchmarks/dispatch_probe.py on the 7B model, one process per XLA_FLAGS variant (default, command
# buffers off, command buffers with while/conditional), each given its share of what is left of the call. ~8-9 min:
# install + preflight ~15 s; the 7B model dir (~25 s, skipped when call_bench.sh / call_http.sh left it under $WORK);
# then the probe until ~25 s before the deadline (a variant cut by its share keeps the batches it measured). Run tool:
# timeout_s 600, carry [".whl"], command `bash benchmarks/h200/call_dispatch.sh`. $OUT: <date>_dispatch_probe_h200.json,
# <date>_dispatch_hlo_h200.txt.gz (the default variant's optimized HLO of every step probed),
# <date>_dispatch_trace_h200.xplane.pb.gz (a profiler trace of 9 decode calls at the first batch), dispatch.log.
#   WORK=/root/http-bench  where the model is (call_bench.sh's and call_http.sh's default too)
#   BATCHES=1,256,64       measured in this order; POOL_GB=32: the engine's pool (GiB)
#   BIG_POOL_GB=0          then the default flags once more with this pool (0: the engine's own, most of the card:
#                          H4), only if 90 s are left; BIG_POOL_GB= (empty) skips it
#   VARIANTS="NAME=FLAGS;..."  the XLA_FLAGS variants, in order (dispatch_probe.py --variants)
#   CALLS=20               timed calls per mode
#   H200_DRY=1 PRESET=tiny N_ADAPTERS=8 BATCHES=1,8   a dry run on the CPU
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=benchmarks/h200/setup.sh
source benchmarks/h200/setup.sh || exit 1
WORK=${WORK:-/root/http-bench}
PRESET=${PRESET:-llama-2-7b}
report=$OUT/${DATE}_dispatch_probe_h200.json
extra=()
if [ -n "${VARIANTS:-}" ]; then extra+=(--variants "$VARIANTS"); fi
if [ -n "${BIG_POOL_GB-0}" ]; then extra+=(--big-pool-gb "${BIG_POOL_GB-0}"); fi

run_steps() {
    echo "== model under $WORK ($(left) s left)"
    prepare_model
    local prep=$?
    local limit=$(( $(left) - 10 ))
    echo "== dispatch probe on $WORK/model-$PRESET, batches ${BATCHES:-1,256,64}, $limit s"
    timeout -k 10 "$limit" python3 benchmarks/dispatch_probe.py --model-dir "$WORK/model-$PRESET" \
        --batches "${BATCHES:-1,256,64}" --calls "${CALLS:-20}" --pool-gb "${POOL_GB:-32}" \
        --deadline-s $(( limit - 15 )) --cache-dir "$WORK/dispatch-cache" --label h200 --out "$report" \
        --hlo-out "$OUT/${DATE}_dispatch_hlo_h200.txt.gz" --trace-out "$OUT/${DATE}_dispatch_trace_h200.xplane.pb.gz" \
        "${extra[@]}"
    local rc=$?
    if [ "$rc" -ne 0 ] && [ -f "$report" ]; then  # cut or failed: the table of what the report holds
        python3 benchmarks/dispatch_probe.py --summary "$report"
    fi
    echo "== dispatch call done, $(left) s left: prepare rc=$prep probe rc=$rc (124: cut by the limit)"
}
run_steps 2>&1 | tee "$OUT/dispatch.log"
