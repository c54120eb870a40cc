"""Token log-probabilities: computed in the jitted step, fetched to the host only when a request asked for them.

What they are: the model's own distribution, ``log_softmax`` of the raw logits (vLLM's default "raw" logprobs, what
OpenAI returns, and what scoring harnesses such as lm-evaluation-harness need), i.e. before logit_bias, penalties,
a token mask, temperature and top-k/top-p. So a logprob never depends on how the token was sampled, and a prompt
token's logprob (echo) is comparable with a generated one's.

Every step computes, for each sampled row, the sampled token's logprob and the :data:`MAX_LOGPROBS` most likely
tokens (branch-free: a row that did not ask costs the same, a few vocabulary passes and no sort), all
packed in one int32 array so that one device-to-host copy brings them back. A prefill step built for prompt
logprobs (the ``echo`` variant) does the same for every token row against the next token of the prompt.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .sampling import MAX_LOGPROBS
from .vocab_select import top_k

PACKED_WIDTH = 1 + 2 * MAX_LOGPROBS  # per row: the chosen token's logprob, top ids, top logprobs


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the most likely alternatives at its position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), as many as the request asked for


def packed_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """int32 [R, PACKED_WIDTH] from logits [R, V] (float32) and the token id of each row (float32 fields as bits).
    The top ids are ``lax.top_k``'s (ties to the lower id), found without sorting the vocabulary
    (``vocab_select.top_k``: the logits' order is the logprobs' order)."""
    logits = logits.astype(jnp.float32)
    logits = jnp.where(jnp.isnan(logits), -jnp.inf, logits)
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, targets[:, None].astype(jnp.int32), axis=-1)
    k = min(MAX_LOGPROBS, logits.shape[-1])
    _, top_ids = top_k(logits, k)
    top_lp = jnp.take_along_axis(logp, top_ids, axis=-1)
    if k < MAX_LOGPROBS:  # a vocabulary smaller than the top list (tiny test models)
        pad = MAX_LOGPROBS - k
        top_lp = jnp.pad(top_lp, ((0, 0), (0, pad)), constant_values=-jnp.inf)
        top_ids = jnp.pad(top_ids, ((0, 0), (0, pad)), constant_values=-1)
    bits = jax.lax.bitcast_convert_type
    return jnp.concatenate([bits(chosen, jnp.int32), top_ids.astype(jnp.int32), bits(top_lp, jnp.int32)], axis=-1)


def read_row(packed: np.ndarray, token_id: int, n_top: int) -> TokenLogprob:
    """The host's view of one packed row: ``token_id``'s logprob and the ``n_top`` most likely tokens."""
    return _Rows(packed[None]).read(0, token_id, n_top)


def read_prompt(packed: np.ndarray, prompt_ids: list[int], first_row: int, n_top: int) -> list[TokenLogprob | None]:
    """Prompt logprobs from an echo prefill's per-row output: None for the first token (nothing precedes it), then
    token i's logprob from row ``first_row + i - 1`` (the row that predicts it)."""
    rows = _Rows(packed[first_row:first_row + len(prompt_ids) - 1])
    return [None] + [rows.read(i - 1, prompt_ids[i], n_top) for i in range(1, len(prompt_ids))]


class _Rows:
    """Packed rows as Python lists, converted once per step (a per-row numpy read costs more than the token)."""

    def __init__(self, packed: np.ndarray):
        self.chosen = packed[:, 0].view(np.float32).tolist()
        self.ids = packed[:, 1:1 + MAX_LOGPROBS].tolist()
        self.values = packed[:, 1 + MAX_LOGPROBS:].view(np.float32).tolist()
        self.valid = int((packed[0, 1:1 + MAX_LOGPROBS] >= 0).sum()) if len(packed) else 0  # tiny vocabularies

    def read(self, row: int, token_id: int, n_top: int) -> TokenLogprob:
        n = min(n_top, self.valid)
        top = tuple(zip(self.ids[row][:n], self.values[row][:n], strict=True))
        return TokenLogprob(int(token_id), self.chosen[row], top)


class StepLogprobs:
    """A dispatched step's logprob outputs (still on the device) and which of its sequences asked: per sequence row,
    the number of top alternatives (None: no logprobs) and, for an echo prefill, (first token row, top count). Read
    back on first use, once the step's tokens are (so the decode pipelining is unchanged)."""

    def __init__(self, output, n_top: list[int | None], prompt: list[tuple[int, int] | None]):
        self.output, self.n_top, self.prompt = output, n_top, prompt
        self._rows: _Rows | None = None  # the asked rows, by their index in _row_of
        self._row_of: dict[int, int] = {}
        self._prompt_rows: np.ndarray | None = None

    @staticmethod
    def of_step(output, seqs: list, items: list) -> StepLogprobs | None:
        """For the step just dispatched with ``items`` (StepItems, rows in order) of ``seqs``; None if nobody asked."""
        n_top = [seq.sampling.logprobs for seq in seqs]
        if all(n is None for n in n_top) and not any(it.prompt_logprobs for it in items):
            return None
        starts = np.cumsum([0] + [len(it.tokens) for it in items])
        prompt = [(int(starts[i]), seq.sampling.prompt_logprobs) if it.prompt_logprobs else None
                  for i, (seq, it) in enumerate(zip(seqs, items, strict=True))]
        return StepLogprobs(output, n_top, prompt)

    def row(self, row: int, token_id: int, seq) -> tuple[TokenLogprob | None, list | None]:
        """(the sampled token's logprob, the prompt logprobs) of sequence row ``row``, each None if not asked; the
        prompt logprobs are also kept on ``seq`` (a recompute after preemption does not ask for them again)."""
        token = prompt = None
        if self.n_top[row] is not None:
            if self._rows is None:  # only the rows that asked become Python lists (a quarter of 256 rows: -0.15 ms)
                asked = [i for i, n in enumerate(self.n_top) if n is not None]
                self._rows = _Rows(np.asarray(self.output.logprobs)[asked])
                self._row_of = {r: j for j, r in enumerate(asked)}
            token = self._rows.read(self._row_of[row], token_id, self.n_top[row])
        if self.prompt[row] is not None:
            if self._prompt_rows is None:
                self._prompt_rows = np.asarray(self.output.prompt_logprobs)
            first, n_top = self.prompt[row]
            prompt = seq.prompt_logprobs = read_prompt(self._prompt_rows, seq.prompt_ids, first, n_top)
        return token, prompt
