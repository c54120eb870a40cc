#!/usr/bin/env bash
# One H200 call: S1 n=2000 at saturation over HTTP with the midpoint step buckets (the GPU default since session 28:
# 768 / 1536 prefill rows, 192 decode rows) and then with --no-mid-buckets, on one machine (machine to machine S1
# moves ~5%, more than the change). The first server starts cold (its warm-up is issue 14's bar, <= 104 s for 7B),
# the second from the first's compilation cache. Each run is call_http.sh ep with RATES=sat INPROC=0 (~230 s cold,
# ~130 s warm); each run's files move to $OUT/mid/ or $OUT/pow2/. VARIANTS="pow2 mid" reverses the order.
# Run tool: timeout_s 600, carry [".whl"], command `bash benchmarks/h200/call_buckets.sh`.
#   H200_DRY=1 PRESET=tiny N_ADAPTERS=32 WORK=/tmp/bk-work bash benchmarks/h200/call_buckets.sh   # CPU dry run
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
start=$(date +%s)
limit=${CALL_LIMIT_S:-575}
if [ -n "${H200_DRY:-}" ]; then export OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"; fi
for variant in ${VARIANTS:-mid pow2}; do
    args=${HTTP_ARGS:-}
    [ "$variant" = pow2 ] && args="$args --no-mid-buckets"
    spent=$(( $(date +%s) - start ))
    echo "== $variant: ${spent} s into the call"
    CALL_LIMIT_S=$((limit - spent)) HTTP_ARGS="$args" RATES=sat INPROC=0 ADAPTER_SET=S1 \
        bash benchmarks/h200/call_http.sh ep
    mkdir -p "$OUT/$variant"
    find "$OUT" -maxdepth 1 -type f -exec mv {} "$OUT/$variant/" \;
    grep -hE "warm-up|step buckets|compiled ahead" "$OUT/$variant"/server_*.log 2>/dev/null | cut -c1-200 | tail -n 4
done
echo "== call done after $(( $(date +%s) - start )) s"
