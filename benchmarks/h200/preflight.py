"""Are the packages the server, the tests and the GPU suite need there, at the versions asked for? A failed import
found 5 minutes into a device call costs the call; this answers in 2 seconds at its start.

    python3 benchmarks/h200/preflight.py --wheels .whl        # here: every requirement of .whl/ is carried or imaged
    python3 benchmarks/h200/preflight.py --site /tmp/site     # there, after the install: check, top up, import
    python3 benchmarks/h200/preflight.py --aiperf-wheels .whl/aiperf     # here: aiperf's carried set, statically
    /tmp/aiperf_site_python benchmarks/h200/preflight.py --aiperf /tmp/aiperf_site   # there, under aiperf's Python

Requirements: pyproject's dependencies and test extra (less the packages the image brings or the suite skips:
torch, ruff, lm_eval, ray), pytest-xdist for the suite, and the Requires-Dist of every carried wheel. On the device a
requirement the image meets at too old a version is met from ``.whl/floor/`` (installed into the site then), or
reported; one met by nothing fails the check (exit 1), as does a module that does not import.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import importlib.util
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
NOT_CHECKED = {"torch", "ruff", "lm-eval", "ray"}  # the image's torch is the one used; the others are skipped
EXTRA = ["pytest-xdist>=3.2"]  # .ci/gpu-suite (-n, --dist loadgroup)
IMPORTS = ["fastapi", "starlette", "uvicorn", "pydantic", "openai", "httpx", "re2", "llguidance", "jsonschema",
           "prometheus_client", "xdist", "jinja2", "tokenizers", "safetensors"]
# KINDS.md's list of the image's Python packages (read 2026-11-17), names only: the versions are not known here.
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split())
# aiperf 0.13's requirements that `aiperf profile` never imported in a traced run (every process, 2026-12-02; the
# k8s operator, dashboards, plots, sweeps, public datasets, audio, GPU telemetry): neither carried nor checked.
AIPERF_UNUSED = {"aiosqlite", "dash", "dash-bootstrap-components", "datasets", "jmespath", "kaleido", "kopf",
                 "kubernetes-asyncio", "nvidia-ml-py", "optuna", "plotly", "python-multipart", "soundfile",
                 "starlette-compress", "textual", "zstandard", "prometheus-client", "pandas", "matplotlib",
                 "seaborn", "tiktoken", "protobuf"}
# Modules `aiperf profile` imported there, one per carried or pinned package it uses (the CLI, the controller and
# its ZMQ, the dataset manager with PIL/ffmpeg, crick's t-digest, the aiohttp transport, pydantic-settings, ...):
# a failed import here costs 2 s instead of the aiperf run.
AIPERF_IMPORTS = ["aiperf.cli", "aiperf.cli_commands.profile", "aiperf.common.environment", "aiperf.common.logging",
                  "aiperf.controller.system_controller", "aiperf.dataset.dataset_manager",
                  "aiperf.dataset.generator.video", "aiperf.metrics.list_metric_aggregation",
                  "aiperf.transports.aiohttp_transport", "aiperf.common.mixins.process_health_mixin",
                  "aiperf.plugin.plugins", "setproctitle", "transformers", "tokenizers"]
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def project_requirements() -> list[Requirement]:
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in proj["dependencies"] + proj["optional-dependencies"]["test"] + EXTRA]
    return [r for r in reqs if canonicalize_name(r.name) not in NOT_CHECKED]


def applies(req: Requirement, env: dict | None) -> bool:
    return req.marker is None or req.marker.evaluate(env or {"extra": ""})


def wheel_info(path: Path) -> tuple[str, Version, list[Requirement]]:
    with zipfile.ZipFile(path) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    name = re.search(r"^Name: (.+)$", meta, re.M).group(1).strip()
    ver = Version(re.search(r"^Version: (.+)$", meta, re.M).group(1).strip())
    reqs = [Requirement(r) for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M)]
    return canonicalize_name(name), ver, reqs


def check_wheels(whl: Path) -> int:
    """Here: every requirement of the project and of the carried wheels is met by a carried wheel or named by the
    image (whose versions this machine cannot see; the device check sees them)."""
    carried = {n: (v, r) for n, v, r in map(wheel_info, sorted(whl.glob("*.whl")))}
    floor = {n: v for n, v, _ in map(wheel_info, sorted((whl / "floor").glob("*.whl")))}
    reqs = [(r, "project") for r in project_requirements()]
    reqs += [(r, n) for n, (_, rs) in carried.items() for r in rs if applies(r, TARGET_ENV)]
    bad = 0
    versions = {n: v for n, (v, _) in carried.items()}
    for req, who in reqs:
        ok, how = met(req, versions)
        if how == "image" and (name := canonicalize_name(req.name)) in floor:
            how += f" (floor {floor[name]} carried)"
        if not ok:
            bad += 1
            print(f"preflight: {req} (for {who}): {how}")
    print(f"preflight: {len(carried)} carried wheels, {len(floor)} floor wheels, {len(reqs)} requirements: "
          + ("all met or imaged" if not bad else f"{bad} NOT MET"))
    return 1 if bad else 0


def met(req, versions: dict[str, str]) -> tuple[bool, str]:
    """Whether ``req`` is met, and by what: a carried wheel's version in ``versions``, else the image, else nowhere."""
    name = canonicalize_name(req.name)
    if name in versions:
        return req.specifier.contains(versions[name], prereleases=True), f"carried {versions[name]}"
    return (True, "image") if name in IMAGE else (False, "NOWHERE")


