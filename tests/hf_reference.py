"""HF transformers + PEFT as the independent reference (torch, CPU, float32). Imported by tests only."""

from __future__ import annotations

import numpy as np
import torch
from peft import PeftModel
from transformers import LlamaForCausalLM


def hf_model(model_dir) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logits(model_dir, prompt: list[int], adapter_dir=None) -> np.ndarray:
    """Logits [len, vocab] of ``prompt`` with the adapter alone (a fresh model each call: nothing leaks)."""
    model = hf_model(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].numpy()


def hf_generate(model_dir, prompt: list[int], max_new_tokens: int, adapter_dir=None) -> list[int]:
    """Greedy continuation with PEFT ``generate`` (EOS ignored, exactly ``max_new_tokens``)."""
    model = hf_model(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())
