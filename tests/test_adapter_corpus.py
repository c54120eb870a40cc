"""Adapter files are untrusted: a corpus of hostile or malformed PEFT adapter dirs, each written at test time from a
random good one, must each be refused with its reason, at register/verify time (unit level) and over HTTP
(``/v1/load_lora_adapter``: a 4xx with the reason, never a 500, and the server keeps serving). Also: path and name
rules of runtime loads, patterns matched in linear time (a catastrophic regex neither freezes the server nor changes
PEFT's answers for ordinary patterns), the header is checked before any weight is read, and a rejected load's
memory is freed at once.

Every corpus case is (id, how to break the adapter, a fragment its rejection reason must contain, the HTTP status a
runtime load of it must get).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from server_fixtures import BASE_NAME, start_server

from slora_jax.lora import weights_file
from slora_jax.lora.peft import AdapterError, AdapterNotAllowed, check_peft_dir, load_peft_adapter, pattern_value
from slora_jax.lora.peft_config import peft_ranks
from slora_jax.lora.sources import PeftDirSource
from slora_jax.model.config import MODULES, ModelConfig, module_key
from slora_jax.serve.adapters import AdapterAdmin
from slora_jax.serve.protocol import APIError
from slora_jax.tools import synth

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"
DROP = object()  # as a config value: remove the key


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[Path, ModelConfig, Path], None]  # (adapter dir, model, a dir outside the allowed ones)
    fragment: str
    status: int = 400


def write_good(path: Path, cfg: ModelConfig, **kw) -> Path:
    """A servable random adapter (rank 4 on q,k,v,o unless told otherwise)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    return synth.write_adapter(path, cfg, **{"rank": 4, "seed": seed, **kw})


def config(**changes) -> Callable:
    def make(path, cfg, outside):
        write_good(path, cfg)
        conf = json.loads((path / CONFIG).read_text())
        conf.update(changes)
        conf = {k: v for k, v in conf.items() if v is not DROP}
        (path / CONFIG).write_text(json.dumps(conf))
    return make


def raw_config(data: bytes) -> Callable:
    def make(path, cfg, outside):
        write_good(path, cfg)
        (path / CONFIG).write_bytes(data)
    return make


def tensors(edit: Callable[[dict, ModelConfig], None]) -> Callable:
    def make(path, cfg, outside):
        write_good(path, cfg)
        found = load_file(str(path / WEIGHTS))
        edit(found, cfg)
        save_file(found, str(path / WEIGHTS))
    return make


def raw_weights(edit: Callable[[bytes], bytes]) -> Callable:
    def make(path, cfg, outside):
        write_good(path, cfg)
        (path / WEIGHTS).write_bytes(edit((path / WEIGHTS).read_bytes()))
    return make


def key(layer: int = 0, module: str = "q_proj", which: str = "A") -> str:
    return f"{PREFIX}.{layer}.{'mlp' if module.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}." \
           f"{module}.lora_{which}.weight"


def scaled(factor: float, which: str = "A") -> Callable:
    def edit(t, cfg):
        t[key(1, "v_proj", which)] = (t[key(1, "v_proj", which)] * 0 + factor).astype(np.float32)
    return edit


def poison(value: float) -> Callable:
    def edit(t, cfg):
        a = t[key(1, "k_proj")].copy()
        a.flat[np.random.default_rng().integers(a.size)] = value
        t[key(1, "k_proj")] = a
    return edit


def retyped(dtype) -> Callable:
    def edit(t, cfg):
        t[key()] = np.ones(t[key()].shape, dtype)
    return edit


def reshaped(shape_of: Callable[[tuple], tuple]) -> Callable:
    def edit(t, cfg):
        t[key()] = np.random.default_rng().standard_normal(shape_of(t[key()].shape)).astype(np.float32)
    return edit


def header(claim: dict, data: bytes = b"") -> Callable:
    body = json.dumps(claim).encode()
    return raw_weights(lambda _: struct.pack("<Q", len(body)) + body + data)


def special_file(which: str, kind: str) -> Callable:
    def make(path, cfg, outside):
        write_good(path, cfg)
        (path / which).unlink()
        if kind == "fifo":
            os.mkfifo(path / which)
        elif kind == "dir":
            (path / which).mkdir()
        elif kind == "loop":
            os.symlink(path / which, path / which)
    return make


def linked_out(which: str, relative: bool) -> Callable:
    """``which`` is a symlink to the same (valid) file in an adapter dir outside the allowed directories."""
    def make(path, cfg, outside):
        write_good(path, cfg)
        target = write_good(outside / path.name, cfg) / which
        (path / which).unlink()
        os.symlink(os.path.relpath(target, path) if relative else target, path / which)
    return make


