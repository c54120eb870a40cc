"""Helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def git_commit() -> str:
    """The commit measured: $SLORA_GIT_COMMIT (set by the caller where the tree has no .git), else git."""
    env = os.environ.get("SLORA_GIT_COMMIT")
    if env:
        return env
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        out = res.stdout.strip()
        return out if res.returncode == 0 and len(out) == 40 else "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


COPY_PROBE = r"""
import json, sys, time
out = {}
try:
    import torch
    assert torch.cuda.is_available(), "torch has no CUDA"
    n = int(sys.argv[1]) // 2
    a = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    def timed(fn, reps):
        fn(); torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = []
        for _ in range(5):
            start.record()
            for _ in range(reps):
                fn()
            end.record(); torch.cuda.synchronize()
            best.append(start.elapsed_time(end) / 1e3 / reps)
        return sorted(best)[len(best) // 2]
    t = timed(lambda: b.copy_(a), 10)
    out["copy_gbps"] = 2 * a.numel() * 2 / t / 1e9
    out["copy_source"] = "torch b.copy_(a), %d MiB bf16, read+write" % (a.numel() * 2 >> 20)
    out["device"] = torch.cuda.get_device_name()
    del a, b
    m = int(sys.argv[2])
    if m:
        x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
        y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
        t = timed(lambda: x @ y, 10)
        out["matmul_tflops"] = 2 * m**3 / t / 1e12
        out["matmul_source"] = "torch bf16 %d^3" % m
    out["torch"] = torch.__version__
except Exception as exc:  # noqa: BLE001
    out["error"] = repr(exc)
print("PROBE" + json.dumps(out))
"""


def device_ceilings(copy_bytes: int = 2 << 30, matmul_n: int = 0) -> dict:
    """Copy bandwidth (read + write) and, if ``matmul_n``, the bf16 matmul rate, from torch in a child process so
    that JAX has not claimed the GPU yet. Keys: copy_gbps, copy_source, device, matmul_tflops; ``error`` if none."""
    try:
        proc = subprocess.run([sys.executable, "-c", COPY_PROBE, str(copy_bytes), str(matmul_n)], capture_output=True,
                              text=True, timeout=180)
        line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE"))
        return json.loads(line[len("PROBE"):])
    except Exception as exc:  # noqa: BLE001
        return {"error": repr(exc)}
