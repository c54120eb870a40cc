"""Sampling parameters (validated on the host) and the sampler that runs inside the jitted step."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from .vocab_select import keep_threshold

# What one request may ask for (OpenAI caps ``stop`` at 4; we allow more). Each bounds per-token host work: every
# stop string is searched for in each new piece of text, and the detokenizer holds back the longest one's length.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_SEED = 2**63  # exclusive
INT32_MAX = 2**31 - 1
# The smallest top_p sent to the device. A smaller one (1e-38 and below) flushes to 0 in float32 there, which would
# keep no token at all; any top_p this small keeps only the most likely token, i.e. it is greedy, and so is the floor
# (the top token's probability is at least 1 / vocab > 1e-6 for every vocabulary below a million entries).
TOP_P_FLOOR = 1e-6
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit; its completions stop at 5)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request; the prefill step carries this many per sequence
MAX_REPETITION_PENALTY = 100.0


class InvalidSampling(ValueError):
    """A sampling value the engine will not serve; ``field`` names the :class:`SamplingParams` field it refuses (the
    OpenAI name, so the server can point a client at its own request field)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, OpenAI/vLLM names. temperature 0 = greedy."""

    max_tokens: int | None = 16  # None: as many as fit (the engine resolves it at add_request); 0: prefill only
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # per generated token: its log-prob and this many top alternatives; None = off
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo); None = off
    presence_penalty: float = 0.0  # OpenAI: minus this from a token's logit once it was generated
    frequency_penalty: float = 0.0  # OpenAI: minus this per time a token was generated
    repetition_penalty: float = 1.0  # vLLM/HF: tokens in prompt or output: positive logits / p, negative * p
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), OpenAI's logit_bias
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens

    @property
    def needs_penalty_row(self) -> bool:
        """Whether the step must keep this request's token counts and bias on the device (``penalties.py``)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def validate(self, max_model_len: int | None = None) -> SamplingParams:
        """Raise :class:`InvalidSampling` (a ValueError) with a clear message for values we will not serve. A top_k
        beyond the vocabulary is valid (it keeps every token, like 0)."""
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise InvalidSampling("max_tokens", f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if max_model_len is not None and self.max_tokens is not None and self.max_tokens > max_model_len:
            raise InvalidSampling("max_tokens", f"max_tokens {self.max_tokens} exceeds the model's context of "
                                                f"{max_model_len} tokens")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise InvalidSampling("temperature", f"temperature must be in [0, 100], got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidSampling("top_k", f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidSampling("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise InvalidSampling("seed", f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidSampling("stop_token_ids", f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most "
                                                    f"{MAX_STOP_TOKEN_IDS} are accepted")
        if any(not _is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise InvalidSampling("stop_token_ids", "stop_token_ids must be token ids (non-negative integers)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidSampling("stop", f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are "
                                          "accepted")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSampling("stop", "stop must be non-empty strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidSampling("stop", f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        self._validate_logprobs_and_penalties()
        return self

    def _validate_logprobs_and_penalties(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
                raise InvalidSampling(name, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise InvalidSampling(name, f"{name} must be in [-2, 2], got {v!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidSampling("repetition_penalty", f"repetition_penalty must be in (0, "
                                                        f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidSampling("logit_bias", f"logit_bias holds {len(self.logit_bias)} entries; at most "
                                                f"{MAX_LOGIT_BIAS} are accepted")
        ids = [t for t, _ in self.logit_bias]
        if any(not _is_int(t) or not 0 <= t <= INT32_MAX for t in ids) or len(set(ids)) != len(ids):
            raise InvalidSampling("logit_bias", "logit_bias keys must be distinct token ids (non-negative integers)")
        if any(not _is_real(b) or not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise InvalidSampling("logit_bias", "logit_bias values must be numbers in [-100, 100]")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidSampling("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidSampling("min_tokens", f"min_tokens ({self.min_tokens}) exceeds max_tokens "
                                                f"({self.max_tokens})")

    @functools.cached_property
    def host_row(self) -> tuple:
        """(temperature, top_k, top_p, presence, frequency, repetition, min_tokens) as the step holds them: top_k
        beyond int32 is off anyway, a top_p that float32 would flush to 0 is :data:`TOP_P_FLOOR`. Made once per
        params object, since every decode step of the request needs it (``sampling_arrays``)."""
        return (self.temperature, min(max(self.top_k, 0), INT32_MAX), max(self.top_p, TOP_P_FLOOR),
                self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.min_tokens)

    def token_ids_to_check(self) -> list[tuple[str, int]]:
        """(field, token id) of every id the request names, for the engine's vocabulary check."""
        return ([("stop_token_ids", t) for t in self.stop_token_ids]
                + [("logit_bias", t) for t, _ in self.logit_bias])


def _is_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool) and bool(np.isfinite(x))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampler inputs, [B] each unless noted; padding rows are greedy, unpenalised and unconstrained."""

    temperature: jax.Array  # float32
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32
    seed: jax.Array  # uint32: the low half of the row's 64-bit seed
    seed_hi: jax.Array  # uint32: its high half (every bit of a seed counts: no two seeds share a stream)
    counter: jax.Array  # int32: tokens generated so far (so each step draws fresh randomness)
    # int32 [B, mask_words(V)]: bit j of word w set = token 32 * w + j may be sampled (llguidance's and xgrammar's
    # packed bitmask layout); every bit set for unconstrained and padding rows
    token_mask: jax.Array
    # penalties (penalties.py): the row's counts/bias row in the device state (-1: none), its three penalties, and
    # (prefill) its prompt length plus its logit_bias entries ([B, NB]: NB = MAX_LOGIT_BIAS in prefill steps, 0 in
    # decode steps, whose rows' bias is already in the state; unused entries have id -1)
    penalty_row: jax.Array  # int32
    presence: jax.Array  # float32
    frequency: jax.Array  # float32
    repetition: jax.Array  # float32
    prompt_len: jax.Array  # int32
    bias_ids: jax.Array  # int32 [B, NB]
    bias_values: jax.Array  # float32 [B, NB]


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's packed token mask."""
    return -(-vocab_size // 32)


def sampling_arrays(params: list[SamplingParams | None], seeds: list[int], counters: list[int], rows: int,
                    vocab_size: int, masks: list[np.ndarray | None] | None = None, *, eos_ids: tuple[int, ...] = (),
                    penalty_rows: list[int] | None = None, prompt_lens: list[int] | None = None,
                    bias_entries: int = 0) -> dict[str, np.ndarray]:
    """Numpy inputs for ``rows`` rows (padded); ``seeds`` are already resolved per request. Values are brought into
    what the step holds: top_k beyond int32 is off anyway (the device clamps it to the vocabulary), a top_p that
    float32 would flush to 0 is raised to :data:`TOP_P_FLOOR` (both greedy).

    ``masks[i]`` (None: unconstrained) is row i's allowed tokens as a packed bitmask (see ``SamplingArrays``): any
    4-byte integer dtype, ``mask_words(vocab_size)`` words; bits past the vocabulary are ignored. A row short of its
    ``min_tokens`` also has ``eos_ids`` (unless it ignores EOS) and its stop_token_ids taken out, unless that would
    leave its own mask nothing (a grammar that must end now wins over min_tokens).

    ``penalty_rows[i]`` (-1: none) is row i's row in the penalty state; ``prompt_lens`` and ``bias_entries`` (the
    logit_bias capacity per row, 0 in decode steps) only matter in prefill steps, which fill that state."""
    words = mask_words(vocab_size)
    token_mask = np.full((rows, words), -1, np.int32)
    for i, m in enumerate(masks or ()):
        if m is not None:
            token_mask[i] = _packed_mask(m, words)
    n = len(params)
    if n > rows:
        raise ValueError(f"{n} sampling rows exceed the step's {rows}")
    # one row of settings per request, made once per SamplingParams (host_row): the batch is a single numpy array
    vals = np.fromiter(itertools.chain.from_iterable(_PAD_ROW if p is None else p.host_row for p in params),
                       np.float64, n * len(_PAD_ROW)).reshape(n, len(_PAD_ROW))
    live = np.fromiter((p is not None for p in params), bool, n)
    out = dict(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32),
               top_p=np.ones(rows, np.float32), seed=np.zeros(rows, np.uint32),
               seed_hi=np.zeros(rows, np.uint32), counter=np.zeros(rows, np.int32),
               token_mask=token_mask, penalty_row=np.full(rows, -1, np.int32), presence=np.zeros(rows, np.float32),
               frequency=np.zeros(rows, np.float32), repetition=np.ones(rows, np.float32),
               prompt_len=np.zeros(rows, np.int32), bias_ids=np.full((rows, bias_entries), -1, np.int32),
               bias_values=np.zeros((rows, bias_entries), np.float32))
    out["temperature"][:n], out["top_k"][:n], out["top_p"][:n] = vals[:, 0], vals[:, 1], vals[:, 2]
    # 64-bit seeds as two 32-bit halves (exact Python ints; padding rows keep 0): the key is their 64 bits
    live_seeds = [int(s) if p is not None else 0 for p, s in zip(params, seeds, strict=False)]
    out["seed"][:n] = [s & 0xFFFFFFFF for s in live_seeds]
    out["seed_hi"][:n] = [(s >> 32) & 0xFFFFFFFF for s in live_seeds]
    out["counter"][:n] = [c if p is not None else 0 for p, c in zip(params, counters, strict=False)]
    short = np.flatnonzero(live & (out["counter"][:n] < vals[:, 6]))  # still below their min_tokens
    for i in short.tolist():
        p = params[i]
        _forbid(token_mask[i], p.stop_token_ids + (() if p.ignore_eos else tuple(eos_ids)), vocab_size)
    if penalty_rows is not None:
        has = live & (np.asarray(penalty_rows[:n], np.int64).reshape(n) >= 0)
        out["penalty_row"][:n] = np.where(has, penalty_rows[:n], -1)
        if prompt_lens is not None:
            out["prompt_len"][:n] = np.where(has, prompt_lens[:n], 0)
        out["presence"][:n] = np.where(has, vals[:, 3], 0.0)
        out["frequency"][:n] = np.where(has, vals[:, 4], 0.0)
        out["repetition"][:n] = np.where(has, vals[:, 5], 1.0)
        for i in np.flatnonzero(has).tolist() if bias_entries else ():
            bias = params[i].logit_bias[:bias_entries]
            if bias:
                out["bias_ids"][i, :len(bias)], out["bias_values"][i, :len(bias)] = zip(*bias, strict=True)
    return out


# A padding row's host_row: greedy, no top-k, no top-p, no penalty, no min_tokens.
_PAD_ROW = (0.0, 0, 1.0, 0.0, 0.0, 1.0, 0)


def _forbid(row: np.ndarray, token_ids: tuple[int, ...], vocab_size: int) -> None:
    """Clear ``token_ids``' bits in one packed mask row, unless that leaves no token allowed."""
    ids = np.asarray([t for t in token_ids if 0 <= t < vocab_size], np.int64)
    if not len(ids):
        return
    words = row.view(np.uint32)
    kept = words.copy()
    np.bitwise_and.at(kept, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))
    if _any_allowed(kept, vocab_size):
        words[:] = kept


def _any_allowed(words: np.ndarray, vocab_size: int) -> bool:
    full, rest = divmod(vocab_size, 32)
    return bool(words[:full].any() or (rest and words[full] & np.uint32((1 << rest) - 1)))


def _packed_mask(mask: np.ndarray, words: int) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.shape != (words,) or mask.dtype.kind not in "iu" or mask.dtype.itemsize != 4:
        raise ValueError(f"a token mask must be {words} 32-bit integer words, got {mask.dtype} {mask.shape}")
    return mask.view(np.int32)


def allowed_tokens(token_mask: jax.Array, vocab_size: int) -> jax.Array:
    """bool [B, V] from the packed mask [B, W]."""
    words = jax.lax.bitcast_convert_type(token_mask, jnp.uint32)
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(token_mask.shape[0], -1)[:, :vocab_size].astype(bool)


def sample(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Token ids [B] from logits [B, V]: greedy where temperature == 0, else Gumbel-max over :func:`kept_logits`
    (so a sampled row draws from the softmax of its kept tokens, renormalized).

    No ``lax.cond``: on GPU a conditional copies its predicate to the host and waits for it, which would stall the
    host inside every step's dispatch until the device reached the sampler (the host/device overlap lost). Rows
    without top-k/top-p get a threshold that masks nothing, so one branch-free path serves every row.
    """
    greedy, kept = _greedy_and_kept(logits, s)
    vocab = logits.shape[-1]
    keys = jax.vmap(lambda hi, lo, c: jax.random.fold_in(_seed_key(hi, lo), c))(s.seed_hi, s.seed, s.counter)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)
    sampled = jnp.argmax(kept + gumbel, axis=-1).astype(jnp.int32)
    return jnp.where(s.temperature > 0, sampled, greedy)


def _seed_key(hi: jax.Array, lo: jax.Array) -> jax.Array:
    """The threefry key of a 64-bit seed, as key data [hi, lo]: for a seed below 2**32 the key ``PRNGKey(seed)``
    makes, so those seeds draw what they always drew; above, the high half is no longer folded into 32 bits."""
    return jax.random.wrap_key_data(jnp.stack([hi, lo]).astype(jnp.uint32), impl="threefry2x32")


def kept_logits(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """float32 [B, V]: each row's logits over its temperature, -inf outside what it may sample: the tokens its
    ``token_mask`` allows (all if it allows none), then the top_k largest and the smallest most-likely prefix whose
    mass before its last token is below top_p (always the top token; ties by value kept together)."""
    return _greedy_and_kept(logits, s)[1]


def _greedy_and_kept(logits, s: SamplingArrays):
    logits = logits.astype(jnp.float32)
    logits = jnp.where(jnp.isnan(logits), -jnp.inf, logits)  # a NaN would win the argmax
    vocab = logits.shape[-1]
    allowed = allowed_tokens(s.token_mask, vocab)
    allowed = allowed | ~jnp.any(allowed, axis=-1, keepdims=True)
    logits = jnp.where(allowed, logits, -jnp.inf)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kept = jnp.where(scaled >= keep_threshold(scaled, k, s.top_p), scaled, -jnp.inf)  # no sort (vocab_select.py)
    return greedy, kept
