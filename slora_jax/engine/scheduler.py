"""Iteration-level scheduling: which sequences run this step, admission against the pool, preemption.

A step is either a prefill (newly admitted sequences, whole prompts) or a decode (every running sequence, one token
each). Admission asks for the request's worst-case KV (prompt + max_tokens) plus its adapter's pages if it is not
resident; pages are then taken as the sequence grows, and when the pool runs dry the most recently admitted sequence
is preempted (its pages freed, recomputed later from its tokens so far). The order of admission is a policy.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from ..lora.peft import AdapterError
from .adapter_store import NoRoom
from .config import EngineConfig
from .pool import PagedPool
from .sequence import Sequence, Status


class Policy(Protocol):
    """The order in which admission tries waiting sequences. Admission stops at the first that does not fit, and
    prefetch loads the adapters of the first ``max_prefill_seqs`` in this same order, so a policy decides both."""

    def order(self, waiting: deque[Sequence]) -> Iterable[Sequence]:
        """Waiting sequences in admission order; consumed lazily (admission and prefetch stop early)."""


POLICIES: dict[str, Callable[[], Policy]] = {}


def register_policy(name: str):
    """Class decorator: make a policy selectable as ``EngineConfig(scheduling_policy=name)``."""

    def add(cls):
        if name in POLICIES:
            raise ValueError(f"scheduling policy {name!r} is already registered")
        POLICIES[name] = cls
        return cls

    return add


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None


@register_policy("fcfs")
class FCFS:
    """First come, first served (preempted sequences go back to the front)."""

    def order(self, waiting: deque[Sequence]) -> Iterator[Sequence]:
        return iter(waiting)


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


class Scheduler:
    """Owns admission: the fit rule (``check_request``, ``_admit``), the admission order (``policy``, ``head``) and
    preemption. Everyone who asks "does this fit" or "who is next" asks here."""

    def __init__(self, ecfg: EngineConfig, pool: PagedPool, store, policy: Policy | None = None):
        self.ecfg, self.pool, self.store = ecfg, pool, store
        self.policy = policy or make_policy(ecfg.scheduling_policy)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._failed: list[tuple[Sequence, str]] = []
        self.num_preemptions = 0

    def take_failed(self) -> list[tuple[Sequence, str]]:
        """Sequences whose adapter failed to load (with the reason), once each."""
        failed, self._failed = self._failed, []
        return failed

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

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
        if n_prompt >= self.ecfg.max_model_len:
            raise RequestRejected(f"the prompt has {n_prompt} tokens; this model's context is "
                                  f"{self.ecfg.max_model_len} tokens (prompt + max_tokens must fit)", "prompt")

    def check_request(self, n_prompt: int, max_tokens: int | None, adapter: str | None) -> int:
        """Raise :class:`RequestRejected` for a request that could never be admitted (admission would wait for it
        forever); returns its max_tokens, with None resolved to as many as fit."""
        max_len = self.ecfg.max_model_len
        self.check_prompt(n_prompt)
        room = self.kv_room(adapter)
        if max_tokens is None:
            max_tokens = max(1, room - n_prompt)
        total = n_prompt + max_tokens
        if total > max_len:
            raise RequestRejected(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                                  f"context of {max_len} tokens", "max_tokens")
        if total > room:
            raise RequestRejected(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) needs more KV cache than "
                                  f"this server's pool holds next to the adapter ({room} tokens); lower max_tokens",
                                  "max_tokens")
        return max_tokens

    # ---------------------------------------------------------------- planning
    def schedule(self) -> Plan | None:
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
        return not seq.length_done and seq.num_tokens < self.ecfg.max_model_len

    def _admit(self) -> list[Sequence]:
        ecfg, page = self.ecfg, self.ecfg.page_size
        batch: list[Sequence] = []
        tokens = 0
        for seq in self.policy.order(self.waiting):
            n = seq.num_tokens
            if (len(batch) >= ecfg.max_prefill_seqs or len(self.running) + len(batch) >= ecfg.max_batch_size
                    or tokens + n > ecfg.max_prefill_tokens):
                break
            worst = self.worst_case_pages(seq)
            adapter_pages = self.store.pages_needed_to_load(seq.adapter) if seq.adapter else 0
            if worst + adapter_pages > self.pool.num_free_pages + self.store.evictable_pages():
                break
            slot = self._acquire(seq)
            if slot is None:
                if seq.error is not None:  # adapter failed to load: the engine ends this request
                    continue
                break
            need = pages_for(n, page)
            if worst > self.pool.num_free_pages and not self.store.reclaim_pages(worst):
                self._release(seq)
                break
            seq.kv_pages = self.pool.alloc_kv_pages(need, owner=seq.request_id)
            seq.adapter_slot = slot
            batch.append(seq)
            tokens += n
        for seq in batch:
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
        # rows of one adapter next to each other: SGMV segments
        batch.sort(key=lambda s: s.adapter_slot)
        return batch

    def _acquire(self, seq: Sequence) -> int | None:
        if seq.adapter is None:
            return -1
        try:
            return self.store.acquire(seq.adapter)
        except AdapterError as e:
            seq.error = str(e)
            self._failed.append((seq, str(e)))
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
            if self.pool.num_free_pages >= 1 or self.store.reclaim_pages(1):
                seq.kv_pages += self.pool.alloc_kv_pages(1, owner=seq.request_id)
                i += 1
                continue
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
            # if the victim was seq itself, i now points past the end
        return preempted

    # ---------------------------------------------------------------- finishing
    def free(self, seq: Sequence) -> None:
        """Return a sequence's pages and adapter pin (finished, aborted or preempted)."""
        if seq.kv_pages:
            self.pool.free_kv_pages(seq.kv_pages, owner=seq.request_id)
            seq.kv_pages = []
        if seq.status == Status.RUNNING:
            self._release(seq)
            self.running.remove(seq)
        seq.num_cached = 0

    def preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