def deleted(which: str) -> Callable:
    def make(path, cfg, outside):
        write_good(path, cfg)
        (path / which).unlink()
    return make


def _extra(name: str, shape_of: Callable[[ModelConfig], tuple]) -> Callable:
    return tensors(lambda t, cfg: t.update({name: np.zeros(shape_of(cfg), np.float32)}))


CASES = [
    # ---- r, lora_alpha
    Case("r-string", config(r="8"), "ranks must be ints"),
    Case("r-null", config(r=None), "ranks must be ints"),
    Case("r-zero", config(r=0), "ranks must be ints"),
    Case("r-negative", config(r=-4), "ranks must be ints"),
    Case("r-float", config(r=4.0), "ranks must be ints"),
    Case("r-bool", config(r=True), "ranks must be ints"),
    Case("r-huge", config(r=10**40), "above the configured maximum"),
    Case("r-above-max", config(r=32), "rank 32"),
    Case("alpha-nan", config(lora_alpha=float("nan")), "finite"),
    Case("alpha-inf", config(lora_alpha=float("inf")), "finite"),
    Case("alpha-minus-inf", config(lora_alpha=float("-inf")), "finite"),
    Case("alpha-beyond-float32", config(lora_alpha=1e39), "finite"),
    Case("alpha-string", config(lora_alpha="16"), "must be a number"),
    Case("alpha-null", config(lora_alpha=None), "must be a number"),
    Case("alpha-bool", config(lora_alpha=True), "must be a number"),
    Case("alpha-huge-scale", config(lora_alpha=1e38), "overflow"),
    # ---- target_modules, exclude_modules
    Case("targets-int", config(target_modules=5), "target_modules"),
    Case("targets-bad-regex", config(target_modules="("), "target_modules"),
    Case("targets-backreference", config(target_modules=r"(q)_proj\1"), "backreferences"),
    Case("targets-lookahead", config(target_modules=r"(?=.*q_proj).*"), "lookaround"),
    Case("targets-long-regex", config(target_modules="q" * 5000), "5000 characters"),
    Case("targets-regex-matching-nothing", config(target_modules=r"nothing\.here"), "matches no supported"),
    Case("targets-empty-list", config(target_modules=[]), "target_modules"),
    Case("targets-list-of-int", config(target_modules=[5]), "not a non-empty string"),
    Case("targets-empty-string-entry", config(target_modules=["q_proj", ""]), "not a non-empty string"),
    Case("targets-dict", config(target_modules={"q_proj": 1}), "target_modules"),
    Case("targets-null", config(target_modules=None), "no target_modules"),
    Case("targets-missing", config(target_modules=DROP), "no target_modules"),
    Case("targets-not-linear", config(target_modules=["q_proj", "mlp"]), "not a linear projection"),
    Case("targets-lm-head", config(target_modules=["q_proj", "lm_head"]), "not supported"),
    Case("exclude-int", config(exclude_modules=5), "exclude_modules"),
    Case("exclude-bad-regex", config(exclude_modules="(("), "exclude_modules"),
    Case("exclude-list-of-int", config(exclude_modules=[1]), "exclude_modules"),
    # ---- layers_to_transform, layers_pattern
    Case("layers-string", config(layers_to_transform="ab"), "layers_to_transform"),
    Case("layers-floats", config(layers_to_transform=[0.5]), "layers_to_transform"),
    Case("layers-bools", config(layers_to_transform=[True]), "layers_to_transform"),
    Case("layers-negative", config(layers_to_transform=[-1]), "outside the model"),
    Case("layers-beyond", config(layers_to_transform=[0, 99]), "outside the model"),
    Case("layers-dict", config(layers_to_transform={"0": 1}), "layers_to_transform"),
    Case("layers-with-regex-target", config(target_modules=".*q_proj", layers_to_transform=[0]), "string"),
    Case("layers-pattern-int", config(layers_to_transform=[0, 1], layers_pattern=5), "layers_pattern"),
    Case("layers-pattern-zero", config(layers_to_transform=[0, 1], layers_pattern=0), "layers_pattern"),
    Case("layers-pattern-bad-regex", config(layers_to_transform=[0, 1], layers_pattern="("), "layers_pattern"),
    Case("layers-pattern-alone", config(layers_pattern="layers"), "needs layers_to_transform"),
    # ---- rank_pattern, alpha_pattern
    Case("rank-pattern-list", config(rank_pattern=[1]), "rank_pattern must be an object"),
    Case("rank-pattern-string", config(rank_pattern="q_proj"), "rank_pattern must be an object"),
    Case("rank-pattern-string-rank", config(rank_pattern={"q_proj": "8"}), "ranks must be ints"),
    Case("rank-pattern-zero-rank", config(rank_pattern={"q_proj": 0}), "ranks must be ints"),
    Case("rank-pattern-rank-above-max", config(rank_pattern={"q_proj": 64}), "above the configured maximum"),
    Case("rank-pattern-bad-regex", config(rank_pattern={"(": 4}), "rank_pattern key"),
    Case("rank-pattern-lookbehind", config(rank_pattern={"(?<=self_attn\\.)q_proj": 4}), "lookaround"),
    Case("rank-pattern-too-many", config(rank_pattern={f"m{i}": 4 for i in range(300)}), "the limit is"),
    Case("alpha-pattern-list", config(alpha_pattern=[1]), "alpha_pattern must be an object"),
    Case("alpha-pattern-nan", config(alpha_pattern={"q_proj": float("nan")}), "finite"),
    Case("alpha-pattern-string", config(alpha_pattern={"q_proj": "x"}), "must be a number"),
    Case("alpha-pattern-bad-regex", config(alpha_pattern={"[": 4.0}), "alpha_pattern key"),
    # ---- the other fields
    Case("peft-type-int", config(peft_type=5), "peft_type"),
    Case("peft-type-prefix", config(peft_type="PREFIX_TUNING"), "peft_type"),
    Case("task-type-int", config(task_type=5), "task_type"),
    Case("base-model-list", config(base_model_name_or_path=[1]), "base_model_name_or_path"),
    Case("rslora-string", config(use_rslora="yes"), "use_rslora"),
    Case("dora", config(use_dora=True), "DoRA"),
    Case("dora-string", config(use_dora="false"), "use_dora"),
    Case("fan-in-fan-out-string", config(fan_in_fan_out="no"), "fan_in_fan_out"),
    Case("bias-all", config(bias="all"), "bias"),
    Case("bias-int", config(bias=5), "bias"),
    Case("lora-bias", config(lora_bias=True), "lora_bias"),
    Case("modules-to-save", config(modules_to_save=["lm_head"]), "modules_to_save"),
    Case("modules-to-save-string", config(modules_to_save="lm_head"), "modules_to_save"),
    Case("modules-to-save-zero", config(modules_to_save=0), "modules_to_save"),  # 0 == False: it passed
    Case("dropout-string", config(lora_dropout="0.1"), "lora_dropout"),
    Case("dropout-above-one", config(lora_dropout=2.0), "lora_dropout"),
    Case("trainable-tokens", config(trainable_token_indices=[1, 2]), "trainable_token_indices"),
    Case("target-parameters", config(target_parameters=["x"]), "target_parameters"),
    Case("layer-replication", config(layer_replication=[[0, 1]]), "layer_replication"),
    # ---- the config file itself
    Case("config-list", raw_config(b"[1, 2]"), "not a JSON object"),
    Case("config-string", raw_config(b'"LORA"'), "not a JSON object"),
    Case("config-null", raw_config(b"null"), "not a JSON object"),
    Case("config-truncated", raw_config(b'{"r": 4, "target_modu'), "unreadable adapter_config.json"),
    Case("config-empty", raw_config(b""), "unreadable adapter_config.json"),
    Case("config-not-utf8", raw_config(b'{"r": 4, "task_type": "\xff\xfe"}'), "not UTF-8"),
    Case("config-deeply-nested", raw_config(b"[" * 200_000 + b"]" * 200_000), "nested too deeply"),
    Case("config-nested-within-limit", raw_config(b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
         "nested too deeply"),
    Case("config-huge", raw_config(b'{"pad": "' + b"x" * (2 << 20) + b'"}'), "the limit is"),
    Case("config-huge-int", raw_config(b'{"r": ' + b"9" * 5000 + b"}"), "unreadable adapter_config.json"),
    Case("config-missing", deleted(CONFIG), "missing adapter_config.json"),
    Case("config-fifo", special_file(CONFIG, "fifo"), "not a regular file"),
    Case("config-dir", special_file(CONFIG, "dir"), "not a regular file"),
    Case("config-symlink-loop", special_file(CONFIG, "loop"), "symlink loop"),
    # ---- the weights file
    Case("weights-missing", deleted(WEIGHTS), "missing adapter_model.safetensors"),
    Case("weights-fifo", special_file(WEIGHTS, "fifo"), "not a regular file"),
    Case("weights-dir", special_file(WEIGHTS, "dir"), "not a regular file"),
    Case("weights-empty", raw_weights(lambda b: b""), "too short"),
    Case("weights-truncated", raw_weights(lambda b: b[: len(b) - 100]), "unreadable adapter_model.safetensors"),
    Case("weights-header-only", raw_weights(lambda b: b[: 8 + int.from_bytes(b[:8], "little")]),
         "unreadable adapter_model.safetensors"),
    Case("weights-garbage", raw_weights(lambda b: b"\x00\x01not a safetensors file" * 10), "unreadable"),
    Case("weights-huge-header-length", raw_weights(lambda b: struct.pack("<Q", 1 << 40) + b[8:]), "the limit is"),
    Case("weights-corrupt-header", raw_weights(lambda b: b[:8] + b"{" * (int.from_bytes(b[:8], "little"))
                                               + b[8 + int.from_bytes(b[:8], "little"):]), "unreadable"),
    Case("weights-lying-shape", header({"x": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 16]}},
                                       b"\x00" * 16), "unreadable"),
    Case("weights-unexpected-tensor", _extra("base_model.model.model.norm.weight", lambda c: (c.hidden_size,)),
         "unexpected tensor"),
    Case("weights-untargeted-module", _extra(key(0, "gate_proj"), lambda c: (4, c.hidden_size)),
         "not in target_modules"),
    Case("weights-layer-beyond", _extra(key(7, "q_proj"), lambda c: (4, c.hidden_size)), "layer 7"),
    Case("weights-embedding", _extra("base_model.model.model.embed_tokens.lora_embedding_A", lambda c: (4, 8)),
         "embeddings"),
    Case("weights-dora-magnitude", _extra(f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", lambda c: (8,)),
         "DoRA"),
    Case("weights-duplicate", tensors(lambda t, c: t.update({key().removeprefix("base_model.model."): t[key()]})),
         "two lora_A tensors"),
    Case("weights-missing-b", tensors(lambda t, c: t.pop(key(1, "o_proj", "B"))), "lora_B missing"),
    Case("weights-two-adapters", tensors(lambda t, c: [t.update({k.replace(f"lora_{w}.", f"lora_{w}.{n}."): t.pop(k)})
                                                        for k in list(t) for w, n in (("A", "default"), ("B", "other"))
                                                        if f"lora_{w}." in k]),
         "more than one adapter"),  # A of PEFT's adapter "default", B of "other": once paired and served
    Case("weights-missing-module", tensors(lambda t, c: [t.pop(key(1, "k_proj", w)) for w in "AB"]),
         "no weights for targeted"),
    Case("weights-int32", tensors(retyped(np.int32)), "dtype I32"),
    Case("weights-int8", tensors(retyped(np.int8)), "dtype I8"),
    Case("weights-bool", tensors(retyped(np.bool_)), "dtype BOOL"),
    Case("weights-0d", tensors(reshaped(lambda s: ())), "do not match"),
    Case("weights-1d", tensors(reshaped(lambda s: (s[0] * s[1],))), "do not match"),
    Case("weights-3d", tensors(reshaped(lambda s: (1, *s))), "do not match"),
    Case("weights-transposed", tensors(reshaped(lambda s: s[::-1])), "do not match"),
    Case("weights-nan", tensors(poison(np.nan)), "non-finite"),
    Case("weights-inf", tensors(poison(-np.inf)), "non-finite"),
    Case("weights-3e38", tensors(scaled(3e38)), "overflow"),
    Case("weights-1e20", tensors(scaled(1e20, "B")), "overflow"),
    Case("weights-beyond-float32", tensors(lambda t, c: t.update({key(): t[key()].astype(np.float64) * 1e300})),
         "beyond float32"),
    # ---- paths that lead outside the allowed directories: 403 over HTTP
    Case("config-symlinked-out", linked_out(CONFIG, relative=False), "outside", 403),
    Case("config-symlinked-out-relative", linked_out(CONFIG, relative=True), "outside", 403),
    Case("weights-symlinked-out", linked_out(WEIGHTS, relative=False), "outside", 403),
    Case("weights-symlinked-out-relative", linked_out(WEIGHTS, relative=True), "outside", 403),
]


