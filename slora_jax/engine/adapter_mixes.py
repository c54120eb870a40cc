"""The adapter mixes an engine serves: which registered adapters are mixes, of which parts, and when they go.

A mix (``slora_jax.lora.mixes``) is registered in the adapter store like any adapter, under its stable name, the
first time a request asks for it; later requests for the same parts and weights reuse it (its host rows and pool
residency are the store's, as for any adapter). This registry adds the two rules a mix needs beyond that:

* a mix is dropped with any of its parts (a part unregistered, or replaced, must not live on inside a mix); a part
  is not unregistered while a request that has not finished (running, waiting or preempted) uses it or one of its
  mixes: that request finishes on the weights it asked for, as in vLLM, and a refused unload drops nothing;
* the ``mix:`` names are the mixes' own: no adapter is registered under one;
* mixes are bounded: past ``max_mixes``, the least recently asked-for ones are unregistered, except those a request
  waits for or runs with, an operator pinned, or that were asked for within ``grace_s`` (the request that asked may
  still be on its way to ``add_request``). Clients sending ever new weights therefore cannot grow the registry
  without bound, nor push out a mix another request is about to use.

Threading: ``register``, ``names`` and ``in`` are thread-safe (a server calls ``register`` while building a request);
``drop`` and ``prune`` are for the engine thread. One lock makes a registration and a part's unregistration
exclusive, so no mix is ever registered over a part that is being dropped.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from slora_jax.engine.adapter_store import AdapterInUse, AdapterStore
from slora_jax.lora.mixes import MAX_MIX_PARTS, MIX_PREFIX, MixParts, MixSource, canonical_parts, mix_name

__all__ = ["DEFAULT_MAX_MIXES", "MIX_GRACE_S", "AdapterMixes"]

DEFAULT_MAX_MIXES = 256
MIX_GRACE_S = 60.0


class AdapterMixes:
    """The mixes registered in ``store``. ``busy()`` yields the adapters of the requests not finished (one entry a
    request)."""

    def __init__(self, store: AdapterStore, busy: Callable[[], Iterable[str | None]], *,
                 max_parts: int = MAX_MIX_PARTS, max_mixes: int = DEFAULT_MAX_MIXES, grace_s: float = MIX_GRACE_S):
        if max_parts < 1 or max_mixes < 0 or grace_s < 0:
            raise ValueError("max_parts must be >= 1, max_mixes and grace_s >= 0")
        self.store, self.busy = store, busy
        self.max_parts, self.max_mixes, self.grace_s = max_parts, max_mixes, grace_s
        self._lock = threading.Lock()  # guards everything below; held across store registrations (no IO there)
        self._parts: OrderedDict[str, MixParts] = OrderedDict()  # mix -> its parts, least recently asked for first
        self._asked: dict[str, float] = {}  # mix -> monotonic time last asked for
        self.registered = 0  # mixes built so far (a repeated mix is not built again)

    def register(self, parts: Mapping[str, float]) -> str:
        """The name of the mix of ``parts`` ({adapter: weight}), registering it on first use.

        Raises ValueError for malformed parts (count, weights), a part that is itself a mix or a tensor-parallel
        pool, KeyError for a part that is not registered, and :class:`AdapterError` (a ValueError) for a part that
        failed or a mix whose rank is above the store's maximum.
        """
        if self.store.pool.vec != self.store.model_cfg.head_dim:  # MixSource needs the parts' whole-model rows
            raise ValueError("adapters: mixes are not served under tensor parallelism yet (host rows are per device)")
        parts = canonical_parts(parts, self.max_parts)
        name = mix_name(parts)
        with self._lock:
            for part, _ in parts:
                if part in self._parts:
                    raise ValueError(f"adapters: {part!r} is itself a mix; name the adapters it mixes instead")
                if part not in self.store:
                    raise KeyError(f"adapters: the adapter {part[:200]!r} does not exist (not a loaded adapter)")
            known = self._parts.get(name)
            if known is None:
                if name in self.store:
                    raise ValueError(f"adapters: the mix's name {name!r} is taken by an adapter that is not this mix")
                self.store.register(name, MixSource(parts, self.store.host.rank_table, self.store.host.rows_now))
                self._parts[name] = parts
                self.registered += 1
            elif known != parts:  # 64 bits of SHA-256 collided: refuse rather than serve another mix
                raise ValueError(f"adapters: the mix's name {name!r} is taken by another mix")
            self._parts.move_to_end(name)
            self._asked[name] = time.monotonic()
        return name

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._parts

    def names(self) -> list[str]:
        with self._lock:
            return list(self._parts)

    def parts(self, name: str) -> MixParts | None:
        """The mix's (part, weight) pairs, sorted by part; None if ``name`` is not a mix."""
        with self._lock:
            return self._parts.get(name)

    def register_adapter(self, name: str, source, verify: bool = False) -> None:
        """Any thread: an adapter (not a mix) into the store; ValueError for a name in the mixes' namespace, which
        the mix of that name would later find taken (the store's own errors as they come)."""
        if name.startswith(MIX_PREFIX):
            raise ValueError(f"invalid adapter name {name[:300]!r}: names starting with {MIX_PREFIX!r} are kept for "
                             "adapter mixes")
        self.store.register(name, source, verify=verify)

    def drop(self, name: str, unregister: Callable[[str], None]) -> None:
        """Engine thread: ``unregister`` each mix built from ``name``, then ``name`` itself (a mix or not). Raises
        :class:`AdapterInUse` before dropping anything while a request not finished or a pin holds any of them;
        else what ``unregister`` raises (KeyError for an unknown name)."""
        with self._lock:
            mixes = [m for m, parts in self._parts.items() if any(p == name for p, _ in parts)]
            users = list(self.busy())
            for held in [*mixes, name]:
                requests, pins = users.count(held), self.store.pin_count(held)
                if requests or pins:
                    via = "" if held == name else f" through its mix {held!r}"
                    raise AdapterInUse(f"adapter {name!r} is in use{via}: {requests} request(s) not finished "
                                       f"(running, waiting or preempted) and {pins} pin(s) (running sequences' and "
                                       "explicit pins); unload it once they end")
            for mix in mixes:
                unregister(mix)
                self._forget(mix)
            unregister(name)
            self._forget(name)

    def prune(self, unregister: Callable[[str], None]) -> None:
        """Engine thread: while more than ``max_mixes`` are registered, ``unregister`` the least recently asked-for
        mixes that nothing holds (no waiting or running request, no pin, not asked for within ``grace_s``)."""
        with self._lock:
            excess = len(self._parts) - self.max_mixes
            if excess <= 0:
                return
            now, busy = time.monotonic(), set(self.busy())
            for mix in list(self._parts):
                if excess <= 0 or now - self._asked[mix] < self.grace_s:
                    break  # least recently asked for first: the rest were asked for even more recently
                if mix in busy or self.store.pin_count(mix):
                    continue
                unregister(mix)
                self._forget(mix)
                excess -= 1

    def _forget(self, name: str) -> None:
        self._parts.pop(name, None)
        self._asked.pop(name, None)
