"""``python -m slora_jax.serve``: flags named like vLLM's, so existing scripts need few changes.

With no ``--model`` it serves the embedded demo (random tiny Llama + 100 adapters, built once into a cache dir).
On a machine without a GPU it defaults to the ``reference`` backend (Pallas in interpret mode is far too slow to
serve) and float32; on a GPU to ``pallas`` and bfloat16.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pallas_kernels.backends import backend_names

from ..engine.config import MIN_POOL_BATCH, ROW_TOKENS, EngineConfig
from ..engine.policies import POLICIES
from .config import (
    BODY_BYTES_BESIDE_PROMPT,
    BODY_BYTES_PER_PROMPT_CHAR,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_TENANT_HEADER,
    MIN_BODY_BYTES,
    PROMPT_CHARS_PER_TOKEN,
    ServerConfig,
    check_api_key,
    context_len,
)
from .flag_types import header_name, non_negative_int, positive_int, positive_seconds, vtc_weights

log = logging.getLogger("slora_jax.serve")
GPU_BATCH_BOUND = 256  # a GPU server's batch without --max-batch-size: this, lowered to what the pool holds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slora_jax.serve", description=__doc__.splitlines()[0])
    g = p.add_argument_group("model and adapters")
    g.add_argument("--model", type=Path, help="HF Llama model dir (config.json, safetensors, tokenizer); "
                   "omit to serve the embedded demo")
    g.add_argument("--served-model-name", help="name clients use for the base model (default: the dir's name)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters to serve, each validated fully at start-up")
    g.add_argument("--adapter-dir", type=Path, action="append", default=[], metavar="DIR",
                   help="serve every subdir of DIR as an adapter named after it (read on first use); runtime "
                   "loads are allowed from below DIR (repeatable)")
    g.add_argument("--allowed-adapter-dir", type=Path, action="append", default=[], metavar="DIR",
                   help="also allow /v1/load_lora_adapter from below DIR (repeatable)")
    g.add_argument("--max-loras", type=int, default=None,
                   help="adapters resident in the pool at once (default: the max batch size, so that a batch of "
                   "requests for as many different adapters can run together)")
    g.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory")
    g.add_argument("--adapter-host-gb", type=float, default=None, metavar="GB",
                   help="host memory for adapters read from disk (default: 40%% of the memory available at start, "
                   "at least 1 GB), so a served adapter is read from disk once")
    g.add_argument("--adapter-read-processes", type=int, default=None, metavar="N",
                   help="processes reading adapter files, so reads never wait on the engine thread (default 5 on a "
                   "GPU: the 4 IO threads' and the engine thread's; 0 on CPU: read on the IO threads)")
    g.add_argument("--host-fill", action=argparse.BooleanOptionalAction, default=None,
                   help="read every registered adapter into host memory in the background once the server starts "
                   "(into free room of --adapter-host-gb, never evicting; behind the requests' own reads), so a "
                   "request's first use of an adapter waits for no disk read (default: on, off with --ray, whose "
                   "replicas share the host and each serve their share of the adapters); --no-host-fill reads each "
                   "adapter at its first request")
    g.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank accepted")
    e = p.add_argument_group("engine")
    e.add_argument("--pool-gb", type=float, default=None,
                   help="memory of the unified KV + adapter pool (default: 85%% of the device memory free after "
                   "the weights are loaded; 0.25 GB on CPU)")
    e.add_argument("--num-pages", type=int, default=None, help="pool size in pages instead of --pool-gb")
    e.add_argument("--max-batch-size", type=int, default=None,
                   help="most running sequences per decode step (default on a GPU: as many as the pool holds with "
                   f"{ROW_TOKENS} tokens of KV a row, a power of two from {MIN_POOL_BATCH} to {GPU_BATCH_BOUND}; 64 on "
                   "CPU); admission may run fewer, as each request reserves its worst-case KV")
    e.add_argument("--max-model-len", type=int, default=None,
                   help=f"prompt + output tokens (default: the model's, at most {DEFAULT_MAX_MODEL_LEN})")
    e.add_argument("--max-prefill-tokens", type=int, default=None, help="tokens per prefill step (>= max-model-len)")
    e.add_argument("--max-waiting", type=int, default=4096, help="queued requests before 429")
    e.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    e.add_argument("--backend", choices=backend_names(), default=None,
                   help="kernels: pallas (GPU default) or the jnp reference (CPU default)")
    e.add_argument("--layer-loop", choices=["auto", "scan", "unroll"], default="auto",
                   help="unroll: per-layer weights, no per-step weight copies (auto on GPU); scan: stacked weights, "
                        "short compiles (auto on CPU)")
    e.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar="N",
                   help="split the model over N devices of this host: heads, KV heads, MLP columns and the pool "
                   "(README: 'Serving on several GPUs')")
    e.add_argument("--fully-sharded-loras", action="store_true",
                   help="with --tensor-parallel-size: split every adapter N ways too (less adapter memory, up to 4 "
                   "small all-reduces more per layer) instead of adding no collectives")
    e.add_argument("--converted-params-dir", type=Path, default=None, metavar="DIR",
                   help="restore the converted, sharded weights from DIR (orbax) when it holds them for this model, "
                   "TP size, dtype and layout; else convert the HF checkpoint and save them there")
    e.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto",
                   help="params and pool dtype (auto: bfloat16 on GPU, float32 on CPU)")
    e.add_argument("--stable-step-inputs", action=argparse.BooleanOptionalAction, default=None,
                   help="copy each step's input into one persistent device buffer, so the step's CUDA graph is not "
                   "updated every call (default: on on a GPU, off on CPU)")
    e.add_argument("--no-warmup", action="store_true", help="compile step buckets on first use instead of now")
    e.add_argument("--no-mid-buckets", action="store_true", help="step sizes at powers of two only (default on a "
                   "GPU: also 3/2 of each from 512 prefill tokens and 128 decode rows; fewer padding rows)")
    e.add_argument("--compilation-cache-dir", type=Path, default=Path(os.environ.get(
                       "SLORA_JAX_CACHE_DIR", Path.home() / ".cache" / "slora_jax")) / "xla",
                   help="keep compiled steps here (and each step's executable under executables/) so a restart "
                        "skips its compiles and tracing (default: "
                        "$SLORA_JAX_CACHE_DIR/xla or ~/.cache/slora_jax/xla)")
    e.add_argument("--no-compilation-cache", action="store_true",
                   help="compile every step at start-up (the executable store is off too)")
    q = p.add_argument_group("scheduling (docs/SERVING.md, 'Scheduling policies')")
    q.add_argument("--scheduling-policy", choices=sorted(POLICIES), default="fcfs",
                   help="order in which waiting requests are admitted (and their adapters prefetched)")
    q.add_argument("--first-token-slo-s", type=positive_seconds, default=None, metavar="SECONDS",
                   help="default first-token deadline after arrival (a request may set its own first_token_slo_s); "
                   "the slo policy serves the earliest deadline first")
    q.add_argument("--early-abort", action="store_true",
                   help="end a request that can no longer meet its first-token deadline (HTTP 503) instead of "
                   "serving it late")
    q.add_argument("--enable-prefix-caching", action="store_true",
                   help="share the KV pages of prompt prefixes (same adapter, same tokens) between requests")
    q.add_argument("--vtc-weights", type=vtc_weights, default=None, metavar="IN,OUT",
                   help="vtc: service counted per prompt token and per generated token (default "
                   f"{EngineConfig.vtc_input_weight:g},{EngineConfig.vtc_output_weight:g})")
    q.add_argument("--vtc-reserved-slots", type=non_negative_int, default=None, metavar="N",
                   help="vtc: the last N batch slots go only to tenants below an equal share of the batch, so a "
                   "light tenant does not wait for a heavy tenant's request to finish (default max-batch-size/32)")
    q.add_argument("--adapter-lookahead", type=positive_int, default=None, metavar="N",
                   help="adapter-aware: waiting requests searched for one whose adapter is resident (default "
                   f"{EngineConfig.adapter_lookahead})")
    q.add_argument("--adapter-max-bypass", type=non_negative_int, default=None, metavar="N",
                   help="adapter-aware: how many younger requests may be admitted before a waiting one, which then "
                   f"goes first (default {EngineConfig.adapter_max_bypass}; 0 = fcfs)")
    q.add_argument("--admit-while-loading", action=argparse.BooleanOptionalAction, default=None,
                   help="admission passes over a request whose adapter is still being read from disk (or copied to "
                   "the GPU) while other requests can run, instead of the engine waiting for that read; it keeps its "
                   "place (default on; it helps most when the adapters outgrow host memory)")
    q.add_argument("--tenant-header", type=header_name, default=DEFAULT_TENANT_HEADER, metavar="NAME",
                   help="request header naming the tenant a request counts towards under vtc (absent: its adapter)")
    s = p.add_argument_group("HTTP")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("SLORA_JAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SLORA_JAX_API_KEY; an empty key is "
                   "refused); also turns off /docs, /redoc and /openapi.json")
    s.add_argument("--max-body-bytes", type=positive_int, default=None, help="largest request body, 413 beyond "
                   f"(default: {BODY_BYTES_PER_PROMPT_CHAR} bytes a prompt character plus "
                   f"{BODY_BYTES_BESIDE_PROMPT >> 20} MiB, at least {MIN_BODY_BYTES >> 20} MiB)")
    s.add_argument("--max-prompt-chars", type=int, default=None,
                   help=f"longest text prompt or chat, in characters (default: {PROMPT_CHARS_PER_TOKEN} per token of "
                   "--max-model-len)")
    s.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="time a client has to send a request's headers (then 408 and the connection is closed)")
    s.add_argument("--body-timeout-s", type=float, default=30.0,
                   help="time a client has to send a request's body after its headers (then 408)")
    s.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, how long running requests may take to finish before they end with an error")
    s.add_argument("--defer-hand-over", action=argparse.BooleanOptionalAction, default=False,
                   help="hand each step's tokens to the HTTP side once the next step is on the device, not as soon "
                   "as the step returns (ServerConfig.defer_hand_over; off until the H200 shows it helps)")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine (model, warm-up, steps) in a child process of its own, so the HTTP side "
                   "(JSON, SSE, detokenization) and the step loop do not share one GIL (docs/SERVING.md). On by "
                   "default (H200, 7B, 2000 adapters: 0.99 of the in-process engine's throughput, against 0.90 "
                   "without), except with --ray; --no-engine-process keeps the engine in the server's process")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    r = p.add_argument_group("replicas on Ray Serve (docs/RAY.md; pip install -e '.[ray]')")
    r.add_argument("--ray", action="store_true", help="serve --replicas engines behind one endpoint on --host/--port, "
                   "each request routed to a replica holding its adapter")
    r.add_argument("--replicas", type=positive_int, default=2, metavar="N", help="engines (one per GPU) with --ray")
    r.add_argument("--ray-address", default=None, metavar="ADDR", help="Ray cluster to join ('auto': the one this "
                   "machine belongs to; ray://HOST:10001); default: start a local one")
    return p


# flags that only one policy reads: given with another policy they do nothing, which the log says
_POLICY_FLAGS = {"vtc_weights": "vtc", "vtc_reserved_slots": "vtc", "adapter_lookahead": "adapter-aware",
                 "adapter_max_bypass": "adapter-aware"}


def scheduling_options(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` scheduling fields the flags ask for (unset flags keep the engine's defaults)."""
    opts = dict(scheduling_policy=args.scheduling_policy, first_token_slo_s=args.first_token_slo_s,
                early_abort=args.early_abort, prefix_cache=args.enable_prefix_caching)
    if args.vtc_weights is not None:
        opts["vtc_input_weight"], opts["vtc_output_weight"] = args.vtc_weights
    for name in ("vtc_reserved_slots", "adapter_lookahead", "adapter_max_bypass"):
        if getattr(args, name) is not None:
            opts[name] = getattr(args, name)
    # on for a server unless --no-admit-while-loading (the engine's own default stays off, for offline runs): with
    # adapters beyond host memory it halved the mean TTFT at 70% of saturation on the H200 (NOTES, session 13)
    opts["admit_while_loading"] = args.admit_while_loading is not False
    for name, policy in _POLICY_FLAGS.items():
        if getattr(args, name) is not None and args.scheduling_policy != policy:
            log.warning("--%s only applies to --scheduling-policy %s (this server uses %s)", name.replace("_", "-"),
                        policy, args.scheduling_policy)
    if args.early_abort and args.first_token_slo_s is None:
        log.info("--early-abort without --first-token-slo-s: only requests with their own first_token_slo_s have a "
                 "deadline")
    return opts