PATH_CASES = [  # (id, lora_path or a function (uploads, outside) -> lora_path, status, fragment)
    ("unknown-user-home", "~nosuchuser-slora/x", 400, "home directory"),
    ("nul-byte", "a\u0000b", 400, "control characters"),
    ("newline", "a\nb", 400, "control characters"),
    ("5000-characters", "x" * 5000, 400, "the limit is 4096"),
    ("name-too-long-in-path", "x" * 300, 400, "too long"),
    ("symlink-loop", lambda up, out: _link(up / "loop-a", up / "loop-b") or _link(up / "loop-b", up / "loop-a")
     or "loop-a", 400, "symlink loop"),
    ("dotdot", "../outside/evil", 403, "outside"),
    ("absolute-outside", lambda up, out: str(out / "evil"), 403, "outside"),
    ("dir-symlink-out", lambda up, out: _link(up / "abs-link", out / "evil") or str(up / "abs-link"), 403,
     "outside"),
    ("relative-dir-symlink-out", lambda up, out: _link(up / "rel-link", Path("..") / out.name / "evil")
     or "rel-link", 403, "outside"),
    ("dangling-symlink-out", lambda up, out: _link(up / "dangling", out / "not-there") or "dangling", 403,
     "outside"),
    ("etc", "/etc", 403, "outside"),
    # outside, the same answer whether a directory exists there or not (a 400 for a loop or a long name in an
    # existing directory, 403 for a missing one, told a client which directories exist on the server)
    ("long-name-in-an-outside-dir", lambda up, out: str(out / ("x" * 300)), 403, "outside"),
    ("long-name-in-a-missing-dir", lambda up, out: str(out / "nosuchdir" / ("x" * 300)), 403, "outside"),
    ("symlink-loop-outside", lambda up, out: _link(out / "loop-c", out / "loop-d") or _link(out / "loop-d",
                                                                                            out / "loop-c")
     or str(out / "loop-c"), 403, "outside"),
]
NAME_CASES = [("x" * 5000, "invalid request|the limit"), ("a\tb", "control"), ("a\x00b", "control"),
              (" padded", "whitespace"), ("", "invalid request|empty"), (BASE_NAME, "base model"),
              ("mix:0123456789abcdef", "kept for adapter mixes")]
