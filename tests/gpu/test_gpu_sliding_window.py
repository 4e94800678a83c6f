"""Models whose every layer slides, on the GPU, in a KV cache smaller than their sequences:
the blocks behind the window are freed as sequences advance and their block-table entries
hold a placeholder, which neither the Triton kernel (eager, piecewise or in a decode CUDA
graph) nor anything else may read. Greedy tokens of a Gemma 3 whose layers all slide and of
a Mistral with a sliding window, on CUDA in float32 (eager and with CUDA graphs), must equal
the CPU path's, with 8-token blocks, 16 of them, for sequences of up to 230 tokens.
Figures go to $GPU_TEST_OUT/sliding_window_*.json."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gpu_record import record
from tiny_models import build_tiny_model

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.sampling_params import SamplingParams

ARCHS = {
    "gemma3": {"layer_types": ["sliding_attention"] * 4, "sliding_window": 12},
    "mistral": {"sliding_window": 20},
}


def run(folder: Path, device: str, eager: bool, prompts: list[list[int]]
        ) -> tuple[dict[str, list[int]], int]:
    """Each request's greedy tokens, and the most blocks any sequence held at once."""
    engine = build_engine(EngineConfig(
        model=str(folder), device=device, dtype="float32", enforce_eager=eager,
        block_size=8, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=4))
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out: dict[str, list[int]] = {}
    most = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        most = max([most] + [engine.kv.num_held_blocks(s.request_id)
                             for s in engine.scheduler.running])
    assert engine.kv.num_free_blocks == 16
    return out, most


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gpu_sliding_window_frees_blocks_and_matches_cpu(arch: str, tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, arch, seed=5, max_position_embeddings=1024,
                              **ARCHS[arch])
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (5, 40, 130, 77)]
    cpu, _ = run(folder, "cpu", True, prompts)
    row: dict[str, object] = {"gpu": torch.cuda.get_device_name(0)}
    for name, eager in (("cuda_eager_fp32", True), ("cuda_graphs_fp32", False)):
        got, most = run(folder, "cuda", eager, prompts)
        same = [key for key in cpu if got[key] == cpu[key]]
        row[name] = {"identical": len(same), "of": len(cpu), "most_blocks_held": most}
        assert len(same) == len(cpu), f"{name}: {sorted(set(cpu) - set(same))} differ"
        assert most < 16
    record(f"sliding_window_{arch}", row)