def parse_lora_modules(items: list[str]) -> dict[str, Path]:
    modules = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules: expected NAME=PATH, got {item!r}")
        if name in modules:
            raise SystemExit(f"--lora-modules: {name!r} given twice")
        modules[name] = Path(path).expanduser()
    return modules


def adapter_subdirs(root: Path) -> dict[str, Path]:
    """Every subdir of ``root`` holding an adapter_config.json, by name."""
    if not root.is_dir():
        raise SystemExit(f"--adapter-dir: {root} is not a directory")
    return {p.name: p for p in sorted(root.iterdir()) if (p / "adapter_config.json").is_file()}


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def register_adapters(engine, base_name: str, lora_modules: dict[str, Path], adapter_dirs: list[Path]) -> None:
    """``--lora-modules`` through the one validate-then-register path (a bad one stops the server with the reason),
    then every adapter subdir (config checked now, weights on first use; a bad one is skipped with its reason)."""
    from tqdm import tqdm

    from ..lora.peft import AdapterError
    from .adapters import AdapterAdmin
    from .protocol import APIError

    admin = AdapterAdmin(engine, base_name)
    for adapter_name, path in tqdm(lora_modules.items(), desc="validating adapters", disable=not lora_modules):
        try:
            admin.register(adapter_name, path)
        except APIError as e:
            raise SystemExit(f"--lora-modules: {e.message}") from None
    for root in adapter_dirs:
        found = adapter_subdirs(root.expanduser())
        skipped = 0
        for adapter_name, path in tqdm(found.items(), desc=f"registering {root}", disable=len(found) < 2):
            if engine.has_adapter(adapter_name):
                continue
            try:  # one bad adapter among thousands must not stop the server: skip it with its reason
                admin.check_name(adapter_name)  # a directory's name is a client's model name, as a runtime load's
                engine.register_adapter(adapter_name, path)
            except APIError as e:
                log.warning("skipping %r: %s", str(path), e.message)  # repr: a name may not be text
                skipped += 1
            except (AdapterError, ValueError) as e:
                log.warning("skipping %s", e)
                skipped += 1
        if skipped:
            log.warning("%d of %d adapters under %s were skipped (see above)", skipped, len(found), root)