NAME_IDS = ["5000-chars", "tab", "nul", "padded", "empty", "base", "mix"]


def _link(link: Path, target: Path) -> None:
    if not os.path.lexists(link):
        os.symlink(target, link)


# ---------------------------------------------------------------- unit level: register and verify


@pytest.fixture
def dirs(tmp_path):
    (tmp_path / "allowed").mkdir()
    (tmp_path / "outside").mkdir()
    return (tmp_path / "allowed").resolve(), (tmp_path / "outside").resolve()


def _register_and_verify(path: Path, cfg: ModelConfig, roots: tuple[Path, ...], dtype=np.float32):
    """What a runtime load does: the register-time check, then the full read into pool rows."""
    source = PeftDirSource(path, allowed_roots=roots)
    source.rank_table("bad-one", cfg, 16)
    return source.load_rows("bad-one", cfg, 16, dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_bad_adapter_is_refused_with_its_reason(case, dirs, tiny_cfg):
    allowed, outside = dirs
    path = allowed / case.id
    case.make(path, tiny_cfg, outside)
    with pytest.raises(AdapterError) as info:
        _register_and_verify(path, tiny_cfg, (allowed,))
    assert case.fragment.lower() in info.value.reason.lower(), info.value.reason
    assert info.value.adapter == "bad-one" and "bad-one" in str(info.value)
    assert isinstance(info.value, AdapterNotAllowed) == (case.status == 403)


def test_the_good_adapter_behind_every_case_loads(dirs, tiny_cfg):
    """The cases differ from a servable adapter only by what they break."""
    allowed, _ = dirs
    rows = _register_and_verify(write_good(allowed / "fine", tiny_cfg), tiny_cfg, (allowed,))
    assert rows.max_rank == 4 and np.isfinite(rows.vectors).all()


def test_weights_a_float16_pool_cannot_hold_are_refused_there_only(dirs, tiny_cfg):
    allowed, _ = dirs
    path = allowed / "big"
    tensors(scaled(7e4))(path, tiny_cfg, None)
    _register_and_verify(path, tiny_cfg, (allowed,), np.float32)
    with pytest.raises(AdapterError, match="beyond float16's largest value"):
        _register_and_verify(path, tiny_cfg, (allowed,), np.float16)


HEADER_CASES = ["weights-unexpected-tensor", "weights-untargeted-module", "weights-layer-beyond",
                "weights-duplicate", "weights-missing-b", "weights-int32", "weights-3d", "weights-transposed"]


@pytest.mark.parametrize("case", [c for c in CASES if c.id in HEADER_CASES], ids=lambda c: c.id)
def test_names_dtypes_and_shapes_are_refused_before_any_weight_is_read(case, dirs, tiny_cfg, monkeypatch):
    allowed, outside = dirs
    reads = []
    real_open = weights_file.safe_open

    class Counting:
        def __init__(self, *args, **kw):
            self.inner = real_open(*args, **kw)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return self.f.get_slice(name)

        def get_tensor(self, name):
            reads.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(weights_file, "safe_open", Counting)
    case.make(allowed / case.id, tiny_cfg, outside)
    with pytest.raises(AdapterError, match=case.fragment):
        load_peft_adapter(allowed / case.id, tiny_cfg)
    assert reads == []
    load_peft_adapter(write_good(allowed / "fine", tiny_cfg), tiny_cfg)
    assert len(reads) == 2 * 4 * tiny_cfg.num_hidden_layers  # the counter does see reads


def test_a_weights_file_rewritten_while_it_is_read_fails_as_the_adapters_error(dirs, tiny_cfg, monkeypatch):
    """The weights are parsed from a private copy: a writer truncating the file (``cp new old`` does) once killed
    the process with SIGBUS in the mapped file. Truncated before the copy: a retryable error; after it: the copy,
    whole, is what loads."""
    allowed, _ = dirs
    path = write_good(allowed / "moving", tiny_cfg)
    file = path / weights_file.WEIGHTS_NAME
    real_size_check, real_check = weights_file._check_header_size, weights_file._check_header

    def truncated_after(fn):
        def wrapped(*args, **kw):
            out = fn(*args, **kw)
            os.truncate(file, 200)  # in place, as a rewrite starts
            return out
        return wrapped

    monkeypatch.setattr(weights_file, "_check_header_size", truncated_after(real_size_check))
    with pytest.raises(AdapterError, match="changed while it was read") as info:
        _register_and_verify(path, tiny_cfg, (allowed,))
    assert info.value.retry_after_s is not None
    monkeypatch.setattr(weights_file, "_check_header_size", real_size_check)
    path = write_good(allowed / "moving2", tiny_cfg)
    file = path / weights_file.WEIGHTS_NAME
    want = load_peft_adapter(path, tiny_cfg)
    monkeypatch.setattr(weights_file, "_check_header", truncated_after(real_check))
    got = load_peft_adapter(path, tiny_cfg)
    assert got.modules.keys() == want.modules.keys()
    assert all(np.array_equal(got.modules[k].a, want.modules[k].a) for k in want.modules)


def test_a_weights_file_larger_than_its_ranks_allow_is_refused_before_it_is_copied(dirs, tiny_cfg, monkeypatch):
    allowed, _ = dirs
    path = write_good(allowed / "padded", tiny_cfg)
    with open(path / weights_file.WEIGHTS_NAME, "ab") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB of nothing after valid weights
    monkeypatch.setattr(weights_file, "_private_copy", None)  # never reached
    with pytest.raises(AdapterError, match="more than its LoRA weights can take"):
        _register_and_verify(path, tiny_cfg, (allowed,))


def _wide_model() -> ModelConfig:
    """A model whose adapters weigh megabytes, so what a failed load keeps is measurable."""
    conf = synth.preset_config("tiny") | dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                                              num_key_value_heads=8, head_dim=64)
    return ModelConfig.from_dict(conf)


