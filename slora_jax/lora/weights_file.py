"""``adapter_model.safetensors`` as untrusted input: the header first, the weights only if it is right.

The header (tensor names, dtypes, shapes) is bounded in size and checked against what the config adapts before a
single weight is read, so a file with the wrong names, extra or missing tensors, integer or 3-d tensors, or shapes
that do not fit the base model costs a few kB of reading, not the whole file. Weights are then read one module at a
time and checked as they arrive (finite, within float32), so a bad value stops the read early.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from pathlib import Path

import ml_dtypes  # also registers bfloat16 with numpy, so BF16 adapters read as numpy arrays
import numpy as np
from safetensors import safe_open

from slora_jax.lora.adapter_files import open_adapter_file
from slora_jax.lora.errors import RETRY_AFTER_S, AdapterError
from slora_jax.model.config import ATTN_MODULES, MODULES, ModelConfig, module_key

__all__ = ["FLOAT_DTYPES", "MAX_HEADER_BYTES", "WEIGHTS_NAME", "peft_weights_path", "read_lora_weights"]

WEIGHTS_NAME = "adapter_model.safetensors"
MAX_HEADER_BYTES = 16 << 20  # a 126-layer model's 1,764 LoRA tensors need ~0.2 MB
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d{1,6})\.(self_attn|mlp)\.(\w+)\.lora_([AB])(\.[^.]+)?\.weight$"
)


def peft_weights_path(path: Path, name: str) -> Path:
    """``path``'s ``adapter_model.safetensors``; raises if there is no such regular file (cheap: no read)."""
    st = Path(path) / WEIGHTS_NAME
    try:
        present, exists = st.is_file(), st.exists()
        has_bin = not present and (Path(path) / "adapter_model.bin").exists()
    except OSError as e:
        raise AdapterError(name, f"cannot read {st.name}: {e.strerror}", RETRY_AFTER_S) from None
    if exists and not present:
        raise AdapterError(name, f"{WEIGHTS_NAME} is not a regular file")
    if not present:  # gone since it was registered (being replaced, a disk away): a later read may find it
        extra = " (adapter_model.bin is not read: convert it to safetensors)" if has_bin else ""
        raise AdapterError(name, f"missing {WEIGHTS_NAME} in {path}{extra}", RETRY_AFTER_S)
    return st


def _check_header_size(fd: int, size: int, name: str) -> None:
    """The 8-byte little-endian header length, checked before the parser allocates anything for it."""
    if size < 8:
        raise AdapterError(name, f"unreadable {WEIGHTS_NAME}: {size} bytes is too short for a header")
    length = int.from_bytes(os.pread(fd, 8, 0), "little")
    if length > MAX_HEADER_BYTES:
        raise AdapterError(name, f"unreadable {WEIGHTS_NAME}: a header of {length} bytes (the limit is "
                                 f"{MAX_HEADER_BYTES})")
    if 8 + length > size:
        raise AdapterError(name, f"unreadable {WEIGHTS_NAME}: truncated (header of {length} bytes, file of {size})")


def _tensor_pair(key: str, name: str, num_layers: int) -> tuple[int, str, str, str]:
    """(layer, module, "A" or "B", the PEFT adapter name suffix or "") of a LoRA tensor name; raises for anything
    else in the file."""
    match = _KEY_RE.match(key)
    shown = key if len(key) <= 120 else key[:117] + "..."
    if match is None:
        if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
            raise AdapterError(name, f"LoRA on embeddings or lm_head is not supported ({shown})")
        if "magnitude" in key:
            raise AdapterError(name, f"DoRA weights are not supported ({shown})")
        raise AdapterError(name, f"unexpected tensor {shown!r}")
    layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
    if module not in MODULES or (parent == "self_attn") != (module in ATTN_MODULES):
        raise AdapterError(name, f"unknown target module in tensor {shown!r}")
    if layer >= num_layers:
        raise AdapterError(name, f"tensor {shown!r} is for layer {layer}; the model has {num_layers}")
    return layer, module, which, match[5] or ""


