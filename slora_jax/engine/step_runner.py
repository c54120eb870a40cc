"""Builds each step's batch in numpy, pads it to a bucket, and runs the jitted prefill / decode step.

Only array data varies between steps of one bucket, so after :meth:`StepRunner.warmup` nothing compiles. The pool is
donated to every step (updated in place) and sampling runs inside the step: only token ids come back to the host,
plus packed logprobs when a request asked for them (``StepOutput``). The penalty state (``penalties.py``) is threaded
through every step beside the pool, also donated.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from pallas_kernels.lora_sgmv import make_tiles
from pallas_kernels.prefill_attention import max_prefill_tiles, prefill_tile_map

from ..model.config import ATTN_MODULES, MODULES, ModelConfig
from ..model.paged import PagedSpec, StepBatch, paged_forward
from ..model.sharding import TensorParallel, step_parts
from . import compile_counter, executable_store, penalties
from .config import EngineConfig, resolve_stable_inputs
from .logprobs import packed_logprobs
from .sampling import MAX_LOGIT_BIAS, SamplingArrays, SamplingParams, sample, sampling_arrays
from .stable_inputs import StableInputs

log = logging.getLogger(__name__)
# A compile that fails to start one of the GPU compiler's tools (H200, session 28: "INTERNAL: Failed to launch ptxas"
# on one of 8 compile threads, once in ~10 cold starts of a 7B server) is tried again, up to this many times
TRANSIENT_COMPILE_ERRORS = ("Failed to launch",)
COMPILE_TRIES = 3


def compile_with_retries(lowered, tries: int = COMPILE_TRIES, pause_s: float = 1.0):
    """``lowered.compile()``, again after a transient launch failure; any other error, or the last try's, raises."""
    for attempt in range(1, tries + 1):
        try:
            return lowered.compile()
        except Exception as e:  # only the transient kinds are tried again
            if attempt == tries or not any(m in str(e) for m in TRANSIENT_COMPILE_ERRORS):
                raise
            log.warning("compile failed (%s); try %d of %d in %.0f s", str(e)[:200], attempt + 1, tries, pause_s)
            time.sleep(pause_s)


@dataclasses.dataclass
class StepItem:
    """One sequence's part in a step: compute ``tokens`` at positions ``start..``; KV pages ``pages``."""

    tokens: list[int]
    start: int
    pages: list[int]
    adapter_slot: int  # -1 = base model
    sampling: SamplingParams | None
    seed: int
    counter: int  # tokens generated so far (fresh randomness per step)
    token_src: int = -1  # decode: take the input token from row ``token_src`` of the previous step's output
    token_mask: np.ndarray | None = None  # tokens this step may sample (packed bits, see SamplingArrays); None: all
    penalty_row: int = -1  # its row in the penalty state (a prefill fills it from ``tokens``); -1: none
    prompt_len: int = 0  # prefill: positions below this are prompt tokens (penalties count the rest as generated)
    prompt_logprobs: bool = False  # prefill: this sequence needs every row's logprobs (the echo variant runs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutput:
    """What a step returns besides the pool and penalty state; only ``tokens`` is read back every step."""

    tokens: jax.Array  # int32 [out_rows]: each sequence row's sampled token (the next decode step's input)
    logprobs: jax.Array  # int32 [B, PACKED_WIDTH]: the sampled token's logprob and the top ones (logprobs.py)
    prompt_logprobs: jax.Array | None = None  # echo prefill: int32 [T, PACKED_WIDTH], row t against token t + 1


# Decode steps compile one variant per set of projections whose LoRA kernels run; a step runs the smallest variant
# covering its batch's adapters, so q,k,v,o-only adapters (S-LoRA's setting) or base-only batches launch no MLP (or no)
# LoRA kernels: ~0.45 ms of a 10.6 ms Llama-2-7B decode step at batch 64 on the H200.
LORA_VARIANTS: dict[str, tuple[int, ...]] = {
    "none": (),
    "attn": tuple(MODULES.index(m) for m in ATTN_MODULES),
    "all": tuple(range(len(MODULES))),
}


