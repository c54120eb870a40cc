"""Start the real HTTP server in-process (uvicorn in a background thread, free port) on the tiny model for tests.

Each test module starts its own server (module-scoped fixture) with a small engine on the reference backend; the
test can still reach the engine, its thread and the app directly (``RunningServer``) to check pool stats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.model.config import ModelConfig
from slora_jax.serve.config import ServerConfig
from slora_jax.serve.server import Server
from slora_jax.tools import synth
from slora_jax.tools.tokenizer import load_tokenizer, write_tokenizer

BASE_NAME = "tiny-test"
RANKS = (4, 8, 16, 32)
TARGETS = (("q_proj", "k_proj", "v_proj", "o_proj"), ("q_proj", "v_proj"),
           ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
SMALL_ENGINE = dict(num_pages=256, max_model_len=256, max_prefill_tokens=256, max_batch_size=16, max_loras=8,
                    max_lora_rank=32, dtype="float32", backend="reference")


def adapter_name(i: int) -> str:
    return f"ad-{i:03d}"


def write_model_with_tokenizer(out: Path, seed: int = 3) -> Path:
    model_dir = synth.write_model(out, "tiny", seed=seed)
    write_tokenizer(model_dir, ModelConfig.from_model_dir(model_dir).vocab_size)
    return model_dir


def write_adapters(out: Path, cfg: ModelConfig, n: int, ranks=RANKS) -> dict[str, Path]:
    """``n`` adapters of mixed ranks and targets named ad-000.. (every rank fits the engine's max_lora_rank)."""
    return {adapter_name(i): synth.write_adapter(out / adapter_name(i), cfg, rank=ranks[i % len(ranks)],
                                                 targets=TARGETS[i % len(TARGETS)], seed=500 + i)
            for i in range(n)}


@dataclasses.dataclass
class RunningServer:
    server: Server
    engine: Engine
    model_dir: Path
    adapter_dir: Path
    adapters: list[str]
    api_key: str | None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def base_url(self) -> str:
        return self.server.url + "/v1"

    @property
    def tokenizer(self):
        """The server's own (plain) tokenizer."""
        return self.server.app.state.tokenizer

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def call(self, fn, timeout: float = 60.0):
        """Run ``fn()`` in the engine thread (the only safe place to touch the engine) and return its result."""
        return asyncio.run(self.server.engine_thread.call(fn, timeout=timeout))

    def stats(self) -> dict:
        return self.call(self.engine.stats)

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Engine stats once no request is waiting or running and every finished one was released."""
        deadline = time.monotonic() + timeout
        while True:
            stats, open_requests = self.call(lambda: (self.engine.stats(), len(self.engine.requests)))
            if stats["waiting"] == 0 and stats["running"] == 0 and open_requests == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {stats}, {open_requests} open requests")
            time.sleep(0.05)

    def offline_generate(self, prompts: list[list[int]], adapters: list[str | None], sampling) -> list[list[int]]:
        """``Engine.generate`` on the serving engine (inside its thread; call it while no request is in flight)."""
        return self.call(lambda: self.engine.generate(prompts, adapters, sampling), timeout=300)

    def stop(self) -> None:
        self.server.stop()


def start_server(root: Path, n_adapters: int = 8, api_key: str | None = None, allowed_dirs: tuple[Path, ...] = (),
                 warmup: bool = False, ranks: tuple[int, ...] = RANKS, **engine_overrides) -> RunningServer:
    """Write the tiny model (+ tokenizer) and ``n_adapters`` adapters under ``root`` and serve them on a free port.

    The adapter dir is always an allowed load dir. Warm-up is off by default: tests compile only the buckets they
    use, which keeps each module's start-up short.
    """
    model_dir = write_model_with_tokenizer(root / "model")
    cfg = ModelConfig.from_model_dir(model_dir)
    adapter_dir = root / "adapters"
    adapters = write_adapters(adapter_dir, cfg, n_adapters, ranks)
    ecfg = EngineConfig(**{**SMALL_ENGINE, **engine_overrides})
    engine = Engine.from_model_dir(model_dir, ecfg, adapters=adapters, tokenizer=load_tokenizer(model_dir),
                                   progress=False)
    if warmup:
        engine.warmup(progress=False)
    config = ServerConfig(served_model_name=BASE_NAME, api_key=api_key,
                          allowed_adapter_dirs=(adapter_dir, *allowed_dirs))
    server = Server(engine, config, host="127.0.0.1", port=0, log_level="warning",
                    tokenizer=load_tokenizer(model_dir))
    server.start_background()
    return RunningServer(server, engine, model_dir, adapter_dir, list(adapters), api_key)


def start_server_with_options(root: Path, server_options: dict, n_adapters: int = 4, api_key: str | None = None,
                              **engine_overrides) -> RunningServer:
    """Like :func:`start_server`, with ``ServerConfig`` fields of the test's choosing (limits, timeouts, shutdown
    grace)."""
    model_dir = write_model_with_tokenizer(root / "model")
    cfg = ModelConfig.from_model_dir(model_dir)
    adapter_dir = root / "adapters"
    adapters = write_adapters(adapter_dir, cfg, n_adapters)
    ecfg = EngineConfig(**{**SMALL_ENGINE, **engine_overrides})
    engine = Engine.from_model_dir(model_dir, ecfg, adapters=adapters, tokenizer=load_tokenizer(model_dir),
                                   progress=False)
    config = ServerConfig(served_model_name=BASE_NAME, api_key=api_key, allowed_adapter_dirs=(adapter_dir,),
                          **server_options)
    server = Server(engine, config, host="127.0.0.1", port=0, log_level="warning",
                    tokenizer=load_tokenizer(model_dir))
    server.start_background()
    return RunningServer(server, engine, model_dir, adapter_dir, list(adapters), api_key)