def import_failures(modules: list[str]) -> list[str]:
    """"module: error" for each of ``modules`` that does not import (any exception is the finding)."""
    failed = []
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - any failure to import is the finding
            failed.append(f"{mod}: {type(e).__name__}: {e}"[:200])
    return failed


def check_aiperf_wheels(whl: Path) -> int:
    """Here: every requirement of aiperf and of its carried wheels is carried (there or in .whl/, whose site is on
    aiperf's path after its own), named by the image, or one ``aiperf profile`` does not import."""
    own = {n: (v, r) for n, v, r in map(wheel_info, sorted(whl.glob("*.whl")))}
    server = {n: v for n, v, _ in map(wheel_info, sorted(whl.parent.glob("*.whl")))}
    if "aiperf" not in own:
        print(f"preflight: no aiperf wheel in {whl}")
        return 1
    bad = unused = 0
    reqs = [(r, n) for n, (_, rs) in own.items() for r in rs if applies(r, TARGET_ENV)]
    versions = server | {n: v for n, (v, _) in own.items()}  # aiperf's site comes first on its path
    for req, who in reqs:
        name = canonicalize_name(req.name)
        if name in AIPERF_UNUSED and name not in versions and name not in IMAGE:
            unused += 1
            continue
        ok, how = met(req, versions)
        if not ok:
            bad += 1
            print(f"preflight: aiperf: {req} (for {who}): {how}")
    print(f"preflight: aiperf {own['aiperf'][0]}: {len(own)} wheels, {len(reqs)} requirements, {unused} not imported "
          "by `aiperf profile` (not carried): " + ("the rest met or imaged" if not bad else f"{bad} NOT MET"))
    return 1 if bad else 0


def check_aiperf(site: Path) -> int:
    """There, run by aiperf's Python (its site first on the path, then the server's, then the image): aiperf's
    requirements as its process sees them (a version outside a pin is a warning: aiperf runs with --no-deps) and
    the imports. uvloop without ``run()`` (older than 0.18) is not a failure: the caller turns uvloop off."""
    where = {canonicalize_name(d.metadata["Name"]) for d in md.distributions(path=[str(site)])}
    rows, off, missing = [], [], []
    for r in md.requires("aiperf") or []:
        req = Requirement(r)
        name = canonicalize_name(req.name)
        if not applies(req, None):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            if name not in AIPERF_UNUSED:
                missing.append(str(req))
            continue
        rows.append((name in where, f"{name} {have}"))
        if not req.specifier.contains(Version(have), prereleases=True):
            off.append(f"{req} (has {have})")
    failed = import_failures(AIPERF_IMPORTS)
    print(f"preflight: aiperf {md.version('aiperf')}: {sum(own for own, _ in rows)} of its requirements from its "
          "site; from the server's site or the image: " + ", ".join(r for own, r in rows if not own))
    if off:
        print("preflight: aiperf: outside its pins (runs anyway unless an import fails): " + "; ".join(off))
    for line in missing:
        print(f"preflight: aiperf: MISSING {line}")
    uvloop = importlib.import_module("uvloop") if importlib.util.find_spec("uvloop") else None
    if uvloop is None or not hasattr(uvloop, "run"):
        print("preflight: aiperf: uvloop missing or without run(): AIPERF_SERVICE_DISABLE_UVLOOP=1")
    for line in failed:
        print(f"preflight: aiperf: IMPORT FAILED {line}")
    print("preflight: aiperf " + ("FAILED" if failed else "ok"), flush=True)
    return 1 if failed else 0


