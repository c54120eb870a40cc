#!/usr/bin/env bash
# Does scattering an adapter's pages over the pool cost the decode LoRA kernels? (session 25's open question: v1,
# split and fused all take ~96-101 us a layer at 64 rows). The decode table's rows 16 and 64, twice on one machine:
# adapters on random pages of the 8 GiB pool (as the table always ran), then on consecutive pages (--packed). ~1.5
# min. Run tool: carry [".whl"]; after call_suite.sh in the same call, or alone: `bash benchmarks/h200/call_pages.sh`.
# $OUT: <date>_decode_pages_{random,packed}_h200.json, pages.log. A dry run here: `H200_DRY=1 PAGE_ROWS_SET=4 bash ...`.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=benchmarks/h200/setup.sh
source benchmarks/h200/setup.sh >/dev/null || exit 1
for layout in random packed; do
    flag=(); [ "$layout" = packed ] && flag=(--packed)
    echo "== decode table, rows ${PAGE_ROWS_SET:-64,16}, $layout pages ($(left) s left)"
    timeout -k 10 "$(( $(left) - 5 ))" python3 benchmarks/kernels.py --decode-table --rows "${PAGE_ROWS_SET:-64,16}" \
        --layer-variants split_t8k,fused --group-variants "" "${flag[@]}" ${H200_DRY:+--tiny} \
        --out "$OUT/${DATE}_decode_pages_${layout}_h200.json" 2>&1 | grep -v "^    qkv:" | tail -8
done 2>&1 | tee "$OUT/pages.log"
