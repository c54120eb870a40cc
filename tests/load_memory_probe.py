"""Run in a fresh process: load a checkpoint onto 2 CPU devices and print, as JSON, the host memory the load needed
beyond the params themselves (on CPU the devices' buffers live in this process, so they are subtracted).

    python tests/load_memory_probe.py MODEL_DIR {stream|eager}

``stream``: the streaming loader (slora_jax.model.streaming_loader). ``eager``: the reference loader (every tensor as
float32 on the host, then cast and placed), the control that shows the measurement can tell them apart.

``staging_bytes`` = peak resident set (the kernel's VmHWM) - resident set before loading - bytes of the stacked layer
params on the devices. The streaming loader allocates those stacks before it reads any tensor, so at every moment
after that the devices hold at least them: the host memory used for anything else never exceeded ``staging_bytes``.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"  # host memory is the question: the CPU devices, even on a GPU machine

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from slora_jax.model.config import ModelConfig  # noqa: E402
from slora_jax.model.loader import load_params  # noqa: E402
from slora_jax.model.sharding import TensorParallel  # noqa: E402
from slora_jax.model.streaming_loader import stream_params  # noqa: E402


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def device_bytes(tree) -> int:
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards)


def main(model_dir: str, how: str) -> None:
    cfg = ModelConfig.from_model_dir(model_dir)
    tp = TensorParallel.create(cfg, 2)
    jnp.zeros(8).block_until_ready()  # the CPU client and its thread pools exist before the baseline
    baseline = status_bytes("VmRSS")
    t0 = time.perf_counter()
    if how == "stream":
        _, params = stream_params(model_dir, jnp.bfloat16, tp=tp, stacked=True, progress=False)
    else:
        _, params = load_params(model_dir, dtype=jnp.bfloat16, progress=False, stacked=True)
        params = tp.place_params(params)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    peak = status_bytes("VmHWM")
    stacks = device_bytes(params["layers"])
    ckpt = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    print(json.dumps({"checkpoint_bytes": ckpt, "device_bytes": device_bytes(params), "stack_bytes": stacks,
                      "baseline_rss": baseline, "peak_rss": peak, "staging_bytes": peak - baseline - stacks,
                      "seconds": seconds}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
