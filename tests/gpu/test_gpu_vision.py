"""Vision-language models on the GPU: tiny LLaVA, LLaVA-NeXT, Qwen2.5-VL and Gemma 3 folders
(tests/tiny_vlm.py) answer the standard chats (one image after a system turn, two images of
other sizes, images across turns, text only) on CUDA as on the CPU path. The CUDA runs take
the image steps eagerly and decode in CUDA graphs where asked, so this covers the vision
towers on the GPU, Qwen2.5-VL's M-RoPE rows ([3, T] positions, and the shifted positions of
its decode graphs) and Gemma 3's image lookahead in the Triton attention kernel.

In float32 the tokens must be the CPU path's exactly and the chosen tokens' logprobs within
1e-3; bfloat16 is recorded beside them ($GPU_TEST_OUT/vision_paths_<family>.json)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_record import record
from test_gpu_engine_paths import BF16_LOGPROB_TOL, FP32_LOGPROB_TOL, TOP, Outputs, compare
from tiny_vlm import build_tiny_vlm, load_processor
from transformers import AutoConfig
from vlm_reference import image_file, run_cases, standard_chats, vlm_case

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 16


def run_vlm(folder: Path, cases: list, device: str, dtype: str, eager: bool) -> Outputs:
    engine = build_engine(EngineConfig(model=str(folder), device=device, dtype=dtype,
                                       enforce_eager=eager, num_kv_blocks=512,
                                       max_num_batched_tokens=512, max_num_seqs=8))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                            logprobs=TOP)
    outputs = run_cases(engine, cases, params)
    return {key: [lp for out in outs for lp in (out.new_logprobs or [])]
            for key, outs in outputs.items()}


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_5_vl", "gemma3"])
def test_gpu_vision_paths_match_cpu(family: str, tmp_path: Path) -> None:
    folder = build_tiny_vlm(tmp_path, family, seed=3)
    processor = load_processor(folder)
    token = AutoConfig.from_pretrained(folder).image_token_id
    files = image_file(80, 60, 1), image_file(40, 90, 2, "JPEG"), image_file(150, 100, 3)
    cases = [vlm_case(processor, token, messages, images)
             for messages, images in standard_chats(*files)]
    cpu = run_vlm(folder, cases, "cpu", "float32", True)
    assert len(cpu) == len(cases) and all(len(v) == MAX_NEW for v in cpu.values())
    row: dict[str, dict[str, object]] = {}
    for label, dtype, eager in (("cuda_eager_fp32", "float32", True),
                                ("cuda_graphs_fp32", "float32", False),
                                ("cuda_graphs_bf16", "bfloat16", False)):
        got = run_vlm(folder, cases, "cuda", dtype, eager)
        fp32 = dtype == "float32"
        row[label] = compare(cpu, got, FP32_LOGPROB_TOL if fp32 else BF16_LOGPROB_TOL,
                             exact_tokens=fp32)
    record(f"vision_paths_{family}", {"gpu": torch.cuda.get_device_name(0), **row})
    failures = [f"{label}: {failure}" for label, figures in row.items() if "fp32" in label
                for failure in figures["failures"]]  # type: ignore[attr-defined]
    assert not failures, "\n".join(failures[:20])
