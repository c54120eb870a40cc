"""A small byte-level BPE tokenizer trained locally, so the demo model and the tests need no download.

Byte-level BPE can encode any text (every byte is a token), so the random demo model answers real prompts. The files
written are what ``transformers`` saves for a fast tokenizer, so ``AutoTokenizer.from_pretrained(model_dir)`` loads
them; special ids match the Llama convention of the synthetic configs (<unk>=0, <s>=1, </s>=2).

    python -m slora_jax.tools.tokenizer --out /tmp/tiny --vocab-size 512
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = (UNK, BOS, EOS)  # ids 0, 1, 2 in this order

# Role-tagged turns; generation starts after "assistant:". Jinja, as transformers' apply_chat_template expects.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# A few paragraphs of plain English: enough for the merges of a few hundred tokens to be common words and pieces.
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A language model predicts the next word from the words before it.
Serving many fine-tuned adapters on one base model saves memory: the base weights are shared and each adapter is
small. When a request arrives, the server finds its adapter, loads it into the pool if it is not there yet, and
batches the request with others that use different adapters. Tokens stream back to the client as they are made.
Hello, how are you today? I am fine, thank you. What is the weather like where you are? It is sunny and warm here.
Once upon a time there was a little house in the woods. In the house lived an old man and his cat. Every morning the
man made tea and the cat sat by the window to watch the birds. One day a stranger knocked on the door and asked for
water. The old man gave him bread and tea, and the stranger told stories of the cities by the sea.
Please summarise the following text in one sentence. Write a short poem about the moon. Translate this sentence into
French. Explain how a computer works to a child. List three things you can do with a paper clip. The answer is yes.
Numbers: one two three four five six seven eight nine ten. 1 2 3 4 5 6 7 8 9 10 100 1000. Monday, Tuesday, Wednesday,
Thursday, Friday, Saturday and Sunday are the days of the week. January, February, March, April, May and June.
The system is fast because the work is done in large batches and the memory is used well. It is important that every
user gets an answer quickly, even when many users are asking questions at the same time. This is the main idea.
user: Can you help me with my homework? assistant: Of course. What is the question? user: What is two plus two?
assistant: Two plus two is four. user: Thank you! assistant: You are welcome. Is there anything else I can help with?
"""


def build_tokenizer(vocab_size: int, text: str = TRAINING_TEXT):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab_size`` entries (special tokens first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"a byte-level vocab needs at least {len(SPECIAL_TOKENS) + 256} entries, got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # Repeat the text so that the trainer finds enough pair counts for every merge it is allowed.
    tok.train_from_iterator([text] * 4, trainer=trainer)
    if tok.get_vocab_size() < vocab_size:  # a short text runs out of merges: pad with unused filler tokens
        tok.add_tokens([f"<extra_{i}>" for i in range(vocab_size - tok.get_vocab_size())])
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise RuntimeError(f"special token {special} got id {tok.token_to_id(special)}, expected {i}")
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, 1)])
    return tok


def build_sentencepiece_style_tokenizer(vocab_size: int, text: str = TRAINING_TEXT):
    """A Llama-2-style BPE of exactly ``vocab_size`` entries: "\u2581" for spaces, byte fallback (<0x00>.. at ids
    3..258), and Llama-2's decoder, which strips the first token's leading space. Decoding output ids alone then
    loses the space between prompt and answer, as with real Llama-2 and Mistral tokenizers (tests need that)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    base = len(SPECIAL_TOKENS) + len(byte_tokens)
    if vocab_size <= base:
        raise ValueError(f"a byte-fallback vocab needs more than {base} entries, got {vocab_size}")
    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trained = Tokenizer(models.BPE(unk_token=UNK))
    trained.pre_tokenizer = metaspace
    trained.train_from_iterator([text] * 4, trainer=trainers.BpeTrainer(vocab_size=vocab_size - base,
                                                                       min_frequency=1, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    pieces = sorted(model["vocab"], key=model["vocab"].get)[: vocab_size - base]
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *byte_tokens, *pieces])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    merges = [m for m in merges if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK, byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # Llama-2's tokenizer.json decoder
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size() < vocab_size:
        tok.add_tokens([f"<extra_{i}>" for i in range(vocab_size - tok.get_vocab_size())])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, 1)])
    return tok


STYLES = {"byte-level": build_tokenizer, "sentencepiece": build_sentencepiece_style_tokenizer}


def write_tokenizer(out: str | Path, vocab_size: int, model_max_length: int = 2048, style: str = "byte-level") -> Path:
    """Write tokenizer.json, tokenizer_config.json (with a chat template) and special_tokens_map.json into ``out``;
    ``style``: a key of :data:`STYLES`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    STYLES[style](vocab_size).save(str(out / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length, "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
    }
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=2)
    with open(out / "special_tokens_map.json", "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}, f, indent=2)
    return out


def has_tokenizer(model_dir: str | Path) -> bool:
    model_dir = Path(model_dir)
    return any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def preload() -> None:
    """Import what :func:`load_tokenizer` needs. transformers' import alone takes seconds (8 s of a first load's
    8.5 on the CPU box), so a server does it in a thread while the engine loads and compiles."""
    from transformers import AutoTokenizer  # noqa: F401


def load_tokenizer(model_dir: str | Path):
    """The model dir's tokenizer through ``transformers.AutoTokenizer``; None when the dir has none."""
    if not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m slora_jax.tools.tokenizer", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="model dir to write the tokenizer files into")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--style", choices=sorted(STYLES), default="byte-level")
    args = p.parse_args(argv)
    print(f"wrote {write_tokenizer(args.out, args.vocab_size, style=args.style)}")


if __name__ == "__main__":
    main()
