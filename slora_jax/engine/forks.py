"""Several samples of one prompt (OpenAI's ``n``): one prefill of the prompt, its full pages shared by the samples.

The samples of a request are ordinary sequences tied by a :class:`ForkGroup`. Admission takes one sample of a group
first; once its prefill is dispatched its prompt's full pages are handed to the scheduler's page sharing (the prefix
cache when it is on, else a cache that frees a page when its last sample lets go), and the other samples, admitted
from the next step on, take references to those pages and compute only the prompt's tail: the tokens past the last
full page (at least the last token, whose logits each sample samples from with its own seed). That tail is fewer
than ``page_size`` tokens and is recomputed per sample rather than copied: a page copy would be a new device op,
the tail fits the prefill buckets already compiled. Shared pages are never written (a sample writes only its own
pages), so no copy-on-write is needed. Admission counts the shared pages once (a sample's reservation leaves out
what it shares).

Sample 0 uses the request's seed (so ``n=1`` answers exactly as before); sample i > 0 a seed mixed from (seed, i),
so every sample has its own reproducible random stream. Without a seed every sample draws its own.
"""

from __future__ import annotations

import dataclasses
import itertools

from .sampling import SamplingParams
from .scheduler import RequestRejected, pages_for

MAX_SAMPLES = 16  # samples one request may ask for (``n``, ``best_of``)
_groups = itertools.count()
_MASK63 = (1 << 63) - 1


@dataclasses.dataclass(eq=False)
class ForkGroup:
    """The samples of one request (``Sequence.fork``). ``prefilled``: one sample's prefill was dispatched, so the
    others may now share its prompt's full pages."""

    request_id: str
    sample_ids: list[str]
    prefilled: bool = False


def sample_ids(request_id: str, n: int) -> list[str]:
    """The engine request ids of a request's ``n`` samples: the request id itself when ``n == 1``."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def sample_seed(seed: int, index: int) -> int:
    """Sample ``index``'s seed in [0, 2**63): ``seed`` itself for sample 0, a splitmix64 mix of (seed, index)
    after it (seeds of nearby requests' samples do not collide as seed + index would)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK63


def group_pages(n_prompt: int, max_tokens: int, n: int, page_size: int) -> int:
    """KV pages ``n`` samples hold at most together: each sample's own, the prompt's shared full pages once."""
    each = pages_for(n_prompt + max_tokens, page_size)
    shared = (n_prompt - 1) // page_size  # what a later sample's admission matches (it computes its last token)
    return each + (n - 1) * (each - shared)


def group_max_tokens(n_prompt: int, max_tokens: int | None, n: int, room_pages: int, max_model_len: int,
                     page_size: int) -> int:
    """``max_tokens`` for ``n`` samples that must fit together in ``room_pages`` (the pool beside the adapter):
    None resolves to as many as fit; raise :class:`RequestRejected` naming ``n`` when they cannot fit."""
    shared = (n_prompt - 1) // page_size
    each = (room_pages + (n - 1) * shared) // n  # pages per sample when all n fit
    most = min(each * page_size, max_model_len) - n_prompt
    resolved = most if max_tokens is None else max_tokens
    # (a max_tokens beyond the context is add_request's to refuse, with the context as the reason)
    if (max_tokens is None and most < 1) or (resolved <= max_model_len - n_prompt and
                                              group_pages(n_prompt, resolved, n, page_size) > room_pages):
        raise RequestRejected(f"n={n} samples of prompt ({n_prompt} tokens) + max_tokens ({resolved}) need more KV "
                              f"cache than this server's pool holds next to the adapter (at most {max(most, 0)} "
                              f"tokens each); lower n or max_tokens", "n")
    return resolved


def add_samples(engine, n: int, prompt_ids: list[int], adapter: str | None = None,
                sampling: SamplingParams | None = None, request_id: str | None = None, **kwargs) -> list[str]:
    """Queue ``n`` samples of one prompt in ``engine`` (``Engine.add_request``'s arguments and errors, plus
    :class:`RequestRejected` for a bad ``n`` or samples that cannot fit together); returns their request ids
    (:func:`sample_ids`), in sample order. All or none are queued."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SAMPLES:
        raise RequestRejected(f"n must be an integer in [1, {MAX_SAMPLES}], got {n!r}", "n")
    if n == 1:
        return [engine.add_request(prompt_ids, adapter, sampling, request_id=request_id, **kwargs)]
    sampling = (sampling or SamplingParams()).validate()
    if prompt_ids and adapter is not None and not engine.has_adapter(adapter):
        raise KeyError(f"unknown adapter {adapter!r}")
    if prompt_ids and len(prompt_ids) < engine.ecfg.max_model_len:  # else add_request refuses the prompt below
        adapter_pages = engine.store.adapter_pages(adapter) if adapter is not None else 0
        max_tokens = group_max_tokens(len(prompt_ids), sampling.max_tokens, n, engine.pool.num_pages - adapter_pages,
                                      engine.ecfg.max_model_len, engine.ecfg.page_size)
        sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
    group = ForkGroup(request_id or f"samples-{next(_groups)}", [])
    try:
        for i, rid in enumerate(sample_ids(group.request_id, n)):
            seed = None if sampling.seed is None else sample_seed(sampling.seed, i)
            own = sampling if seed is None else dataclasses.replace(sampling, seed=seed)
            group.sample_ids.append(engine.add_request(prompt_ids, adapter, own, request_id=rid, **kwargs))
            engine.requests[rid].fork = group  # before any step: admission takes one sample of the group first
    except BaseException:
        for rid in group.sample_ids:  # all or none
            engine.abort(rid)
            engine.release(rid)
        raise
    return group.sample_ids