@pytest.mark.parametrize("bad_value, fragment", [(np.nan, "non-finite"), (1e20, "overflow")])
def test_a_rejected_load_frees_its_weights_at_once(tmp_path, bad_value, fragment):
    cfg = _wide_model()
    path = write_good(tmp_path / "a", cfg, rank=64, targets=MODULES)
    found = load_file(str(path / WEIGHTS))
    last = f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"  # (1, v_proj) is read last: everything else is in memory
    found[last] = np.full_like(found[last], bad_value)
    save_file(found, str(path / WEIGHTS))
    size = sum(t.nbytes for t in found.values())
    del found
    gc.collect()
    gc.disable()  # what a rejected load holds must go by reference counting alone
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        try:
            PeftDirSource(path).load_rows("a", cfg, 64, np.float32)
        except AdapterError as e:
            kept = e  # kept, as the host tier keeps a failure
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        gc.enable()
    assert fragment in kept.reason
    assert size > 3_000_000 and held < size // 20, (held, size)


# ---------------------------------------------------------------- patterns: linear time, PEFT's answers


CATASTROPHIC = "(.|.)*X"


def test_a_catastrophic_regex_is_matched_in_linear_time(dirs, tiny_cfg):
    allowed, _ = dirs
    path = write_good(allowed / "evil", tiny_cfg, rank_pattern={CATASTROPHIC: 2, "(a*)*b": 2},
                      alpha_pattern={CATASTROPHIC: 1.0}, extra_config={"exclude_modules": "(x+x+)+y"})
    start = time.monotonic()
    ranks = check_peft_dir(path, tiny_cfg, "evil", 16)
    load_peft_adapter(path, tiny_cfg)
    assert time.monotonic() - start < 5.0  # backtracking on a module name would take hours; 5 s spares a loaded box
    assert set(ranks.values()) == {4}  # the patterns match no module name: PEFT's answer too
    config(target_modules=CATASTROPHIC)(allowed / "evil2", tiny_cfg, None)
    start = time.monotonic()
    with pytest.raises(AdapterError, match="matches no supported projection"):
        check_peft_dir(allowed / "evil2", tiny_cfg, "evil2", 16)
    assert time.monotonic() - start < 5.0


