"""Every Triton kernel of ``pallas_kernels`` lowered for CUDA at production shapes, on any host (no GPU needed).

Why: the CPU suite runs the kernels in interpret mode, which never checks what the Triton lowering demands (a Triton
rule for every primitive, power-of-two array shapes, no scalar prefetch), and GPU time is scarce, so a kernel change
that breaks the lowering would otherwise first show up on the GPU. jaxlib carries Triton's MLIR dialects, so
``lower(lowering_platforms=("cuda",))`` runs the whole Pallas -> Triton lowering here (jax 0.11 through an abstract
H200: tests/cuda_lowering.py); the inputs are ``jax.ShapeDtypeStruct``s and nothing is compiled or run. What only
Triton's compiler checks (e.g. ``tl.dot``'s 16-row minimum, shared memory and register limits) still needs the GPU
suite.

Shapes are the serving ones: Llama-2-7B (32 heads, 32 KV heads) and Llama-3-8B (GQA: 8 KV heads) from ``configs/``,
bf16, a 64 GiB unified pool of 16-token pages, 64 adapter slots, the engine's GPU tiles (``lora_block_t`` 64,
``attn_block_q`` 128), decode batches 1 / 64 / 256, prefills of 512 and 2048 tokens in 16 sequence slots, LoRA ranks 8
and 64. Kernels are called through the backend table (``pallas_kernels.backends``) with the static arguments the
serving forward passes; the last tests lower that forward itself. Each case asserts which Triton kernels the lowered
module holds, by name. Covered elsewhere: ``keep_threshold`` (test_keep_threshold_kernel.py) and the Mosaic GPU
prefill kernel (test_mosaic_prefill_attention.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from cuda_lowering import lower_for_cuda
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import pallas_kernels
from pallas_kernels.backends import get_backend
from pallas_kernels.lora_common import AdapterTable
from pallas_kernels.lora_fused import FusedTuning
from pallas_kernels.lora_sgmv import SegmentTiles
from pallas_kernels.paged_attention import default_pages_per_block
from pallas_kernels.prefill_attention import default_prefill_tiles, max_prefill_tiles
from slora_jax.engine.adapter_shards import AdapterShards
from slora_jax.engine.config import EngineConfig
from slora_jax.model.config import MODULES, ModelConfig
from slora_jax.model.llama import init_params
from slora_jax.model.paged import PagedSpec, StepBatch, paged_forward
from slora_jax.tools.synth import preset_config

S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
# the Triton custom call: jaxlib <= 0.10.2 embeds the Triton IR; later jaxlibs compile it at lowering (GPU hosts)
TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")

# Llama-2 context, GPU tiles; "pallas-triton" by name: the "pallas" alias may take another lowering for a role
ENGINE = EngineConfig(max_model_len=4096, backend="pallas-triton").with_platform_defaults("gpu")
POOL_BYTES = 64 << 30
MODELS = ("llama-2-7b", "llama-3-8b")
GROUPS = {"qkv": (0, 1, 2), "o": (3,), "gate_up": (4, 5), "down": (6,)}  # the forward's LoRA groups
BATCHES = (1, 64, 256)
PREFILL_TOKENS = (512, 2048)
RANKS = (8, 64)

# On a GPU the suite compiles and runs every kernel (and lowering here would compile each again: minutes)
pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GPU suite compiles and runs these kernels")

LORA_NAMES = {"fused": ["lora_bgmv_fused"], "split": ["lora_bgmv_split_shrink", "lora_bgmv_split_expand"]}
UNFUSED_NAMES = ["lora_bgmv_shrink", "lora_bgmv_expand"]
SGMV_NAMES = ["lora_sgmv_shrink", "lora_sgmv_expand"]


@pytest.fixture(scope="module", autouse=True)
def cuda_lowering():
    """Skip the module where this jax cannot lower Pallas Triton kernels for CUDA at all: a trivial kernel, written
    with plain jax, fails to lower (e.g. a jaxlib that compiles Triton at lowering but has no CUDA plugin)."""

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    call = pl.pallas_call(add_one, out_shape=S((16,), F32), interpret=False, compiler_params=pltriton.CompilerParams())
    try:
        lower_for_cuda(call, S((16,), F32))
    except Exception as e:  # an environment limit: nothing of this project is involved
        pytest.skip(f"this jax cannot lower Pallas Triton kernels for CUDA: {type(e).__name__}: {e}")


def cuda_text(fn, *args) -> str:
    """``fn`` lowered for CUDA (StableHLO text)."""
    return lower_for_cuda(fn, *args).as_text()


def triton_kernels(fn, *args) -> list[str]:
    """Names of the Triton kernels in ``fn`` lowered for CUDA, in program order."""
    calls = [line for line in cuda_text(fn, *args).splitlines() if any(f"@{t}(" in line for t in TARGETS)]
    return [re.search(r'\bname = "([^"]*)"', line)[1] for line in calls]


@dataclasses.dataclass(frozen=True)
class World:
    """A model's serving shapes: config, the unified pool and the adapter table (all ShapeDtypeStructs)."""

    cfg: ModelConfig
    pool: S
    table: AdapterTable
    max_pages: int  # KV pages per sequence

    def group(self, name: str) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
        """(modules, d_in, d_outs) of a LoRA group, as the forward computes them."""
        modules = GROUPS[name]
        dims = [self.cfg.module_dims(MODULES[m]) for m in modules]
        return modules, dims[0][0], tuple(d for _, d in dims)


