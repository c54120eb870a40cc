#!/usr/bin/env bash
# Call 1 of the H200 runbook (README.md beside this): the whole GPU test suite, `.ci/gpu-suite` with 14 workers.
# ~6-8 min: install + preflight ~15 s, pytest 250-400 s (session 6: 388 s with loadfile). Run tool: timeout_s 600,
# carry [".whl"], command `bash benchmarks/h200/call_suite.sh`; extra arguments go to pytest (a dry run here:
# `H200_DRY=1 WORKERS=2 bash benchmarks/h200/call_suite.sh tests/test_structure.py`).
# $OUT: gpu_suite.log (the whole pytest output, one line per test) and <date>_gpu_suite_h200.json (counts, failures,
# the 25 slowest tests, the 20 longest files, the GPU memory's peak, and "compile": the compile ledger's sums, below;
# gpu_memory_mib.txt, the samples); the table at the end
# is what the lead records in benchmarks/NOTES.md.
# The compile ledger (tests/compile_ledger.py): every worker writes one JSON line per test, its JAX compiles' count and
# seconds by phase, to a dir under /tmp that summary.py sums into the JSON (the dir itself is not copied to $OUT).
# COMPILE_LEDGER=0 turns it off.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=benchmarks/h200/setup.sh
source benchmarks/h200/setup.sh || exit 1
export WORKERS=${WORKERS:-14} GPU_NAME
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
log=$OUT/gpu_suite.log
limit=$(( $(left) - 20 ))  # summary and copy after it
echo "suite: WORKERS=$WORKERS, pytest limit $limit s, log $log"
ledger=""
if [ "${COMPILE_LEDGER:-1}" != 0 ]; then
    ledger=$(mktemp -d /tmp/slora-compile-ledger.XXXXXX) && export SLORA_TEST_COMPILE_LEDGER="$ledger"
    echo "suite: compile ledger in $ledger"
fi
start=$(date +%s)
export SUITE_START_EPOCH=$start  # the compile ledger's worker timeline counts from here
# -v -v on top of gpu-suite's -q: one line per finished test, so a run cut by the limit still names its failures.
# timeout signals the whole process group: pytest, its workers and the servers they started.
# The GPU's memory in use, sampled twice a second: its peak says how many workers the card holds.
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$OUT/gpu_memory_mib.txt" 2>/dev/null &
monitor=$!
timeout -k 15 "$limit" .ci/gpu-suite -p no:cacheprovider --durations=0 -v -v "$@" >"$log" 2>&1
rc=$?
wall=$(( $(date +%s) - start ))
kill "$monitor" 2>/dev/null
GPU_MEMORY_PEAK_MIB=$(sort -n "$OUT/gpu_memory_mib.txt" 2>/dev/null | tail -1)
export GPU_MEMORY_PEAK_MIB
tail -n 8 "$log" | cut -c1-200
python3 benchmarks/h200/summary.py suite "$log" "$OUT/${DATE}_gpu_suite_h200.json" "$wall" "$rc" ${ledger:+"$ledger"}
exit "$rc"
