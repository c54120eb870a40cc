#!/usr/bin/env bash
# The one-kernel split plan (session 26: FusedTuning(mode="sync"), expand programs waiting on the shrink's counters)
# against the two-kernel split plan, on one machine: first the compiled kernels against the reference (bf16, every
# group, with a deadline: a kernel that waits forever fails here, not in the table), then the decode table's rows.
# ~4 min. Run tool: carry [".whl"]; `bash benchmarks/h200/call_sync.sh`. $OUT: <date>_decode_sync_h200.json,
# sync.log. A dry run here: `H200_DRY=1 SYNC_ROWS=4 bash benchmarks/h200/call_sync.sh` (tiny shapes, interpret).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=benchmarks/h200/setup.sh
source benchmarks/h200/setup.sh >/dev/null || exit 1
{
    echo "== compiled kernels against the reference, bf16 ($(left) s left)"
    if [ -z "${H200_DRY:-}" ]; then
        timeout -k 10 240 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_lora_fused.py \
            -k "test_gpu_bgmv_lora and bfloat16" 2>&1 | tail -4
    fi
    echo "== decode table, rows ${SYNC_ROWS:-1,16,64,256} ($(left) s left)"
    timeout -k 10 "$(( $(left) - 5 ))" python3 benchmarks/kernels.py --decode-table --rows "${SYNC_ROWS:-1,16,64,256}" \
        --layer-variants "${SYNC_VARIANTS:-split_t8k,sync_t8k,sync,fused}" --group-variants "" ${H200_DRY:+--tiny} \
        --out "$OUT/${DATE}_decode_sync_h200.json" 2>&1 | grep -v "^    qkv:" | tail -14
} 2>&1 | tee "$OUT/sync.log"
