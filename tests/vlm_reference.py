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

IMAGE = {"type": "image"}


def text_part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


# A system turn long enough that the image starts past the first 8-token block.
FIRST_CHAT = [
    {"role": "system", "content": "You look very closely at pictures, at their colours, "
                                  "their shapes and their edges, before you answer."},
    {"role": "user", "content": [IMAGE, text_part("What is in it?")]}]


def standard_chats(a: bytes, b: bytes, c: bytes
                   ) -> list[tuple[list[dict[str, Any]], list[bytes]]]:
    """Four chats over images a, b, c: one image after a system turn (FIRST_CHAT, a), two
    in one turn (b, c), one in each of two user turns (c, a), and text only."""
    return [
        (FIRST_CHAT, [a]),
        ([{"role": "user", "content": [text_part("Compare "), IMAGE, text_part(" with "),
                                        IMAGE, text_part(".")]}], [b, c]),
        ([{"role": "user", "content": [IMAGE, text_part("Describe it.")]},
          {"role": "assistant", "content": [text_part("A pattern of dots.")]},
          {"role": "user", "content": [text_part("And this one?"), IMAGE]}], [c, a]),
        ([{"role": "user", "content": [text_part("No picture today, only words.")]}], []),
    ]


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


# -- checks the vision-language engine tests share ----------------------------------------


def tokens_of(outputs: list[SequenceOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def greedy(max_new: int, **more: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, **more)


def check_vlm_greedy(engine: LLMEngine, cases: list[VlmCase], expected: list[list[int]], *,
                     stagger: bool = False) -> None:
    """Greedy tokens of every case equal `expected` (distinct answers, so that a swap
    shows), and every KV block is free again after."""
    max_new = len(expected[0])
    assert all(len(want) == max_new for want in expected)
    assert len({tuple(want) for want in expected}) == len(expected)
    free = engine.kv.num_free_blocks
    outputs = run_cases(engine, cases, greedy(max_new), stagger=stagger)
    assert [tokens_of(outputs[f"r{i}"]) for i in range(len(cases))] == expected
    assert engine.kv.num_free_blocks == free


def check_vlm_logprobs(hf: torch.nn.Module, case: VlmCase, outs: list[SequenceOutput],
                       max_new: int) -> None:
    """Each chosen token's logprob within 1e-4 of transformers' log-softmax, and the top 5
    in its order."""
    generated = tokens_of(outs)
    reference = torch.log_softmax(hf_vlm_logits(hf, case, generated), -1)
    logprobs = [lp for out in outs for lp in (out.new_logprobs or [])]
    assert len(logprobs) == max_new
    for k, lp in enumerate(logprobs):
        row = reference[len(case.token_ids) - 1 + k]
        assert abs(lp.logprob - row[generated[k]].item()) < 1e-4
        assert [t for t, _ in lp.top] == torch.topk(row, 5).indices.tolist()


def check_all_vlm_logprobs(engine: LLMEngine, hf: torch.nn.Module, cases: list[VlmCase],
                           max_new: int) -> None:
    outputs = run_cases(engine, cases, greedy(max_new, logprobs=5))
    for i, case in enumerate(cases):
        check_vlm_logprobs(hf, case, outputs[f"r{i}"], max_new)


def check_repeated_image(engine: LLMEngine, hf: torch.nn.Module, case: VlmCase,
                         changed: VlmCase, expected: list[int], block_size: int) -> None:
    """`case` twice: the second finds every full block cached, its image's included; then
    `changed` (the same text over another image): blocks up to the image only, and
    transformers' answer to it, another than `case`'s."""
    max_new = len(expected)
    first = run_cases(engine, [case], greedy(max_new), prefix="a")
    assert tokens_of(first["a0"]) == expected
    encoder = engine.runner.images
    assert encoder is not None and (encoder.misses, encoder.hits) == (1, 0)
    again = run_cases(engine, [case], greedy(max_new), prefix="b")
    assert tokens_of(again["b0"]) == expected
    whole = (len(case.token_ids) - 1) // block_size * block_size
    assert again["b0"][-1].num_cached_tokens == whole
    assert changed.token_ids == case.token_ids
    out = run_cases(engine, [changed], greedy(max_new), prefix="c")
    image = changed.images[0]
    assert image.offset >= block_size
    assert out["c0"][-1].num_cached_tokens == image.offset // block_size * block_size
    assert tokens_of(out["c0"]) == hf_vlm_greedy(hf, changed, max_new) != expected


def check_vlm_preemption(engine: LLMEngine, cases: list[VlmCase],
                         expected: list[list[int]]) -> None:
    """Run `cases` at once on an engine whose cache cannot hold them all: some sequence
    is preempted (its images recomputed later), every answer still equals `expected` and
    every block is free at the end."""
    preempted: set[str] = set()
    original = engine.scheduler._preempt

    def spy(request: Any, out: Any) -> None:
        preempted.add(request.request_id)
        original(request, out)

    engine.scheduler._preempt = spy  # type: ignore[method-assign]
    blocks = engine.kv.num_free_blocks
    outputs = run_cases(engine, cases, greedy(len(expected[0])))
    assert preempted, f"a {blocks}-block cache must force preemption"
    assert [tokens_of(outputs[f"r{i}"]) for i in range(len(cases))] == expected
    assert engine.kv.num_free_blocks == blocks
