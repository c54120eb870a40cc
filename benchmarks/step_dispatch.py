"""Host time of one decode step's dispatch: through the jitted step (C++ fast path) and through the same step as an
executable loaded from the executable store (``jax.stages.Compiled``), as a restart serves it. The serving loop
dispatches ~100 steps a second, so a slower call path would cost every step.

    PYTHONPATH=. python benchmarks/step_dispatch.py                              # tiny random model (CPU or GPU)
    PYTHONPATH=. python benchmarks/step_dispatch.py --model-dir DIR --batch 64 --out r.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.executable_store import ExecutableStore
from slora_jax.engine.step_runner import pack_inputs
from slora_jax.tools import synth


def time_calls(call, pool, state, n: int) -> tuple:
    """(seconds until each call returns, seconds per call including the step when each is waited for, the pool and
    penalty state after the calls: both are donated to every call)."""
    dispatch, whole = [], []
    for _ in range(n):
        t = time.perf_counter()
        out, state, pool = call(pool, state)
        dispatch.append(time.perf_counter() - t)
        out.tokens.block_until_ready()
        whole.append(time.perf_counter() - t)
    return dispatch, whole, pool, state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="default: a random tiny model written to a temp dir")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="step_dispatch_"))
    model_dir = args.model_dir or synth.write_model(tmp / "model", "tiny", seed=1)
    on_gpu = jax.default_backend() == "gpu"
    ecfg = EngineConfig(max_batch_size=args.batch, max_prefill_tokens=64, max_prefill_seqs=2, max_model_len=64,
                        page_size=16, max_lora_rank=8, max_loras=2, num_pages=256,
                        dtype="bfloat16" if on_gpu else "float32", backend="pallas" if on_gpu else "reference",
                        decode_lora_variants=False)
    engine = Engine.from_model_dir(model_dir, ecfg, progress=False)
    runner = engine.runner
    fn = runner.step_fn("decode")
    packed, layout = pack_inputs(*runner.build_decode([], n=args.batch))
    params, table, prev = engine.params, engine.pool.table, runner._no_prev  # noqa: SLF001 - a benchmark's probe
    store = ExecutableStore(tmp / "executables")
    store.save("k", fn.lower(layout, params, engine.pool.array, table, packed, prev, runner.penalty_state).compile())
    loaded = store.load("k", (params, engine.pool.array, table, packed, prev, runner.penalty_state), [jax.devices()[0]])
    ways = {"jit": lambda pool, st: fn(layout, params, pool, table, packed, prev, st),
            "loaded": lambda pool, st: loaded(params, pool, table, packed, prev, st)}
    pool, state, report = engine.pool.array, runner.penalty_state, {"device": str(jax.devices()[0]),
                                                                    "batch": args.batch, "calls": args.calls}
    for _ in range(2):  # both ways twice, alternating: the second round is reported
        for name, call in ways.items():
            dispatch, whole, pool, state = time_calls(call, pool, state, args.calls)
            report[name] = {"dispatch_us_median": statistics.median(dispatch) * 1e6,
                            "dispatch_us_p90": sorted(dispatch)[int(0.9 * len(dispatch))] * 1e6,
                            "step_us_median": statistics.median(whole) * 1e6}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
