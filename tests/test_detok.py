"""The detokenizer and a server choice's text, against the real test tokenizers (byte-level BPE, and a Llama-2-style
SentencePiece BPE whose decoder strips the first token's leading space), as vLLM defines the answer's text."""

from __future__ import annotations

import random

import pytest

from slora_jax.engine.detok import MAX_PENDING, IncrementalDetokenizer
from slora_jax.engine.sequence import RequestOutput
from slora_jax.engine.token_bytes import incomplete_tail, token_bytes
from slora_jax.serve.choices import BackendDecoder, Choice
from slora_jax.serve.generation import merge_outputs
from slora_jax.tools.tokenizer import load_tokenizer, write_tokenizer


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    return load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("byte"), 512))


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    return load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("sp"), 512, style="sentencepiece"))


def split(tok, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of ``prompt + answer`` encoded whole, as a model would have produced them."""
    p_ids, ids = tok.encode(prompt), tok.encode(prompt + answer)
    assert ids[:len(p_ids)] == p_ids
    return p_ids, ids[len(p_ids):]


def outputs(ids: list[int], reason: str = "length") -> list[RequestOutput]:
    last = len(ids) - 1
    return [RequestOutput("r", [t], i == last, reason if i == last else None) for i, t in enumerate(ids)]


def run_choice(choice: Choice, outs: list[RequestOutput]) -> str:
    streamed = ""
    for out in outs:
        streamed += choice.add(out)[0]
        if choice.done:
            break
    return streamed


def test_sentencepiece_answer_keeps_its_leading_space(sp_tok):
    """Llama-2's decoder strips the first decoded token's leading space: decoded alone the answer lost it ("the
    sea"); decoded after the prompt's last ids it is " the sea", as vLLM answers (and echo reads "... is the sea")."""
    prompt = "The capital of France is"
    p_ids, ids = split(sp_tok, prompt, " the sea")
    assert sp_tok.convert_ids_to_tokens(ids)[0].startswith("\u2581")
    assert sp_tok.decode(ids, skip_special_tokens=True) == "the sea"  # the decoder's own behaviour
    for tokenizer in (sp_tok, BackendDecoder.wrap(sp_tok)):
        choice = Choice(0, "r", tokenizer, (), p_ids)
        streamed = run_choice(choice, outputs(ids))
        assert streamed == choice.text == " the sea"
        assert choice.token_ids == ids  # generated ids only: the context is not counted


def test_sentencepiece_stop_string_with_a_leading_space_matches_at_the_start(sp_tok):
    p_ids, ids = split(sp_tok, "The capital of France is", " the sea")
    choice = Choice(0, "r", sp_tok, (" the",), p_ids)
    streamed = run_choice(choice, outputs(ids))
    assert choice.finish_reason == "stop" and streamed == choice.text == ""


def test_offline_detokenizer_agrees_with_the_servers(sp_tok):
    """The engine's own detokenizer (stop strings watched offline) is built with the same prompt context."""
    p_ids, ids = split(sp_tok, "Hello, how are you", " today? I am fine")
    detok = IncrementalDetokenizer(sp_tok, ("zzz",), p_ids)
    text = ""
    for i, t in enumerate(ids):
        detok.add([t], final=i == len(ids) - 1)
        text += detok.take(final=i == len(ids) - 1)
    assert text == " today? I am fine"


@pytest.mark.parametrize("stream_merged", [False, True])
def test_stop_token_text_is_left_out(byte_tok, stream_merged):
    """A stop token id (or EOS) that ends the choice is counted in its tokens but not decoded into its text."""
    p_ids, ids = split(byte_tok, "Hello, how are you", " today? I am fine")
    stop_id = ids[-1]
    assert byte_tok.decode([stop_id]).strip()
    choice = Choice(0, "r", byte_tok, (), p_ids, end_ids=frozenset({stop_id}))
    outs = outputs(ids, "stop")
    streamed = run_choice(choice, merge_outputs(outs) if stream_merged else outs)
    assert streamed == choice.text == byte_tok.decode(ids[:-1])
    assert choice.token_ids == ids and choice.finish_reason == "stop"


def test_a_grammar_stop_keeps_its_last_token(byte_tok):
    """A choice that ends "stop" on a token outside end_ids (its grammar completed) keeps that token's text."""
    p_ids, ids = split(byte_tok, "Hello, how are you", " today?")
    choice = Choice(0, "r", byte_tok, (), p_ids, end_ids=frozenset({2}))
    assert run_choice(choice, outputs(ids, "stop")) == " today?"


@pytest.mark.parametrize("chunk", [1, 4])
def test_min_tokens_holds_off_stop_strings(byte_tok, chunk):
    """vLLM looks for stop strings only once more than min_tokens tokens exist, in text past the min_tokens-th
    token's (a match may start before it)."""
    text = "Hello world. Hello world. Hello world."
    ids = byte_tok.encode(text, add_special_tokens=False)
    first = byte_tok.decode(ids[:6])
    assert "ld" in first
    want_end = text.find("ld", len(first) - 1)
    choice = Choice(0, "r", byte_tok, ("ld",), min_tokens=6)
    outs = [RequestOutput("r", ids[i:i + chunk], False) for i in range(0, len(ids), chunk)]
    streamed = run_choice(choice, outs)
    assert choice.finish_reason == "stop" and len(choice.token_ids) > 6
    assert streamed == choice.text == text[:want_end]


def test_a_stop_string_before_min_tokens_is_not_found_later(byte_tok):
    """Text of the first min_tokens tokens is never searched again: a short stop string wholly inside it does not
    end the choice once min_tokens pass."""
    ids = byte_tok.encode("Hello world, and more", add_special_tokens=False)
    n = next(i for i in range(1, len(ids)) if "ld" in byte_tok.decode(ids[:i]))
    detok = IncrementalDetokenizer(byte_tok, ("ld", "xxxxxxxxx"), min_tokens=n)
    for t in ids:
        detok.add([t])
    assert not detok.stopped and detok.text == "Hello world, and more"


def test_merged_outputs_never_commit_a_split_character(byte_tok):
    """The SSE loop merges queued outputs into one add(); when every merged piece ends inside a character, the
    forced commit after MAX_PENDING tokens once committed U+FFFD for a valid character."""
    text = "\U0001f600\u4e2d\U0001f600\u00e9\U0001f600\u20ac\u6587e"
    ids = byte_tok.encode(text, add_special_tokens=False)
    assert len(ids) > MAX_PENDING
    outs = outputs(ids)
    for size in (1, 2, 3, 5):
        choice = Choice(0, "r", BackendDecoder.wrap(byte_tok), ())
        streamed = "".join(choice.add(out)[0] for i in range(0, len(outs), size)
                           for out in merge_outputs(outs[i:i + size]))
        assert streamed == choice.text == text, size


class _LongestDecode:
    """A tokenizer that records the most ids one decode call was given (what a token costs to detokenize)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0
        self.all_special_ids = tokenizer.all_special_ids  # the wrapped tokenizer's (BackendDecoder keeps them too)

    def decode(self, ids, skip_special_tokens=False):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("which, bytes_known", [("byte_tok", True), ("sp_tok", True), ("byte_tok", False)])
def test_streamed_text_equals_the_decoded_continuation(request, which, bytes_known):
    """Random texts (multi-byte characters, stop strings, merged outputs, some random ids): what streams equals
    the whole text, which equals the continuation of the prompt's decoding cut at the first stop string. Random
    ids only for byte-level BPE: a byte-fallback decoder turns a valid byte token into U+FFFD when invalid bytes
    precede it in one group, which a window of the last tokens cannot see (vLLM's neither)."""
    tok = request.getfixturevalue(which)
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    # U+FFFD itself too: real ones once made a forced commit take a split character's first bytes for clean text
    alphabet = [*"abcde xyz.,\n", "\u00e9", "\u00f6", "\u20ac", "\U0001f600", "\u4e2d", "\u6587", "\ufffd",
                "\ufffd" * 6]
    for _ in range(300):
        p_ids = tok.encode("Hello there")
        ids = tok.encode("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))), add_special_tokens=False)
        if which != "sp_tok" and rng.random() < 0.3:
            ids = [rng.randint(3, 511) for _ in range(rng.randint(1, 20))]
        prefix = tok.decode(p_ids, skip_special_tokens=True)
        full = tok.decode(p_ids + ids, skip_special_tokens=True)[len(prefix):]
        stop = full[(a := rng.randint(0, max(len(full) - 1, 0))):a + rng.randint(1, 4)]
        stops = (stop,) if stop and "\ufffd" not in stop and rng.random() < 0.7 else ()
        # a decoder without the tokenizer's backend: its token bytes are unknown, the detokenizer's text rules decide
        decoder = BackendDecoder.wrap(tok) if bytes_known else _LongestDecode(tok)
        choice = Choice(0, "r", decoder, stops, p_ids)
        size = rng.choice([1, 1, 2, 3])
        outs = [RequestOutput("r", ids[i:i + size], (last := i + size >= len(ids)), "length" if last else None)
                for i in range(0, len(ids), size)]
        streamed = run_choice(choice, outs)
        want = full[:full.find(stops[0])] if stops and stops[0] in full else full
        assert streamed == choice.text == want, (seed, ids, stops)


@pytest.mark.parametrize("which", ["byte_tok", "sp_tok", "sp_backend"])
def test_a_run_of_skipped_special_tokens_keeps_decodes_short_and_the_text_unchanged(request, which):
    """EOS repeated under ignore_eos (or BOS forced by logit_bias) decodes to nothing; each one stayed in the window,
    so every later token re-decoded the whole run (16k tokens: 5.6 s against 0.04 s). The text is as without them."""
    tok = request.getfixturevalue("byte_tok" if which == "byte_tok" else "sp_tok")
    rng = random.Random()
    p_ids, ids = split(tok, "Once upon a time", " there was a café — naïve 😀 end")
    cut, run = rng.randrange(1, len(ids)), rng.randrange(300, 600)
    special = rng.choice([t for t in (tok.eos_token_id, tok.bos_token_id) if t is not None])
    with_run = ids[:cut] + [special] * run + ids[cut:]
    texts = []
    for seq in (ids, with_run):
        decoder = _LongestDecode(BackendDecoder.wrap(tok) if which == "sp_backend" else tok)
        detok = IncrementalDetokenizer(decoder, (), p_ids)
        pieces = []
        for t in seq:
            detok.add([t])
            pieces.append(detok.take())
        detok.add([], final=True)
        pieces.append(detok.take(final=True))
        texts.append("".join(pieces))
        assert decoder.longest <= 2 * MAX_PENDING + 8, (which, decoder.longest)
    context = tok.decode(p_ids, skip_special_tokens=True)
    assert texts[0] == texts[1] == tok.decode(p_ids + ids, skip_special_tokens=True)[len(context):]


@pytest.mark.parametrize("which", ["byte_tok", "sp_tok"])
def test_token_bytes_decode_as_the_tokenizer(request, which):
    """Every token's bytes decode (lossily) to its own decoding, and a text's tokens' bytes join to the text."""
    tok = request.getfixturevalue(which)
    table = token_bytes(tok)
    assert table is not None
    for i in range(len(tok)):
        assert table(i).decode("utf-8", "replace").removeprefix(" ") == tok.decode([i]).removeprefix(" "), i
    rng = random.Random()
    alphabet = [*"ab z.\n", "\u00e9", "\u20ac", "\U0001f600", "\u4e2d", "\ufffd"]
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(map(table, ids)).decode().removeprefix(" ") == text.removeprefix(" "), text


def test_a_cut_before_an_incomplete_tail_changes_no_character():
    """Cutting bytes before incomplete_tail's count: the two parts decode to what the whole decodes to, whatever
    bytes follow (random bytes, biased towards UTF-8 lead and continuation bytes)."""
    rng = random.Random()
    pool = [*range(0x80, 0xC0), *range(0xC2, 0xF5), *b"az", 0xC0, 0xF8, 0xFF]
    for _ in range(5000):
        data = bytes(rng.choice(pool) for _ in range(rng.randint(0, 8)))
        more = bytes(rng.choice(pool) for _ in range(rng.randint(0, 4)))
        cut = len(data) - incomplete_tail(data)
        assert 0 <= len(data) - cut <= 3
        head, rest = data[:cut], data[cut:] + more
        assert head.decode("utf-8", "replace") + rest.decode("utf-8", "replace") == \
            (data + more).decode("utf-8", "replace"), (data, more)
