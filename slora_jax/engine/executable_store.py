"""Keeps each warm-up step's compiled executable on disk, so a restart loads it instead of tracing, lowering and
compiling the step again.

JAX's persistent compilation cache skips only XLA's compile: every step is still traced and lowered in Python first
(1-2 s per unrolled 7B step, ~33 steps), which alone exceeds a 40 s restart. An entry here is keyed by everything
that determines the executable: jax/jaxlib versions, the backend and its devices, the source of ``slora_jax`` and
``pallas_kernels`` (any edit misses), XLA_FLAGS and the jax settings that change lowering, the step runner's model,
engine and tensor-parallel settings, the job, its static layout and every argument's shape, dtype and sharding.

A bad entry (truncated, corrupt, written for other inputs, failing to load) is logged, deleted and compiled again;
nothing here may stop a server from starting. A step holding a Mosaic GPU kernel is not stored: it loads only in the
process that compiled it. Entries are pickles (as ``jax.experimental.serialize_executable`` makes them): keep the
cache dir as private as the code itself.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import logging
import os
import pickle
import platform
import re
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

FORMAT = b"slora-jax-exe-1\n"  # file magic; bump when the entry layout changes
ENV_SWITCH = "SLORA_JAX_EXECUTABLE_STORE"  # "0": keep the persistent compilation cache but not this store
# "1" / "0": also store (or not) a step that JAX's persistent cache served; unset: on the GPU only. On XLA:CPU (jax
# 0.10.2) such an executable, serialized again, loads at the next start and fails at its first run ("Function ... not
# found"); on XLA:GPU (jax 0.11.2, H200, session 9) tests/test_executable_store.py's GPU test passes. Without it a
# restart after a code change never refills the store for the steps JAX's cache still holds (traced at every start).
STORE_CACHE_SERVED_SWITCH = "SLORA_JAX_STORE_CACHE_SERVED"
SUFFIX = ".exe"
# Custom calls whose executables load only in the process that compiled them: a Mosaic GPU kernel is linked into
# that process, and in another one loading fails ("Failed to lookup host symbol ... paged_prefill_mosaic_mosaic_gpu";
# jax 0.11.2, H200, session 20: both Mosaic prefill steps were dropped at every restart). Such steps are not stored;
# JAX's persistent cache still spares them XLA's compile.
PROCESS_BOUND_CALL = re.compile(r'custom_call_target="(mosaic_gpu[^"]*)"')
PACKAGES = ("slora_jax", "pallas_kernels")
# jax settings that change what a step lowers to (the rest of the key pins the code and shapes)
JAX_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                "jax_threefry_partitionable", "jax_use_shardy_partitioner", "jax_numpy_dtype_promotion")

# EngineConfig fields that never reach a compiled step (scheduling, host tiers, pool sizing: the pool's shape is in
# the argument signature). Every other field, present or future, is part of the key.
NOT_IN_STEPS = frozenset({
    "pool_bytes", "num_pages", "max_waiting", "scheduling_policy", "first_token_slo_s", "early_abort",
    "vtc_input_weight", "vtc_output_weight", "vtc_reserved_slots", "adapter_lookahead", "adapter_max_bypass",
    "prefix_cache", "max_cpu_loras", "host_budget_bytes", "max_staged_adapters", "admit_while_loading",
    "adapter_read_processes", "stable_step_inputs"})

_active: ExecutableStore | None = None


def enable(path: str | Path) -> ExecutableStore | None:
    """Keep warm-up executables under ``path`` from now on (the server: ``<compilation cache dir>/executables``);
    None, and off, when $SLORA_JAX_EXECUTABLE_STORE is "0"."""
    global _active
    if os.environ.get(ENV_SWITCH, "1") == "0":
        _active = None
        return None
    _active = ExecutableStore(path)
    return _active


def disable() -> None:
    global _active
    _active = None


def active() -> ExecutableStore | None:
    """The store warm-ups use, or None (off: the default, and with ``--no-compilation-cache``)."""
    return _active


@functools.cache
def source_digest() -> str:
    """sha256 over every .py file of the packages whose code becomes the steps (paths and contents)."""
    h = hashlib.sha256()
    for name in PACKAGES:
        root = Path(importlib.import_module(name).__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root.parent)).encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def environment() -> str:
    """What every entry of this process shares: versions, backend, devices, code and lowering settings."""
    devices = jax.devices()
    backend = devices[0].client
    jaxlib = sys.modules.get("jaxlib")
    parts = dict(
        jax=jax.__version__, jaxlib=getattr(jaxlib, "__version__", "?"), python=platform.python_version(),
        platform=backend.platform, platform_version=backend.platform_version,
        devices=[(d.id, d.device_kind) for d in devices], processes=jax.process_count(),
        xla_flags=os.environ.get("XLA_FLAGS", ""), source=source_digest(),
        settings={name: str(getattr(jax.config, name, None)) for name in JAX_SETTINGS})
    return repr(sorted(parts.items()))


def step_settings(ecfg) -> dict:
    """The engine settings (a dataclass) that can change a compiled step."""
    return {f.name: getattr(ecfg, f.name) for f in dataclasses.fields(ecfg) if f.name not in NOT_IN_STEPS}


def abstract_signature(args) -> str:
    """The pytree structure and every leaf's shape, dtype, weak type and sharding (a host array: 'host')."""
    leaves, tree = jax.tree.flatten(args)
    sig = [str(tree)]
    for x in leaves:
        if isinstance(x, jax.Array):
            sig.append(f"{x.shape}|{x.dtype}|{getattr(x, 'weak_type', False)}|{x.sharding}")
        else:
            a = np.asarray(x)
            sig.append(f"{a.shape}|{a.dtype}|host")
    return "\n".join(sig)


