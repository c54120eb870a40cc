"""Counts XLA backend compiles in this process, so steady-state serving can prove it compiles nothing; and turns on
JAX's persistent compilation cache, so a restart loads its compiled steps from disk instead of compiling them; and
says how many threads may compile warm-up steps at once."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"  # every compile request, served from the cache or not
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_count = 0
_hits = 0
_thread_hits = threading.local()  # per thread: a compile's cache lookup records its hit on the compiling thread
_installed = False


def _listener(event: str, duration_secs: float, **kwargs) -> None:
    global _count
    if event == _EVENT:
        with _lock:
            _count += 1


def _hit_listener(event: str, **kwargs) -> None:
    global _hits
    if event == _CACHE_HIT:
        with _lock:
            _hits += 1
        _thread_hits.n = getattr(_thread_hits, "n", 0) + 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            jax.monitoring.register_event_listener(_hit_listener)
            _installed = True


def cache_hits() -> int:
    """Compiles served from the persistent compilation cache since :func:`install`."""
    return _hits


def thread_cache_hits() -> int:
    """Compiles served from the persistent cache on the calling thread since :func:`install` (tells whether one
    ``compile()`` on this thread was a cache hit while other threads compile too)."""
    return getattr(_thread_hits, "n", 0)


def enable_persistent_cache(path: str | Path) -> Path:
    """Keep every compiled executable in ``path`` (JAX's own cache, keyed by the program, the devices and the
    versions), so the next process with the same shapes skips its compiles. Call before the first compile."""
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the steps' many small compiles too
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def compile_count() -> int:
    """Backend compiles seen since :func:`install` (process-wide: any jitted function counts)."""
    return _count


MAX_COMPILE_WORKERS = 8
COMPILE_HOST_BYTES = 2 << 30  # host memory one step compile may take (a guess on the safe side for a 7B step)


def compile_workers() -> int:
    """Threads for compiling warm-up steps ahead: $SLORA_JAX_COMPILE_WORKERS if set; else 1 (one compile at a time)
    while the persistent cache is off, otherwise one per core, at most 8 and one per 2 GiB of available memory."""
    env = os.environ.get("SLORA_JAX_COMPILE_WORKERS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"SLORA_JAX_COMPILE_WORKERS must be a positive integer, got {env!r}")
        return int(env)
    if not persistent_cache_enabled():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_COMPILE_WORKERS, cores, available_memory() // COMPILE_HOST_BYTES))


def persistent_cache_enabled() -> bool:
    return bool(jax.config.jax_compilation_cache_dir)


def available_memory() -> int:
    """Host memory available to new allocations: MemAvailable, or less where this process's cgroup (a container's
    memory limit) leaves less; a large number where neither can be read."""
    room = 1 << 50
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    cgroup = _cgroup_room()
    return room if cgroup is None else min(room, cgroup)


_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # v2
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _cgroup_room(files=_CGROUP_FILES) -> int | None:
    """Bytes left under the cgroup's memory limit, or None without a limit (or where it cannot be read)."""
    for limit_file, usage_file in files:
        try:
            limit, usage = Path(limit_file).read_text().strip(), int(Path(usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None
