"""Host time of structured output: llguidance grammar compiles and per-token masks (CPU only, no device).

    PYTHONPATH=. python benchmarks/grammar_masks.py                      # the demo vocabulary (512 tokens)
    PYTHONPATH=. python benchmarks/grammar_masks.py --vocab 32000        # a 32k byte-level BPE trained on local text

Each grammar is walked by sampling uniformly among the tokens its mask allows until it is done; every mask after the
first is timed (the first one is computed at compile time, in the server's tokenizer threads). ``--vocab N`` trains
a byte-level BPE of N tokens on the Python standard library's sources, so merges are real words and code pieces
rather than the demo's filler tokens.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from slora_jax.engine.grammar import GrammarCompiler, GrammarSpec, allowed_tokens
from slora_jax.tools.tokenizer import load_tokenizer, write_tokenizer

SPECS = {
    "person": GrammarSpec("json_schema", {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 130},
                       "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}}}),
    "order": GrammarSpec("json_schema", {
        "type": "object", "additionalProperties": False, "required": ["items", "total"],
        "properties": {"items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
            "properties": {"sku": {"enum": ["A1", "B2", "C3"]}, "qty": {"type": "integer", "minimum": 1,
                                                                         "maximum": 9}}}},
            "total": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01}}}),
    "json_object": GrammarSpec("json_object"),
    "regex": GrammarSpec("regex", r"[A-Z][a-z]{2,10}( [A-Z][a-z]{2,10}){0,3}, [0-9]{5}"),
    "choice": GrammarSpec("choice", ["positive", "negative", "neutral", "mixed feelings"]),
}


def train_tokenizer(out: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from slora_jax.tools.tokenizer import SPECIAL_TOKENS

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    write_tokenizer(out, 512)  # the config files; tokenizer.json is replaced below
    tok.save(str(out / "tokenizer.json"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=512, help="512: the demo tokenizer; more: train one on local text")
    p.add_argument("--walks", type=int, default=20, help="random walks per grammar")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tokenizer(tmp, 512) if args.vocab == 512 else train_tokenizer(Path(tmp), args.vocab)
        tokenizer = load_tokenizer(path)
    vocab = len(tokenizer)
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, (tokenizer.eos_token_id,))
    compiler.compile(GrammarSpec("regex", "a"))
    results = {"vocab": vocab, "llguidance_tokenizer_s": time.perf_counter() - t0, "grammars": {}}
    rng = np.random.default_rng(0)
    for name, spec in SPECS.items():
        compile_s, mask_s, lengths = [], [], []
        for _ in range(args.walks):
            t = time.perf_counter()
            m = compiler.compile(spec)
            compile_s.append(time.perf_counter() - t)
            n = 0
            while not m.is_done() and n < args.max_tokens:
                token = int(rng.choice(allowed_tokens(m.mask(), vocab)))
                m.accept(token)
                n += 1
                if token == tokenizer.eos_token_id:
                    break
                t = time.perf_counter()
                m.mask()
                mask_s.append(time.perf_counter() - t)
            lengths.append(n)
        us = np.asarray(mask_s) * 1e6
        results["grammars"][name] = {
            "compile_ms_median": 1e3 * float(np.median(compile_s)), "compile_ms_max": 1e3 * max(compile_s),
            "mask_us_median": float(np.median(us)), "mask_us_p90": float(np.percentile(us, 90)),
            "mask_us_p99": float(np.percentile(us, 99)), "mask_us_max": float(us.max()), "masks": len(us),
            "tokens_median": float(np.median(lengths))}
        r = results["grammars"][name]
        print(f"{name:12s} compile {r['compile_ms_median']:7.2f} ms   mask median {r['mask_us_median']:7.1f} us  "
              f"p90 {r['mask_us_p90']:7.1f}  p99 {r['mask_us_p99']:8.1f}  max {r['mask_us_max']:8.1f}  "
              f"({r['masks']} masks, {r['tokens_median']:.0f} tokens per walk)")
    print(f"vocab {vocab}: llguidance tokenizer built in {results['llguidance_tokenizer_s']:.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
