"""The step runner builds a step's host inputs with numpy over the whole batch; they must be exactly what building
them one row at a time gives. The reference here is that row-at-a-time builder (the runner's before it was
vectorized), written out plainly; random batches of mixed states are built both ways and every array compared
bit for bit, the packed buffer too."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pallas_kernels.lora_sgmv import make_tiles
from pallas_kernels.prefill_attention import max_prefill_tiles, prefill_tile_map
from slora_jax.engine.config import EngineConfig
from slora_jax.engine.sampling import (
    INT32_MAX,
    MAX_LOGIT_BIAS,
    TOP_P_FLOOR,
    SamplingArrays,
    SamplingParams,
    mask_words,
    sampling_arrays,
)
from slora_jax.engine.step_runner import StepInputError, StepItem, StepRunner, pack_inputs
from slora_jax.model.paged import StepBatch

# ---------------------------------------------------------------- the reference: one row at a time


def ref_sampling(params, seeds, counters, rows, vocab, masks=None, *, eos_ids=(), penalty_rows=None,
                 prompt_lens=None, bias_entries=0) -> dict:
    words = mask_words(vocab)
    out = dict(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32),
               top_p=np.ones(rows, np.float32), seed=np.zeros(rows, np.uint32),
               seed_hi=np.zeros(rows, np.uint32), counter=np.zeros(rows, np.int32),
               token_mask=np.full((rows, words), -1, np.int32), penalty_row=np.full(rows, -1, np.int32),
               presence=np.zeros(rows, np.float32), frequency=np.zeros(rows, np.float32),
               repetition=np.ones(rows, np.float32), prompt_len=np.zeros(rows, np.int32),
               bias_ids=np.full((rows, bias_entries), -1, np.int32),
               bias_values=np.zeros((rows, bias_entries), np.float32))
    for i, m in enumerate(masks or ()):
        if m is not None:
            out["token_mask"][i] = np.asarray(m).view(np.int32)
    for i, p in enumerate(params):
        if p is None:
            continue
        out["temperature"][i] = p.temperature
        out["top_k"][i] = min(max(p.top_k, 0), INT32_MAX)
        out["top_p"][i] = max(p.top_p, TOP_P_FLOOR)
        out["seed"][i], out["seed_hi"][i] = seeds[i] % 2**32, seeds[i] // 2**32
        out["counter"][i] = counters[i]
        if counters[i] < p.min_tokens:
            forbidden = [t for t in p.stop_token_ids + (() if p.ignore_eos else tuple(eos_ids)) if 0 <= t < vocab]
            allowed = [bool((out["token_mask"][i, t // 32] >> (t % 32)) & 1) for t in range(vocab)]
            kept = [a and t not in forbidden for t, a in enumerate(allowed)]
            if forbidden and any(kept):
                for t in forbidden:
                    word = out["token_mask"][i, t // 32 : t // 32 + 1].view(np.uint32)
                    word &= ~np.uint32(1 << (t % 32))
        row = -1 if penalty_rows is None else penalty_rows[i]
        if row >= 0:
            out["penalty_row"][i] = row
            out["prompt_len"][i] = 0 if prompt_lens is None else prompt_lens[i]
            out["presence"][i], out["frequency"][i] = p.presence_penalty, p.frequency_penalty
            out["repetition"][i] = p.repetition_penalty
            for j, (t, b) in enumerate(p.logit_bias[:bias_entries]):
                out["bias_ids"][i, j], out["bias_values"][i, j] = t, b
    return out


def ref_fill(runner, a, items, first_rows) -> None:
    page = runner.ecfg.page_size
    for i, it in enumerate(items):
        r0, n = first_rows[i], len(it.tokens)
        for j in range(n):
            pos = it.start + j
            a["tokens"][r0 + j] = it.tokens[j]
            a["positions"][r0 + j] = pos
            a["kv_slots"][r0 + j] = it.pages[pos // page] * page + pos % page
            a["row_slot"][r0 + j] = it.adapter_slot
        for j, p in enumerate(it.pages):
            a["page_table"][i, j] = p
        a["context_lens"][i] = it.start + n
        a["logits_rows"][i] = r0 + n - 1


def ref_finish(runner, a, items, n_seqs, bias_entries):
    pad = n_seqs - len(items)
    s = ref_sampling([it.sampling for it in items] + [None] * pad, [it.seed for it in items] + [0] * pad,
                     [it.counter for it in items] + [0] * pad, n_seqs, runner.cfg.vocab_size,
                     [it.token_mask for it in items], eos_ids=tuple(runner.cfg.eos_token_id),
                     penalty_rows=[it.penalty_row for it in items] + [-1] * pad,
                     prompt_lens=[it.prompt_len for it in items] + [0] * pad, bias_entries=bias_entries)
    return StepBatch(**a), SamplingArrays(**s)


def ref_prefill(runner, items, n_rows):
    ecfg, n_seqs = runner.ecfg, runner.ecfg.max_prefill_seqs
    a = runner._base_arrays(n_rows, n_seqs)  # noqa: SLF001 - zeros of the step's shapes
    first_rows = [sum(len(it.tokens) for it in items[:i]) for i in range(len(items) + 1)]
    ref_fill(runner, a, items, first_rows)
    total = first_rows[-1]
    a["q_starts"][:] = total
    a["q_starts"][: len(items) + 1] = first_rows
    lora = make_tiles(a["row_slot"], ecfg.lora_block_t, -(-n_rows // ecfg.lora_block_t) + n_seqs + 1)
    a["lora_tiles"] = np.stack([lora.start, lora.length, lora.slot]).astype(np.int32)
    a["attn_tiles"] = prefill_tile_map(a["q_starts"], a["context_lens"], n_rows, ecfg.attn_block_q,
                                       max_prefill_tiles(n_rows, n_seqs, ecfg.attn_block_q))
    return ref_finish(runner, a, items, n_seqs, MAX_LOGIT_BIAS)


def ref_decode(runner, items, n):
    a = runner._base_arrays(n, n)  # noqa: SLF001
    ref_fill(runner, a, items, list(range(len(items))))
    token_src = np.full(n, -1, np.int32)
    for i, it in enumerate(items):
        token_src[i] = it.token_src
        a["q_starts"][i + 1:] += 1
    a["lora_tiles"] = np.zeros((3, 1), np.int32)
    a["attn_tiles"] = np.zeros((1, 4), np.int32)
    return (*ref_finish(runner, a, items, n, 0), token_src)


# ---------------------------------------------------------------- random batches of mixed states


def random_params(rng, vocab) -> SamplingParams:
    kind = rng.integers(6)
    kw = dict(seed=int(rng.integers(2**63)), max_tokens=int(rng.integers(1, 100)))
    if kind == 0:
        kw.update(temperature=0.0)
    elif kind == 1:
        kw.update(temperature=float(rng.uniform(0.1, 2)), top_p=float(rng.uniform(1e-9, 1)))
    elif kind == 2:
        kw.update(temperature=float(rng.random()), top_k=int(rng.choice([0, -1, 5, 2**40])), logprobs=3)
    elif kind == 3:  # penalties and logit_bias
        ids = rng.choice(vocab, size=int(rng.integers(0, min(12, vocab + 1))), replace=False)  # vocab may be < 12
        kw.update(presence_penalty=float(rng.uniform(-2, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
                  repetition_penalty=float(rng.uniform(0.5, 3)),
                  logit_bias=tuple((int(t), float(rng.uniform(-100, 100))) for t in ids))
    elif kind == 4:  # min_tokens with stop ids (and EOS unless ignored)
        kw.update(min_tokens=int(rng.integers(0, 8)), max_tokens=int(rng.integers(8, 50)),
                  stop_token_ids=tuple(int(t) for t in rng.integers(0, vocab, size=int(rng.integers(0, 4)))),
                  ignore_eos=bool(rng.integers(2)), temperature=float(rng.random()))
    else:
        kw.update(repetition_penalty=float(rng.uniform(0.5, 3)), temperature=0.0)
    return SamplingParams(**kw)


def random_mask(rng, vocab):
    words = rng.integers(0, 2**32, size=mask_words(vocab), dtype=np.uint64).astype(np.uint32)
    if rng.integers(3) == 0:  # a grammar that allows one token only
        words[:] = 0
        t = int(rng.integers(vocab))
        words[t // 32] = 1 << (t % 32)
    return words.view(np.int32) if rng.integers(2) else words


def random_items(rng, runner, n_items, decode: bool) -> list[StepItem]:
    ecfg, vocab = runner.ecfg, runner.cfg.vocab_size
    page, max_len = ecfg.page_size, ecfg.max_model_len
    budget = ecfg.prefill_buckets[-1]
    items, shared = [], None
    for _ in range(n_items):
        sp = random_params(rng, vocab) if rng.integers(8) else None
        if decode:
            n, start = 1, int(rng.integers(0, max_len - 1))
        else:  # a whole prompt, a prompt after a cached prefix, or a resumed (preempted) sequence's tokens
            n = int(rng.integers(1, max(2, min(40, budget // n_items))))
            start = int(rng.integers(0, 4)) * page if rng.integers(2) else 0
            start = min(start, max_len - n)
        n_pages = -(-(start + n) // page) + int(rng.integers(0, 2))
        if shared is not None and rng.integers(3) == 0:  # a sample of the same request (n > 1): the same pages
            pages = shared[:n_pages] + [int(p) for p in rng.integers(0, 5000, size=max(0, n_pages - len(shared)))]
        else:
            pages = [int(p) for p in rng.integers(0, 5000, size=n_pages)]
        pages = pages[:ecfg.max_pages_per_seq]
        shared = pages
        prompt_len = int(rng.integers(0, start + n + 1))
        counter = int(rng.integers(0, 12))
        items.append(StepItem(
            tokens=[0] if decode and rng.integers(2) else [int(t) for t in rng.integers(0, vocab, size=n)],
            start=start, pages=pages, adapter_slot=int(rng.integers(-1, 6)), sampling=sp,
            seed=int(rng.integers(2**63)), counter=counter,
            token_src=int(rng.integers(-1, n_items)) if decode else -1,
            token_mask=random_mask(rng, vocab) if rng.integers(4) == 0 else None,
            penalty_row=int(rng.integers(-1, 8)), prompt_len=prompt_len,
            prompt_logprobs=bool(rng.integers(2))))
    if not decode and rng.integers(2):
        items.sort(key=lambda it: it.adapter_slot)  # as the scheduler lays them out (SGMV segments)
    return items


def make_runner(tiny_cfg, rng) -> StepRunner:
    vocab = int(rng.choice([tiny_cfg.vocab_size, 500, 97]))  # full and partial mask words
    cfg = dataclasses.replace(tiny_cfg, vocab_size=vocab, eos_token_id=(2, int(rng.integers(3, vocab))))
    ecfg = EngineConfig(max_batch_size=32, max_prefill_tokens=256, max_prefill_seqs=8, max_model_len=256,
                        page_size=int(rng.choice([4, 16])), max_lora_rank=8, max_loras=6, num_pages=5000,
                        dtype="float32", backend="reference", lora_block_t=16, attn_block_q=16,
                        prefill_mid_buckets_from=int(rng.choice([0, 32, 128])),
                        decode_mid_buckets_from=int(rng.choice([0, 2, 8])))
    return StepRunner(cfg, ecfg)


def assert_same(got, want, what):
    for part_got, part_want in zip(got, want, strict=True):
        if isinstance(part_want, np.ndarray):
            np.testing.assert_array_equal(part_got, part_want, f"{what}: token_src")
            continue
        for f in dataclasses.fields(part_want):
            g, w = np.asarray(getattr(part_got, f.name)), np.asarray(getattr(part_want, f.name))
            assert g.dtype == w.dtype and g.shape == w.shape, (what, f.name, g.dtype, w.dtype, g.shape, w.shape)
            np.testing.assert_array_equal(g.view(np.int32), w.view(np.int32), f"{what}: {f.name}")  # bit-exact
    packed_got, layout_got = pack_inputs(*got)
    packed_want, layout_want = pack_inputs(*want)
    assert layout_got == layout_want
    np.testing.assert_array_equal(packed_got, packed_want)


# ---------------------------------------------------------------- the checks


def test_decode_inputs_equal_the_row_at_a_time_build(tiny_cfg, rng):
    runner = make_runner(tiny_cfg, rng)
    for n in (0, 1, *rng.integers(2, 33, size=6).tolist()):
        items = random_items(rng, runner, n, decode=True)
        bucket = runner.ecfg.decode_buckets[np.searchsorted(runner.ecfg.decode_buckets, max(n, 1))]
        assert_same(runner.build_decode(items), ref_decode(runner, items, bucket), f"decode of {n}")


def test_prefill_inputs_equal_the_row_at_a_time_build(tiny_cfg, rng):
    runner = make_runner(tiny_cfg, rng)
    for n in (0, 1, *rng.integers(2, runner.ecfg.max_prefill_seqs + 1, size=6).tolist()):
        items = random_items(rng, runner, n, decode=False)
        total = sum(len(it.tokens) for it in items)
        buckets = runner.ecfg.prefill_buckets
        n_rows = buckets[-1] if rng.integers(3) == 0 else buckets[np.searchsorted(buckets, max(total, 1))]
        assert_same(runner.build_prefill(items, n_rows=n_rows), ref_prefill(runner, items, n_rows),
                    f"prefill of {n}")


def test_sampling_arrays_equal_the_row_at_a_time_build(rng):
    for _ in range(10):
        vocab = int(rng.integers(1, 700))
        rows = int(rng.integers(1, 40))
        n = int(rng.integers(0, rows + 1))
        params = [random_params(rng, vocab) if rng.integers(5) else None for _ in range(n)]
        seeds = [int(rng.integers(2**63)) for _ in range(n)]
        counters = [int(rng.integers(0, 10)) for _ in range(n)]
        masks = [random_mask(rng, vocab) if rng.integers(3) == 0 else None for _ in range(int(rng.integers(0, n + 1)))]
        kw = dict(eos_ids=tuple(int(t) for t in rng.integers(0, vocab, size=2)),
                  penalty_rows=[int(r) for r in rng.integers(-1, 5, size=n)] if rng.integers(4) else None,
                  prompt_lens=[int(r) for r in rng.integers(0, 50, size=n)] if rng.integers(3) else None,
                  bias_entries=int(rng.choice([0, 3, MAX_LOGIT_BIAS])))
        got = sampling_arrays(params, seeds, counters, rows, vocab, masks, **kw)
        want = ref_sampling(params, seeds, counters, rows, vocab, masks, **kw)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            np.testing.assert_array_equal(got[k].view(np.int32), want[k].view(np.int32), k)


@pytest.mark.parametrize("fault", ["pages short of a position", "too many pages", "token beyond int32"])
def test_an_item_whose_inputs_cannot_be_built_is_named(tiny_cfg, rng, fault):
    """The batch-wide build still refuses what the per-row one refused, and the step names the culprit alone."""
    runner = make_runner(tiny_cfg, rng)
    items = random_items(rng, runner, 6, decode=True)
    bad = int(rng.integers(len(items)))
    page = runner.ecfg.page_size
    if fault == "pages short of a position":
        items[bad] = dataclasses.replace(items[bad], pages=items[bad].pages[: items[bad].start // page])
    elif fault == "too many pages":
        items[bad] = dataclasses.replace(items[bad], pages=list(range(runner.ecfg.max_pages_per_seq + 1)))
    else:
        items[bad] = dataclasses.replace(items[bad], tokens=[2**31])
    with pytest.raises((IndexError, ValueError, OverflowError)):
        ref_decode(runner, items, 8)
    with pytest.raises(StepInputError) as e:
        runner._host_inputs(runner.build_decode, items)  # noqa: SLF001 - what decode() calls before dispatch
    assert e.value.rows == [bad]


def test_step_logprobs_read_the_asked_rows_among_others(rng):
    """Only the rows that asked for logprobs are read back into Python; each still gets its own row's values."""
    from types import SimpleNamespace

    from slora_jax.engine.logprobs import PACKED_WIDTH, StepLogprobs, read_row
    from slora_jax.engine.sampling import MAX_LOGPROBS

    rows = int(rng.integers(2, 40))
    packed = rng.integers(0, 1000, size=(rows, PACKED_WIDTH)).astype(np.int32)
    packed[:, 0] = rng.standard_normal(rows).astype(np.float32).view(np.int32)
    packed[:, 1 + MAX_LOGPROBS:] = rng.standard_normal((rows, MAX_LOGPROBS)).astype(np.float32).view(np.int32)
    n_top = [int(rng.integers(0, MAX_LOGPROBS + 1)) if rng.integers(3) == 0 else None for _ in range(rows)]
    step = StepLogprobs(SimpleNamespace(logprobs=packed, prompt_logprobs=None), n_top, [None] * rows)
    order = rng.permutation(rows).tolist()
    for row in order:
        token = int(rng.integers(1000))
        got, prompt = step.row(row, token, SimpleNamespace())
        assert prompt is None
        assert got == (None if n_top[row] is None else read_row(packed[row], token, n_top[row]))
