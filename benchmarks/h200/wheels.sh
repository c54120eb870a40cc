#!/usr/bin/env bash
# Run HERE (this machine has pip and a package index; the H200 machine has neither): download into .whl/ (repo root,
# ignored, never committed) the cp312 manylinux wheels our server, tests and the GPU suite need that the GPU image
# lacks, and into .whl/floor/ the ones the image has at a version we cannot see (preflight.py installs one of those
# there only when the image's is older than a requirement). Versions: the ones the CPU suite runs with here. Then
# it checks that every requirement of what it fetched is carried or in the image (preflight.py --wheels) and writes
# .whl/COMMIT, which the call scripts put into the results (the H200 copy of the tree has no .git).
#   bash benchmarks/h200/wheels.sh           # fetch (what is there already is kept), check, stamp
#   bash benchmarks/h200/wheels.sh --stamp   # only .whl/COMMIT (before each call, after a commit)
#   bash benchmarks/h200/wheels.sh --aiperf  # also .whl/aiperf/ (25 wheels, ~15 MB): NVIDIA aiperf for
#                                            # `AIPERF=1 call_http.sh` (issue 13's third-party client)
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")" .whl/floor
grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"

stamp() {  # the commit the tree that travels is at; "+dirty" when tracked files differ from it
    local c
    c="$(git rev-parse HEAD)"
    git diff --quiet HEAD -- . 2>/dev/null || c="$c+dirty"
    echo "$c" >.whl/COMMIT
    echo "wheels.sh: .whl/COMMIT = $c"
}
if [ "${1:-}" = "--stamp" ]; then stamp; exit 0; fi
want_aiperf=""; [ "${1:-}" = "--aiperf" ] && want_aiperf=1

# Not in the image (KINDS.md's package list, 2026-11-17): always installed there.
MISSING=(
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
    openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1
    google-re2==1.1.20251105 llguidance==1.9.1
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0
)
# In the image at an unknown version, and asked for at a floor by us or by a wheel above (anyio>=4.10 by openai,
# idna>=3.18 by httpx2, typing-extensions>=4.14.1 by pydantic, h11>=0.16 by httpcore2, ...): carried, installed
# only if needed. All pure Python and small. Heavy or compiled ones (numpy, tokenizers, safetensors, orbax, jax,
# torch, transformers, peft, markupsafe) are not: preflight.py reports them if the image's are too old.
FLOOR=(
    anyio==4.16.0 idna==3.20 typing-extensions==4.16.0 h11==0.16.0 httpx==0.28.1 httpcore==1.0.9
    certifi==2026.5.20 click==8.5.1 annotated-doc==0.0.7 attrs==26.1.0 prometheus-client==0.26.0 tqdm==4.70.1
    jinja2==3.1.6 pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0 pytest-xdist==3.8.0 execnet==2.1.2
)
# Left out on purpose: ray[serve] and lm_eval (hundreds of MB; tests/test_ray_serve.py and tests/test_lm_eval.py
# importorskip them), ruff (CI's linter).
# aiperf (--aiperf: opt-in, ~15 MB, only `AIPERF=1 call_http.sh` uses it; once fetched, .whl/aiperf travels with
# every carry of .whl, well under the limit). Installed there into a site of its own (setup.sh's setup_aiperf), seen
# only by the aiperf process, so its pins never reach the server's imports. Not its whole closure (dash, plotly,
# kaleido, optuna, datasets, kopf, kubernetes-asyncio, textual, zstandard, ... would be ~100 MB): what `aiperf
# profile` imported in a traced run (2026-12-02, every module of every process, this box), less what the image has
# (numpy, transformers, tokenizers, pillow, uvloop, pyarrow, scipy, jinja2, ...) or our .whl carries (pydantic,
# fastapi, uvicorn: the server's site is on aiperf's path after its own).
AIPERF=(
    aiperf==0.13.0
    # not in the image
    crick==0.0.8 cyclopts==4.25.3 docstring-parser==0.18.0 rich-rst==2.2.0 ffmpeg-python==0.2.0 future==1.0.0
    msgspec==0.23.0 orjson==3.11.9 pydantic-settings==2.16.3 python-dotenv==1.2.4 pyzmq==26.4.0
    ruamel-yaml==0.18.17 ruamel-yaml-clib==0.2.15 setproctitle==1.3.8
    # in the image at versions we cannot see, pinned by aiperf (aiofiles~=24.1, rich~=14.1, psutil~=7.0,
    # aiohttp>=3.14.3, which needs yarl>=1.25.1): carried so aiperf gets its own
    aiofiles==24.1.0 rich==14.1.0 psutil==7.0.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0
    frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
)

fetch() {  # dir, specs...
    local dir="$1"; shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
        -d "$dir" "$@" 2>&1 | sed '/is ignored: it is neither a file nor a directory/d'  # this box's pip config
}
fetch .whl "${MISSING[@]}"
fetch .whl/floor "${FLOOR[@]}"
if [ -n "$want_aiperf" ]; then mkdir -p .whl/aiperf; fetch .whl/aiperf "${AIPERF[@]}"; fi

# One version of each: an older download left beside a newer one would stop the install there.
python3 - <<'EOF'
import collections, pathlib, re, sys
for d in (pathlib.Path(".whl"), pathlib.Path(".whl/floor"), pathlib.Path(".whl/aiperf")):
    seen = collections.defaultdict(list)
    for w in d.glob("*.whl"):
        seen[re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower()].append(w.name)
    dup = {k: v for k, v in seen.items() if len(v) > 1}
    if dup:
        sys.exit(f"wheels.sh: two versions in {d}: {dup} (remove the stale ones)")
EOF
python3 benchmarks/h200/preflight.py --wheels .whl
if [ -d .whl/aiperf ]; then python3 benchmarks/h200/preflight.py --aiperf-wheels .whl/aiperf; fi
stamp
aiperf_note=""
if [ -d .whl/aiperf ]; then
    aiperf_note="$(find .whl/aiperf -type f -name "*.whl" | wc -l) in .whl/aiperf ($(du -sh .whl/aiperf | cut -f1)); "
fi
echo "wheels.sh: $(find .whl -maxdepth 1 -type f -name "*.whl" | wc -l) wheels in .whl \
($(du -sh --exclude=floor --exclude=aiperf .whl | cut -f1)), \
$(find .whl/floor -type f -name "*.whl" | wc -l) in .whl/floor ($(du -sh .whl/floor | cut -f1)); ${aiperf_note}all: $(du -sh .whl | cut -f1) \
(carry limit 64 MiB with the tree: $(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1) tracked)"
