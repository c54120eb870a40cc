# Sourced by every call_*.sh at its start, on the H200 machine, in the repo root: the carried wheels into /tmp/site,
# the environment, a 2-second preflight (a missing package fails the call now, not minutes in), and `left`, the
# seconds this call has before its own deadline. Not run by itself.
#   CALL_LIMIT_S   the deadline the call script keeps, from its start (default 575: the run tool kills at 600)
#   H200_DRY=1     a dry run on a machine without the GPU image: no install, $OUT defaults to /tmp/h200-out
# shellcheck shell=bash
T0=$(date +%s)
CALL_LIMIT_S=${CALL_LIMIT_S:-575}
left() { echo $((T0 + CALL_LIMIT_S - $(date +%s))); }
if [ -n "${H200_DRY:-}" ]; then
    OUT=${OUT:-/tmp/h200-out}
    mkdir -p "$OUT"
fi
if [ -z "${OUT:-}" ] || [ ! -d "$OUT" ]; then echo "setup.sh: \$OUT is not set (run through the device tool)" >&2; return 1; fi
export PYTHONUNBUFFERED=1
export DATE; DATE=$(date -u +%F)  # the results' names
if [ -z "${SLORA_GIT_COMMIT:-}" ]; then SLORA_GIT_COMMIT=$(cat .whl/COMMIT 2>/dev/null || echo unknown); fi
export SLORA_GIT_COMMIT
if [ -z "${H200_DRY:-}" ]; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "setup.sh: no .whl/*.whl here: run benchmarks/h200/wheels.sh on the dev machine and carry .whl" >&2
        return 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl 2>&1 | grep -v "Running pip as the 'root' user" || true
    export PYTHONPATH=/tmp/site:.
else
    export PYTHONPATH=.
fi
if [ -z "${H200_DRY:-}" ]; then
    python3 benchmarks/h200/preflight.py --site "${PYTHONPATH%%:*}" || return 1
else  # the site would be the repo root: a top-up would install wheels into the work tree
    echo "preflight: skipped (dry run)"
fi
echo "setup: $(date -u +%FT%TZ) commit $SLORA_GIT_COMMIT; $(nvidia-smi --query-gpu=name,memory.used,memory.total \
--format=csv,noheader 2>/dev/null || echo 'no nvidia-smi'); $(nproc) cores; $(( $(left) )) s left in this call"

# The 7B (or $PRESET) model and $N_ADAPTERS PEFT adapters under $WORK, written once (http_serving.prepare_preset;
# ~25 s on the H200, nothing when present). Returns its exit status.
prepare_model() {
    timeout -k 10 150 python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from http_serving import ADAPTER_SETS, prepare_preset
print(prepare_preset('$PRESET', Path('$WORK'), ${N_ADAPTERS:-2000}, 20, *ADAPTER_SETS['${ADAPTER_SET:-S1}']))"
}

# AIPERF=1 (call_http.sh): NVIDIA aiperf's wheels (.whl/aiperf, `wheels.sh --aiperf`) into a site of its own and a
# wrapper that runs python3 with that site first, then the server's (pydantic, fastapi), then the image. Only the
# aiperf process sees it, so aiperf's pins (rich, aiohttp, psutil, ...) never reach the server. Sets AIPERF_PY (the
# wrapper, for http_serving.py's --aiperf-python); returns 1, with the reason printed, when aiperf is not usable.
#   AIPERF_WHEELS (.whl/aiperf), AIPERF_SITE (/tmp/aiperf_site), AIPERF_BASE_PYTHON (python3: the image's)
setup_aiperf() {
    local wheels=${AIPERF_WHEELS:-.whl/aiperf} site=${AIPERF_SITE:-/tmp/aiperf_site} base check rc
    AIPERF_PY=${site}_python
    base=$(command -v "${AIPERF_BASE_PYTHON:-python3}") || { echo "setup: aiperf: no ${AIPERF_BASE_PYTHON:-python3}"; return 1; }
    if ! ls "$wheels"/aiperf-*.whl >/dev/null 2>&1; then
        echo "setup: aiperf: no $wheels/aiperf-*.whl (run benchmarks/h200/wheels.sh --aiperf here and carry .whl)"
        return 1
    fi
    rm -rf "$site"
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
        >"$site.pip.log" 2>&1; then
        echo "setup: aiperf: install failed: $(grep -v "Running pip as the 'root' user" "$site.pip.log" | tail -n 3)"
        return 1
    fi
    printf '#!/bin/sh\n# aiperf only (setup.sh): its site, then the server'"'"'s, then the image\nexport PYTHONPATH=%s\nexec %s "$@"\n' \
        "$site${PYTHONPATH:+:$PYTHONPATH}" "$base" >"$AIPERF_PY"
    chmod +x "$AIPERF_PY"
    check=$(timeout 90 "$AIPERF_PY" benchmarks/h200/preflight.py --aiperf "$site" 2>&1); rc=$?
    echo "$check" | cut -c1-800
    if echo "$check" | grep -q "AIPERF_SERVICE_DISABLE_UVLOOP=1"; then
        sed -i '3i export AIPERF_SERVICE_DISABLE_UVLOOP=1' "$AIPERF_PY"
    fi
    [ "$rc" -eq 0 ]
}
