"""Shared fixtures: small random HF model dirs and PEFT adapter dirs, written once per test session."""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # 4 CPU devices, beside any flags
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),  # (.ci/gpu-suite sets its own)
                                                     "--xla_force_host_platform_device_count=4"]))

import jax  # noqa: E402
import pytest  # noqa: E402
from store_helpers import StoreMaker, logged_rng  # noqa: E402
from xdist_order import order_for_xdist  # noqa: E402

from slora_jax.model.config import ModelConfig  # noqa: E402
from slora_jax.tools import synth  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"

# One persistent compilation cache for the whole run (a temporary dir): many test modules build and warm up engines
# of the same tiny shapes, and each engine's jitted steps are new functions to JAX, so without it every module
# compiled the same executables again. Compile counts are unchanged (a cache hit still counts as a compile request);
# tests of the cache itself run in subprocesses with their own dirs. SLORA_TEST_COMPILE_CACHE=0 turns it off. CPU (CI):
# 1467 -> ~1000 s. GPU suite (session 12, 12 workers): 345 -> 333 s, 804 compiles served from it, an engine file's
# fixture 188 -> 116 s; the xdist workers share one dir (named by the run's id, left for the machine's /tmp) and
# compile warm-ups on 2 threads each.
_CACHE_SWITCH = os.environ.get("SLORA_TEST_COMPILE_CACHE", "1")
if _CACHE_SWITCH != "0":
    import atexit  # noqa: E402
    import shutil  # noqa: E402
    import tempfile  # noqa: E402

    from slora_jax.engine import compile_counter  # noqa: E402

    _run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if _run_id:  # one dir for every worker of this run; none removes it (another may still be using it)
        _cache_dir = os.path.join(tempfile.gettempdir(), f"slora-test-xla-cache-{_run_id}")
    else:
        _cache_dir = tempfile.mkdtemp(prefix="slora-test-xla-cache-")
        atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    if ON_GPU:
        os.environ.setdefault("SLORA_JAX_COMPILE_WORKERS", "2")
    compile_counter.enable_persistent_cache(_cache_dir)
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
if ON_GPU:
    # The fp32 checks claim fp32 parity (model vs HF, kernels vs their jnp references, batched vs alone). On the GPU
    # an fp32 matmul at default precision, in XLA and in Pallas' Triton dots alike, runs in TF32 (10-bit mantissa:
    # ~3e-4 relative error, seen as 2e-4..7e-4 here), so the suite asks for full precision everywhere; bf16 paths
    # are unaffected (their inputs are already bf16). Serving and benchmarks keep the default.
    # The same for the processes tests start (servers, engine processes): jax reads its flags from the environment.
    jax.config.update("jax_default_matmul_precision", "highest")
    os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"

# Opt-in: SLORA_TEST_COMPILE_LEDGER=<dir>, where each test's JAX compiles are written (tests/compile_ledger.py).
_LEDGER_DIR = os.environ.get("SLORA_TEST_COMPILE_LEDGER")


# The adapter zoo of the foundation's acceptance: mixed ranks, rsLoRA, patterns, partial targets, layer subsets.
ADAPTER_SPECS = {
    "r4-qkvo": dict(rank=4, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    "r8-all7": dict(rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "r16-rslora": dict(rank=16, use_rslora=True, alpha=8.0,
                       targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "r32-qv": dict(rank=32, targets=("q_proj", "v_proj")),
    "patterns": dict(rank=8, alpha=16.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"),
                     rank_pattern={"o_proj": 4, r"layers\.1\.self_attn\.q_proj": 16},
                     alpha_pattern={"down_proj": 3.0, r"layers\.0\.self_attn\.v_proj": 40.0}),
    "layer1-only": dict(rank=16, targets=("q_proj", "k_proj", "gate_proj", "up_proj"), layers_to_transform=[1]),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: synth.write_model(root / name, name, seed=i + 1)
            for i, name in enumerate(("tiny", "tiny-mha", "tiny-llama3"))}


@pytest.fixture(scope="session")
def tiny_dir(model_dirs):
    return model_dirs["tiny"]


@pytest.fixture(scope="session")
def tiny_cfg(tiny_dir):
    return ModelConfig.from_model_dir(tiny_dir)


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory, tiny_cfg):
    root = tmp_path_factory.mktemp("adapters")
    return {name: synth.write_adapter(root / name, tiny_cfg, seed=10 + i, **spec)
            for i, (name, spec) in enumerate(ADAPTER_SPECS.items())}


@pytest.fixture
def rng(request):
    """A fresh random generator per test, its seed printed (shown on failure, to replay)."""
    return logged_rng(request.node.name)


@pytest.fixture
def make_store(tiny_cfg):
    """Makes small adapter stores for a test and closes them all after it."""
    with StoreMaker(tiny_cfg) as make:
        yield make


def pytest_configure(config):
    """Keep the queue in the order tests/xdist_order.py makes (xdist 3.5+'s ``loadscopereorder``, on by default,
    sorts groups by their number of tests). An option, not a command-line flag: older xdist has neither, and an
    unknown flag stops pytest."""
    if getattr(config.option, "dist", None) == "loadgroup" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if _LEDGER_DIR:
        try:
            from compile_ledger import CompileLedger

            config.pluginmanager.register(CompileLedger(_LEDGER_DIR), "slora-compile-ledger")
        except Exception as e:  # noqa: BLE001  (a ledger that cannot start must not stop the run)
            print(f"conftest: compile ledger off ({type(e).__name__}: {e})")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the marks into node ids
def pytest_collection_modifyitems(config, items):
    """The GPU suite's groups and queue order (tests/xdist_order.py); nothing without xdist's loadgroup."""
    if config.getoption("loadgroup", default=False):
        order_for_xdist(items)
