"""Presence, frequency and repetition penalties and logit_bias, applied inside the jitted step.

The counts they need live on the device, in a :class:`PenaltyState` that every step takes and returns (donated, like
the pool): one row per running request that asked for a penalty or a bias (rows handed out by :class:`PenaltyRows`),
so no token history crosses from the host per step. A prefill step (re)fills its requests' rows from the tokens it
computes: prompt rows mark "seen in the prompt", rows past the prompt (a request recomputed after preemption) count as
generated, and the request's logit_bias entries are written; then every step adds its sampled token to its row's
counts. A request that reuses a cached prompt prefix would skip those prompt rows, so such requests bypass the
prefix cache (``Sequence.needs_whole_prompt``).

Definitions (OpenAI for presence/frequency and logit_bias, vLLM/HF for repetition), applied in this order to the
model's logits: ``+ bias[t]``; for t in prompt or output: ``l / r`` if ``l > 0`` else ``l * r``;
``- frequency * count[t] - presence * (count[t] > 0)`` (counts over generated tokens only).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..model.paged import StepBatch
from .sampling import SamplingArrays
from .sequence import Sequence, Status


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PenaltyState:
    """Per penalty row, over the vocabulary: [R, V] each. Memory: R * V * 9 bytes (Llama-2's 32000 tokens and 64
    rows: 18 MB; Llama-3's 128256 tokens and 256 rows: 295 MB)."""

    counts: jax.Array  # int32: times each token was generated
    in_prompt: jax.Array  # bool: the token occurs in the prompt
    bias: jax.Array  # float32: logit_bias

    @staticmethod
    def zeros(rows: int, vocab_size: int, device=None) -> PenaltyState:
        return PenaltyState(counts=jnp.zeros((rows, vocab_size), jnp.int32, device=device),
                            in_prompt=jnp.zeros((rows, vocab_size), bool, device=device),
                            bias=jnp.zeros((rows, vocab_size), jnp.float32, device=device))


def _state_rows(s: SamplingArrays, n_rows: int) -> jax.Array:
    """Each sampler row's state row, with "none" mapped past the end (scatters there are dropped)."""
    return jnp.where(s.penalty_row >= 0, s.penalty_row, n_rows)


def refill(state: PenaltyState, s: SamplingArrays, batch: StepBatch) -> PenaltyState:
    """Prefill: reset the rows of the step's sequences and fill them from the step's token rows and bias entries."""
    n_state, vocab = state.counts.shape
    rows = _state_rows(s, n_state)  # [B]
    counts = state.counts.at[rows].set(0, mode="drop")
    in_prompt = state.in_prompt.at[rows].set(False, mode="drop")
    bias_ids = jnp.where(s.bias_ids >= 0, s.bias_ids, vocab)
    bias = state.bias.at[rows].set(0.0, mode="drop").at[rows[:, None], bias_ids].set(s.bias_values, mode="drop")
    # which sequence each token row belongs to (rows past the last sequence are padding)
    t = jnp.arange(batch.tokens.shape[0])
    seq = jnp.minimum(jnp.searchsorted(batch.q_starts[1:], t, side="right"), rows.shape[0] - 1)
    live = (t < batch.q_starts[-1]) & (s.penalty_row[seq] >= 0)
    prompt_tok = batch.positions < s.prompt_len[seq]
    row_of_token = jnp.where(live, rows[seq], n_state)
    in_prompt = in_prompt.at[jnp.where(prompt_tok, row_of_token, n_state), batch.tokens].set(True, mode="drop")
    counts = counts.at[jnp.where(prompt_tok, n_state, row_of_token), batch.tokens].add(1, mode="drop")
    return PenaltyState(counts, in_prompt, bias)


def apply(logits: jax.Array, s: SamplingArrays, state: PenaltyState) -> jax.Array:
    """``logits`` [B, V] with each row's bias and penalties applied (rows without a state row are unchanged)."""
    has = (s.penalty_row >= 0)[:, None]
    rows = jnp.maximum(s.penalty_row, 0)
    counts = jnp.where(has, state.counts[rows], 0)
    seen = has & (state.in_prompt[rows] | (counts > 0))
    logits = logits + jnp.where(has, state.bias[rows], 0.0)
    rep = s.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - s.frequency[:, None] * counts - s.presence[:, None] * (counts > 0)


def count_sampled(state: PenaltyState, s: SamplingArrays, sampled: jax.Array) -> PenaltyState:
    """Every row's sampled token counted in its state row."""
    rows = _state_rows(s, state.counts.shape[0])
    return dataclasses.replace(state, counts=state.counts.at[rows, sampled].add(1, mode="drop"))


class PenaltyRows:
    """Hands out the state's rows to requests that need one. A row is free once its request is finished; a waiting
    (preempted) request's row may be taken, since its next prefill fills a new one. There are as many rows as running
    requests can be, so a running request always finds one."""

    def __init__(self, n_rows: int):
        self.owners: list[Sequence | None] = [None] * n_rows

    def row_for_prefill(self, seq: Sequence) -> int:
        """The row ``seq``'s prefill step fills (-1 when it needs none)."""
        if not seq.sampling.needs_penalty_row:
            return -1
        if 0 <= seq.penalty_row < len(self.owners) and self.owners[seq.penalty_row] is seq:
            return seq.penalty_row
        free = [i for i, o in enumerate(self.owners) if o is None or o.status == Status.FINISHED]
        row = free[0] if free else next(i for i, o in enumerate(self.owners) if o.status != Status.RUNNING)
        old = self.owners[row]
        if old is not None:
            old.penalty_row = -1
        self.owners[row], seq.penalty_row = seq, row
        return row
