"""Iteration-level scheduling: which sequences run this step, admission against the pool, preemption.

A step is either a prefill (newly admitted sequences, whole prompts) or a decode (every running sequence, one token
each). Admission asks for the request's worst-case KV (prompt + max_tokens) plus its adapter's pages if it is not
resident; pages are then taken as the sequence grows, and when the pool runs dry the most recently admitted sequence
is preempted (its pages freed, recomputed later from its tokens so far). The order of admission is a policy.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections import deque
from collections.abc import Callable

from ..lora.peft import AdapterError
from .adapter_store import NoRoom
from .config import EngineConfig
from .page_allocator import KV
from .policies import Policy, PolicyContext, make_policy
from .pool import PagedPool
from .prefix_cache import PrefixCache
from .sequence import Sequence, Status

# first-token latencies (admission to first token) remembered for the early-abort bound
TTFT_WINDOW = 64


class RequestRejected(ValueError):
    """A request the engine will never serve as asked (bad input, or larger than the pool); ``param`` names the
    request field to blame, for HTTP error bodies."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class Plan:
    kind: str  # "prefill" | "decode"
    seqs: list[Sequence]
    preempted: list[Sequence] = dataclasses.field(default_factory=list)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def check_prompt_fits(ecfg, n_prompt: int) -> None:
    """Raise :class:`RequestRejected` for a prompt that leaves no room in the context for even one token (reads only
    the config: a server without the scheduler, such as an engine process's front end, asks it too)."""
    if n_prompt >= ecfg.max_model_len:
        raise RequestRejected(f"the prompt has {n_prompt} tokens; this model's context is "
                              f"{ecfg.max_model_len} tokens (prompt + max_tokens must fit)", "prompt")


