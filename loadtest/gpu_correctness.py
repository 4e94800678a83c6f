"""GPU path against the CPU reference path, on the GPU machine, with pass/fail bounds.

Builds a small random-weight Llama model (and a Qwen3 one), runs the same greedy requests
through the engine on CPU (PyTorch reference kernels, float32) and on CUDA (Triton kernels,
eager and with decode CUDA graphs, the overlapped loop on and off), and checks:
- float32: token ids identical to the CPU path's, chosen-token logprobs within 1e-3;
- bfloat16 (vLLM's "logprobs close" rule): until the first differing token the chosen
  tokens' logprobs agree within BF16_LOGPROB_TOL nats, and at the first differing token
  each path's token is among the other path's top-5 there (the paths forked at a near
  tie, not at a wrong answer); after a fork the contexts differ and nothing is compared;
- the overlapped loop gives the same tokens and logprobs as the synchronous one, exactly.

Prints one line per check and a last line "N passed, M failed"; exits 1 if any failed.

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
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import SamplingParams

LENGTHS = [1, 5, 17, 64, 130, 300, 33, 2, 90, 250, 16, 48]
TOP = 5
FP32_LOGPROB_TOL = 1e-3
BF16_LOGPROB_TOL = 0.1

Outputs = dict[str, list[TokenLogprobs]]


def run(folder: Path, device: str, dtype: str, eager: bool, prompts: list[list[int]],
        max_tokens: int, async_scheduling: str = "auto") -> Outputs:
    engine = LLMEngine(EngineConfig(model=str(folder), device=device, dtype=dtype,
                                    enforce_eager=eager, num_kv_blocks=512,
                                    max_num_batched_tokens=256, max_num_seqs=16,
                                    async_scheduling=async_scheduling))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=TOP)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out: Outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_logprobs or [])
    return out


def compare(ref: Outputs, got: Outputs, tol: float, exact_tokens: bool) -> dict[str, object]:
    """Agreement figures and failures of `got` against `ref` (see the module docstring)."""
    failures: list[str] = []
    identical, prefix, worst = 0, [], 0.0
    for key in ref:
        a, b = ref[key], got[key]
        if len(a) != len(b):
            failures.append(f"{key}: {len(b)} tokens, want {len(a)}")
            continue
        fork = next((i for i, (x, y) in enumerate(zip(a, b)) if x.token_id != y.token_id),
                    len(a))
        identical += fork == len(a)
        prefix.append(fork / len(a))
        for i in range(fork):  # logprobs while the paths agree
            diff = abs(a[i].logprob - b[i].logprob)
            worst = max(worst, diff)
            if diff > tol:
                failures.append(f"{key}[{i}]: logprob differs by {diff:.4f} > {tol}")
        if fork < len(a):
            if exact_tokens:
                failures.append(f"{key}: tokens differ from position {fork}")
                continue
            x, y = a[fork], b[fork]
            if (x.token_id not in {t for t, _ in y.top}
                    or y.token_id not in {t for t, _ in x.top}):
                failures.append(f"{key}[{fork}]: fork to {y.token_id} (want {x.token_id}) is "
                                f"not a near tie: outside the top-{TOP} of the other path")
    return {"identical_sequences": identical / len(ref),
            "mean_agreeing_prefix": sum(prefix) / max(len(prefix), 1),
            "max_abs_logprob_diff_on_shared_prefix": worst, "failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(0),
                                  "torch": torch.__version__,
                                  "bounds": {"fp32_logprob": FP32_LOGPROB_TOL,
                                             "bf16_logprob": BF16_LOGPROB_TOL, "top": TOP}}
    passed = failed = 0
    for arch, head_dim in (("llama", 64), ("qwen3", 128)):
        with tempfile.TemporaryDirectory() as tmp:
            folder = build_tiny_model(Path(tmp), arch, seed=11, hidden_size=256,
                                      num_attention_heads=8, num_key_value_heads=2,
                                      head_dim=head_dim, intermediate_size=512,
                                      num_hidden_layers=4, max_position_embeddings=1024)
            rng = random.Random(3)
            prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in LENGTHS]
            cpu = run(folder, "cpu", "float32", True, prompts, args.max_tokens)
            row: dict[str, object] = {}
            runs: dict[str, Outputs] = {}
            for name, dtype, eager, overlap in (
                    ("cuda_eager_fp32", "float32", True, "on"),
                    ("cuda_graphs_fp32", "float32", False, "on"),
                    ("cuda_eager_bf16", "bfloat16", True, "on"),
                    ("cuda_graphs_bf16", "bfloat16", False, "on"),
                    ("cuda_graphs_bf16_sync", "bfloat16", False, "off")):
                runs[name] = run(folder, "cuda", dtype, eager, prompts, args.max_tokens, overlap)
                fp32 = dtype == "float32"
                row[name] = compare(cpu, runs[name], FP32_LOGPROB_TOL if fp32 else
                                    BF16_LOGPROB_TOL, exact_tokens=fp32)
            row["overlapped_vs_sync_bf16"] = compare(runs["cuda_graphs_bf16_sync"],
                                                     runs["cuda_graphs_bf16"], 0.0, True)
            for name, figures in row.items():
                assert isinstance(figures, dict)
                ok = not figures["failures"]
                passed += ok
                failed += not ok
                print(f"{arch} {name}: {'PASS' if ok else 'FAIL'} "
                      f"identical={figures['identical_sequences']:.2f} "
                      f"prefix={figures['mean_agreeing_prefix']:.2f} "
                      f"max_dlogprob={figures['max_abs_logprob_diff_on_shared_prefix']:.4f}"
                      + "".join(f"\n    {f}" for f in figures["failures"][:5]), flush=True)
            results[arch] = row
    print(f"{passed} passed, {failed} failed")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
