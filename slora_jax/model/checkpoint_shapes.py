"""What a checkpoint of a config must hold, checked before any weight is read.

Why: the loaders place each tensor where the config says it goes, and a tensor smaller than its slot fit silently
(the rest stayed zero: ``config.json`` with 4 KV heads over tensors with 2 served finite, wrong logits), or failed
later with an error that named neither the tensor nor the config field. HF refuses such a checkpoint; so do we,
naming both.
"""

from __future__ import annotations

from collections.abc import Mapping

from .config import MODULES, ModelConfig, module_key

_FIELDS = {  # the config fields a projection's shape comes from
    "q_proj": "hidden_size, num_attention_heads, head_dim", "k_proj": "hidden_size, num_key_value_heads, head_dim",
    "v_proj": "hidden_size, num_key_value_heads, head_dim", "o_proj": "hidden_size, num_attention_heads, head_dim",
    "gate_proj": "hidden_size, intermediate_size", "up_proj": "hidden_size, intermediate_size",
    "down_proj": "hidden_size, intermediate_size",
}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF tensor name -> (its shape, the config fields it follows from); kernels as HF stores them, [d_out, d_in].
    ``lm_head.weight`` only when the embeddings are not tied."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": ((v, h), "vocab_size, hidden_size"), "model.norm.weight": ((h,), "hidden_size")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((v, h), "vocab_size, hidden_size")
    for i in range(cfg.num_hidden_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{i}.{norm}.weight"] = ((h,), "hidden_size")
        for m in MODULES:
            d_in, d_out = cfg.module_dims(m)
            out[f"{module_key(i, m)}.weight"] = ((d_out, d_in), _FIELDS[m])
    return out


def check_checkpoint_shapes(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ValueError if a tensor the config needs is missing (``lm_head.weight`` with untied embeddings
    included) or has another shape than the config gives it; the message names the tensor and the fields."""
    for name, (want, fields) in expected_shapes(cfg).items():
        if name not in shapes:
            hint = " (tie_word_embeddings is false in config.json)" if name == "lm_head.weight" else ""
            raise ValueError(f"the checkpoint has no tensor {name!r}{hint}")
        got = tuple(int(d) for d in shapes[name])
        if got != want:
            raise ValueError(f"checkpoint tensor {name!r} has shape {list(got)}, but config.json ({fields}) gives "
                             f"{list(want)}: the config does not describe these weights")