def site_requirements(site: Path) -> list[tuple[Requirement, str]]:
    reqs = [(r, "project") for r in project_requirements()]
    for dist in md.distributions(path=[str(site)]):
        reqs += [(Requirement(r), dist.metadata["Name"]) for r in dist.requires or []]
    return [(r, who) for r, who in reqs if applies(r, None)]


def check_site(site: Path, floor_dir: Path, install: bool) -> int:
    """There: each requirement against what imports would find (the site first, as PYTHONPATH puts it)."""
    floor = {n: (v, p) for p in sorted(floor_dir.glob("*.whl")) for n, v, _ in [wheel_info(p)]}
    missing, old, top_up = [], [], {}
    rows = {}
    for req, who in site_requirements(site):
        name = canonicalize_name(req.name)
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        ok = have is not None and req.specifier.contains(Version(have), prereleases=True)
        rows.setdefault(name, [have, []])[1].append(f"{req.specifier or '*'} ({who})")
        if ok:
            continue
        if name in floor and req.specifier.contains(floor[name][0], prereleases=True):
            top_up[name] = floor[name][1]
        elif have is None:
            missing.append(f"{req} (for {who})")
        else:
            old.append(f"{req} (for {who}): image has {have}, not carried")
    if top_up and install:
        print(f"preflight: installing from {floor_dir}: {sorted(top_up)}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, top_up.values())],
                       check=True)
        # again in a fresh process: this one has read the old versions' metadata and maybe imported them
        return subprocess.run([sys.executable, __file__, "--site", str(site), "--floor", str(floor_dir),
                               "--no-install"]).returncode
    failed_imports = import_failures(IMPORTS)
    where = {canonicalize_name(d.metadata["Name"]) for d in md.distributions(path=[str(site)])}
    print("preflight: " + ", ".join(f"{n} {v[0]}{'*' if n in where else ''}" for n, v in sorted(rows.items()))
          + "   (* = carried)")
    for line in old:
        print(f"preflight: WARNING too old: {line}")
    for line in missing + [f"{n} not met after top-up" for n in top_up]:
        print(f"preflight: MISSING {line}")
    for line in failed_imports:
        print(f"preflight: IMPORT FAILED {line}")
    bad = missing or failed_imports or top_up
    print("preflight: " + ("FAILED" if bad else "ok"), flush=True)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, help="here: check the wheels in this dir (and its floor/) statically")
    ap.add_argument("--site", type=Path, help="there: the --target dir the wheels were installed into")
    ap.add_argument("--floor", type=Path, default=ROOT / ".whl" / "floor")
    ap.add_argument("--no-install", action="store_true", help="report only, install no floor wheel")
    ap.add_argument("--aiperf-wheels", type=Path, help="here: check aiperf's carried wheels (.whl/aiperf) statically")
    ap.add_argument("--aiperf", type=Path, metavar="SITE", help="there, run by aiperf's Python: its site's check")
    args = ap.parse_args()
    if args.wheels:
        return check_wheels(args.wheels)
    if args.aiperf_wheels:
        return check_aiperf_wheels(args.aiperf_wheels)
    if args.aiperf:
        return check_aiperf(args.aiperf)
    if args.site is None:
        ap.error("--wheels or --site")
    return check_site(args.site, args.floor, install=not args.no_install)


if __name__ == "__main__":
    sys.exit(main())
