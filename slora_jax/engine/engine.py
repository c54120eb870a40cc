"""The serving engine: requests in, tokens out, many adapters batched on one base model.

``step()`` reads top-down: schedule -> run the jitted step (pool donated) -> prefetch adapters for the waiting head
while the device works -> append tokens, stop, free. Usable offline in a few lines::

    engine = Engine.from_model_dir("model/", EngineConfig(pool_bytes=8 << 30), adapter_dir="adapters/")
    outs = engine.generate([[1, 2, 3]], adapters=["adapter-0001"], sampling=SamplingParams(temperature=0))
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.backends import get_backend

from ..model.config import ModelConfig
from ..model.params import stack_layer_params, unstack_layer_params
from ..model.params_checkpoint import load_serving_params
from ..model.sharding import TensorParallel
from . import compile_counter, offline
from .adapter_mixes import AdapterMixes
from .adapter_store import AdapterStore
from .callbacks import each_then_raise
from .config import EngineConfig, resolve_layer_loop
from .detok import IncrementalDetokenizer
from .grammar import GrammarMatcher, prepare_grammar_rows
from .logprobs import StepLogprobs
from .penalties import PenaltyRows
from .pool import PagedPool
from .sampling import SamplingParams
from .scheduler import RequestRejected, Scheduler
from .sequence import RequestOutput, Sequence, Status
from .step_clock import StepClock
from .step_runner import StepInputError, StepItem, StepRunner, lora_variant

log = logging.getLogger(__name__)

# Adapters of the first max_prefill_seqs waiting requests are prefetched (host read, device staging, pool load when
# there is room); those of the next (READ_AHEAD - 1) * max_prefill_seqs are only read into host memory. Staging
# deeper (as every add_request once did) pushed the head's staged pages out of the bounded staging area.
READ_AHEAD = 4


# The start of the error message of a request ended for its own input (its error_kind is "request": HTTP 400).
INVALID_REQUEST = "invalid request"


class QueueFull(RuntimeError):
    """Too many waiting requests: the caller should retry later (HTTP 429/503)."""


class Engine:
    def __init__(self, cfg: ModelConfig, params: dict, ecfg: EngineConfig, tokenizer=None,
                 interpret: bool | None = None):
        compile_counter.install()
        ecfg = ecfg.with_platform_defaults(jax.default_backend())
        self.cfg, self.ecfg = cfg, ecfg.validate(cfg)
        self.layer_loop = resolve_layer_loop(ecfg.layer_loop, jax.default_backend())
        unrolled = isinstance(params["layers"], list | tuple)
        if self.layer_loop == "unroll" and not unrolled:
            params = dict(params, layers=unstack_layer_params(params["layers"]))
        elif self.layer_loop == "scan" and unrolled:
            params = dict(params, layers=stack_layer_params(params["layers"]))
        self.tp = TensorParallel.maybe(cfg, ecfg.tensor_parallel_size, ecfg.fully_sharded_loras)  # model/sharding.py
        self.params = params if self.tp is None else self.tp.place_params(params)
        get_backend(ecfg.backend)  # unknown names fail here, listing the known ones
        self.tokenizer = tokenizer
        dtype = jnp.dtype(ecfg.dtype)
        ecfg = self.ecfg = ecfg.with_pool_size(jax.devices()[0].memory_stats())  # the weights are on the device now
        self.pool = PagedPool(cfg, page_size=ecfg.page_size, max_slots=ecfg.max_loras, max_rank=ecfg.max_lora_rank,
                              num_pages=ecfg.num_pages, memory_bytes=None if ecfg.num_pages else ecfg.pool_bytes,
                              dtype=dtype, tp=self.tp)
        ecfg = self.ecfg = ecfg.with_batch_from_pool(self.pool.num_pages * ecfg.page_size).with_host_defaults(
            jax.default_backend(), compile_counter.available_memory())
        self.store = AdapterStore(cfg, self.pool, host_budget_bytes=ecfg.host_budget_bytes, max_rank=ecfg.max_lora_rank,
                                  dtype=np.dtype(dtype), max_host_adapters=ecfg.max_cpu_loras,
                                  max_staged=ecfg.max_staged_adapters, read_processes=ecfg.adapter_read_processes)
        self.scheduler = Scheduler(ecfg, self.pool, self.store)
        done = Status.FINISHED
        self.mixes = AdapterMixes(self.store, lambda: [s.adapter for s in self.requests.values() if s.status != done])
        self.runner = StepRunner(cfg, ecfg, interpret=interpret, tp=self.tp)
        self.penalty_rows = PenaltyRows(ecfg.max_batch_size)  # rows of runner.penalty_state
        self.requests: dict[str, Sequence] = {}
        self.warm_compiles: int | None = None
        self.num_steps = 0
        self.last_plan = None  # what the last step ran (benchmarks read it)
        self.clock = StepClock()  # host seconds per step phase, and per kind of step (last: the last step's)
        self._failed_prefill: list[Sequence] = []  # the sequences of the last prefill that raised
        # dispatched, tokens not read yet: (sequences, their rows in the output, token ids on the device)
        self._inflight: tuple[list[Sequence], list[int], jax.Array, StepLogprobs | None] | None = None
        self._inflight_kind: str | None = None  # its plan's kind
        self._step_logprobs: StepLogprobs | None = None  # of the step _dispatch just queued

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, ecfg: EngineConfig, adapters: dict[str, str | Path] | None = None,
                       adapter_dir: str | Path | None = None, tokenizer=None, interpret: bool | None = None,
                       progress: bool = True, converted_params_dir: str | Path | None = None) -> Engine:
        stacked = resolve_layer_loop(ecfg.layer_loop, jax.default_backend()) == "scan"  # converted: orbax cache dir
        cfg, params = load_serving_params(model_dir, jnp.dtype(ecfg.dtype), tp=ecfg.tensor_parallel_size,
                                          stacked=stacked, progress=progress, converted_dir=converted_params_dir)
        engine = cls(cfg, params, ecfg, tokenizer=tokenizer, interpret=interpret)
        if adapter_dir is not None:
            engine.store.register_dir(adapter_dir)
        for name, path in (adapters or {}).items():
            engine.register_adapter(name, path)
        return engine

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt_ids: list[int], adapter: str | None = None, sampling: SamplingParams | None = None,
                    request_id: str | None = None, on_output: Callable[[RequestOutput], None] | None = None,
                    watch_stop_strings: bool = True, tenant: str | None = None,
                    first_token_slo_s: float | None = None, grammar: GrammarMatcher | None = None) -> str:
        """Queue a request; raises ValueError (bad input; :class:`RequestRejected` names the field), KeyError
        (unknown adapter) or QueueFull. ``sampling.max_tokens=None`` means as many as fit.

        ``tenant``: whose service it counts towards under a fairness policy (default: its adapter).
        ``first_token_slo_s``: its first token is due this many seconds after now (default
        ``EngineConfig.first_token_slo_s``); with ``early_abort`` it is ended, not served late.
        ``grammar``: a ``GrammarMatcher`` (engine/grammar.py; the request follows its own copy) the output must
        match; the request stops when it is complete.

        ``watch_stop_strings=False``: the caller detokenizes the output itself and aborts on a stop string (the
        server does, off the engine thread), so the engine keeps no detokenizer for this request.
        """
        if not prompt_ids:
            raise RequestRejected("prompt is empty", "prompt")
        if any(not 0 <= int(t) < self.cfg.vocab_size for t in prompt_ids):
            raise RequestRejected(f"prompt token ids must be in [0, {self.cfg.vocab_size})", "prompt")
        self.scheduler.check_prompt(len(prompt_ids))
        sampling = (sampling or SamplingParams()).validate()  # the context limit: check_request below
        for field, t in sampling.token_ids_to_check():
            if t >= self.cfg.vocab_size:
                raise RequestRejected(f"{field} token ids must be in [0, {self.cfg.vocab_size})", field)
        if adapter is not None and adapter not in self.store:
            raise KeyError(f"unknown adapter {adapter!r}")
        max_tokens = self.scheduler.check_request(len(prompt_ids), sampling.max_tokens, adapter, sampling.min_tokens)
        if max_tokens != sampling.max_tokens:
            sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        if len(self.scheduler.waiting) >= self.ecfg.max_waiting:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests are waiting; try again later")
        if first_token_slo_s is not None and not (first_token_slo_s > 0 and math.isfinite(first_token_slo_s)):
            raise RequestRejected(f"the first-token deadline must be a positive number of seconds, got "
                                  f"{first_token_slo_s!r}", "first_token_slo_s")
        now = time.monotonic()
        seq = Sequence(prompt_ids=[int(t) for t in prompt_ids], adapter=adapter, sampling=sampling,
                       on_output=on_output, arrival_time=now, tenant=tenant, grammar=grammar and grammar.fork(),
                       deadline=None if first_token_slo_s is None else now + first_token_slo_s)
        if request_id is not None:
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            seq.request_id = request_id
        if self.tokenizer is not None and sampling.stop and watch_stop_strings:
            seq.detok = IncrementalDetokenizer(self.tokenizer, sampling.stop, seq.prompt_ids, sampling.min_tokens)
        seq.seed = sampling.seed if sampling.seed is not None else int(np.random.default_rng().integers(2**31))
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self.mixes.prune(self._unregister)  # too many mixes: drop unused ones (never this request's)
        if adapter is not None:
            n_head = self.ecfg.max_prefill_seqs
            if seq in self.scheduler.head(n_head):  # in the head: get it onto the device now
                self._prefetch_head(read_ahead=False)
            elif len(self.scheduler.waiting) <= READ_AHEAD * n_head:
                self.store.read_ahead([adapter])
        return seq.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages; False if it is unknown or already finished."""
        seq = self.requests.get(request_id)
        if seq is None or seq.status == Status.FINISHED:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        inflight = self._inflight is not None and any(s.status != Status.FINISHED for s in self._inflight[0])
        return self.scheduler.has_work() or inflight

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch the next step, then read back the previous one while the device runs this one.

        A decode step takes its input tokens straight from the previous step's output on the device, so the host's
        bookkeeping (tokens, stops, callbacks, the next batch) overlaps the device's work instead of idling it.
        """
        t0 = time.perf_counter()
        outputs = self._end_failed()
        plan = self.scheduler.schedule()
        outputs += self._end_failed()
        self.last_plan = plan
        previous, previous_kind = self._inflight, self._inflight_kind
        if previous is not None and all(s.status == Status.FINISHED for s in previous[0]):
            previous = None  # nothing to read back; a failed step's error (its batch aborted) is not raised again
        t1 = time.perf_counter()
        if plan is not None:
            try:
                next_ids, failed = self._dispatch(plan, previous)
            except BaseException:
                if plan.kind == "prefill":  # admitted, never prefilled: they wait again, holding nothing
                    self.scheduler.requeue(plan.seqs)
                    self._failed_prefill = list(plan.seqs)
                raise
            outputs += failed
            if next_ids is None:  # every sequence of the plan was refused
                plan = None
            else:
                self.num_steps += 1
                if plan.kind == "prefill":
                    self.scheduler.on_prefilled(plan.seqs)
                    self._failed_prefill = []
        t2 = time.perf_counter()
        # dispatched (or nothing to run): the new step's tokens are now the ones on the device
        self._inflight = None
        if previous is not None:
            for seq in previous[0]:
                seq.inflight = -1
        if plan is not None:
            for row, seq in enumerate(plan.seqs):
                seq.inflight = row
            self._inflight = (plan.seqs, list(range(len(plan.seqs))), next_ids, self._step_logprobs)
            self._inflight_kind = plan.kind
            self._prefetch_head()
        t3 = time.perf_counter()
        t4 = t3
        if previous is not None:
            tokens = np.asarray(previous[2])  # waits for the previous step (this one is queued behind it)
            t4 = time.perf_counter()
            try:
                outputs += self._drain(previous[0], previous[1], tokens, previous[3])
            finally:
                self.clock.record((t1 - t0, t2 - t1, t3 - t2, t4 - t3, time.perf_counter() - t4), previous_kind)
        else:
            self.clock.record((t1 - t0, t2 - t1, t3 - t2, 0.0, time.perf_counter() - t3), None)
        return outputs

    def _dispatch(self, plan, previous) -> tuple[jax.Array | None, list[RequestOutput]]:
        """Queue the plan's step; returns (its token ids on the device, outputs of refused sequences).

        A sequence whose own inputs cannot be packed for the step (found before dispatch, the pool untouched) ends
        with an error and leaves the plan; the others run as if it never was (``next_ids`` None: none left)."""
        failed = []
        prepare_grammar_rows(plan.seqs, previous)  # masks; waits for the previous step if a grammar row needs it
        while plan.seqs:
            items = [self._item(seq, plan.kind) for seq in plan.seqs]
            try:
                if plan.kind == "prefill":
                    next_ids, self.pool.array = self.runner.prefill(self.params, self.pool.array, self.pool.table,
                                                                    items)
                else:
                    prev_ids = previous[2] if previous is not None else None
                    slots = [seq.adapter_slot for seq in plan.seqs if seq.adapter_slot >= 0]
                    lora = lora_variant(self.pool.slot_modules[slots].any(axis=0))
                    next_ids, self.pool.array = self.runner.decode(self.params, self.pool.array, self.pool.table,
                                                                   items, prev_ids, lora=lora)
                self._step_logprobs = StepLogprobs.of_step(self.runner.last_output, plan.seqs, items)
                return next_ids, failed
            except StepInputError as e:
                bad = [plan.seqs[i] for i in e.rows]
                log.warning("refusing %d request(s) whose step inputs cannot be built: %s", len(bad), e)
                for seq in bad:
                    failed.append(self._finish(seq, "error", f"{INVALID_REQUEST}: its step inputs cannot be built "
                                                             f"({e})", "request"))
                plan.seqs = [seq for seq in plan.seqs if seq not in bad]
        return None, failed

    def _prefetch_head(self, read_ahead: bool = True) -> None:
        """Adapters for the head of the waiting queue: onto the device (and into the pool where there is room);
        host reads only for the requests behind it. An optimisation: a failure here is logged, never raised."""
        n_head = self.ecfg.max_prefill_seqs
        queue = self.scheduler.head(READ_AHEAD * n_head if read_ahead else n_head)  # the policy's order
        head, behind = queue[:n_head], queue[n_head:]
        # leave the head's worst-case KV free: an adapter loaded into pages that admission then reclaims for that KV
        # is evicted unused and loaded again next step (thrash seen at 2000 adapters in a 24 GiB pool)
        head_kv = sum(self.scheduler.worst_case_pages(s) for s in head)
        try:
            self.store.prefetch([s.adapter for s in head if s.adapter is not None], keep_free_pages=head_kv)
            self.store.read_ahead(s.adapter for s in behind if s.adapter is not None)
        except Exception:  # noqa: BLE001 - admission loads what prefetch could not
            log.warning("adapter prefetch failed", exc_info=True)

    @property
    def time_in(self) -> dict[str, float]:
        """Cumulative host seconds per step phase (benchmarks read and reset it)."""
        return self.clock.total

    def _drain(self, seqs: list[Sequence], rows: list[int], tokens: np.ndarray,
               logprobs: StepLogprobs | None = None) -> list[RequestOutput]:
        """Append a dispatched step's tokens, read back (sequences ended meanwhile drop theirs). Every token is
        appended even if a callback raises; the first callback error is raised at the end."""
        now = time.monotonic()
        def append(seq_row: tuple[Sequence, int]) -> RequestOutput | None:
            seq, row = seq_row
            if seq.status == Status.FINISHED:
                return None
            if seq.status == Status.RUNNING:
                seq.num_cached = len(seq.prompt_ids) + len(seq.output_ids)  # K/V this step wrote
            token = int(tokens[row])
            return self._append(seq, token, now, logprobs and logprobs.row(row, token, seq))

        return each_then_raise(zip(seqs, rows, strict=True), append)

    def _end_failed(self) -> list[RequestOutput]:
        """End the requests the scheduler could not serve (every one, even if a callback raises); one aborted since
        (a step raised before reporting it) has had its final output."""
        failed = [f for f in self.scheduler.take_failed() if f[0].status != Status.FINISHED]
        return each_then_raise(failed, lambda f: self._finish(f[0], "error", *f[1:]))

    def _item(self, seq: Sequence, kind: str) -> StepItem:
        mask = seq.grammar.mask() if seq.grammar is not None else None
        if kind == "prefill":
            start = seq.num_cached  # > 0 when a cached prompt prefix is shared: only the rest is computed
            return StepItem(tokens=seq.all_ids[start:], start=start, pages=seq.kv_pages,
                            adapter_slot=seq.adapter_slot, sampling=seq.sampling, seed=seq.seed,
                            counter=seq.num_generated, token_mask=mask, prompt_len=len(seq.prompt_ids),
                            penalty_row=self.penalty_rows.row_for_prefill(seq),
                            prompt_logprobs=seq.sampling.prompt_logprobs is not None and seq.prompt_logprobs is None)
        on_device = seq.inflight >= 0
        return StepItem(tokens=[0 if on_device else (seq.output_ids or seq.prompt_ids)[-1]], start=seq.num_tokens - 1,
                        pages=seq.kv_pages, adapter_slot=seq.adapter_slot, sampling=seq.sampling, seed=seq.seed,
                        counter=seq.num_generated, token_src=seq.inflight, token_mask=mask,
                        penalty_row=seq.penalty_row)

    def _append(self, seq: Sequence, token: int, now: float, logprobs: tuple | None = None) -> RequestOutput:
        token_lp, prompt_lp = logprobs or (None, None)  # what StepLogprobs.row read, if the request asked
        if seq.sampling.max_tokens == 0:  # prefill only (for the prompt logprobs): its sampled token is not served
            return self._finish(seq, "length", prompt_logprobs=prompt_lp)
        if not self.scheduler.on_token(seq, now):  # early abort: a first token past its deadline is not served
            return self._finish(seq, "error", self.scheduler.deadline_message(seq, now), "deadline")
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_ids.append(token)
        if seq.grammar is not None and not seq.grammar.catch_up(seq.output_ids):
            return self._finish(seq, "error", f"{INVALID_REQUEST}: its grammar failed ({seq.grammar.error})", "request")
        sp = seq.sampling
        reason = "stop" if seq.grammar is not None and seq.grammar.is_done() else None
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.cfg.eos_token_id):
            reason = "stop"
        elif seq.detok is not None:
            seq.detok.add([token])
            if seq.detok.stopped:
                reason = "stop"
        known = len(seq.prompt_ids) + len(seq.output_ids)
        if reason is None and (len(seq.output_ids) >= sp.max_tokens or known >= self.ecfg.max_model_len):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        text = seq.detok.take(final=reason is not None) if seq.detok is not None else ""
        out = RequestOutput(seq.request_id, [token], reason is not None, reason, text=text, prompt_logprobs=prompt_lp,
                            logprobs=None if token_lp is None else [token_lp])
        if seq.on_output is not None:
            seq.on_output(out)  # may raise: the token is already appended
        return out

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, error_kind: str | None = None,
                **fields) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        out = RequestOutput(seq.request_id, [], True, reason, error=error, error_kind=error_kind, **fields)
        if seq.on_output is not None:
            seq.on_output(out)
        return out

    # ---------------------------------------------------------------- what a server may ask
    # Engine-thread calls, except where a docstring says thread-safe. A server asks through these, never through
    # the engine's parts (scheduler, pool, store), so those stay free to change. The residency API (adapter_states,
    # read_adapter, pin_adapter, unpin_adapter, watch_adapters) tells routers where each adapter is.

    def running_request_ids(self) -> list[str]:
        """Requests a failed step may have hurt: the running batch, and a failed prefill's (waiting again)."""
        failed = [s for s in self._failed_prefill if s.status == Status.WAITING]
        return [s.request_id for s in [*self.scheduler.running, *failed]]

    def pool_lost(self) -> bool:
        """The pool array was donated to a step that failed: KV cache and resident adapters are gone for good."""
        is_deleted = getattr(self.pool.array, "is_deleted", None)
        return bool(is_deleted is not None and is_deleted())

    def check_prompt_length(self, n_prompt: int) -> None:
        """Thread-safe: :class:`RequestRejected` for a prompt of ``n_prompt`` tokens that leaves no room in the
        context (what ``add_request`` checks first; a server asks before queueing an oversized prompt)."""
        self.scheduler.check_prompt(n_prompt)

    def has_adapter(self, name: str) -> bool:
        """Thread-safe: whether ``name`` is a registered adapter (it may still fail to load)."""
        return name in self.store

    def adapter_names(self) -> list[str]:
        """Thread-safe: every registered adapter but the mixes (they come and go with requests)."""
        return [name for name in self.store.names() if name not in self.mixes]

    def register_adapter(self, name: str, source, verify: bool = False) -> None:
        """Thread-safe: serve ``source`` (a PEFT dir, a ``LoraAdapter`` or an ``AdapterSource``) as ``name``.

        Raises :class:`AdapterError` with the reason for one we cannot serve, ValueError if the name is taken or is
        a mix's. ``verify`` reads and checks every weight now (blocking: call it off the engine thread), so a bad
        adapter never reaches a request; else only the config and shapes are checked and weights on first use.
        """
        self.mixes.register_adapter(name, source, verify)

    def register_mix(self, parts: dict[str, float]) -> str:
        """Thread-safe: the adapter serving ``parts`` ({adapter: weight}) as PEFT's ``cat`` mix, registered on first
        use; ValueError for bad parts or weights or a rank above the maximum, KeyError for an unknown part."""
        return self.mixes.register(parts)

    def unregister_adapter(self, name: str) -> None:
        """Stop serving an adapter and the mixes built from it; KeyError if unknown, ``AdapterInUse`` while requests
        not finished (waiting and preempted ones too) or pins hold it or one of those mixes (nothing dropped)."""
        self.mixes.drop(name, self._unregister)

    def _unregister(self, name: str) -> None:
        self.store.unregister(name)
        if self.scheduler.prefix_cache is not None:  # a new adapter of this name must not hit the old one's K/V
            self.scheduler.prefix_cache.drop_adapter(name)

    def adapter_states(self, tier: str | None = None) -> list[dict]:
        """Every registered adapter's residency as plain dicts (``tier``: only those in ``device``, ``host`` or
        ``disk``): size, pins, loads, evictions, last use, load times, failure reason (``AdapterStore.states``)."""
        return self.store.states(tier)

    def read_adapter(self, name: str, timeout: float | None = None) -> None:
        """Thread-safe, blocking (call it off the engine thread): the adapter's rows into host memory, so that a pin
        right after does not read its source on the engine thread. Raises its :class:`AdapterError`."""
        self.store.host.fetch(name).result(timeout)

    def pin_adapter(self, name: str) -> dict:
        """Make ``name`` resident and keep it so until as many :meth:`unpin_adapter` calls; returns its state.
        KeyError if unknown, :class:`AdapterError` if it cannot be loaded, ``NoRoom`` if it cannot fit now or if
        explicit pins would leave other adapters no slot, or less than a full-length request and the largest
        adapter in pages."""
        if name not in self.store:
            raise KeyError(f"unknown adapter {name!r}")
        keep = self.ecfg.max_pages_per_seq + self.pool.max_pages
        self.store.check_pin(name, keep)
        self.scheduler.reclaim_pages(self.store.pages_needed_to_load(name))  # unused cached prefixes go first
        self.store.pin(name, keep)
        return self.store.states(names=[name])[0]

    def unpin_adapter(self, name: str) -> dict:
        """Drop one explicit pin (KeyError if unknown, ValueError if it has none); returns its state."""
        if name not in self.store:
            raise KeyError(f"unknown adapter {name!r}")
        self.store.unpin(name)
        return self.store.states(names=[name])[0]

    def watch_adapters(self, listener: Callable[[str, str, float | None], None]) -> None:
        """Thread-safe: ``listener(name, event, seconds)`` on pool loads, evictions and source reads (see
        ``AdapterStore.add_listener``; called on the engine thread and IO threads, so cheap and thread-safe)."""
        self.store.add_listener(listener)

    def reconfigure_scheduling(self, **changes) -> None:
        """Change the admission policy, deadlines or prefix caching (EngineConfig's scheduling fields) while the
        engine is idle; shapes and compiled steps are untouched, so nothing compiles."""
        self.scheduler.reconfigure(**changes)
        self.ecfg = self.scheduler.ecfg

    # ---------------------------------------------------------------- conveniences
    def warmup(self, progress: bool = True) -> None:
        """Compile every bucket now so that serving never compiles; records the compile count."""
        self.pool.array = self.runner.warmup(self.params, self.pool.array, self.pool.table, progress=progress)
        self.store.warmup()
        jax.block_until_ready(self.pool.array)
        self.warm_compiles = compile_counter.compile_count()

    def compiles_since_warmup(self) -> int:
        return compile_counter.compile_count() - (self.warm_compiles or 0)

    def generate(self, prompts: list[list[int]], adapters: list[str | None] | None = None,
                 sampling: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        """Offline batch: every prompt's generated token ids (errors raise)."""
        return offline.generate(self, prompts, adapters, sampling)

    def stream(self, prompt_ids: list[int], adapter: str | None = None,
               sampling: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Run one request to the end (driving the engine), yielding its outputs as they come."""
        return offline.stream(self, prompt_ids, adapter, sampling)

    def release(self, request_id: str) -> None:
        """Forget a finished request (servers call this once its output is delivered)."""
        seq = self.requests.get(request_id)
        if seq is not None and seq.status == Status.FINISHED:
            del self.requests[request_id]

    def stats(self) -> dict:
        return {
            "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running), "steps": self.num_steps,
            "preemptions": self.scheduler.num_preemptions, "deadline_aborts": self.scheduler.num_deadline_aborts,
            "compiles": compile_counter.compile_count(), "compiles_since_warmup": self.compiles_since_warmup(),
            "step_seconds": dict(self.time_in),
            "steps_by_kind": {kind: dict(v) for kind, v in self.clock.by_kind.items()},
            "pool": self.pool.stats(kv_tokens_live=self.scheduler.live_kv_tokens()),
            "adapters": self.store.stats(),
            "prefix_cache": self.scheduler.prefix_cache.stats() if self.scheduler.prefix_cache else {},
        }