@functools.cache
def world(model: str, rank: int = ENGINE.max_lora_rank) -> World:
    cfg = ModelConfig.from_dict(preset_config(model), model)
    n_layers, head_dim = cfg.num_hidden_layers, cfg.head_dim
    page_rows = 2 * cfg.num_key_value_heads * ENGINE.page_size  # as PagedPool lays it out
    num_pages = POOL_BYTES // (n_layers * page_rows * head_dim * 2)
    adapter_pages = math.ceil(AdapterShards(cfg).max_vectors(rank) / page_rows)
    slots, n_mod = ENGINE.max_loras, len(MODULES)
    table = AdapterTable(S((slots, adapter_pages), I32), *(S((slots, n_layers, n_mod), I32),) * 3,
                         S((slots, n_layers, n_mod), F32))
    return World(cfg, S((n_layers, num_pages, page_rows, head_dim), BF16), table, ENGINE.max_pages_per_seq)


def lora_tiles(n_rows: int) -> int:
    """SGMV tiles of a prefill bucket, as the step runner sizes them."""
    return -(-n_rows // ENGINE.lora_block_t) + ENGINE.max_prefill_seqs + 1


# ----------------------------------------------------------------------------------------------------------------------
# LoRA: decode (BGMV: fused, split, unfused) and prefill (SGMV)
# ----------------------------------------------------------------------------------------------------------------------


def decode_lora(backend: str, model: str, batch: int, group: str, rank: int, tuning=None) -> list[str]:
    w = world(model, rank)
    modules, d_in, d_outs = w.group(group)
    lora = get_backend(backend).bgmv_lora
    kw = {} if tuning is None else dict(tuning=tuning)

    def fn(x, y, pool, layer, row_slot, table):
        return lora(x, y, pool, layer, row_slot, table, modules, rank, d_outs, interpret=False, **kw)

    return triton_kernels(fn, S((batch, d_in), BF16), S((batch, sum(d_outs)), BF16), w.pool, S((), I32),
                          S((batch,), I32), w.table)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("group", tuple(GROUPS))
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("model", MODELS)
def test_decode_lora(model, batch, group, rank):
    """The decode path of the forward: one ``bgmv_lora`` per group, in the plan the cost model picks."""
    assert decode_lora(ENGINE.backend, model, batch, group, rank) in LORA_NAMES.values()


@pytest.mark.parametrize("group", tuple(GROUPS))
@pytest.mark.parametrize("batch", (1, 256))
@pytest.mark.parametrize("model", MODELS)
def test_decode_lora_split(model, batch, group):
    """The split plan (d_in over programs, then an expand that sums the partials), forced: the cost model picks it
    only for a few of these shapes (Llama-3-8B's down_proj at batch 1)."""
    assert decode_lora(ENGINE.backend, model, batch, group, 64, FusedTuning(mode="split")) == LORA_NAMES["split"]


@pytest.mark.parametrize("mode", ("fused", "split"))
def test_decode_lora_returns_the_base_shape_from_the_kernel(mode):
    """The kernel's output is ``[T, D]`` itself, with no reshape after it: a reshaped output stood between the kernel
    and the next RMSNorm's fusion as a convert kernel (64 a decode step on a 7B model, session 11's profile)."""
    w = world("llama-2-7b", 8)
    modules, d_in, d_outs = w.group("qkv")
    lora, batch, width = get_backend(ENGINE.backend).bgmv_lora, 64, sum(d_outs)

    def fn(x, y, pool, layer, row_slot, table):
        return lora(x, y, pool, layer, row_slot, table, modules, 8, d_outs, interpret=False,
                    tuning=FusedTuning(mode=mode))

    lines = cuda_text(fn, S((batch, d_in), BF16), S((batch, width), BF16), w.pool, S((), I32), S((batch,), I32),
                      w.table).splitlines()
    last_call = max(i for i, line in enumerate(lines) if any(f"@{t}(" in line for t in TARGETS))
    assert lines[last_call].endswith(f"-> tensor<{batch}x{width}xbf16>"), lines[last_call][-200:]
    assert not any("stablehlo.reshape" in line for line in lines[last_call:]), lines[last_call:]


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("group", tuple(GROUPS))
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("model", MODELS)
def test_decode_lora_unfused(model, batch, group, rank):
    """``bgmv_shrink`` then ``bgmv_expand`` (the unfused backend; tensor parallel LoRA calls the same roles)."""
    assert decode_lora("pallas-unfused", model, batch, group, rank) == UNFUSED_NAMES


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("group", tuple(GROUPS))
@pytest.mark.parametrize("tokens", PREFILL_TOKENS)
@pytest.mark.parametrize("model", MODELS)
def test_prefill_lora(model, tokens, group, rank):
    """The prefill path: ``sgmv_shrink`` then ``sgmv_expand`` over the step's segment tiles."""
    w = world(model, rank)
    modules, d_in, d_outs = w.group(group)
    kb, block_t = get_backend(ENGINE.backend), ENGINE.lora_block_t

    def fn(x, y, pool, layer, tiles, table):
        tiles = SegmentTiles(*tiles)  # as PagedOps unpacks StepBatch.lora_tiles
        small = kb.sgmv_shrink(x, pool, layer, tiles, table, modules, rank, block_t, interpret=False)
        return kb.sgmv_expand(small, y, pool, layer, tiles, table, modules, d_outs, block_t, interpret=False)

    names = triton_kernels(fn, S((tokens, d_in), BF16), S((tokens, sum(d_outs)), BF16), w.pool, S((), I32),
                           S((3, lora_tiles(tokens)), I32), w.table)
    assert names == SGMV_NAMES


# ----------------------------------------------------------------------------------------------------------------------
# Attention: paged decode (flash-decoding, one or several splits) and ragged prefill
# ----------------------------------------------------------------------------------------------------------------------


def attention_kw(cfg: ModelConfig) -> dict:
    return dict(page_size=ENGINE.page_size, num_kv_heads=cfg.num_key_value_heads,
                sm_scale=1.0 / math.sqrt(cfg.head_dim), interpret=False)


def decode_kernel_name(cfg: ModelConfig, suffix: str = "") -> str:
    """The pattern of the decode attention kernel's name at the engine's GPU pages (any split count)."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    block_k = default_pages_per_block(ENGINE.page_size) * ENGINE.page_size
    return rf"paged_decode_g{group}_bk{block_k}_s\d+{suffix}"


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("model", MODELS)
def test_decode_attention(model, batch):
    w = world(model)
    cfg, kw = w.cfg, attention_kw(w.cfg)
    attend = get_backend(ENGINE.backend).decode_attention

    def fn(q, pool, layer, page_table, context_lens):
        return attend(q, pool, layer, page_table, context_lens, **kw)

    names = triton_kernels(fn, S((batch, cfg.num_attention_heads, cfg.head_dim), BF16), w.pool, S((), I32),
                           S((batch, w.max_pages), I32), S((batch,), I32))
    assert len(names) == 1 and re.fullmatch(decode_kernel_name(cfg), names[0]), names


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("model", MODELS)
def test_decode_attention_rope(model, batch):
    """The serving decode path: q/k rotation and the KV write inside the attention kernel, the pool in place."""
    w = world(model)
    cfg, kw = w.cfg, attention_kw(w.cfg)
    attend = get_backend(ENGINE.backend).decode_attention_rope

    def fn(qkv, cos, sin, pool, layer, page_table, context_lens, kv_slots):
        return attend(qkv, cos, sin, pool, layer, page_table, context_lens, kv_slots,
                      num_heads=cfg.num_attention_heads, **kw)

    width = cfg.q_width + 2 * cfg.kv_width
    names = triton_kernels(fn, S((batch, width), BF16), S((batch, cfg.head_dim), F32), S((batch, cfg.head_dim), F32),
                           w.pool, S((), I32), S((batch, w.max_pages), I32), S((batch,), I32), S((batch,), I32))
    assert len(names) == 1 and re.fullmatch(decode_kernel_name(cfg, "_rope"), names[0]), names


@pytest.mark.parametrize("tokens", PREFILL_TOKENS)
@pytest.mark.parametrize("model", MODELS)
def test_prefill_attention(model, tokens):
    w = world(model)
    cfg, kw, seqs, block_q = w.cfg, attention_kw(w.cfg), ENGINE.max_prefill_seqs, ENGINE.attn_block_q
    attend = get_backend(ENGINE.backend).prefill_attention

    def fn(q, pool, layer, page_table, q_starts, context_lens, tile_map):
        return attend(q, pool, layer, page_table, q_starts, context_lens, tile_map=tile_map, block_q=block_q, **kw)

    names = triton_kernels(fn, S((tokens, cfg.num_attention_heads, cfg.head_dim), BF16), w.pool, S((), I32),
                           S((seqs, w.max_pages), I32), S((seqs + 1,), I32), S((seqs,), I32),
                           S((max_prefill_tiles(tokens, seqs, block_q), 4), I32))
    block_q, block_k, _, _ = default_prefill_tiles(block_q)
    assert names == [f"paged_prefill_bq{block_q}_bk{block_k}"]


# ----------------------------------------------------------------------------------------------------------------------
# The serving forward itself (all 32 layers in one scanned layer body), and what this file covers
# ----------------------------------------------------------------------------------------------------------------------


def step_batch(rows: int, seqs: int, lora_tiles_n: int, attn_tiles_n: int, max_pages: int) -> StepBatch:
    vec = S((rows,), I32)
    return StepBatch(tokens=vec, positions=vec, kv_slots=vec, row_slot=vec, page_table=S((seqs, max_pages), I32),
                     context_lens=S((seqs,), I32), q_starts=S((seqs + 1,), I32), logits_rows=S((seqs,), I32),
                     lora_tiles=S((3, lora_tiles_n), I32), attn_tiles=S((attn_tiles_n, 4), I32))


@pytest.mark.parametrize("mode", ("decode", "prefill"))
@pytest.mark.parametrize("model", MODELS)
def test_serving_forward(model, mode):
    """``paged_forward`` as the step runner calls it on a GPU (decode batch 64, a 512-token prefill): every kernel
    the model launches, with the arguments it passes, lowers to Triton."""
    w = world(model)
    spec = PagedSpec(mode=mode, backend=ENGINE.backend, page_size=ENGINE.page_size, max_rank=ENGINE.max_lora_rank,
                     lora_block_t=ENGINE.lora_block_t, attn_block_q=ENGINE.attn_block_q, interpret=False)
    if mode == "decode":
        batch = step_batch(64, 64, 1, 1, w.max_pages)
    else:
        seqs = ENGINE.max_prefill_seqs
        batch = step_batch(512, seqs, lora_tiles(512), max_prefill_tiles(512, seqs, ENGINE.attn_block_q), w.max_pages)
    params = jax.eval_shape(lambda: init_params(w.cfg, jax.random.key(0), BF16))  # stacked layers: one scan body
    names = triton_kernels(functools.partial(paged_forward, w.cfg, spec), params, w.pool, w.table, batch)
    attention = [n for n in names if n.startswith("paged_")]
    lora = [n for n in names if n.startswith("lora_")]
    assert len(attention) == 1 and len(attention) + len(lora) == len(names), names
    if mode == "decode":  # rotation and KV write in the attention kernel; one bgmv_lora per group: 1 or 2 kernels
        assert attention[0].startswith("paged_decode_") and attention[0].endswith("_rope"), names
        assert 4 <= len(lora) <= 8, names
        assert set(lora) <= {*LORA_NAMES["fused"], *LORA_NAMES["split"]}, names
    else:
        assert attention[0].startswith("paged_prefill_") and lora == SGMV_NAMES * 4, names


# Kernel names (up to their first formatted field) asserted above, or elsewhere (keep_threshold_p, small_matmul: their
# own test files lower them for CUDA)
COVERED = {*LORA_NAMES["fused"], *LORA_NAMES["split"], *UNFUSED_NAMES, *SGMV_NAMES, "paged_decode_g",
           "paged_prefill_bq", "keep_threshold_p", "small_matmul"}


def test_every_triton_kernel_is_covered():
    """A new ``pallas_call`` in pallas_kernels (a new kernel, or a new file) needs a case here (or its own test)."""
    found = set()
    for path in Path(pallas_kernels.__file__).parent.glob("*.py"):
        text = path.read_text()
        if path.stem != "lowering" and re.search(r"\bpallas_call\b", text):
            names = re.findall(r'\bname=f?"([a-z_]+)', text)
            assert names, f"{path.name} calls pallas_call without a name="
            found.update(names)
    assert found and found <= COVERED, sorted(found - COVERED)
