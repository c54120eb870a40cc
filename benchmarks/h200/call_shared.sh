#!/usr/bin/env bash
# Decode LoRA programs that serve a run of one adapter's rows (FusedTuning.shared_rows, backends pallas-shared-rows
# and pallas-shared-rows-8) against a program a row, on the H200: (1) `kernels.py --shared-rows`: one layer, all 7
# projections, rank 16, at 128 / 256 rows whose rows share adapters (32 x 4, S1's popularity, 5 adapters, none),
# each variant checked against the reference first (~2-3 min, mostly compiles); (2) `decode_profile.py` on the 7B
# step at B=128 with 32 adapters (issue 14's decode bar case, rows ordered by adapter as the engine orders them),
# once per backend (~70 s each). Run tool: timeout_s 600, carry [".whl"], command `bash benchmarks/h200/call_shared.sh`.
# $OUT: <date>_shared_rows_h200.json, <date>_decode_profile_h200_shared.jsonl, shared.log.
#   BACKENDS="pallas pallas-shared-rows pallas-shared-rows-8"   decode_profile's backends, in this order
#   PROFILE_ARGS="--batch 128 --adapters 32"                    decode_profile's case
#   H200_DRY=1   a dry run on the CPU (kernels.py --tiny, decode_profile --tiny)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=benchmarks/h200/setup.sh
source benchmarks/h200/setup.sh || exit 1
dry=(); iters=()
if [ -n "${H200_DRY:-}" ]; then dry=(--tiny); iters=(--iters 2); fi
table=$OUT/${DATE}_shared_rows_h200.json
profile=$OUT/${DATE}_decode_profile_h200_shared.jsonl
read -r -a backends <<< "${BACKENDS:-pallas pallas-shared-rows pallas-shared-rows-8}"
read -r -a case_args <<< "${PROFILE_ARGS:---batch 128 --adapters 32}"

run_steps() {
    local status=()
    echo "== kernels.py --shared-rows ($(left) s left)"
    timeout -k 10 "$(( $(left) < 260 ? $(left) - 20 : 240 ))" python3 benchmarks/kernels.py --shared-rows \
        --out "$table" "${dry[@]}"
    status+=("shared_rows rc=$?")
    for backend in "${backends[@]}"; do
        local limit=$(( $(left) - 10 ))
        if [ "$limit" -lt 60 ]; then status+=("$backend skipped: $limit s left"); continue; fi
        echo "== decode_profile --backend $backend ${case_args[*]} ($limit s left)"
        timeout -k 10 "$limit" python3 benchmarks/decode_profile.py --backend "$backend" "${case_args[@]}" \
            --label "$backend" --out "$profile" "${dry[@]}" "${iters[@]}"
        status+=("$backend rc=$?")
    done
    python3 - "$profile" <<'EOF'
import json, sys
print(f"\n{'backend':24s} {'step ms':>8s} {'floor':>7s} {'x':>5s} {'lora us':>8s} {'kernels':>7s}")
try:
    lines = open(sys.argv[1]).read().splitlines()
except OSError:
    lines = []
for line in lines:
    r = json.loads(line)
    us = r.get("device_us_per_step", {})
    lora = us.get("lora") if isinstance(us, dict) else None
    print(f"{r['backend']:24s} {r['step_ms']:8.3f} {r['floor_ms']:7.3f} {r['x_floor'] or 0:5.2f} "
          f"{lora if lora is not None else float('nan'):8.1f} {r.get('kernels_per_step', 0):7.0f}")
EOF
    echo "== shared-rows call done, $(left) s left: ${status[*]}"
}
run_steps 2>&1 | tee "$OUT/shared.log"
