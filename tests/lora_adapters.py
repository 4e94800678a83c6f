"""PEFT LoRA adapters for the tiny test models, written by peft itself (the reference)."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(base: Path, out: Path, *, seed: int, rank: int = 8, alpha: int = 16,
                  targets: list[str] | None = None, use_rslora: bool = False) -> Path:
    """Save a LoRA adapter of the model folder `base` with random non-zero A and B (PEFT
    starts B at zero, which would make the adapter a no-op)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                        lora_dropout=0.0, use_rslora=use_rslora, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path) -> torch.nn.Module:
    """transformers + peft with the adapter applied: the reference for the engine."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).eval()


def greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    """The model's greedy continuation of `prompt` (exactly `max_new` tokens)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()