def _check_header(f, name: str, model: ModelConfig, ranks: dict[tuple[int, str], int]) -> dict:
    """``{(layer, module): {"A": tensor name, "B": tensor name}}`` once every name, dtype and shape is right."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    suffixes: dict[str, str] = {}  # PEFT's adapter name in tensor names (".default"): one adapter's tensors only
    for key in f.keys():
        layer, module, which, suffix = _tensor_pair(key, name, model.num_hidden_layers)
        suffixes.setdefault(suffix, key)
        if len(suffixes) > 1:
            raise AdapterError(name, f"tensors of more than one adapter: {', '.join(sorted(suffixes.values()))}")
        pair = found.setdefault((layer, module), {})
        if which in pair:
            raise AdapterError(name, f"two lora_{which} tensors for {module_key(layer, module)}: {pair[which]!r} "
                                     f"and {key!r}")
        pair[which] = key
    missing = sorted(set(ranks) - set(found))
    if missing:
        raise AdapterError(name, f"no weights for targeted module(s) {[module_key(*m) for m in missing[:3]]}")
    unexpected = sorted(set(found) - set(ranks))
    if unexpected:
        raise AdapterError(name, f"weights for module(s) not in target_modules: "
                                 f"{[module_key(*m) for m in unexpected[:3]]}")
    for (layer, module), pair in sorted(found.items()):
        where = module_key(layer, module)
        if set(pair) != {"A", "B"}:
            raise AdapterError(name, f"{where} has lora_{'A' if 'A' not in pair else 'B'} missing")
        d_in, d_out = model.module_dims(module)
        r = ranks[(layer, module)]
        shapes, dtypes = {}, {}
        for which, key in pair.items():
            tensor = f.get_slice(key)
            shapes[which], dtypes[which] = tuple(tensor.get_shape()), tensor.get_dtype()
            if dtypes[which] not in FLOAT_DTYPES:
                raise AdapterError(name, f"{where}: lora_{which} has dtype {dtypes[which]}; LoRA weights must be "
                                         f"floating point ({', '.join(FLOAT_DTYPES)})")
        if shapes["A"] != (r, d_in) or shapes["B"] != (d_out, r):
            raise AdapterError(
                name, f"{where}: lora_A {shapes['A']} / lora_B {shapes['B']} do not match the base model "
                f"(expected ({r}, {d_in}) / ({d_out}, {r}))")
    return found


def _as_float32(tensor: np.ndarray, name: str, where: str) -> np.ndarray:
    if tensor.dtype.itemsize > 4:  # float64: a finite value beyond float32's range would convert to inf
        peak = float(np.abs(tensor).max(initial=0))  # NaN and inf stay so when converted: refused below
        if math.isfinite(peak) and peak > _FLOAT32_MAX:
            raise AdapterError(name, f"{where} has weights beyond float32's range")
    out = np.asarray(tensor, np.float32)  # bf16 / float16 convert exactly; the check is then a native float32 pass
    if not np.isfinite(out).all():
        raise AdapterError(name, f"{where} has non-finite weights (NaN or inf)")
    return out


@contextlib.contextmanager
def _private_copy(file, name: str):
    """A path to the file's bytes copied into an anonymous memory file that only this process holds (Linux), for
    the parser to map. Mapped in place, a file that a writer truncates meanwhile (``cp new old`` does) kills the
    process with SIGBUS at the first page past its new end; a copy that comes up short is the adapter's error."""
    if not hasattr(os, "memfd_create"):
        yield file.path
        return
    fd = os.memfd_create("slora-adapter-weights", os.MFD_CLOEXEC)
    try:
        done = 0
        while done < file.size:
            n = os.sendfile(fd, file.fd, done, file.size - done)
            if n == 0:
                raise AdapterError(name, f"{WEIGHTS_NAME} changed while it was read ({done} of {file.size} bytes "
                                         "there); read it again once it is written", RETRY_AFTER_S)
            done += n
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def read_lora_weights(path: Path, name: str, model: ModelConfig, ranks: dict[tuple[int, str], int],
                      roots: tuple[Path, ...] = (), keep_bf16: bool = False,
                      ) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """``{(layer, module): (a [d_in, r], b [r, d_out])}`` in float32, read from ``path``'s safetensors file after
    its header matched ``ranks`` exactly. With ``roots``, the file must really be inside one of them.

    ``keep_bf16``: BF16 tensors stay bfloat16, unchecked here: for a bfloat16 pool, whose layout
    (``pool_rows.to_pool_rows``) checks their values from the bits in one pass and takes the bits as they are. That
    halves a 7B all-7-projection adapter's read (NOTES, session 13). Other dtypes still become float32."""
    # the most a file matching ``ranks`` can hold (float64 weights): a larger one is refused before it is copied
    most = 8 + MAX_HEADER_BYTES + 8 * sum(r * sum(model.module_dims(m)) for (_, m), r in ranks.items())
    with open_adapter_file(Path(path) / WEIGHTS_NAME, name, roots) as file:
        _check_header_size(file.fd, file.size, name)
        if file.size > most:
            raise AdapterError(name, f"{WEIGHTS_NAME} is {file.size} bytes, more than its LoRA weights can take "
                                     f"({most} bytes at most for the ranks its config gives)")
        with _private_copy(file, name) as private:
            return _read_checked(private, name, model, ranks, keep_bf16)


def _read_checked(path: str, name: str, model: ModelConfig, ranks: dict[tuple[int, str], int], keep_bf16: bool,
                  ) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """The weights of a safetensors file at ``path`` (this process's private copy), once its header matched."""
    try:
        handle = safe_open(path, framework="numpy")
    except Exception as e:  # the parser raises several types for corrupt headers
        raise AdapterError(name, f"unreadable {WEIGHTS_NAME}: {e}") from None
    with handle as f:
        layout = _check_header(f, name, model, ranks)
        weights = {}
        for (layer, module), keys in sorted(layout.items()):
            where = module_key(layer, module)
            a, b = (f.get_tensor(keys[w]) for w in "AB")  # [r, d_in], [d_out, r]
            if not (keep_bf16 and a.dtype == b.dtype == ml_dtypes.bfloat16):
                a, b = _as_float32(a, name, where), _as_float32(b, name, where)
            # a: a view of lora_A (the pool rows take A^T's rows as they are, and column sums run along memory)
            weights[(layer, module)] = (a.T, np.ascontiguousarray(b.T))
        return weights
