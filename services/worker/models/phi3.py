"""Phi-3, Phi-3.5 and Phi-4-mini (`Phi3ForCausalLM`): the Llama-family decoder of llama.py.

transformers' Phi-3 is Llama with q/k/v and gate/up already fused in the checkpoint
(`self_attn.qkv_proj`, `mlp.gate_up_proj`: gate rows, then up rows), which are the parameters
llama.py fuses into, so the checkpoint names map one to one. What else sets Phi-3 apart is read
from its config by `ModelConfig`: LongRoPE (`rope_scaling` type "longrope", kernels/rotary.py),
`partial_rotary_factor` (Phi-4-mini rotates 3/4 of each head) and `sliding_window` (Phi-3-mini-4k:
2047), which slides every layer as Mistral's does (`ModelConfig.layer_windows`, applied by
llama.py's attention; the blocks behind the window are freed as a sequence advances).
"""

from __future__ import annotations

from meshserve.services.worker.models.llama import CausalLM


class Phi3ForCausalLM(CausalLM):
    """A Phi-3 decoder over the paged KV cache."""

    def checkpoint_layout(self) -> dict[str, tuple[str, int, int]]:
        """Hugging Face tensor name -> (parameter name, first row, number of rows): the same
        names, each tensor whole."""
        return {name: (name, 0, param.shape[0]) for name, param in self.named_parameters()}
