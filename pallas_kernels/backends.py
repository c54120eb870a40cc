"""Kernel backends: the table of functions the serving forward calls, one entry per implementation.

The forward (``slora_jax.model.paged``) never names a kernel: it looks its backend up with :func:`get_backend` and
calls the roles of the :class:`KernelBackend` it gets. Every backend fills every role with the same signature, so a
new implementation (Mosaic GPU kernels, say) is its kernel files beside the Triton ones plus one
:func:`register_backend` call below; where a kernel's own signature differs from its role's, a small adapter here
bridges it. Each backend also carries its default tile settings per platform (:func:`default_tiles`).

Role signatures (``interpret`` is ignored by backends without an interpret mode; ``modules``, ``max_rank``,
``d_outs``, ``block_t``, ``page_size``, ``num_kv_heads``, ``sm_scale`` and ``block_q`` are static):

* ``bgmv_shrink(x, pool, layer, row_slot, table, modules, max_rank, *, interpret)`` -> f32[T, len(modules), max_rank]
* ``bgmv_expand(y, base, pool, layer, row_slot, table, modules, d_outs, *, interpret)`` -> [T, sum(d_outs)]
* ``bgmv_lora(x, base, pool, layer, row_slot, table, modules, max_rank, d_outs, *, interpret)``: shrink and expand
  of one group in one call (decode; the serving forward's path on one device) -> [T, sum(d_outs)]
* ``sgmv_shrink(x, pool, layer, tiles, table, modules, max_rank, block_t, *, interpret)``: as bgmv_shrink
* ``sgmv_expand(y, base, pool, layer, tiles, table, modules, d_outs, block_t, *, interpret)``: as bgmv_expand
* ``decode_attention(q, pool, layer, page_table, context_lens, *, page_size, num_kv_heads, sm_scale, interpret)``
* ``decode_attention_rope(qkv, cos, sin, pool, layer, page_table, context_lens, kv_slots, *, page_size, num_heads,
  num_kv_heads, sm_scale, interpret)`` -> (out, pool): the decode step's q/k rotation, KV write and attention in one
  call (the serving forward's decode path on one device; ``decode_attention`` + ``write_kv`` serve the rest)
* ``prefill_attention(q, pool, layer, page_table, q_starts, context_lens, *, tile_map, block_q, page_size,
  num_kv_heads, sm_scale, interpret)``
* ``write_kv(pool, layer, k, v, slots, page_size)`` -> pool

Shapes and meanings are those of the Triton kernels (``lora_bgmv``, ``lora_fused``, ``lora_sgmv``,
``paged_attention``, ``prefill_attention``, ``kv_cache``), whose docstrings are the contract.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax

from pallas_kernels import kv_cache, lora_bgmv, lora_fused, lora_sgmv, paged_attention, prefill_attention

FALLBACK_PLATFORM = "cpu"  # tile settings for platforms a backend has no entry for


@dataclasses.dataclass(frozen=True)
class TileDefaults:
    """Engine tile settings a backend wants on one platform (field names are EngineConfig's)."""

    lora_block_t: int  # rows per SGMV tile
    attn_block_q: int  # query rows per prefill attention tile
    min_prefill_bucket: int  # smallest prefill bucket compiled
    min_decode_bucket: int = 1  # smallest decode batch compiled
    # decode rotates q, k and writes the new KV inside its attention kernel (decode_attention_rope). Off where the
    # kernels run in interpret mode: there the aliased pool output is copied on every grid step (~80x slower tiny
    # decode steps on CPU); the CPU tests call that path explicitly.
    decode_rope_in_attention: bool = False
    # from this many rows up, a bucket at 3/2 of each power of two too (0: powers of two only). Where a step's GEMMs
    # are bound by FLOPs rather than by reading the weights, padding rows cost time: with midpoints a step pays for at
    # most half again its rows, not twice (S1: two prompts of ~260 tokens ran in a 1024-row prefill)
    prefill_mid_buckets_from: int = 0
    decode_mid_buckets_from: int = 0


# Interpret mode and tiny test models run fastest with small tiles (the EngineConfig defaults).
SMALL_TILES = TileDefaults(lora_block_t=16, attn_block_q=16, min_prefill_bucket=16)
# tl.dot-sized tiles for the compiled Triton kernels (measured in benchmarks/NOTES.md). Decode batches start at 4
# rows: at one row XLA's GEMMs for o_proj and down_proj stream their weights at 57-64% of the copy bandwidth on the
# H200, at four rows at 87-91% (benchmarks/small_matmul.py, NOTES session 16), so a lone sequence runs faster in a
# 4-row step than in a 1-row one (the padding rows carry no context and no adapter), and 2 buckets fewer compile.
# A 7B step's GEMMs cost more than reading its weights from ~150 rows (H200: 4.27 TB/s, ~660 TFLOP/s), so midpoint
# buckets start at 512 prefill rows (768, 1536, ...) and 128 decode rows (192).
TRITON_GPU_TILES = TileDefaults(lora_block_t=64, attn_block_q=128, min_prefill_bucket=128, min_decode_bucket=4,
                                decode_rope_in_attention=True, prefill_mid_buckets_from=512,
                                decode_mid_buckets_from=128)


@dataclasses.dataclass(frozen=True, eq=False)
class KernelBackend:
    """One implementation of every kernel role (signatures in the module docstring) plus its tile defaults."""

    name: str
    bgmv_shrink: Callable
    bgmv_expand: Callable
    bgmv_lora: Callable
    sgmv_shrink: Callable
    sgmv_expand: Callable
    decode_attention: Callable
    decode_attention_rope: Callable
    prefill_attention: Callable
    write_kv: Callable
    tiles: Mapping[str, TileDefaults]  # platform (jax.default_backend(): "cpu", "gpu", ...) -> settings

    def __post_init__(self):
        if FALLBACK_PLATFORM not in self.tiles:
            raise ValueError(f"backend {self.name!r} needs tile settings for {FALLBACK_PLATFORM!r}")

    def tiles_for(self, platform: str) -> TileDefaults:
        """This backend's tile settings on ``platform``; platforms without an entry get the CPU ones."""
        return self.tiles.get(platform, self.tiles[FALLBACK_PLATFORM])


ROLES = tuple(f.name for f in dataclasses.fields(KernelBackend) if f.name not in ("name", "tiles"))


def _reference_prefill_attention(q, pool, layer, page_table, q_starts, context_lens, *, tile_map, block_q, page_size,
                                 num_kv_heads, sm_scale, interpret=None):
    """The jnp reference in the prefill role: it needs no host tile map, tile size or interpret flag."""
    del tile_map, block_q, interpret
    return prefill_attention.paged_prefill_attention_reference(
        q, pool, layer, page_table, q_starts, context_lens, page_size=page_size, num_kv_heads=num_kv_heads,
        sm_scale=sm_scale)


REFERENCE = KernelBackend(
    name="reference",
    bgmv_shrink=lora_bgmv.bgmv_shrink_reference,
    bgmv_expand=lora_bgmv.bgmv_expand_reference,
    bgmv_lora=lora_fused.bgmv_lora_reference,
    sgmv_shrink=lora_sgmv.sgmv_shrink_reference,
    sgmv_expand=lora_sgmv.sgmv_expand_reference,
    decode_attention=paged_attention.paged_decode_attention_reference,
    decode_attention_rope=paged_attention.paged_decode_attention_rope_reference,
    prefill_attention=_reference_prefill_attention,
    write_kv=kv_cache.write_kv,
    # the same tiles as the Pallas backend: block_t shapes the SGMV reference's inputs, and on a GPU a reference run
    # should compile the same buckets as the kernels it is compared with
    tiles={"cpu": SMALL_TILES, "gpu": TRITON_GPU_TILES},
)

PALLAS_TRITON = KernelBackend(
    name="pallas-triton",
    bgmv_shrink=lora_bgmv.bgmv_shrink,
    bgmv_expand=lora_bgmv.bgmv_expand,
    bgmv_lora=lora_fused.bgmv_lora,
    sgmv_shrink=lora_sgmv.sgmv_shrink,
    sgmv_expand=lora_sgmv.sgmv_expand,
    decode_attention=paged_attention.paged_decode_attention,
    decode_attention_rope=paged_attention.paged_decode_attention_rope,
    prefill_attention=prefill_attention.paged_prefill_attention,
    write_kv=kv_cache.write_kv,
    tiles={"cpu": SMALL_TILES, "gpu": TRITON_GPU_TILES},
)

# The v1 decode LoRA (shrink, XLA sum of the d_in splits, expand: 3 kernels per group instead of 1), kept selectable
# so that the fused kernels can be compared with it in the same run.
PALLAS_TRITON_UNFUSED = dataclasses.replace(PALLAS_TRITON, name="pallas-triton-unfused",
                                            bgmv_lora=lora_fused.bgmv_lora_unfused)

# Prefill attention has a second lowering, Mosaic GPU (prefill_attention_mgpu.py, Hopper only), imported on first use
# so this package imports where jax lacks it. 'auto' picks per shape at trace time: Mosaic where it runs (a CUDA GPU
# of compute capability 9.x, bf16/f16 pool, head_dim 64/128, page_size >= its MIN_PAGE_SIZE, not interpret mode) and
# the call has at least MOSAIC_PREFILL_MIN_ROWS query rows, else Triton. The "pallas" alias takes
# ATTENTION_PREFILL_IMPL: 'auto' since session 19. Inside the 7B step on the H200 (jax 0.11.2, 2026-12-03) a prefill
# step of 16k tokens took 478 ms against Triton's 565, 4k 96.5 against 102.8, 8x256 45.0 against 45.6. Mosaic GPU's
# custom call demands 256-byte aligned operands; the step runner's packed inputs start every field on that boundary
# (step_runner.FIELD_ALIGN) since XLA hands a static slice of a parameter to a custom call as a pointer into it.
PREFILL_IMPLS = ("triton", "mosaic", "auto")
ATTENTION_PREFILL_IMPL = "auto"
MOSAIC_PREFILL_MIN_ROWS = 2048


@functools.cache
def mosaic_prefill_platform() -> bool:
    """True on a Hopper GPU where jax has the Mosaic GPU Pallas lowering."""
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError:
        return False
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def _mosaic_prefill_attention(q, pool, layer, page_table, q_starts, context_lens, *, tile_map, block_q, page_size,
                              num_kv_heads, sm_scale, interpret=None):
    """The Mosaic GPU kernel in the prefill role (compiled only: ``interpret`` must be unset or False)."""
    from pallas_kernels import prefill_attention_mgpu
    if interpret:
        raise ValueError("the Mosaic GPU prefill kernel has no interpret mode here; use the Triton backend on CPU")
    return prefill_attention_mgpu.paged_prefill_attention_mosaic(
        q, pool, layer, page_table, q_starts, context_lens, tile_map=tile_map, block_q=block_q, page_size=page_size,
        num_kv_heads=num_kv_heads, sm_scale=sm_scale)


def _auto_prefill_attention(q, pool, layer, page_table, q_starts, context_lens, *, tile_map, block_q, page_size,
                            num_kv_heads, sm_scale, interpret=None):
    """Mosaic where it runs and the call is big enough (module comment above), else Triton; decided from shapes."""
    kw = dict(tile_map=tile_map, block_q=block_q, page_size=page_size, num_kv_heads=num_kv_heads, sm_scale=sm_scale)
    if not interpret and q.shape[0] >= MOSAIC_PREFILL_MIN_ROWS and mosaic_prefill_platform():
        from pallas_kernels import prefill_attention_mgpu
        if prefill_attention_mgpu.mosaic_prefill_unsupported(q.shape, q.dtype, pool.shape, pool.dtype,
                                                             page_size=page_size, num_kv_heads=num_kv_heads) is None:
            return _mosaic_prefill_attention(q, pool, layer, page_table, q_starts, context_lens, **kw)
    return prefill_attention.paged_prefill_attention(q, pool, layer, page_table, q_starts, context_lens, **kw,
                                                     interpret=interpret)


PALLAS_MOSAIC_PREFILL = dataclasses.replace(PALLAS_TRITON, name="pallas-mosaic-prefill",
                                            prefill_attention=_mosaic_prefill_attention)
PALLAS_AUTO_PREFILL = dataclasses.replace(PALLAS_TRITON, name="pallas-auto-prefill",
                                          prefill_attention=_auto_prefill_attention)
PREFILL_VARIANTS = dict(zip(PREFILL_IMPLS, (PALLAS_TRITON, PALLAS_MOSAIC_PREFILL, PALLAS_AUTO_PREFILL), strict=True))

_REGISTRY: dict[str, KernelBackend] = {}


def register_backend(backend: KernelBackend, *aliases: str, replace: bool = False) -> KernelBackend:
    """Make ``backend`` selectable by its name and ``aliases`` (``EngineConfig.backend``, ``--backend``)."""
    for name in (backend.name, *aliases):
        if name in _REGISTRY and not replace:
            raise ValueError(f"kernel backend {name!r} is already registered")
    for name in (backend.name, *aliases):
        _REGISTRY[name] = backend
    return backend


def unregister_backend(name: str) -> None:
    """Forget one name (tests that register a temporary backend)."""
    _REGISTRY.pop(name, None)


def backend_names() -> tuple[str, ...]:
    """Every selectable name, aliases included, in registration order."""
    return tuple(_REGISTRY)


def get_backend(name: str) -> KernelBackend:
    """The backend registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown kernel backend {name!r}; known: {', '.join(backend_names())}") from None


def default_tiles(backend: str, platform: str) -> dict[str, int | bool]:
    """EngineConfig settings (the fields of ``TileDefaults``) of ``backend`` on ``platform``."""
    return dataclasses.asdict(get_backend(backend).tiles_for(platform))


register_backend(REFERENCE)
for _impl, _backend in PREFILL_VARIANTS.items():  # "pallas": today's Pallas kernels, whichever lowering serves best
    register_backend(_backend, *(("pallas",) if _impl == ATTENTION_PREFILL_IMPL else ()))
register_backend(PALLAS_TRITON_UNFUSED, "pallas-unfused")
