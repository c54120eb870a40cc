"""Does a host-to-device input transfer block the host while a step runs? Times each way of getting a small int32
array to a jitted step while a ~20 ms computation is in flight.

    PYTHONPATH=. python benchmarks/transfer_probe.py

Why: PjRt on GPU synchronises allocations with the compute stream, so a fresh device buffer for a numpy argument may
have to wait for the computation already queued; if the host waits too, the engine's overlap of host work with the
device is lost. Memory kinds (``pinned_host``) are tried as a way around it.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def main() -> None:
    dev = jax.devices()[0]
    n = 8192 if dev.platform == "gpu" else 512
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)

    @jax.jit
    def long(x):
        for _ in range(24):
            x = (x @ x) * 0.01
        return x

    meta = np.arange(4096, dtype=np.int32)
    use = jax.jit(lambda x: x.sum())
    kinds = {}
    for kind in ("pinned_host", "unpinned_host", "device"):
        try:
            s = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)
            jax.device_put(meta, s).block_until_ready()
            kinds[kind] = s
        except Exception as e:  # noqa: BLE001
            print(f"memory kind {kind}: unavailable ({type(e).__name__}: {str(e)[:80]})")
    modes = {
        "jit(numpy arg)": lambda: use(meta),
        "device_put(numpy)": lambda: jax.device_put(meta),
    }
    for kind, s in kinds.items():
        if kind == "device":
            continue
        modes[f"device_put -> {kind}"] = lambda s=s: jax.device_put(meta, s)
        to_dev = kinds.get("device")
        if to_dev is not None:
            inside = jax.jit(lambda x, to_dev=to_dev: jax.device_put(x, to_dev).sum())
            try:
                xh = jax.device_put(meta, s)
                assert int(inside(xh)) == int(meta.sum())
                modes[f"jit({kind} arg, moved inside)"] = lambda s=s, inside=inside: inside(jax.device_put(meta, s))
            except Exception as e:  # noqa: BLE001
                print(f"jit with a {kind} argument: fails ({type(e).__name__}: {str(e)[:120]})")
    for fn in modes.values():
        jax.block_until_ready(fn())
    t = time.perf_counter()
    long(a).block_until_ready()
    long_ms = (time.perf_counter() - t) * 1e3
    print(f"{jax.devices()[0].device_kind} jax {jax.__version__}: in-flight computation {long_ms:.1f} ms")
    for name, fn in modes.items():
        host = []
        for _ in range(5):
            out = long(a)
            time.sleep(0.002)  # the computation is running now
            t = time.perf_counter()
            r = fn()
            host.append((time.perf_counter() - t) * 1e3)
            jax.block_until_ready((out, r))
        print(f"  {name:40s} host {np.median(host):7.3f} ms (median of 5)")


if __name__ == "__main__":
    main()