class Scheduler:
    """Owns admission: the fit rule (``check_request``, ``_admit``), the admission order (``policy``, ``head``) and
    preemption. Everyone who asks "does this fit" or "who is next" asks here."""

    def __init__(self, ecfg: EngineConfig, pool: PagedPool, store, policy: Policy | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.ecfg, self.pool, self.store = ecfg, pool, store
        self.clock = clock
        self._ttfts: deque[float] = deque(maxlen=TTFT_WINDOW)
        self.policy = policy or make_policy(ecfg.scheduling_policy, self._policy_context(ecfg))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._failed: list[tuple[Sequence, str, str]] = []
        self.num_preemptions = 0
        self.num_deadline_aborts = 0
        self.prefix_cache = self._make_prefix_cache(ecfg)
        # without the prefix cache, the samples of one request (forks) share their prompt's pages through this one
        self.fork_pages = PrefixCache(self.pool.allocator, ecfg.page_size, retain=False)

    SCHEDULING_FIELDS = ("scheduling_policy", "first_token_slo_s", "early_abort", "vtc_input_weight",
                         "vtc_output_weight", "vtc_reserved_slots", "adapter_lookahead", "adapter_max_bypass",
                         "prefix_cache")

    def reconfigure(self, **changes) -> None:
        """Change admission settings (``SCHEDULING_FIELDS`` of EngineConfig) while no request is in the engine: a
        new policy object and, if asked, a fresh (or no) prefix cache. Nothing else about the engine changes."""
        unknown = set(changes) - set(self.SCHEDULING_FIELDS)
        if unknown:
            raise ValueError(f"not scheduling settings: {sorted(unknown)} (these are: {self.SCHEDULING_FIELDS})")
        if self.has_work():
            raise RuntimeError("reconfigure the scheduler only while no request is waiting or running")
        ecfg = dataclasses.replace(self.ecfg, **changes)
        policy = make_policy(ecfg.scheduling_policy, self._policy_context(ecfg))
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.ecfg, self.policy = ecfg, policy
        self.prefix_cache = self._make_prefix_cache(ecfg)
        self._ttfts.clear()

    def _make_prefix_cache(self, ecfg: EngineConfig) -> PrefixCache | None:
        return PrefixCache(self.pool.allocator, ecfg.page_size) if ecfg.prefix_cache else None

    def take_failed(self) -> list[tuple[Sequence, str, str]]:
        """Sequences that cannot be served (reason, kind: "adapter" failed to load, "deadline" missed), once each."""
        failed, self._failed = self._failed, []
        return failed

    def add(self, seq: Sequence) -> None:
        if seq.deadline is None and self.ecfg.first_token_slo_s is not None:
            seq.deadline = seq.arrival_time + self.ecfg.first_token_slo_s
        self.waiting.append(seq)
        self.policy.on_arrival(seq)

    # ---------------------------------------------------------------- what the engine reports back
    def on_token(self, seq: Sequence, now: float) -> bool:
        """One generated token of ``seq`` at ``now``; False when it is a first token past the deadline that early
        abort must not serve (the caller then ends the request with :meth:`deadline_message`)."""
        self.policy.on_tokens(seq, 1)
        if seq.first_token_time is not None:
            return True
        if seq.admit_time is not None:
            self._ttfts.append(now - seq.admit_time)
        late = self.ecfg.early_abort and seq.deadline is not None and now > seq.deadline
        self.num_deadline_aborts += late
        return not late

    def _policy_context(self, ecfg: EngineConfig) -> PolicyContext:
        return PolicyContext(ecfg, self.store.is_resident, self.clock, self.typical_time_to_first_token)

    def typical_time_to_first_token(self) -> float:
        """The median admission-to-first-token time lately (0 before any)."""
        return statistics.median(self._ttfts) if self._ttfts else 0.0

    def min_time_to_first_token(self) -> float:
        """A lower bound on admission-to-first-token seen lately (0 before any): a waiting request whose deadline is
        nearer than this cannot make it even if admitted now."""
        return min(self._ttfts, default=0.0)

    def deadline_message(self, seq: Sequence, now: float) -> str:
        late = now - seq.deadline
        return (f"the request could not get its first token by its deadline ({late:.3f} s past it when it could be "
                f"served; the server is overloaded): not served late, try again later")

    def _expire(self) -> None:
        """Early abort: take out waiting requests that can no longer meet their first-token deadline (not those back
        in the queue after a preemption: their first token was served, the deadline was met)."""
        now, bound = self.clock(), self.min_time_to_first_token()
        late = [s for s in self.waiting
                if s.deadline is not None and s.first_token_time is None and now + bound > s.deadline]
        for seq in late:
            self.waiting.remove(seq)
            self.num_deadline_aborts += 1
            self._failed.append((seq, self.deadline_message(seq, now + bound), "deadline"))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def head(self, n: int) -> list[Sequence]:
        """The next ``n`` waiting sequences in the policy's admission order (what prefetch should prepare)."""
        return list(itertools.islice(self.policy.order(self.waiting), n))

    # ---------------------------------------------------------------- the fit rule
    def worst_case_pages(self, seq: Sequence) -> int:
        """KV pages a sequence may come to hold (prompt + max_tokens): what admission reserves."""
        return pages_for(seq.max_total_tokens, self.ecfg.page_size)

    def kv_room(self, adapter: str | None) -> int:
        """Most tokens (prompt + max_tokens) one request with this adapter can ever hold: the context, or what the
        whole pool holds next to the adapter's pages if less."""
        adapter_pages = self.store.adapter_pages(adapter) if adapter is not None else 0
        return min(self.ecfg.max_model_len, (self.pool.num_pages - adapter_pages) * self.ecfg.page_size)

    def check_prompt(self, n_prompt: int) -> None:
        """Raise :class:`RequestRejected` for a prompt that leaves no room in the context for even one token."""
        check_prompt_fits(self.ecfg, n_prompt)

    def check_request(self, n_prompt: int, max_tokens: int | None, adapter: str | None, min_tokens: int = 0) -> int:
        """Raise :class:`RequestRejected` for a request that could never be admitted (admission would wait for it
        forever) or never reach its ``min_tokens``; returns its max_tokens, with None resolved to as many as fit."""
        max_len = self.ecfg.max_model_len
        self.check_prompt(n_prompt)
        room = self.kv_room(adapter)
        if max_tokens is None and n_prompt >= room:  # the client set no max_tokens: the prompt is what cannot fit
            raise RequestRejected(f"the prompt ({n_prompt} tokens) leaves no room for a token in the KV cache this "
                                  f"server's pool holds next to the adapter ({room} tokens); shorten the prompt",
                                  "prompt")
        if max_tokens is None:
            max_tokens = room - n_prompt
        total = n_prompt + max_tokens
        if total > max_len:
            raise RequestRejected(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                                  f"context of {max_len} tokens", "max_tokens")
        if total > room:
            raise RequestRejected(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) needs more KV cache than "
                                  f"this server's pool holds next to the adapter ({room} tokens); lower max_tokens",
                                  "max_tokens")
        if min_tokens > max_tokens:  # max_tokens given: SamplingParams.validate refused it already
            raise RequestRejected(f"min_tokens ({min_tokens}) exceeds the {max_tokens} tokens this request can "
                                  f"generate after its {n_prompt}-token prompt", "min_tokens")
        return max_tokens

    # ---------------------------------------------------------------- planning
    def schedule(self) -> Plan | None:
        if self.ecfg.early_abort:
            self._expire()
        admitted = self._admit()
        if admitted:
            return Plan("prefill", admitted)
        preempted = self._reserve_decode_pages()
        seqs = self._decodable()
        return Plan("decode", seqs, preempted) if seqs else None

    def _decodable(self) -> list[Sequence]:
        return [s for s in self.running if self._can_grow(s)]

    def _can_grow(self, seq: Sequence) -> bool:
        """May still get a token (one whose last token is still on the device may already be done)."""
        return seq.can_grow(self.ecfg.max_model_len)

    def _admit(self) -> list[Sequence]:
        batch: list[Sequence] = []
        try:
            self._choose(batch, wait_for_reads=False)
            if not batch and not self.running:  # nothing else can run: wait for the first adapter's read
                self._choose(batch, wait_for_reads=True)
        except BaseException:  # a device error mid-admission: those taken so far give back their pages and pins
            for seq in batch:
                self.free(seq)
                self._release(seq)
                seq.adapter_slot = -1
            raise
        now = self.clock()
        for seq in batch:
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            seq.admit_time = now
            self.running.append(seq)
        self.policy.on_admitted(batch, self.waiting)
        # rows of one adapter next to each other: SGMV segments
        batch.sort(key=lambda s: s.adapter_slot)
        return batch

    def _choose(self, batch: list[Sequence], wait_for_reads: bool) -> None:
        """Append to ``batch`` the waiting sequences this prefill takes, each with its KV pages and adapter pin.
        With ``admit_while_loading``, one whose adapter is still being read is passed over, unless
        ``wait_for_reads`` and it would be the batch's first (then admission waits for its read)."""
        ecfg, page = self.ecfg, self.ecfg.page_size
        tokens, forks, passed = 0, set(), 0
        for seq in self.policy.order(self.waiting):
            if seq.error is not None:  # its adapter failed this step (the first pass): the engine ends it once
                continue
            n = seq.num_tokens
            if (len(batch) >= ecfg.max_prefill_seqs or len(self.running) + len(batch) >= ecfg.max_batch_size
                    or tokens + n > ecfg.max_prefill_tokens):
                break
            if not self.policy.may_take_slot(seq, ecfg.max_batch_size - len(self.running) - len(batch)):
                continue
            if seq.fork is not None and not seq.fork.prefilled and seq.fork in forks:
                continue  # a sample of a request waits for its sibling's prefill, then shares its prompt pages
            adapter = seq.adapter
            if (ecfg.admit_while_loading and adapter is not None and (not wait_for_reads or self.running or batch)
                    and not self.store.is_resident(adapter) and not self.store.host.ready_without_wait(adapter)):
                passed += 1  # its adapter loads meanwhile; it keeps its place in the queue
                if passed >= ecfg.adapter_lookahead:
                    break
                continue
            # a prefill that must compute every prompt token (prompt logprobs, penalties) shares nothing
            cache = None if seq.needs_whole_prompt else self._sharing(seq)
            shared = cache.match(seq.adapter, seq.prompt_ids) if cache else []
            worst = self.worst_case_pages(seq) - len(shared)  # shared pages are counted once, by the cache
            adapter_pages = self.store.pages_needed_to_load(seq.adapter) if seq.adapter else 0
            if worst + adapter_pages + self._pinning_takes(seq.adapter) > self.obtainable_pages():
                self._unshare(seq, shared)
                break
            # the store makes room for a load from free pages and unpinned adapters: unused cached prefixes go
            # before any adapter (recomputing a prefix is cheaper than reading an adapter again)
            short = adapter_pages - self.pool.num_free_pages
            if short > 0 and self.prefix_cache:
                self.prefix_cache.evict(short)
            slot = None
            try:
                slot = self._acquire(seq)
                if slot is None:
                    self._unshare(seq, shared)
                    if seq.error is not None:  # adapter failed to load: the engine ends this request
                        continue
                    break
                if not self.reclaim_pages(worst):
                    self._unshare(seq, shared)
                    self._release(seq)
                    break
                own = self.pool.alloc_kv_pages(pages_for(n, page) - len(shared), owner=seq.request_id)
            except BaseException:  # e.g. the device failed a load: this one gives back what it took, then _admit
                self._unshare(seq, shared)
                if slot is not None:
                    self._release(seq)
                raise
            seq.kv_pages = shared + own
            seq.shared_pages, seq.num_cached = len(shared), len(shared) * page  # prefill computes from there
            seq.adapter_slot = slot
            batch.append(seq)
            if cache is not None:
                cache.count(seq.prompt_ids, len(shared))
            tokens += n
            forks.add(seq.fork)

    def _pinning_takes(self, adapter: str | None) -> int:
        """Pages that pinning ``adapter`` takes out of :meth:`obtainable_pages`: a resident adapter no sequence
        pins counts there as evictable (was: admission pinned it, found no room and let go, every step)."""
        if adapter is None or not self.store.is_resident(adapter) or self.store.pin_count(adapter):
            return 0
        return self.store.adapter_pages(adapter)

    def _acquire(self, seq: Sequence) -> int | None:
        if seq.adapter is None:
            return -1
        try:
            return self.store.acquire(seq.adapter)
        except AdapterError as e:
            seq.error = str(e)
            # a failure that may pass (a disk away) is not the request's fault: "adapter_unavailable" (HTTP 503)
            self._failed.append((seq, str(e), "adapter" if e.retry_after_s is None else "adapter_unavailable"))
            return None
        except NoRoom:
            return None

    def _release(self, seq: Sequence) -> None:
        if seq.adapter is not None:
            self.store.release(seq.adapter)

    def _reserve_decode_pages(self) -> list[Sequence]:
        """Give every running sequence the page its next token needs, preempting the newest when short."""
        preempted = []
        page = self.ecfg.page_size
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if not self._can_grow(seq):
                i += 1
                continue
            position = seq.num_tokens - 1  # the token this decode step writes
            if position // page < len(seq.kv_pages):
                i += 1
                continue
            if self.reclaim_pages(1):
                seq.kv_pages += self.pool.alloc_kv_pages(1, owner=seq.request_id)
                i += 1
                continue
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
            # if the victim was seq itself, i now points past the end
        return preempted

    # ---------------------------------------------------------------- room
    def live_kv_tokens(self) -> int:
        """Tokens whose K/V the running sequences use, each page's counted once: samples of one prompt and prefix
        cache hits share leading pages (a page holds as many live tokens as its fullest user has in it)."""
        size, live = self.ecfg.page_size, {}
        for seq in self.running:
            for i, page in enumerate(seq.kv_pages[: pages_for(seq.num_cached, size)]):
                live[page] = max(live.get(page, 0), min(size, seq.num_cached - i * size))
        return sum(live.values())

    def obtainable_pages(self) -> int:
        """Free pages plus what evicting unused cached prefixes and unpinned adapters would free."""
        cached = self.prefix_cache.evictable_pages if self.prefix_cache else 0
        return self.pool.num_free_pages + cached + self.store.evictable_pages()

    def reclaim_pages(self, n_pages: int) -> bool:
        """Make ``n_pages`` free: unused cached prefixes go first (a recompute of a prompt prefix), then unpinned
        adapters (a reload from host memory). All or nothing: False, evicting nothing, if it cannot be done."""
        if self.pool.num_free_pages >= n_pages:
            return True
        if self.obtainable_pages() < n_pages:
            return False
        if self.prefix_cache:
            self.prefix_cache.evict(n_pages - self.pool.num_free_pages)
        return self.store.reclaim_pages(n_pages)

    def _sharing(self, seq: Sequence) -> PrefixCache | None:
        """Where ``seq`` shares prompt pages: the prefix cache, else the fork pages for the samples of a request."""
        if self.prefix_cache is not None:
            return self.prefix_cache
        return self.fork_pages if seq.fork is not None else None

    def _unshare(self, seq: Sequence, pages: list[int]) -> None:
        if pages:
            self._sharing(seq).release(pages)

    def on_prefilled(self, seqs: list[Sequence]) -> None:
        """The prefill of ``seqs`` was dispatched: their prompts' full pages join the prefix cache (or, for the
        samples of a request, the fork pages), and the other samples of their requests may be admitted."""
        for seq in seqs:
            if seq.status != Status.RUNNING:
                continue
            if seq.fork is not None:
                seq.fork.prefilled = True
            sharing = self._sharing(seq)
            if sharing is not None:
                seq.shared_pages = sharing.insert(seq.adapter, seq.prompt_ids, seq.kv_pages, seq.shared_pages,
                                                  (KV, seq.request_id))

    # ---------------------------------------------------------------- finishing
    def free(self, seq: Sequence) -> None:
        """Return a sequence's pages and adapter pin (finished, aborted or preempted)."""
        if seq.kv_pages:
            self.pool.free_kv_pages(seq.kv_pages[seq.shared_pages:], owner=seq.request_id)
            self._unshare(seq, seq.kv_pages[:seq.shared_pages])
            seq.kv_pages, seq.shared_pages = [], 0
        if seq.status == Status.RUNNING:
            self._release(seq)
            self.running.remove(seq)
        seq.num_cached = 0

    def preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self._back_to_wait(seq)

    def _back_to_wait(self, seq: Sequence) -> None:
        """Pages and pin returned, the sequence at the head of the waiting queue (recomputed when admitted)."""
        self.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.policy.on_preempted(seq)

    def requeue(self, seqs: list[Sequence]) -> None:
        """A prefill that failed (raised at or right after its dispatch): its running sequences go back to the head
        of the waiting queue, in order, holding no pages or pins, to be admitted and prefilled again. Without this
        they went on running with no prompt K/V and decoded wrong tokens."""
        for seq in reversed(seqs):
            if seq.status == Status.RUNNING:
                self._back_to_wait(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == Status.FINISHED:
            return
        if seq.status == Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.policy.on_finished(seq)