def batch_size(args: argparse.Namespace, on_gpu: bool) -> int:
    """Running sequences per decode step: --max-batch-size, else ``GPU_BATCH_BOUND`` on a GPU (an upper bound: see
    :func:`batch_from_pool`) and 64 on CPU."""
    return args.max_batch_size or (GPU_BATCH_BOUND if on_gpu else 64)


def batch_from_pool(args: argparse.Namespace, on_gpu: bool) -> bool:
    """Whether the engine lowers the batch to what its pool holds (``EngineConfig.batch_from_pool``): on a GPU
    without --max-batch-size. The bound is 256, not 512: on the H200 512 rows gave S1 +3% requests a second but S2
    with 2000 adapters -4.7% (adapter pages took the KV's), 1.8x the time between tokens (NOTES, sessions 21-22)."""
    return on_gpu and not args.max_batch_size


def max_loras(args: argparse.Namespace, batch: int) -> int:
    """Adapter slots: --max-loras, else one per running sequence of the batch's bound (fixed when the pool is built;
    a slot costs its table row, its pages come from the pool). With 64 slots for a batch of 256 on the H200, S1 (2000
    adapters, power-law popularity) ran ~72 sequences a step: the rest waited for a slot, not for memory."""
    return args.max_loras or batch


def served_model_name(args: argparse.Namespace) -> str:
    """The name clients use for the base model."""
    from .demo import DEMO_MODEL_NAME

    return args.served_model_name or (DEMO_MODEL_NAME if args.model is None else args.model.expanduser().resolve().name)


