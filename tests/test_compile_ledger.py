"""The opt-in compile ledger (tests/compile_ledger.py) and its sums in benchmarks/h200/summary.py:
the GPU suite runs it once per session with no chance to fix it, so a child pytest on this machine proves the whole
path: a compile in a fixture lands in setup, one in the test body in call, an eager jnp op counts as eager."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGET = "tests/test_compile_ledger.py::test_ledger_target"


@pytest.fixture
def compiled_in_setup():
    return jax.jit(lambda x: x - 1.0)(jnp.ones(7))


def test_ledger_target(compiled_in_setup):
    """What the child pytest runs: one compile in its fixture, a jit and an eager op in its body (shapes no other
    test here uses, so each is a fresh compile in the child)."""
    out = jax.jit(lambda x: x * 3.0 + 1.0)(jnp.ones(11)) + jnp.sin(jnp.ones(13))[:11]
    assert out.shape == (11,) and compiled_in_setup.shape == (7,)


def load_summary():
    spec = importlib.util.spec_from_file_location("h200_summary", ROOT / "benchmarks" / "h200" / "summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ledger_is_off_unless_asked(request):
    if not os.environ.get("SLORA_TEST_COMPILE_LEDGER"):
        assert request.config.pluginmanager.get_plugin("slora-compile-ledger") is None


def test_ledger_records_compiles_by_phase_and_summary_sums_them(tmp_path):
    ledger = tmp_path / "ledger"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SLORA_TEST_"))}
    env.update(SLORA_TEST_COMPILE_LEDGER=str(ledger), SLORA_TEST_COMPILE_CACHE="0", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TARGET], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = list(ledger.glob("main.*.jsonl"))
    assert len(files) == 1
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    rec = next(r for r in records if r["test"] == TARGET)
    setup, call = rec["phases"]["setup"], rec["phases"]["call"]
    assert setup["compiles"] >= 1 and setup["compile_s"] > 0 and setup["lower_n"] >= 1
    assert call["compiles"] >= 2 and call["eager_n"] >= 1 and call["trace_n"] >= 1
    assert call["wall_s"] >= call["busy_s"] > 0
    names = [name for name, _, _ in rec["fns"]]
    assert any(n.startswith("jit(<lambda>)") for n in names) and "jit(sin)" in names

    summary = load_summary()
    assert summary.plain_id(f"{TARGET}@{TARGET}") == TARGET
    assert summary.plain_id(f"{TARGET}@tests/test_compile_ledger.py") == TARGET
    durations = [{"s": 2.5, "when": "call", "test": f"{TARGET}@{TARGET}"},
                 {"s": 0.5, "when": "setup", "test": f"{TARGET}@{TARGET}"}]
    c = summary.compile_ledger(str(ledger), durations, summary.by_file(durations))
    top = c["top_tests"][0]
    assert top["test"] == TARGET and top["wall_s"] == 3.0 and top["wall_from"] == "durations"
    assert c["total"]["compiles"] == setup["compiles"] + call["compiles"] + rec["phases"]["teardown"]["compiles"]
    assert c["by_phase"]["setup"]["compiles"] >= 1 and c["by_file"][0]["compile_s"] > 0
    summary.print_compile(c, str(ledger))
