"""Vision-language prompts and transformers' answers to them, for engine and stack tests.

`vlm_case` renders a chat through the model folder's processor (transformers, the
reference), finds each image's run of placeholder tokens in its token ids and keeps what
transformers' `generate` takes; `hf_vlm_greedy` and `hf_vlm_logits` are transformers'
greedy tokens and logits; `run_cases` runs cases through a meshserve engine.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.images import PromptImage
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.shared.sampling_params import SamplingParams


def image_file(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    """An image of random pixels (so that every pixel moves the embeddings), encoded."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


@dataclass
class VlmCase:
    """One chat prompt with images: its token ids, its images as the engine takes them and
    the processor's output transformers' model takes."""

    token_ids: list[int]
    images: list[PromptImage]
    hf_inputs: dict[str, Any]


def placeholder_runs(token_ids: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of `token` in `token_ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(token_ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def vlm_case(processor: Any, image_token: int, messages: list[dict[str, Any]],
             files: list[bytes]) -> VlmCase:
    """The case of `messages` (with `{"type": "image"}` parts) over image `files`."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pictures = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    inputs = dict(processor(text=text, images=pictures or None, return_tensors="pt"))
    ids = inputs["input_ids"][0].tolist()
    runs = placeholder_runs(ids, image_token)
    assert len(runs) == len(files), f"{len(runs)} placeholder runs for {len(files)} images"
    images = [PromptImage(f, hashlib.sha256(f).digest(), offset, length)
              for f, (offset, length) in zip(files, runs, strict=True)]
    return VlmCase(ids, images, inputs)


def hf_vlm_greedy(hf: torch.nn.Module, case: VlmCase, max_new: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**case.hf_inputs, max_new_tokens=max_new, min_new_tokens=max_new,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(case.token_ids):].tolist()


def hf_vlm_logits(hf: torch.nn.Module, case: VlmCase, generated: list[int]) -> torch.Tensor:
    """transformers' logits [len, V] over the prompt and `generated`, in one forward."""
    inputs = dict(case.hf_inputs)
    ids = torch.tensor([case.token_ids + generated])
    inputs["input_ids"] = ids
    inputs["attention_mask"] = torch.ones_like(ids)
    for key in ("token_type_ids", "mm_token_type_ids"):  # generated tokens are text (0)
        if key in inputs:
            inputs[key] = torch.nn.functional.pad(inputs[key], (0, len(generated)))
    with torch.no_grad():
        return hf(**inputs).logits[0].float()


def run_cases(engine: LLMEngine, cases: list[VlmCase], params: SamplingParams, *,
              stagger: bool = False, prefix: str = "r") -> dict[str, list[SequenceOutput]]:
    """Run every case to completion (with `stagger`, each added a step after the one
    before); the outputs of request `{prefix}{i}`."""
    outputs: dict[str, list[SequenceOutput]] = {}
    pending = list(enumerate(cases))
    while pending or engine.has_unfinished_requests():
        for i, case in pending[:1] if stagger else pending:
            engine.add_request(f"{prefix}{i}", case.token_ids, params, images=case.images)
        pending = pending[1:] if stagger else []
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs
