"""Model configuration read from a Hugging Face ``config.json`` (Llama family, Mistral included)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

# Projection order used everywhere (adapter tables, pool rows, kernels).
MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_INDEX = {name: i for i, name in enumerate(MODULES)}
ATTN_MODULES = MODULES[:4]


def module_key(layer: int, module: str) -> str:
    """A projection's HF module name, e.g. ``model.layers.3.self_attn.q_proj`` (what PEFT patterns match)."""
    return f"model.layers.{layer}.{'self_attn' if module in ATTN_MODULES else 'mlp'}.{module}"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 1
    eos_token_id: tuple[int, ...] = (2,)
    name: str = "llama"
    sliding_window: int | None = None  # Mistral's attention window (None: full causal attention, all we compute)

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    def module_dims(self, module: str) -> tuple[int, int]:
        """(d_in, d_out) of a projection, as ``x @ W`` with W of shape [d_in, d_out]."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_width),
            "k_proj": (h, self.kv_width),
            "v_proj": (h, self.kv_width),
            "o_proj": (self.q_width, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[module]

    @classmethod
    def from_dict(cls, d: dict, name: str = "llama") -> ModelConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "mistral"):
            raise ValueError(f"unsupported model_type {model_type!r}: only llama and mistral are supported")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias are not supported")
        if d.get("hidden_act", "silu") not in ("silu", "swish"):  # the MLP computes SiLU(gate) * up
            raise ValueError(f"hidden_act {d.get('hidden_act')!r} is not supported (only silu)")
        # HF's MistralConfig windows attention at 4096 tokens when the key is absent; null means no window
        window = d.get("sliding_window", 4096) if model_type == "mistral" else d.get("sliding_window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rs = d.get("rope_scaling") or d.get("rope_parameters")
        rope_theta = d.get("rope_theta")
        scaling = None
        if rs:
            rope_theta = rope_theta or rs.get("rope_theta")
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "llama3":
                scaling = RopeScaling(
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs["low_freq_factor"]),
                    high_freq_factor=float(rs["high_freq_factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                )
            elif kind not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}")
        eos = d.get("eos_token_id", 2)
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),  # HF's LlamaConfig / MistralConfig default
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            name=name,
            sliding_window=window,
        )

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        with open(path / "config.json") as f:
            return cls.from_dict(json.load(f), name=path.name)

    def to_hf_dict(self) -> dict:
        """The ``config.json`` HF transformers reads for this model."""
        d = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return d
