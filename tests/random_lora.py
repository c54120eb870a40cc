"""Random LoRA adapters for tests that need weights but no PEFT dir (pool placement, the adapter store)."""

from __future__ import annotations

import numpy as np

from slora_jax.model.adapter_weights import LoraAdapter, LoraModule
from slora_jax.model.config import MODULES, ModelConfig


def random_adapter(cfg: ModelConfig, rng: np.random.Generator, name: str, ranks=(2, 4, 8), targets=MODULES,
                   p_absent: float = 0.0) -> LoraAdapter:
    """Unit-normal A and B and a random scale for each (layer, target), each pair left out with probability
    ``p_absent`` (at least one is kept); each pair's rank drawn from ``ranks``."""

    def module(mod: str, rank: int) -> LoraModule:
        d_in, d_out = cfg.module_dims(mod)
        return LoraModule(a=rng.standard_normal((d_in, rank)).astype(np.float32),
                          b=rng.standard_normal((rank, d_out)).astype(np.float32), scale=float(rng.uniform(0.5, 4.0)))

    modules = {}
    for layer in range(cfg.num_hidden_layers):
        for mod in targets:
            if rng.random() >= p_absent:
                modules[(layer, mod)] = module(mod, int(rng.choice(ranks)))
    if not modules:
        modules[(0, targets[0])] = module(targets[0], int(ranks[0]))
    return LoraAdapter(name=name, modules=modules)