def resolve_model(args: argparse.Namespace, dtype: str) -> tuple[Path, list[Path], str]:
    """(model dir, adapter dirs, served model name) of the flags; writes the demo (in ``dtype``) with no --model."""
    from .demo import ensure_demo

    adapter_dirs = list(args.adapter_dir)
    if args.model is None:
        model_dir, demo_adapters = ensure_demo(dtype)
        adapter_dirs.append(demo_adapters)
        log.info("no --model: serving the embedded demo from %s", model_dir.parent)
        return model_dir, adapter_dirs, served_model_name(args)
    model_dir = args.model.expanduser()
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"--model: {model_dir} has no config.json")
    return model_dir, adapter_dirs, served_model_name(args)


def build_server(args: argparse.Namespace):
    """Load the model and adapters, warm up, and return a ready-to-run :class:`Server`. With ``--engine-process``
    all of that happens in the engine process (:func:`process_engine`); this process gets the tokenizer. Left unset
    (None: only :func:`main` resolves the command's default), the engine runs in this process."""
    from ..tools.tokenizer import load_tokenizer
    from ..tools.tokenizer import preload as preload_tokenizer
    from .server import Server

    if args.engine_process:
        from .engine_client import EngineClient

        # this process needs the tokenizer only once the engine is ready: import transformers meanwhile (13 s
        # between the engine's ready and the server's on the H200 host before; NOTES, session 13)
        threading.Thread(target=preload_tokenizer, name="slora-tokenizer-import", daemon=True).start()
        client = EngineClient.launch(process_engine, (args,), defer_hand_over=args.defer_hand_over,
                                     log_level=args.log_level)
        config, model_dir = client.info["config"], client.info["model_dir"]
        return Server(None, config, host=args.host, port=args.port, log_level=args.log_level,
                      tokenizer=load_tokenizer(model_dir), runner=client)
    engine, config, tokenizer = build_engine(args)
    return Server(engine, config, host=args.host, port=args.port, log_level=args.log_level, tokenizer=tokenizer)