def process_bound_call(compiled) -> str | None:
    """The target of the first :data:`PROCESS_BOUND_CALL` in ``compiled``'s HLO, or None; None too when the text
    cannot be had (then saving decides)."""
    try:
        found = PROCESS_BOUND_CALL.search(compiled.as_text() or "")
    except Exception:  # noqa: BLE001 - not an executable with text: serialize will say what it is
        return None
    return found.group(1) if found else None


class ExecutableStore:
    """One directory of entries: ``<sha256 of key>.exe`` = FORMAT + sha256(body) + body, body a pickle of the key
    text, the serialized executable and its argument and result trees."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.loaded = self.saved = self.dropped = self.cache_served = self.process_bound = 0

    def key(self, *parts: str) -> str:
        """The full key text: this process's :func:`environment` and the caller's parts (runner, job, arguments)."""
        return "\n--\n".join((environment(), *parts))

    def path(self, key: str) -> Path:
        return self.root / (hashlib.sha256(key.encode()).hexdigest() + SUFFIX)

    def load(self, key: str, args: tuple, devices: Sequence) -> jax.stages.Compiled | None:
        """The executable stored for ``key``, loaded onto ``devices`` (the ones it runs on, in mesh order) and
        checked against ``args`` (the positional arguments it will be called with, static ones left out); None
        when there is none or it is unusable (then the entry is gone and a warning says why)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            return self._drop(path, f"unreadable: {e}")
        try:
            head = len(FORMAT)
            if data[:head] != FORMAT:
                return self._drop(path, "not an entry of this format")
            digest, body = data[head:head + 32], data[head + 32:]
            if hashlib.sha256(body).digest() != digest:
                return self._drop(path, f"corrupt or truncated ({len(data)} bytes)")
            entry = pickle.loads(body)
            if entry["key"] != key:
                return self._drop(path, "written for other inputs")
            if entry["in_tree"] != jax.tree.structure((args, {})):
                return self._drop(path, "its argument tree differs from the call's")
            compiled = serialize_executable.deserialize_and_load(
                entry["executable"], entry["in_tree"], entry["out_tree"], backend=devices[0].client,
                execution_devices=list(devices))
        except Exception as e:  # noqa: BLE001 - any failure to load means: compile as if it were not there
            return self._drop(path, f"failed to load: {type(e).__name__}: {e}")
        with self._lock:
            self.loaded += 1
        return compiled

    def save(self, key: str, compiled: jax.stages.Compiled) -> bool:
        """Write ``compiled`` for ``key`` (temp file + rename: a reader never sees half an entry); False, with a
        warning, when it cannot be serialized or written, and False, logged at info, when it holds a
        :data:`PROCESS_BOUND_CALL` (nothing to store: it would not load at the next start)."""
        path = self.path(key)
        bound = process_bound_call(compiled)
        if bound is not None:
            log.info("executable store: not storing %s: it holds a %s call, which loads only in this process",
                     path.name, bound)
            with self._lock:
                self.process_bound += 1
            return False
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
            body = pickle.dumps(dict(key=key, executable=executable, in_tree=in_tree, out_tree=out_tree),
                                protocol=pickle.HIGHEST_PROTOCOL)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=path.stem[:16], suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(FORMAT + hashlib.sha256(body).digest() + body)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except Exception as e:  # noqa: BLE001 - the step still runs; only the next start pays its compile
            log.warning("executable store: cannot save %s: %s: %s", path.name, type(e).__name__, e)
            return False
        with self._lock:
            self.saved += 1
        return True

    @staticmethod
    def stores_cache_served() -> bool:
        switch = os.environ.get(STORE_CACHE_SERVED_SWITCH)
        return jax.default_backend() == "gpu" if switch not in ("0", "1") else switch == "1"

    def note_cache_served(self) -> None:
        """Count a step compiled here that JAX's persistent cache served, so not stored (see the step runner)."""
        with self._lock:
            self.cache_served += 1

    def _drop(self, path: Path, why: str) -> None:
        log.warning("executable store: dropping %s (%s); compiling that step instead", path.name, why)
        path.unlink(missing_ok=True)
        with self._lock:
            self.dropped += 1
        return None
