"""The Mosaic GPU prefill attention inside the engine's jitted step (Hopper only; skipped elsewhere).

Alone the Mosaic kernel was right, but inside the 7B step its custom call refused an operand: XLA passed the tile
map, a static slice of the packed step inputs, as a pointer into that buffer, off the 256-byte boundary Mosaic GPU
requires (NOTES, session 18). This runs whole prefill steps of >= MOSAIC_PREFILL_MIN_ROWS rows through the
``pallas-auto-prefill`` backend and checks every prompt token's log-probability against the Triton backend's on the
same weights (the Triton step is checked against HF PEFT on CPU by the engine tests).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backends
from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams
from slora_jax.lora.synthetic import SyntheticAdapterSource
from slora_jax.model.config import ATTN_MODULES, ModelConfig
from slora_jax.model.llama import init_params

ON_HOPPER = jax.default_backend() == "gpu" and backends.mosaic_prefill_platform()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU with Mosaic GPU")]

# head_dim 128 and a bf16 pool: the shapes the Mosaic kernel takes; GQA (4 query heads on 2 KV heads)
CFG = ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096)
ECFG = EngineConfig(max_batch_size=4, max_prefill_tokens=4096, max_prefill_seqs=4, max_model_len=4096,
                    page_size=16, max_lora_rank=16, max_loras=2, pool_bytes=256 << 20, dtype="bfloat16")


def _prompt_logprobs(backend: str, params, prompts, adapters, seed: int) -> list[np.ndarray]:
    """Every prompt token's log-probability after the first, per prompt, from a fresh engine on ``backend``."""
    eng = Engine(CFG, params, dataclasses.replace(ECFG, backend=backend))
    eng.store.register("a", SyntheticAdapterSource(CFG, 8, tuple(ATTN_MODULES), seed=seed))
    sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    rids = [eng.add_request(p, a, sampling) for p, a in zip(prompts, adapters, strict=True)]
    got: dict[str, list] = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.error is None, out.error
            if out.prompt_logprobs is not None:
                got[out.request_id] = out.prompt_logprobs
    return [np.array([t.logprob for t in got[r][1:]], np.float32) for r in rids]


def test_prefill_steps_through_mosaic_match_triton(monkeypatch):
    rng = np.random.default_rng()
    params = init_params(CFG, jax.random.PRNGKey(int(rng.integers(1 << 30))), jnp.bfloat16)
    mosaic_calls = []
    real = backends._mosaic_prefill_attention

    def counted(q, *args, **kw):  # traced once per compiled step: proves the Mosaic path was taken
        mosaic_calls.append(q.shape)
        return real(q, *args, **kw)

    monkeypatch.setattr(backends, "_mosaic_prefill_attention", counted)
    # one step of 2300 + 700 tokens (a 4096-row bucket; one sequence on an adapter), then 2000 alone (2048 rows)
    prompts = [rng.integers(3, CFG.vocab_size, n).tolist() for n in (2300, 700, 2000)]
    adapters = ["a", None, "a"]
    seed = int(rng.integers(1 << 30))
    want = _prompt_logprobs("pallas-triton", params, prompts, adapters, seed)
    assert not mosaic_calls
    got = _prompt_logprobs("pallas-auto-prefill", params, prompts, adapters, seed)
    assert mosaic_calls and all(shape[0] >= backends.MOSAIC_PREFILL_MIN_ROWS for shape in mosaic_calls)
    for w, g, p in zip(want, got, prompts, strict=True):
        assert g.shape == w.shape == (len(p) - 1,)
        assert np.isfinite(g).all()
        assert np.std(w) > 0.2, "log-probs nearly flat: the comparison would prove little"
        # bf16 activations through two attention kernels: per-token log-probs agree to a few hundredths (a wrong
        # attention moves them by about their spread, ~1)
        assert np.max(np.abs(g - w)) < 0.3, np.max(np.abs(g - w))
        assert np.mean(np.abs(g - w)) < 0.03, np.mean(np.abs(g - w))
