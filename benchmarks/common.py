"""Helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import os
import subprocess


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