def process_engine(args: argparse.Namespace):
    """The engine process's factory (``engine_process.run``): (engine, what the server needs to know of it)."""
    engine, config, model_dir = build_engine_parts(args)
    return engine, {"config": config, "model_dir": model_dir}


def build_engine(args: argparse.Namespace):
    """Load the model and adapters and warm up: (engine, ``ServerConfig``, the server's own tokenizer). A server
    here or a Ray replica (``ray_app``) serves them."""
    from ..tools.tokenizer import load_tokenizer

    engine, config, model_dir = build_engine_parts(args)
    return engine, config, load_tokenizer(model_dir)  # the server's own copy: the engine thread decodes concurrently


def build_engine_parts(args: argparse.Namespace):
    """(engine, ``ServerConfig``, model dir): the model and adapters loaded and warmed up."""
    from ..engine import compile_counter, executable_store
    from ..engine.engine import Engine
    from ..engine.host_fill import HostFill
    from ..model.config import ModelConfig
    from ..tools.tokenizer import load_tokenizer

    started = time.monotonic()
    if not args.no_compilation_cache:
        cache = compile_counter.enable_persistent_cache(args.compilation_cache_dir)
        store = executable_store.enable(cache / "executables")  # restarts skip tracing too, not only compiles
        log.info("compilation cache: %s (executable store: %s)", cache, store.root if store else "off")
    on_gpu = _on_gpu()
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    backend = args.backend or ("pallas" if on_gpu else "reference")
    model_dir, adapter_dirs, name = resolve_model(args, dtype)
    lora_modules = parse_lora_modules(args.lora_modules)

    cfg = ModelConfig.from_model_dir(model_dir)
    max_len = context_len(args.max_model_len, cfg.max_position_embeddings, cfg.sliding_window)
    # no --pool-gb / --num-pages: the engine sizes the pool from the memory free once the weights are loaded
    pool_bytes = None if args.num_pages else int(args.pool_gb * 2**30) if args.pool_gb else None
    batch = batch_size(args, on_gpu)
    ecfg = EngineConfig(
        max_batch_size=batch, batch_from_pool=batch_from_pool(args, on_gpu), max_model_len=max_len,
        max_prefill_tokens=max(args.max_prefill_tokens or max_len, max_len), page_size=args.page_size,
        max_lora_rank=args.max_lora_rank, max_loras=max_loras(args, batch), max_cpu_loras=args.max_cpu_loras,
        adapter_read_processes=args.adapter_read_processes, stable_step_inputs=args.stable_step_inputs,
        host_budget_bytes=None if args.adapter_host_gb is None else int(args.adapter_host_gb * 2**30),
        pool_bytes=pool_bytes, num_pages=args.num_pages, dtype=dtype, backend=backend, max_waiting=args.max_waiting,
        layer_loop=args.layer_loop, **scheduling_options(args),
        tensor_parallel_size=args.tensor_parallel_size, fully_sharded_loras=args.fully_sharded_loras,
        **(dict(prefill_mid_buckets_from=0, decode_mid_buckets_from=0) if args.no_mid_buckets else {}),
        decode_lora_variants=on_gpu).validate(cfg)  # before the weights load; decode variants: launches matter on GPUs
    # kernel tiles: the backend's defaults for this platform (pallas_kernels.backends.default_tiles)
    # The tokenizer loads in a thread beside the weights and the warm-up: nothing needs it before serving, and a
    # first load is seconds of transformers' import (8 of 8.5 s on the CPU box; NOTES, session 13).
    tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="slora-tokenizer")
    tokenizer_future = tokenizer_pool.submit(load_tokenizer, model_dir)
    tokenizer_pool.shutdown(wait=False)
    log.info("loading %s (%s, backend %s)", model_dir, dtype, backend)
    t = time.monotonic()
    engine = Engine.from_model_dir(model_dir, ecfg, progress=True, converted_params_dir=args.converted_params_dir)
    log.info("weights loaded and pool allocated in %.1f s", time.monotonic() - t)
    if tokenizer_future.done():
        tokenizer_future.result()  # a tokenizer that fails to load stops the start here, not after the warm-up
    pool = engine.stats()["pool"]
    capacity = pool["num_pages"] * ecfg.page_size
    if capacity < max_len:
        log.warning("the pool holds %d tokens of KV, less than --max-model-len %d: longer requests will be refused",
                    capacity, max_len)
    log.info("pool: %d pages of %d tokens (%.2f GiB), KV and adapters together; batch up to %d rows",
             pool["num_pages"], ecfg.page_size, pool["pool_bytes"] / 2**30, engine.ecfg.max_batch_size)

    t = time.monotonic()
    register_adapters(engine, name, lora_modules, adapter_dirs)
    log.info("%d adapters registered in %.1f s", len(engine.adapter_names()), time.monotonic() - t)
    if not args.no_warmup:
        log.info("warming up: compiling every step bucket once, so serving never compiles")
        t, compiles, hits = time.monotonic(), compile_counter.compile_count(), compile_counter.cache_hits()
        engine.warmup(progress=True)
        log.info("warm-up: %d compiles (%d from the compilation cache) in %.1f s",
                 compile_counter.compile_count() - compiles, compile_counter.cache_hits() - hits,
                 time.monotonic() - t)
    engine.tokenizer = tokenizer_future.result()
    if engine.tokenizer is None:
        log.warning("%s has no tokenizer: only token-id prompts on /v1/completions will work", model_dir)
    if host_fill(args):
        HostFill(engine.store.host).start()  # stops when the store closes
    log.info("ready in %.1f s after start", time.monotonic() - started)
    config = ServerConfig(served_model_name=name, api_key=args.api_key,
                          allowed_adapter_dirs=tuple(adapter_dirs) + tuple(args.allowed_adapter_dir),
                          max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                          header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                          shutdown_grace_s=args.shutdown_grace_s, tenant_header=args.tenant_header,
                          defer_hand_over=args.defer_hand_over, engine_process=bool(args.engine_process))
    return engine, config, model_dir


