"""GPU path against the CPU reference path, on the GPU machine.

Builds a small random-weight Llama model (and a Qwen3 one), runs the same greedy requests
through the engine on CPU (PyTorch reference kernels), on CUDA eagerly (Triton kernels)
and on CUDA with decode CUDA graphs, and compares:
- float32: the token ids must be identical;
- bfloat16: per-position logprobs of the chosen tokens agree within bf16 tolerance, and the
  fraction of identical tokens is reported (greedy paths may fork after a near tie).

    python loadtest/gpu_correctness.py --out $OUT/gpu_correctness.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import build_tiny_model

from meshserve.services.worker.engine.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.sampling_params import SamplingParams

LENGTHS = [1, 5, 17, 64, 130, 300, 33, 2, 90, 250, 16, 48]


def run(folder: Path, device: str, dtype: str, eager: bool, prompts: list[list[int]],
        max_tokens: int) -> dict[str, tuple[list[int], list[float]]]:
    engine = LLMEngine(EngineConfig(model=str(folder), device=device, dtype=dtype,
                                    enforce_eager=eager, num_kv_blocks=512,
                                    max_num_batched_tokens=256, max_num_seqs=16))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens, lps = out.setdefault(o.request_id, ([], []))
            tokens.extend(o.new_token_ids)
            lps.extend(lp.logprob for lp in o.new_logprobs or [])
    return out


def compare(ref, got) -> dict[str, float]:
    same = sum(ref[k][0] == got[k][0] for k in ref)
    prefix = []
    worst = 0.0
    for k in ref:
        a, b = ref[k][0], got[k][0]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(n / len(a))
        for x, y in zip(ref[k][1][:n], got[k][1][:n]):  # logprobs while the paths agree
            worst = max(worst, abs(x - y))
    return {"identical_sequences": same / len(ref), "mean_agreeing_prefix": sum(prefix)
            / len(prefix), "max_abs_logprob_diff_on_shared_prefix": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for arch, head_dim in (("llama", 64), ("qwen3", 128)):
        with tempfile.TemporaryDirectory() as tmp:
            folder = build_tiny_model(Path(tmp), arch, seed=11, hidden_size=256,
                                      num_attention_heads=8, num_key_value_heads=2,
                                      head_dim=head_dim, intermediate_size=512,
                                      num_hidden_layers=4, max_position_embeddings=1024)
            rng = random.Random(3)
            prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in LENGTHS]
            cpu = run(folder, "cpu", "float32", True, prompts, args.max_tokens)
            row = {}
            for name, dtype, eager in (("cuda_eager_fp32", "float32", True),
                                       ("cuda_graphs_fp32", "float32", False),
                                       ("cuda_eager_bf16", "bfloat16", True),
                                       ("cuda_graphs_bf16", "bfloat16", False)):
                row[name] = compare(cpu, run(folder, "cuda", dtype, eager, prompts,
                                             args.max_tokens))
                print(arch, name, row[name], flush=True)
            results[arch] = row
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