ORDINARY_PATTERNS = ["q_proj", "v_proj", "down_proj", "o_proj", r"layers\.1\.self_attn\.q_proj", ".*proj", "(q|k)_proj",
                     "model.layers.0.mlp.up_proj", r"layers\.[01]\.self_attn\.v_proj", r"mlp\..*", "self_attn.o_proj",
                     r"\d\.mlp\.gate_proj", "proj", "layers.1.mlp.down_proj", r"(?:k|v)_proj", "[gu][a-z]+_proj"]


def test_ordinary_patterns_match_as_in_peft(rng):
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    keys = [module_key(layer, m) for layer in range(3) for m in MODULES]
    for _ in range(40):
        chosen = list(rng.choice(ORDINARY_PATTERNS, size=int(rng.integers(1, 6)), replace=False))
        patterns = {p: int(rng.integers(1, 64)) for p in chosen}
        for key_ in keys:
            matched = get_pattern_key(list(patterns), key_)
            assert pattern_value(patterns, key_, -1) == patterns.get(matched, -1), (patterns, key_)

    cfg = ModelConfig.from_dict(synth.preset_config("tiny") | dict(num_hidden_layers=3))
    target_choices = [["q_proj", "v_proj"], ["down_proj", "o_proj", "k_proj"], list(MODULES),
                      ["model.layers.1.self_attn.q_proj", "v_proj"], ["self_attn.o_proj", "mlp.up_proj"],
                      r".*\.(q|v)_proj", r"model\.layers\.[02]\..*_proj", ".*mlp.*",
                      ["q_proj", "v_proj", "query_key_value", "dense"]]  # names a Llama lacks match nothing
    for _ in range(40):
        targets = target_choices[int(rng.integers(len(target_choices)))]
        kw = {}
        if isinstance(targets, list) and rng.random() < 0.5:
            kw["layers_to_transform"] = sorted(set(rng.integers(0, 3, size=2).tolist()))
            if rng.random() < 0.5:
                kw["layers_pattern"] = "layers"
        if rng.random() < 0.3:
            kw["exclude_modules"] = ["k_proj"] if rng.random() < 0.5 else r".*\.1\.self_attn\..*"
        peft_cfg = LoraConfig(r=4, target_modules=targets, **kw)
        expected = {k for k in (module_key(layer, m) for layer in range(3) for m in MODULES)
                    if check_target_module_exists(peft_cfg, k) is True or hasattr(check_target_module_exists(
                        peft_cfg, k), "group")}
        ours = {"r": 4, "target_modules": targets, **kw}
        try:
            got = {module_key(*pair) for pair in peft_ranks(ours, "p", cfg, 64)}
        except AdapterError as e:
            assert not expected and "matches no supported" in e.reason, (ours, e)
            continue
        assert got == expected, ours


