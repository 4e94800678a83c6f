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

One test per architecture; its figures go to $GPU_TEST_OUT/engine_paths_<arch>.json.
Run by `bash loadtest/gpu.sh tests` and by the part `suite` (step `correctness`).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gpu_record import record
from tiny_models import build_tiny_model

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import SamplingParams

LENGTHS = [1, 5, 17, 64, 130, 300, 33, 2, 90, 250, 16, 48]
TOP = 5
FP32_LOGPROB_TOL = 1e-3
BF16_LOGPROB_TOL = 0.1

Outputs = dict[str, list[TokenLogprobs]]


def run(folder: Path, device: str, dtype: str, eager: bool, prompts: list[list[int]],
        max_tokens: int, async_scheduling: str = "auto") -> Outputs:
    engine = build_engine(EngineConfig(model=str(folder), device=device, dtype=dtype,
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


def fp32_failures_against_cpu(folder: Path, prompts: list[list[int]], max_tokens: int,
                              name: str) -> list[str]:
    """Run `folder` on CPU (float32) and on CUDA (eager fp32, graphs fp32, graphs bf16),
    record each CUDA run's agreement with the CPU as $GPU_TEST_OUT/<name>.json, and return
    the float32 runs' failures (their tokens must equal the CPU's; bf16 is recorded only)."""
    cpu = run(folder, "cpu", "float32", True, prompts, max_tokens)
    row = {}
    for label, dtype, eager in (("cuda_eager_fp32", "float32", True),
                                ("cuda_graphs_fp32", "float32", False),
                                ("cuda_graphs_bf16", "bfloat16", False)):
        got = run(folder, "cuda", dtype, eager, prompts, max_tokens)
        fp32 = dtype == "float32"
        row[label] = compare(cpu, got, FP32_LOGPROB_TOL if fp32 else BF16_LOGPROB_TOL,
                             exact_tokens=fp32)
    record(name, {"gpu": torch.cuda.get_device_name(0), **row})
    return [f"{label}: {failure}" for label, figures in row.items() if "fp32" in label
            for failure in figures["failures"]]  # type: ignore[attr-defined]


@pytest.mark.parametrize("arch, head_dim", [("llama", 64), ("qwen3", 128)])
def test_gpu_paths_match_cpu(arch: str, head_dim: int, tmp_path: Path) -> None:
    max_tokens = 24
    folder = build_tiny_model(tmp_path, arch, seed=11, hidden_size=256,
                              num_attention_heads=8, num_key_value_heads=2,
                              head_dim=head_dim, intermediate_size=512,
                              num_hidden_layers=4, max_position_embeddings=1024)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in LENGTHS]
    cpu = run(folder, "cpu", "float32", True, prompts, max_tokens)
    row: dict[str, dict[str, object]] = {}
    runs: dict[str, Outputs] = {}
    for name, dtype, eager, overlap in (
            ("cuda_eager_fp32", "float32", True, "on"),
            ("cuda_graphs_fp32", "float32", False, "on"),
            ("cuda_eager_bf16", "bfloat16", True, "on"),
            ("cuda_graphs_bf16", "bfloat16", False, "on"),
            ("cuda_graphs_bf16_sync", "bfloat16", False, "off")):
        runs[name] = run(folder, "cuda", dtype, eager, prompts, max_tokens, overlap)
        fp32 = dtype == "float32"
        row[name] = compare(cpu, runs[name], FP32_LOGPROB_TOL if fp32 else BF16_LOGPROB_TOL,
                            exact_tokens=fp32)
    row["overlapped_vs_sync_bf16"] = compare(runs["cuda_graphs_bf16_sync"],
                                             runs["cuda_graphs_bf16"], 0.0, True)
    record(f"engine_paths_{arch}", {
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "bounds": {"fp32_logprob": FP32_LOGPROB_TOL, "bf16_logprob": BF16_LOGPROB_TOL,
                   "top": TOP}, **row})
    failures = [f"{name}: {failure}" for name, figures in row.items()
                for failure in figures["failures"]]  # type: ignore[attr-defined]
    assert not failures, "\n".join(failures[:20])
