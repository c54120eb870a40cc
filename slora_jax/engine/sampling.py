"""Sampling parameters (validated on the host) and the sampler that runs inside the jitted step."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

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


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, OpenAI/vLLM names. temperature 0 = greedy."""

    max_tokens: int | None = 16  # None: as many as fit (the engine resolves it at add_request)
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self, max_model_len: int | None = None) -> SamplingParams:
        """Raise ValueError with a clear message for values we will not serve. A top_k beyond the vocabulary is
        valid (it keeps every token, like 0)."""
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if max_model_len is not None and self.max_tokens is not None and self.max_tokens > max_model_len:
            raise ValueError(f"max_tokens {self.max_tokens} exceeds the model's context of {max_model_len} tokens")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                             "are accepted")
        if any(not _is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (non-negative integers)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are accepted")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be non-empty strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        return self


def _is_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool) and bool(np.isfinite(x))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampler inputs, [B] each; padding rows are greedy."""

    temperature: jax.Array  # float32
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32
    seed: jax.Array  # uint32
    counter: jax.Array  # int32: tokens generated so far (so each step draws fresh randomness)
    # int32 [B, mask_words(V)]: bit j of word w set = token 32 * w + j may be sampled (llguidance's and xgrammar's
    # packed bitmask layout); every bit set for unconstrained and padding rows
    token_mask: jax.Array


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's packed token mask."""
    return -(-vocab_size // 32)


def sampling_arrays(params: list[SamplingParams | None], seeds: list[int], counters: list[int], rows: int,
                    vocab_size: int, masks: list[np.ndarray | None] | None = None) -> dict[str, np.ndarray]:
    """Numpy inputs for ``rows`` rows (padded); ``seeds`` are already resolved per request. Values are brought into
    what the step holds: top_k beyond int32 is off anyway (the device clamps it to the vocabulary), a top_p that
    float32 would flush to 0 is raised to :data:`TOP_P_FLOOR` (both greedy).

    ``masks[i]`` (None: unconstrained) is row i's allowed tokens as a packed bitmask (see ``SamplingArrays``): any
    4-byte integer dtype, ``mask_words(vocab_size)`` words; bits past the vocabulary are ignored."""
    words = mask_words(vocab_size)
    token_mask = np.full((rows, words), -1, np.int32)
    for i, m in enumerate(masks or ()):
        if m is not None:
            token_mask[i] = _packed_mask(m, words)
    temp = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    seed = np.zeros(rows, np.uint32)
    counter = np.zeros(rows, np.int32)
    for i, p in enumerate(params):
        if p is None:
            continue
        temp[i], top_k[i], top_p[i] = p.temperature, min(max(p.top_k, 0), INT32_MAX), max(p.top_p, TOP_P_FLOOR)
        seed[i], counter[i] = (seeds[i] ^ (seeds[i] >> 32)) & 0xFFFFFFFF, counters[i]  # 64-bit seeds: fold the top
    return dict(temperature=temp, top_k=top_k, top_p=top_p, seed=seed, counter=counter, token_mask=token_mask)


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
    """Token ids [B] from logits [B, V]: greedy where temperature == 0, else top-k/top-p filtered Gumbel-max, both
    among the tokens the row's ``token_mask`` allows (a row that allows none is left unconstrained).

    No ``lax.cond``: on GPU a conditional copies its predicate to the host and waits for it, which would stall the
    host inside every step's dispatch until the device reached the sampler (the host/device overlap lost). Rows
    without top-k/top-p get a threshold that masks nothing, so one branch-free path serves every row.
    """
    logits = logits.astype(jnp.float32)
    logits = jnp.where(jnp.isnan(logits), -jnp.inf, logits)  # a NaN would win the argmax and poison the sort
    allowed = allowed_tokens(s.token_mask, logits.shape[-1])
    allowed = allowed | ~jnp.any(allowed, axis=-1, keepdims=True)
    logits = jnp.where(allowed, logits, -jnp.inf)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    masked = jnp.where(scaled >= _filter_threshold(scaled, s), scaled, -jnp.inf)
    vocab = logits.shape[-1]
    keys = jax.vmap(lambda seed, c: jax.random.fold_in(jax.random.PRNGKey(seed), c))(s.seed, s.counter)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)
    sampled = jnp.argmax(masked + gumbel, axis=-1).astype(jnp.int32)
    return jnp.where(s.temperature > 0, sampled, greedy)


def _filter_threshold(scaled, s: SamplingArrays):
    """Per-row logit threshold [B, 1] that keeps the top-k and the smallest top-p prefix (always the top token)."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    cum = jnp.cumsum(probs_sorted, axis=-1)
    keep_sorted = ((cum - probs_sorted) < s.top_p[:, None]) | (s.top_p[:, None] >= 1.0)  # p = 1: exactly all
    p_cut = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.maximum(kth, p_cut)