# ---------------------------------------------------------------- names and paths of runtime loads


@pytest.fixture
def admin(dirs):
    allowed, outside = dirs
    write_good(outside / "evil", synth_cfg())
    return AdapterAdmin(None, BASE_NAME, (allowed,)), allowed, outside


def synth_cfg() -> ModelConfig:
    return ModelConfig.from_dict(synth.preset_config("tiny"))


@pytest.mark.parametrize("case_id, raw, status, fragment", PATH_CASES, ids=[c[0] for c in PATH_CASES])
def test_path_rules(admin, case_id, raw, status, fragment):
    admin, allowed, outside = admin
    raw = raw(allowed, outside) if callable(raw) else raw
    raw = raw.replace("../outside", f"../{outside.name}")
    with pytest.raises(APIError) as info:
        admin.resolve_path(raw)
    assert info.value.status == status and fragment in info.value.message, info.value.message


def test_paths_inside_are_resolved(admin):
    admin, allowed, _ = admin
    write_good(allowed / "sub" / "ok", synth_cfg())
    os.symlink(allowed / "sub" / "ok", allowed / "inner-link")
    assert admin.resolve_path("sub/ok") == allowed / "sub" / "ok"
    assert admin.resolve_path(str(allowed / "inner-link")) == allowed / "sub" / "ok"
    assert admin.resolve_path("sub/../sub/ok") == allowed / "sub" / "ok"
    assert admin.resolve_path("not-yet") == allowed / "not-yet"  # its load then says it is missing