def step_compiler_options(platform: str) -> dict[str, str]:
    """XLA options for the step compiles on ``platform``.

    GPU: no rematerialization pass. It aims at a memory limit below the step's own arguments (the donated pool is one
    of them), so it cannot succeed: for a 102 GiB pool it printed "Can't reduce memory use below ... only reduced to
    305 GiB" at every step compile and saved 30 MB, while the step's real footprint is pool + weights + < 0.5 GiB
    (benchmarks/step_memory.py, NOTES session 5). Off, the warning and the pass's compile time go.
    """
    return {"xla_disable_hlo_passes": "rematerialization"} if platform == "gpu" else {}


def lora_variant(targets: np.ndarray) -> str:
    """The smallest variant whose projections include every True entry of ``targets`` (bool[len(MODULES)])."""
    want = set(np.flatnonzero(targets).tolist())
    return next(name for name, mods in LORA_VARIANTS.items() if want <= set(mods))  # "all" covers every set


class StepInputError(ValueError):
    """Some items' host inputs cannot be built (found before dispatch, so the pool is untouched): ``rows`` are the
    items (indices into the step's list) that fail even on their own; the rest of the batch can run without them."""

    def __init__(self, rows: list[int], cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.rows = rows


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class StepRunner:
    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, interpret: bool | None = None,
                 tp: TensorParallel | None = None):
        ecfg = ecfg.with_platform_defaults(jax.default_backend())
        self.cfg, self.ecfg = cfg, ecfg
        # tensor parallelism: every device runs the step on its local config inside one shard_map (model/sharding.py)
        step_cfg, tp_fields, wrap = step_parts(tp, cfg)
        spec = dict(backend=ecfg.backend, page_size=ecfg.page_size, max_rank=ecfg.max_lora_rank,
                    lora_block_t=ecfg.lora_block_t, attn_block_q=ecfg.attn_block_q, interpret=interpret, **tp_fields)
        self.prefill_spec = PagedSpec(mode="prefill", **spec)
        self.decode_spec = PagedSpec(mode="decode", rope_in_attention=bool(ecfg.decode_rope_in_attention), **spec)
        # every step returns this many token ids (a decode bucket may exceed max_batch_size)
        self.out_rows = max(max(ecfg.decode_buckets), ecfg.max_prefill_seqs)
        # fn(layout, params, pool, table, packed, prev_tokens, penalty_state): layout static, pool and state donated
        self.compiler_options = step_compiler_options(jax.default_backend())
        jit = functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2, 6),
                                compiler_options=self.compiler_options or None)
        self._prefill = jit(wrap(functools.partial(_step, step_cfg, self.prefill_spec, self.out_rows, False)))
        # prompt logprobs (echo): the lm_head over every row; compiled per prefill bucket, run only when asked
        self._prefill_echo = jit(wrap(functools.partial(_step, step_cfg, self.prefill_spec, self.out_rows, True)))
        variants = LORA_VARIANTS if ecfg.decode_lora_variants else {"all": LORA_VARIANTS["all"]}
        self._decode = {name: jit(wrap(functools.partial(_step, step_cfg, dataclasses.replace(
                            self.decode_spec, lora_modules=mods), self.out_rows, False)))
                        for name, mods in variants.items()}
        # every step input committed to its device(s) from the start: a jit call whose inputs differ from warm-up's
        # only in being committed (outputs are, once any input is) compiles again
        device = jax.devices()[0] if tp is None else tp.replicated
        self._no_prev = jnp.zeros(self.out_rows, jnp.int32, device=device)
        # one penalty row per request that can be running at once (engine: PenaltyRows)
        self.penalty_state = penalties.PenaltyState.zeros(ecfg.max_batch_size, cfg.vocab_size, device=device)
        # executables loaded from the store at warm-up, by (jitted step, layout): dispatched instead of the jit call
        self._loaded: dict[tuple[Callable, Layout], jax.stages.Compiled] = {}
        self._devices = [device] if tp is None else list(tp.mesh.devices.flat)  # the steps' devices, in mesh order
        # what the store keys every step of this runner by, beside the job, its layout and the argument shapes
        self.identity = "\n".join(map(repr, (
            cfg, executable_store.step_settings(ecfg), interpret, self.prefill_spec, self.decode_spec, self.out_rows,
            sorted(self.compiler_options.items()),
            tuple(self._decode), None if tp is None else (tp.mesh.axis_names, [d.id for d in self._devices],
                                                           tp.fully_sharded_loras))))
        stable = resolve_stable_inputs(ecfg.stable_step_inputs, jax.default_backend()) and len(self._devices) == 1
        self._stable = StableInputs() if stable else None
        self.last_output: StepOutput | None = None  # of the last step dispatched (its logprobs, on the device)
        self.warmup_stats: dict | None = None  # what the last warm-up compiled, ahead and in its runs

    # ---------------------------------------------------------------- batch building (numpy)
    def _base_arrays(self, n_rows: int, n_seqs: int) -> dict[str, np.ndarray]:
        return dict(
            tokens=np.zeros(n_rows, np.int32), positions=np.zeros(n_rows, np.int32),
            kv_slots=np.full(n_rows, -1, np.int32), row_slot=np.full(n_rows, -1, np.int32),
            page_table=np.zeros((n_seqs, self.ecfg.max_pages_per_seq), np.int32),
            context_lens=np.zeros(n_seqs, np.int32), q_starts=np.zeros(n_seqs + 1, np.int32),
            logits_rows=np.zeros(n_seqs, np.int32))

    def _fill(self, a: dict, items: list[StepItem]) -> np.ndarray:
        """Write the items' token rows (item i's right after item i-1's, from row 0) and sequence entries, numpy over
        the whole batch (one Python pass per field, none per row); returns q_starts of the items (len + 1).

        Raises IndexError for a token position whose page the item does not hold, ValueError for more pages than a
        sequence may have, OverflowError for a value int32 cannot hold (what per-row writes raised before)."""
        page, n = self.ecfg.page_size, len(items)
        lens = np.fromiter((len(it.tokens) for it in items), np.int64, n)
        q_starts = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=q_starts[1:])
        total = int(q_starts[-1])
        starts = np.fromiter((it.start for it in items), np.int64, n)
        n_pages = np.fromiter((len(it.pages) for it in items), np.int64, n)
        width = a["page_table"].shape[1]
        if n and n_pages.max() > width:
            raise ValueError(f"a sequence holds {int(n_pages.max())} pages; at most {width} fit its page table")
        table = a["page_table"][:n]
        table[np.arange(width) < n_pages[:, None]] = np.fromiter(
            itertools.chain.from_iterable(it.pages for it in items), np.int32, int(n_pages.sum()))
        seq = np.repeat(np.arange(n), lens)  # each token row's item
        pos = np.arange(total) - (q_starts[:-1] - starts)[seq]
        page_of = pos // page
        if total and (pos.min() < 0 or (page_of >= n_pages[seq]).any()):
            bad = int(np.flatnonzero((pos < 0) | (page_of >= n_pages[seq]))[0])
            raise IndexError(f"token position {int(pos[bad])} has no KV page (its sequence holds "
                             f"{int(n_pages[seq[bad]])})")
        a["tokens"][:total] = np.fromiter(itertools.chain.from_iterable(it.tokens for it in items), np.int32, total)
        a["positions"][:total] = pos
        a["kv_slots"][:total] = table[seq, page_of] * page + pos % page
        a["row_slot"][:total] = np.repeat(np.fromiter((it.adapter_slot for it in items), np.int64, n), lens)
        a["context_lens"][:n] = starts + lens
        a["logits_rows"][:n] = q_starts[1:] - 1
        return q_starts

    def build_prefill(self, items: list[StepItem], n_rows: int | None = None) -> tuple[StepBatch, SamplingArrays]:
        """Items should come grouped by adapter (SGMV segments); rows are laid out in the given order.
        ``n_rows`` forces a bucket (warm-up); by default the smallest that holds the items."""
        ecfg = self.ecfg
        total = sum(len(it.tokens) for it in items)
        n_rows, n_seqs = n_rows or _bucket(total, ecfg.prefill_buckets), ecfg.max_prefill_seqs
        if len(items) > n_seqs:
            raise ValueError(f"{len(items)} sequences exceed max_prefill_seqs={n_seqs}")
        a = self._base_arrays(n_rows, n_seqs)
        a["q_starts"][: len(items) + 1] = self._fill(a, items)
        a["q_starts"][len(items) + 1:] = total
        lora = make_tiles(a["row_slot"], ecfg.lora_block_t, self._lora_tiles(n_rows))
        a["lora_tiles"] = np.stack([lora.start, lora.length, lora.slot]).astype(np.int32)
        a["attn_tiles"] = prefill_tile_map(a["q_starts"], a["context_lens"], n_rows, ecfg.attn_block_q,
                                           max_prefill_tiles(n_rows, n_seqs, ecfg.attn_block_q))
        return self._finish(a, items, n_seqs, MAX_LOGIT_BIAS)

    def build_decode(self, items: list[StepItem], n: int | None = None) -> tuple[StepBatch, SamplingArrays, np.ndarray]:
        """Also returns ``token_src`` int32[n]: rows whose input token is still on the device (-1 = from the host).
        ``n`` forces a bucket (warm-up)."""
        n = n or _bucket(len(items), self.ecfg.decode_buckets)
        if any(len(it.tokens) != 1 for it in items):
            raise ValueError("a decode step computes exactly one token per sequence")
        a = self._base_arrays(n, n)
        self._fill(a, items)
        token_src = np.full(n, -1, np.int32)
        token_src[: len(items)] = [it.token_src for it in items]
        a["q_starts"][:] = np.minimum(np.arange(n + 1), len(items))
        a["lora_tiles"] = np.zeros((3, 1), np.int32)
        a["attn_tiles"] = np.zeros((1, 4), np.int32)
        return (*self._finish(a, items, n, 0), token_src)

    def _lora_tiles(self, n_rows: int) -> int:
        return -(-n_rows // self.ecfg.lora_block_t) + self.ecfg.max_prefill_seqs + 1

    def _finish(self, a: dict, items: list[StepItem], n_seqs: int,
                bias_entries: int) -> tuple[StepBatch, SamplingArrays]:
        pad = [None] * (n_seqs - len(items))
        s = sampling_arrays([it.sampling for it in items] + pad, [it.seed for it in items] + [0] * len(pad),
                            [it.counter for it in items] + [0] * len(pad), n_seqs, self.cfg.vocab_size,
                            masks=[it.token_mask for it in items], eos_ids=tuple(self.cfg.eos_token_id),
                            penalty_rows=[it.penalty_row for it in items] + [-1] * len(pad),
                            prompt_lens=[it.prompt_len for it in items] + [0] * len(pad), bias_entries=bias_entries)
        return StepBatch(**a), SamplingArrays(**s)

    # ---------------------------------------------------------------- running
    def step_fn(self, kind: str, lora: str = "all"):
        """The jitted step: ``fn(layout, params, pool, table, packed, prev_tokens, penalty_state) -> (StepOutput,
        penalty_state, pool)``; ``kind`` "prefill", "prefill_echo" (also every prompt row's logprobs) or "decode"."""
        if kind == "prefill":
            return self._prefill
        if kind == "prefill_echo":
            return self._prefill_echo
        if lora not in LORA_VARIANTS:
            raise ValueError(f"unknown LoRA variant {lora!r} (one of {tuple(LORA_VARIANTS)})")
        return self._decode.get(lora, self._decode["all"])  # variants off: "all" serves every batch

    @staticmethod
    def _host_inputs(build: Callable, items: list[StepItem]) -> tuple[np.ndarray, Layout]:
        """The packed inputs of ``items``; if they cannot be built, :class:`StepInputError` names the items that
        fail on their own (one bad request must not sink the others). Costs nothing extra unless building fails."""
        try:
            return pack_inputs(*build(items))
        except Exception as e:
            bad = []
            for i, item in enumerate(items):
                try:
                    pack_inputs(*build([item]))
                except Exception:  # noqa: BLE001 - this item is the culprit, whatever the error
                    bad.append(i)
            if not bad:  # no single item is to blame: a real step failure
                raise
            raise StepInputError(bad, e) from e

    def prefill(self, params, pool, table, items: list[StepItem]) -> tuple[jax.Array, jax.Array]:
        """Dispatch a prefill step; returns (next token ids [out_rows], pool) without waiting (``last_output`` holds
        its logprobs). Raises :class:`StepInputError` (before dispatch) for items whose inputs cannot be built."""
        echo = any(it.prompt_logprobs for it in items)  # echo: one compiled bucket, the largest (warmup_jobs)
        build = functools.partial(self.build_prefill, n_rows=self.ecfg.prefill_buckets[-1]) if echo else \
            self.build_prefill
        packed, layout = self._host_inputs(build, items)
        kind = "prefill_echo" if echo else "prefill"
        return self._run(self.step_fn(kind), layout, params, pool, table, packed, self._no_prev)

    def _run(self, fn, layout, params, pool, table, packed, prev_tokens) -> tuple[jax.Array, jax.Array]:
        if self._stable is not None:  # the same device address every call (stable_inputs.py)
            packed = self._stable.put(packed)
        elif len(self._devices) == 1:
            # uncommitted, like numpy (the same compiled entry); under TP the step places the host array itself
            packed = jax.device_put(packed)
        args = (params, pool, table, packed, prev_tokens, self.penalty_state)
        loaded = self._loaded.get((fn, layout)) if self._loaded else None
        if loaded is None:
            out, self.penalty_state, pool = fn(layout, *args)
        else:
            try:  # a loaded executable checks its arguments before it runs (and donates): nothing is lost yet
                out, self.penalty_state, pool = loaded(*args)
            except (TypeError, ValueError) as e:
                log.warning("stored executable refused its arguments (%s); using the jitted step", e)
                del self._loaded[(fn, layout)]
                out, self.penalty_state, pool = fn(layout, *args)
        self.last_output = out
        return out.tokens, pool

    def decode(self, params, pool, table, items: list[StepItem], prev_tokens: jax.Array | None = None,
               lora: str = "all") -> tuple[jax.Array, jax.Array]:
        """Dispatch a decode step; input tokens of rows with ``token_src >= 0`` come from ``prev_tokens`` (the last
        step's output, still on the device), so this step can be queued before that one's tokens are read.
        ``lora`` names the :data:`LORA_VARIANTS` entry to run (it must cover every adapter in ``items``). Raises
        :class:`StepInputError` (before dispatch) for items whose inputs cannot be built."""
        packed, layout = self._host_inputs(self.build_decode, items)
        return self._run(self.step_fn("decode", lora), layout, params, pool, table, packed,
                         self._no_prev if prev_tokens is None else prev_tokens)

    def warmup_jobs(self) -> list[tuple[str, int, str | None]]:
        """(kind, bucket, LoRA variant) of every step serving can run. Echo prefills always run in the largest
        prefill bucket (:meth:`prefill`), so their variant compiles once, not once per bucket."""
        ecfg = self.ecfg
        jobs = [("prefill", n, None) for n in ecfg.prefill_buckets]
        jobs.append(("prefill_echo", ecfg.prefill_buckets[-1], None))
        jobs += [("decode", n, variant) for n in ecfg.decode_buckets for variant in self._decode]
        return jobs

    def warmup(self, params, pool, table, progress: bool = True, workers: int | None = None) -> jax.Array:
        """Compile every bucket, then run each once with an all-padding batch (writes nothing: every KV slot is -1).
        ``workers`` > 1 (default :func:`compile_counter.compile_workers`: 1 unless the persistent compilation cache
        is on) compiles them all ahead on that many threads (XLA compiles without the GIL) before the runs. With the
        executable store on (:func:`executable_store.enable`) steps stored by an earlier start are loaded instead of
        traced and compiled, and the others are compiled ahead and stored."""
        jobs = []
        for kind, n, variant in self.warmup_jobs():
            build = self.build_decode([], n=n) if kind == "decode" else self.build_prefill([], n_rows=n)
            jobs.append((self.step_fn(kind, variant), *pack_inputs(*build), (kind, n, variant)))
        workers = compile_counter.compile_workers() if workers is None else workers
        if self._stable is not None:  # the input copies compile here, counted neither ahead nor in the runs
            self._stable.prepare(len(packed) for _, packed, _, _ in jobs)
        lowerable = all(hasattr(fn, "lower") for fn, *_ in jobs)  # jitted steps (not a test's plain function)
        store = executable_store.active() if lowerable else None
        keys = self._store_keys(store, jobs, params, pool, table) if store is not None else [None] * len(jobs)
        if store is not None:
            self._load_stored(store, jobs, keys, params, pool, table, workers)
        todo = [(job, key) for job, key in zip(jobs, keys, strict=True) if (job[0], job[2]) not in self._loaded]
        before = compile_counter.compile_count(), compile_counter.cache_hits()
        if todo and lowerable and (workers > 1 or store is not None):
            self._compile_ahead(todo, params, pool, table, workers, progress, store)
        ahead = compile_counter.compile_count(), compile_counter.cache_hits()
        for fn, packed, layout, _ in tqdm(jobs, desc="first run of step buckets", disable=not progress):
            tokens, pool = self._run(fn, layout, params, pool, table, packed, self._no_prev)
            tokens.block_until_ready()
        # compiles the runs still needed that the persistent cache did not serve: 0 when compiling ahead worked
        self.warmup_stats = dict(workers=workers, steps=len(jobs), loaded=len(jobs) - len(todo),
                                 ahead_compiles=ahead[0] - before[0],
                                 ahead_cache_hits=ahead[1] - before[1],
                                 run_compiles=compile_counter.compile_count() - ahead[0],
                                 run_cache_hits=compile_counter.cache_hits() - ahead[1])
        return pool

    def _store_keys(self, store, jobs: list, params, pool, table) -> list[str]:
        shared = executable_store.abstract_signature((params, pool, table, self._no_prev, self.penalty_state))
        return [store.key(self.identity, shared, repr(job), repr(layout), executable_store.abstract_signature(packed))
                for _, packed, layout, job in jobs]

    def _load_stored(self, store, jobs: list, keys: list[str], params, pool, table, workers: int) -> None:
        """Take every step the store holds (loads on ``workers`` threads); the rest stay to be compiled."""
        def load(job, key):
            return store.load(key, (params, pool, table, job[1], self._no_prev, self.penalty_state), self._devices)

        t = time.monotonic()
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="load") as threads:
            found = list(threads.map(load, jobs, keys))
        for (fn, _, layout, _), compiled in zip(jobs, found, strict=True):
            if compiled is not None:
                self._loaded[(fn, layout)] = compiled
        log.info("%d of %d step buckets loaded from the executable store in %.1f s", sum(c is not None for c in found),
                 len(jobs), time.monotonic() - t)

    def _compile_ahead(self, todo: list, params, pool, table, workers: int, progress: bool, store) -> None:
        """Lower each step here (Python, holds the GIL) and compile it on a worker thread meanwhile; the jit call
        of the runs then finds the executable compiled in this process (or in the persistent cache). With a store,
        each compiled step is saved there for the next start."""
        def compile_and_store(lowered, key):
            hits = compile_counter.thread_cache_hits()
            compiled = compile_with_retries(lowered)
            # an executable JAX loaded from its persistent cache is not stored again: on XLA:CPU (jax 0.10.2) one
            # re-serialized that way loads at the next start and fails at its first run ("Function ... not found")
            if store is None:
                return
            if compile_counter.thread_cache_hits() == hits or store.stores_cache_served():
                store.save(key, compiled)
            else:
                store.note_cache_served()

        t, workers = time.monotonic(), max(1, workers)
        with (ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool_of_threads,
              tqdm(total=len(todo), desc=f"compiling step buckets ({workers} threads)", disable=not progress) as bar):
            futures = []
            for (fn, packed, layout, _), key in todo:
                lowered = fn.lower(layout, params, pool, table, packed, self._no_prev, self.penalty_state)
                futures.append(pool_of_threads.submit(compile_and_store, lowered, key))
                futures[-1].add_done_callback(lambda _: bar.update())
            for f in futures:
                f.result()
        log.info("%d step buckets compiled ahead on %d threads in %.1f s", len(todo), workers, time.monotonic() - t)


