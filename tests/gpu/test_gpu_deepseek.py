"""DeepSeek-V2 and V3 on the GPU: the Triton latent attention kernel (kernels/triton_mla.py) at
the published models' shape against the PyTorch reference, then tiny models' greedy outputs on
CUDA (eager, and with the decode and piecewise CUDA graphs) against the CPU path. The prompts
run past the engine's 256-token step, so prefill is chunked over a cached prefix, and the
longest one decodes alone past 512 keys, where eager decode splits its keys (split-KV); the
decode graphs split at every step (their steps are shaped for the longest context).
Figures go to $GPU_TEST_OUT/deepseek_*.json.

In float32 the tokens must be the CPU path's exactly; bfloat16 is recorded beside them and
held to the suite's bf16 logprob bound on the shared prefix."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gpu_record import record
from latent_steps import make_latent_step
from test_gpu_engine_paths import fp32_failures_against_cpu
from tiny_models import build_tiny_model

from meshserve.kernels import triton_mla

# (context lengths, query lengths) at R = 512, P = 64 (DeepSeek-V2/V3's latent row).
KERNEL_CASES = {
    "decode": ([1, 700, 2100, 33], [1, 1, 1, 1]),
    "lone-long-decode": ([3000], [1]),  # split-KV chosen
    "chunk-over-prefix": ([300, 90], [64, 90]),
    "fresh-prefill": ([257], [257]),
}


@pytest.mark.parametrize("heads", [16, 128])  # V2-Lite's, and V2's and V3's
def test_gpu_latent_kernel_at_deepseek_shape(heads: int) -> None:
    figures = {}
    for case, (ctx_lens, q_lens) in KERNEL_CASES.items():
        for dtype in (torch.float32, torch.bfloat16):
            step = make_latent_step(ctx_lens, q_lens, heads, 512, 64, 16, dtype=dtype,
                                    seed=heads).to("cuda")
            out = triton_mla.mla_attention(step.query, step.k_cache, step.v_cache, step.meta,
                                           step.scale, step.rank).float().cpu()
            want = step.reference()
            rel = float((out - want).norm() / want.norm())
            worst = float((out - want).abs().max())
            figures[f"{case}_{str(dtype).removeprefix('torch.')}"] = {"rel": rel,
                                                                      "max_abs": worst}
            if dtype == torch.float32:
                torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
            else:
                assert rel < 5e-3 and worst < 2.5e-2, (case, rel, worst)
    record(f"deepseek_kernel_{heads}_heads", {"gpu": torch.cuda.get_device_name(0), **figures})


# Setup -> (tiny_models arch, config overrides): V2 with q_lora_rank and grouped routing, V3
# (interleaved RoPE pairs), and V3 with NeoX RoPE halves (the Triton rotary kernel) and a
# plain q_proj.
SETUPS = {
    "v2": ("deepseek_v2", {}),
    "v3": ("deepseek_v3", {}),
    "v3_neox_q_proj": ("deepseek_v3", {"rope_interleave": False, "q_lora_rank": None}),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_gpu_deepseek_paths_match_cpu(setup: str, tmp_path: Path) -> None:
    arch, overrides = SETUPS[setup]
    folder = build_tiny_model(tmp_path, arch, seed=5, max_position_embeddings=1024, **overrides)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (1, 9, 40, 130, 3, 77, 520)]
    failures = fp32_failures_against_cpu(folder, prompts, 24, f"deepseek_paths_{setup}")
    assert not failures, "\n".join(failures[:20])
