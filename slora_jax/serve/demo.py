"""The embedded demo: a random ``tiny`` Llama, a local tokenizer and 100 PEFT adapters, built once into a cache dir.

``python -m slora_jax.serve`` with no ``--model`` serves this, so the server can be tried with no download. Builds go
to a temporary dir renamed into place, so an interrupted build is never mistaken for a finished one.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from ..model.config import ModelConfig
from ..tools import synth
from ..tools.tokenizer import write_tokenizer

log = logging.getLogger("slora_jax.serve")

DEMO_PRESET = "tiny"
DEMO_ADAPTERS = 100
DEMO_RANKS = (4, 8, 16, 32)
DEMO_MODEL_NAME = "slora-demo"
_TARGETS = (("q_proj", "k_proj", "v_proj", "o_proj"),
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            ("q_proj", "v_proj"))


def cache_root() -> Path:
    """``$SLORA_JAX_CACHE`` if set, else ``~/.cache/slora-jax``."""
    return Path(os.environ.get("SLORA_JAX_CACHE") or Path.home() / ".cache" / "slora-jax").expanduser()


def demo_name(i: int) -> str:
    return f"demo-{i:03d}"


def _build_into(final: Path, build) -> Path:
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        tmp.rename(final)
    except OSError:
        if not final.exists():  # a concurrent builder did not win the race either: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_demo(dtype: str = "float32", root: Path | None = None, n_adapters: int = DEMO_ADAPTERS) -> tuple[Path, Path]:
    """(model dir, adapters dir) of the demo, writing whatever is missing; params are stored in ``dtype``."""
    root = (root or cache_root()) / "demo"
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)

    def build_model(out: Path) -> None:
        log.info("writing the demo model (%s preset, %s) to %s", DEMO_PRESET, dtype, out)
        synth.write_model(out, DEMO_PRESET, seed=0, dtype=np_dtype)
        write_tokenizer(out, ModelConfig.from_model_dir(out).vocab_size)

    model_dir = _build_into(root / f"model-{dtype}", build_model)
    cfg = ModelConfig.from_model_dir(model_dir)

    def build_adapters(out: Path) -> None:
        for i in tqdm(range(n_adapters), desc="writing demo adapters"):
            synth.write_adapter(out / demo_name(i), cfg, rank=DEMO_RANKS[i % len(DEMO_RANKS)],
                                targets=_TARGETS[i % len(_TARGETS)], seed=1000 + i)

    adapters_dir = _build_into(root / f"adapters-{n_adapters}", build_adapters)
    return model_dir, adapters_dir