# Every per-step host input travels as ONE int32 buffer: on the H200 each numpy argument of a jitted call costs
# ~0.45 ms of host time to transfer, and a step has 16 of them (StepBatch, SamplingArrays, token_src).
Layout = tuple[tuple[str, tuple[int, ...], str], ...]  # (field, shape, dtype) in buffer order
# Each field starts at a multiple of 64 int32s (256 bytes). XLA hands a custom call a static slice of a parameter as
# a pointer into that parameter, and the Mosaic GPU custom call refuses any operand not 256-byte aligned ("Input
# buffer 0 is not 256-byte aligned": the prefill tile map, H200, jax 0.11.2, NOTES session 18).
FIELD_ALIGN = 64


def _field_span(size: int) -> int:
    """int32 slots a field of ``size`` elements takes in the buffer (its size rounded up to FIELD_ALIGN)."""
    return -(-size // FIELD_ALIGN) * FIELD_ALIGN


def pack_inputs(batch: StepBatch, s: SamplingArrays,
                token_src: np.ndarray | None = None) -> tuple[np.ndarray, Layout]:
    """(int32 buffer, its static layout); float32 / uint32 fields travel as their bit patterns, each field padded to
    FIELD_ALIGN. ``token_src`` None: every input token comes from the host (prefill)."""
    if token_src is None:
        token_src = np.full(batch.tokens.shape, -1, np.int32)
    arrays = [(f"batch.{f.name}", getattr(batch, f.name)) for f in dataclasses.fields(StepBatch)]
    arrays += [(f"sampling.{f.name}", getattr(s, f.name)) for f in dataclasses.fields(SamplingArrays)]
    arrays.append(("token_src", token_src))
    parts, layout = [], []
    for name, a in arrays:
        a = np.ascontiguousarray(a)
        if a.dtype.itemsize != 4:
            raise TypeError(f"step input {name} is {a.dtype}; only 4-byte dtypes can be packed")
        parts.append(a.view(np.int32).ravel())
        layout.append((name, tuple(a.shape), a.dtype.str))
    packed, offset = np.zeros(sum(_field_span(p.size) for p in parts), np.int32), 0
    for flat in parts:
        packed[offset:offset + flat.size] = flat
        offset += _field_span(flat.size)
    return packed, tuple(layout)


def unpack_inputs(packed: jax.Array, layout: Layout) -> tuple[StepBatch, SamplingArrays, jax.Array]:
    """Inside the jitted step: static slices of the buffer back into the step's inputs."""
    fields, offset = {}, 0
    for name, shape, dtype in layout:
        size = int(np.prod(shape, dtype=np.int64))
        x = packed[offset:offset + size].reshape(shape)
        offset += _field_span(size)
        if np.dtype(dtype) != np.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
        fields[name] = x
    batch = StepBatch(**{k[6:]: v for k, v in fields.items() if k.startswith("batch.")})
    s = SamplingArrays(**{k[9:]: v for k, v in fields.items() if k.startswith("sampling.")})
    return batch, s, fields["token_src"]


def _step(cfg: ModelConfig, spec: PagedSpec, out_rows: int, prompt_logprobs: bool, layout: Layout, params, pool,
          table, packed: jax.Array, prev_tokens: jax.Array, penalty_state: penalties.PenaltyState):
    batch, s, token_src = unpack_inputs(packed, layout)
    tokens = jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], batch.tokens)
    batch = dataclasses.replace(batch, tokens=tokens)
    prompt = None
    if prompt_logprobs:  # the logits of every row; each sequence samples from its own last row's
        every_row = dataclasses.replace(batch, logits_rows=jnp.arange(tokens.shape[0], dtype=jnp.int32))
        all_logits, pool = paged_forward(cfg, spec, params, pool, table, every_row)
        logits = all_logits[batch.logits_rows]
        prompt = packed_logprobs(all_logits, jnp.roll(tokens, -1))  # row t scores the token after it
    else:
        logits, pool = paged_forward(cfg, spec, params, pool, table, batch)
    if spec.mode == "prefill":
        penalty_state = penalties.refill(penalty_state, s, batch)
    sampled = sample(penalties.apply(logits, s, penalty_state), s)
    penalty_state = penalties.count_sampled(penalty_state, s, sampled)
    out = StepOutput(tokens=jnp.zeros(out_rows, jnp.int32).at[: sampled.shape[0]].set(sampled),
                     logprobs=packed_logprobs(logits, sampled), prompt_logprobs=prompt)
    return out, penalty_state, pool


def device_batch(batch: StepBatch) -> StepBatch:
    return jax.tree.map(jnp.asarray, batch)