@pytest.mark.parametrize("name, fragment", NAME_CASES, ids=NAME_IDS)
def test_name_rules(admin, name, fragment):
    admin, _, _ = admin
    with pytest.raises(APIError, match=fragment) as info:
        admin.check_name(name)
    assert info.value.status == 400


# ---------------------------------------------------------------- over HTTP: 4xx with the reason, never 500


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "uploads").mkdir()
    (root / "outside").mkdir()
    server = start_server(root, n_adapters=1, allowed_dirs=(root / "uploads",), ranks=(4,), max_lora_rank=16)
    server.root = root
    server.cfg = ModelConfig.from_model_dir(server.model_dir)
    write_good(root / "outside" / "evil", server.cfg)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        yield client


def _load(http: httpx.Client, name: str, path: str) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def _refused(r: httpx.Response, status: int, fragment: str) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and re.search(fragment, error["message"], re.IGNORECASE), error["message"]
    return error["message"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_http_load_of_every_bad_adapter_is_4xx_with_its_reason(case, srv, http):
    case.make(srv.root / "uploads" / case.id, srv.cfg, srv.root / "outside")
    message = _refused(_load(http, case.id, case.id), case.status, re.escape(case.fragment))
    assert case.id in message


@pytest.mark.parametrize("case_id, raw, status, fragment", PATH_CASES, ids=[c[0] for c in PATH_CASES])
def test_http_path_rules(case_id, raw, status, fragment, srv, http):
    uploads, outside = srv.root / "uploads", srv.root / "outside"
    raw = raw(uploads, outside) if callable(raw) else raw
    _refused(_load(http, f"path-{case_id}", raw), status, "4096" if len(raw) > 4096 else re.escape(fragment))


@pytest.mark.parametrize("name, fragment", NAME_CASES, ids=NAME_IDS)
def test_http_name_rules(name, fragment, srv, http):
    write_good(srv.root / "uploads" / "named", srv.cfg)
    _refused(_load(http, name, "named"), 400, fragment)


def test_a_catastrophic_regex_neither_freezes_the_server_nor_fails_slowly(srv, http):
    uploads = srv.root / "uploads"
    write_good(uploads / "regex-bomb", srv.cfg, rank_pattern={CATASTROPHIC: 2}, alpha_pattern={CATASTROPHIC: 1.0},
               extra_config={"exclude_modules": CATASTROPHIC})
    config(target_modules=CATASTROPHIC)(uploads / "regex-bomb-targets", srv.cfg, None)
    polls, stop = [], threading.Event()

    def poll_health():
        with httpx.Client(base_url=srv.url, timeout=5) as client:
            while not stop.is_set():
                start = time.monotonic()
                status = client.get("/health").status_code
                polls.append((time.monotonic() - start, status))
                time.sleep(0.02)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    try:
        time.sleep(0.3)
        start = time.monotonic()
        loaded, refused = _load(http, "regex-bomb", "regex-bomb"), _load(http, "regex-bomb-2", "regex-bomb-targets")
        elapsed = time.monotonic() - start
        time.sleep(0.3)
    finally:
        stop.set()
        poller.join(10)
    assert loaded.status_code == 200, loaded.text
    _refused(refused, 400, "matches no supported projection")
    assert elapsed < 10
    assert len(polls) >= 10 and all(status == 200 and seconds < 1.0 for seconds, status in polls), polls
    r = http.post("/v1/completions", json={"model": "regex-bomb", "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def test_after_every_refusal_the_server_serves_and_lists_none_of_them(srv, http):
    models = {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert not models & ({c.id for c in CASES} | {f"path-{c[0]}" for c in PATH_CASES})
    for model in (BASE_NAME, srv.adapters[0]):
        r = http.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
