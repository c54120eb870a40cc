"""Engine settings: batch limits, buckets, pool budget, adapter limits."""

from __future__ import annotations

import dataclasses

from pallas_kernels.backends import default_tiles


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo up to the first one >= hi."""
    out, b = [], max(1, lo)
    while True:
        out.append(b)
        if b >= hi:
            return tuple(out)
        b *= 2


def step_buckets(lo: int, hi: int, mid_from: int | None = None, multiple_of: int = 1) -> tuple[int, ...]:
    """``pow2_buckets(lo, hi)`` plus, for each power of two b >= ``mid_from`` (None or 0: none) below the largest,
    the midpoint 3b/2 when it is a multiple of ``multiple_of`` (the tiles a step's rows must fill)."""
    pow2 = pow2_buckets(lo, hi)
    mids = [3 * b // 2 for b in pow2[:-1] if mid_from and b >= mid_from and b % 2 == 0]
    return tuple(sorted(pow2 + tuple(m for m in mids if m % multiple_of == 0)))


LAYER_LOOPS = ("auto", "scan", "unroll")
POOL_FRACTION = 0.85  # of the device memory free after the weights, when the pool size is not given
CPU_POOL_BYTES = 256 << 20
# batch_from_pool: KV tokens of the pool per running row, and the least batch it lowers to
ROW_TOKENS = 256
MIN_POOL_BATCH = 64


def resolve_layer_loop(layer_loop: str, platform: str) -> str:
    """"auto" -> "unroll" on GPU/TPU (no per-step weight copies), "scan" on CPU (compiles stay short)."""
    if layer_loop != "auto":
        return layer_loop
    return "scan" if platform == "cpu" else "unroll"


def resolve_host_budget(budget: int | None, available: int) -> int:
    """None -> 40% of ``available`` host bytes (at least 1 GiB; 8 GiB when ``available`` is unknown, >= 2**50)."""
    if budget is not None:
        return int(budget)
    if available >= 1 << 50:
        return 8 << 30
    return max(1 << 30, int(0.4 * available))


def resolve_stable_inputs(stable: bool | None, platform: str) -> bool:
    """None -> on where the step runs as a CUDA graph (GPU), off on CPU (nothing to gain, one copy more)."""
    return platform != "cpu" if stable is None else bool(stable)


def resolve_read_processes(processes: int | None, platform: str) -> int:
    """None -> 5 adapter read processes on an accelerator (where the engine thread keeps the GIL busy): one for each
    of the store's 4 IO threads and one for the engine thread's own inline read (``HostTier.rows_now``), which then
    never queues behind read-aheads; 0 on CPU."""
    if processes is not None:
        if processes < 0:
            raise ValueError(f"adapter_read_processes must be >= 0, got {processes}")
        return processes
    return 0 if platform == "cpu" else 5


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 64  # running sequences (decode rows)
    max_prefill_tokens: int = 2048  # tokens in one prefill step
    max_prefill_seqs: int = 16  # sequences in one prefill step
    max_model_len: int = 2048  # prompt + output
    page_size: int = 16  # tokens per KV page
    max_lora_rank: int = 64
    max_loras: int = 64  # adapters resident in the pool at once (slots)
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: bounded by host_budget_bytes only)
    # bytes of adapter rows kept in host memory (None: 40% of the memory available when the engine starts, at least
    # 1 GiB; 8 GiB where it cannot be read): S-LoRA keeps every adapter in host memory, so the default follows the host
    host_budget_bytes: int | None = None
    # processes that read adapter files (engine/read_workers.py: reads then never wait on the engine thread's GIL);
    # None: 5 on an accelerator, 0 (read on the IO threads) on CPU
    adapter_read_processes: int | None = None
    # the step's packed input copied into one persistent device buffer per size, so the step's CUDA graph is not
    # updated for a moved input every call (engine/stable_inputs.py); None: on the GPU, off on CPU; single device only
    stable_step_inputs: bool | None = None
    # adapters copied to the device ahead of their pool load (device memory outside the pool: up to this many of the
    # largest adapters); 0 = off, else at least max_prefill_seqs (the head the engine prefetches for), or the head's
    # stagings push each other out and its adapters are copied at admission, on the engine thread
    max_staged_adapters: int = 32
    pool_bytes: int | None = None  # memory budget of the unified pool, per device (neither this nor num_pages: auto)
    num_pages: int | None = None  # or an explicit page count (tests)
    dtype: str = "bfloat16"
    backend: str = "pallas"  # a name from pallas_kernels.backends.backend_names()
    # "unroll": per-layer weight arrays, nothing sliced per step (GPU: a scan copies every layer's weights before its
    # GEMMs, 6 ms of a 17 ms 7B decode step on the H200); "scan": stacked weights, one compiled layer (short CPU
    # compiles); "auto": unroll on accelerators, scan on CPU.
    layer_loop: str = "auto"
    max_waiting: int = 4096  # queue bound: beyond it add_request raises QueueFull
    scheduling_policy: str = "fcfs"  # admission order: a name registered with policies.register_policy
    first_token_slo_s: float | None = None  # default first-token deadline after arrival (a request may override)
    early_abort: bool = False  # end requests that can no longer meet their first-token deadline (never serve late)
    vtc_input_weight: float = 1.0  # "vtc": service counted per prompt token
    vtc_output_weight: float = 2.0  # "vtc": service counted per generated token
    vtc_reserved_slots: int | None = None  # "vtc": last batch slots kept for tenants below an equal share (None: 1/32)
    adapter_lookahead: int = 16  # "adapter-aware": waiting requests searched for a resident adapter
    adapter_max_bypass: int = 32  # "adapter-aware": younger admissions a request may be overtaken by
    # admission passes over a request whose adapter is still being read from its source or copied to the device
    # (starting that read) while other work can run, instead of blocking the engine thread on it (a 7B adapter's
    # read took ~85 ms on the H200 host); at most adapter_lookahead such requests a step. Off until measured there.
    admit_while_loading: bool = False
    # max_batch_size is only an upper bound: the engine lowers it to what the pool holds once the pool is sized
    # (with_batch_from_pool). The server's default on a GPU (bound 256)
    batch_from_pool: bool = False
    prefix_cache: bool = False  # share full KV pages of prompts with the same adapter and token prefix
    min_prefill_bucket: int | None = None  # None: the backend's default for the platform (with_platform_defaults)
    # smallest decode batch compiled (fewer buckets = shorter warm-up); None: the backend's default for the platform
    min_decode_bucket: int | None = None
    # buckets at 3/2 of each power of two from this size up (0: off; None: the backend's default for the platform)
    prefill_mid_buckets_from: int | None = None
    decode_mid_buckets_from: int | None = None
    decode_lora_variants: bool = True  # compile decode steps without MLP / without any LoRA kernels (3x buckets)
    # decode rotates q and k and writes the new KV inside its attention kernel (False: rotate in XLA, scatter, attend;
    # kept for comparisons). Tensor parallel steps always take the three steps. None: the backend's platform default
    # (on for the GPU, off on CPU, where the kernels run in interpret mode; set it off for interpret runs on a GPU)
    decode_rope_in_attention: bool | None = None
    lora_block_t: int | None = None  # kernel tiles; None: the backend's default for the platform
    attn_block_q: int | None = None
    # tensor parallelism over this host's devices (model/sharding.py): heads, KV heads, MLP columns and the pool split
    # N ways, 2 all-reduces per layer; fully_sharded_loras also splits every adapter N ways (up to 4 small all-reduces
    # more per layer) instead of keeping A (q,k,v,gate,up) and B (o,down) whole on every device
    tensor_parallel_size: int = 1
    fully_sharded_loras: bool = False

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        return step_buckets(self.min_decode_bucket, self.max_batch_size, self.decode_mid_buckets_from)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        tiles = max(self.lora_block_t or 1, self.attn_block_q or 1)  # a prefill step's rows fill whole tiles
        return step_buckets(self.min_prefill_bucket, self.max_prefill_tokens, self.prefill_mid_buckets_from, tiles)

    def with_pool_size(self, device_memory_stats: dict | None) -> EngineConfig:
        """``pool_bytes`` from the device's free memory when neither it nor ``num_pages`` is set (call it after the
        weights are on the device): ``POOL_FRACTION`` of what is free, the rest left for activations, the sampler
        and adapter staging; 256 MiB where the device reports no limit (the CPU)."""
        if self.pool_bytes is not None or self.num_pages is not None:
            return self
        stats = device_memory_stats or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        return dataclasses.replace(self, pool_bytes=int(POOL_FRACTION * free) if free > 0 else CPU_POOL_BYTES)

    def with_batch_from_pool(self, pool_tokens: int) -> EngineConfig:
        """With ``batch_from_pool``: ``max_batch_size`` lowered to the largest power of two that leaves each row
        ``ROW_TOKENS`` of the pool's ``pool_tokens`` (at least ``MIN_POOL_BATCH``). Admission already stops where the
        pool does (each request reserves its worst-case KV), so the bound only keeps a small pool from compiling
        and holding step memory for rows that could never run; a large pool gets the whole bound (a 7B model's pool
        on the H200, 208k tokens, would hold 512 rows; the server's bound is 256: NOTES, sessions 21-22)."""
        if not self.batch_from_pool:
            return self
        fits = 1 << max(0, (pool_tokens // ROW_TOKENS).bit_length() - 1)
        batch = min(self.max_batch_size, max(MIN_POOL_BATCH, fits))
        return self if batch == self.max_batch_size else dataclasses.replace(self, max_batch_size=batch)

    def with_platform_defaults(self, platform: str) -> EngineConfig:
        """Unset tile settings taken from the kernel backend's defaults for ``platform`` (the backend table owns
        them, so a new backend brings its own)."""
        tiles = default_tiles(self.backend, platform)
        unset = {k: v for k, v in tiles.items() if getattr(self, k) is None}
        return dataclasses.replace(self, **unset) if unset else self

    def with_host_defaults(self, platform: str, available_bytes: int) -> EngineConfig:
        """Unset host settings resolved for this host: adapter host memory and adapter read processes."""
        return dataclasses.replace(
            self, host_budget_bytes=resolve_host_budget(self.host_budget_bytes, available_bytes),
            adapter_read_processes=resolve_read_processes(self.adapter_read_processes, platform))

    def validate(self, model_cfg=None) -> EngineConfig:
        """Self, checked (and against ``model_cfg``, a ``ModelConfig``, if given); ValueError naming the field."""
        window = getattr(model_cfg, "sliding_window", None)
        if window is not None and self.max_model_len > window:  # our attention is fully causal
            raise ValueError(f"max_model_len {self.max_model_len} is above the model's sliding_window ({window}): "
                             f"attention here is fully causal, which computes what the model does only up to "
                             f"{window} tokens; set max_model_len <= {window}")
        for name in ("max_batch_size", "max_prefill_tokens", "max_prefill_seqs", "max_model_len", "page_size",
                     "max_lora_rank", "max_loras", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("prefill_mid_buckets_from", "decode_mid_buckets_from"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: powers of two only), got {getattr(self, name)}")
        if self.max_staged_adapters != 0 and self.max_staged_adapters < self.max_prefill_seqs:
            raise ValueError(f"max_staged_adapters must be 0 (off) or >= max_prefill_seqs ({self.max_prefill_seqs}), "
                             f"got {self.max_staged_adapters}")
        if self.page_size & (self.page_size - 1):
            raise ValueError("page_size must be a power of two")
        for name in ("min_prefill_bucket", "lora_block_t", "attn_block_q"):
            v = getattr(self, name)
            if v is not None and (v < 1 or v & (v - 1)):
                raise ValueError(f"{name} must be a power of two >= 1 (or None for the backend's default), got {v}")
        if self.max_prefill_tokens < self.max_model_len:
            raise ValueError("max_prefill_tokens must be >= max_model_len (a whole prompt is prefilled in one step)")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {self.layer_loop!r}")
        return self