def host_fill(args: argparse.Namespace) -> bool:
    """--host-fill, else on unless the engine is a Ray replica: replicas on one host would each fill host memory
    with every adapter (8 replicas x 33 GB for 2000 S1 adapters of a 7B), while affinity routing gives each a share."""
    return not getattr(args, "ray", False) if args.host_fill is None else bool(args.host_fill)


GPU_MEMORY_FRACTION = "0.95"  # of the card JAX may use when XLA_PYTHON_CLIENT_MEM_FRACTION is not set


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # before the model loads: an empty key must not cost a minute of start-up to be refused
        check_api_key(args.api_key)
    except ValueError as e:
        parser.error(f"--api-key: {e}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # JAX takes 75% of a GPU unless told otherwise; the pool is sized from what is free after the weights, so let JAX
    # have the card (the rest is the CUDA context and library workspaces). Read when the backend starts, not before.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)
    if args.engine_process is None:  # the default: the engine's own process, unless Ray runs the replicas
        args.engine_process = not args.ray
    if args.ray and args.engine_process:
        parser.error("--engine-process is not available with --ray (each replica runs its engine in-process)")
    if args.engine_process:  # the engine process owns the device; this one must not start JAX on it
        from .engine_client import keep_jax_on_cpu

        keep_jax_on_cpu()
    if args.ray:
        from .ray_app import run_ray

        run_ray(args)
        return
    try:
        server = build_server(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # RuntimeError: the engine process did not start
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        server.run()
    except KeyboardInterrupt:  # a third Ctrl-C exits without draining; uvicorn re-raises it at the end
        pass
