"""LLaVA-1.5 against transformers on the same weights and images.

A tiny random folder written by transformers itself (tests/tiny_vlm.py: a 2-layer CLIP tower
of 16 patches, the projector, a 2-layer Llama): chats with one image, two images of other
sizes, images across turns, and text only, rendered by transformers' processor. transformers'
greedy `generate` and its logits are the reference, through the whole engine: batched and
staggered requests, chunked prefill that cuts through an image's placeholder run, prefix-cache
hits on a repeated image (and none past a changed one), preemption; then what is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from test_engine_vs_hf import make_engine, tokens_of
from tiny_models import build_tiny_model
from tiny_vlm import build_tiny_vlm
from transformers import AutoModelForImageTextToText, AutoProcessor
from vlm_reference import hf_vlm_greedy, hf_vlm_logits, image_file, run_cases, vlm_case

from meshserve.services.worker.engine.images import PromptImage
from meshserve.services.worker.models.llava import LlavaForConditionalGeneration
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
IMAGE = {"type": "image"}


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


# A system turn long enough that the image starts past the first 8-token block.
FIRST = [{"role": "system", "content": "You look very closely at pictures, at their colours, "
                                       "their shapes and their edges, before you answer."},
         {"role": "user", "content": [IMAGE, _text("What is in it?")]}]


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory):
    folder = build_tiny_vlm(tmp_path_factory.mktemp("llava"), "llava", seed=3)
    processor = AutoProcessor.from_pretrained(folder)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    token = hf.config.image_token_index
    wide, tall, square = image_file(80, 60, 1), image_file(40, 90, 2, "JPEG"), image_file(
        56, 56, 3)
    chats = [
        (FIRST, [wide]),
        ([{"role": "user", "content": [_text("Compare "), IMAGE, _text(" with "), IMAGE,
                                        _text(".")]}], [tall, square]),
        ([{"role": "user", "content": [IMAGE, _text("Describe it.")]},
          {"role": "assistant", "content": [_text("A pattern of dots.")]},
          {"role": "user", "content": [_text("And this one?"), IMAGE]}], [square, wide]),
        ([{"role": "user", "content": [_text("No picture today, only words.")]}], []),
    ]
    cases = [vlm_case(processor, token, messages, files) for messages, files in chats]
    expected = [hf_vlm_greedy(hf, case, MAX_NEW) for case in cases]
    return folder, hf, processor, cases, expected


@pytest.mark.parametrize("setup", [
    {"max_num_batched_tokens": 20},  # chunks end inside images' 16-token runs
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
])
@pytest.mark.parametrize("stagger", [False, True])
def test_greedy_tokens_equal_transformers(llava, setup: dict, stagger: bool) -> None:
    folder, _, _, cases, expected = llava
    engine = make_engine(folder, **setup)
    assert isinstance(engine.runner.model, LlavaForConditionalGeneration)
    assert all(len(want) == MAX_NEW for want in expected)
    assert len({tuple(want) for want in expected}) == len(expected)
    outputs = run_cases(engine, cases, GREEDY, stagger=stagger)
    assert [tokens_of(outputs[f"r{i}"]) for i in range(len(cases))] == expected
    assert engine.kv.num_free_blocks == 256


def test_logprobs_equal_transformers_log_softmax(llava) -> None:
    folder, hf, _, cases, _ = llava
    engine = make_engine(folder, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outputs = run_cases(engine, cases, params)
    for i, case in enumerate(cases):
        generated = tokens_of(outputs[f"r{i}"])
        reference = torch.log_softmax(hf_vlm_logits(hf, case, generated), -1)
        logprobs = [lp for out in outputs[f"r{i}"] for lp in (out.new_logprobs or [])]
        assert len(logprobs) == MAX_NEW
        for k, lp in enumerate(logprobs):
            row = reference[len(case.token_ids) - 1 + k]
            assert abs(lp.logprob - row[generated[k]].item()) < 1e-4
            assert [t for t, _ in lp.top] == torch.topk(row, 5).indices.tolist()


def test_a_repeated_image_hits_the_prefix_cache_and_a_changed_one_does_not(llava) -> None:
    folder, hf, processor, cases, expected = llava
    engine = make_engine(folder, block_size=8)
    first = run_cases(engine, [cases[0]], GREEDY, prefix="a")
    assert tokens_of(first["a0"]) == expected[0]
    encoder = engine.runner.images
    assert encoder is not None and (encoder.misses, encoder.hits) == (1, 0)
    # The same chat again: every full block is cached, the image's included.
    again = run_cases(engine, [cases[0]], GREEDY, prefix="b")
    assert tokens_of(again["b0"]) == expected[0]
    whole = (len(cases[0].token_ids) - 1) // 8 * 8
    assert again["b0"][-1].num_cached_tokens == whole
    # The same text over another image of the same size: blocks up to the image only.
    other = image_file(80, 60, 99)
    changed = vlm_case(processor, hf.config.image_token_index,
                       FIRST, [other])
    assert changed.token_ids == cases[0].token_ids
    out = run_cases(engine, [changed], GREEDY, prefix="c")
    image = changed.images[0]
    assert image.offset >= 8
    assert out["c0"][-1].num_cached_tokens == image.offset // 8 * 8
    assert tokens_of(out["c0"]) == hf_vlm_greedy(hf, changed, MAX_NEW) != expected[0]


def test_preempted_sequences_recompute_their_images(llava) -> None:
    folder, _, _, cases, expected = llava
    engine = make_engine(folder, num_kv_blocks=14, max_num_batched_tokens=24)
    preempted: set[str] = set()
    original = engine.scheduler._preempt

    def spy(request, out):
        preempted.add(request.request_id)
        original(request, out)

    engine.scheduler._preempt = spy  # type: ignore[method-assign]
    outputs = run_cases(engine, cases[:3], GREEDY)
    assert preempted, "a 14-block cache must force preemption"
    assert [tokens_of(outputs[f"r{i}"]) for i in range(3)] == expected[:3]
    assert engine.kv.num_free_blocks == 14


def test_bad_images_fail_their_request_alone(llava, tmp_path) -> None:
    folder, _, _, cases, expected = llava
    engine = make_engine(folder)
    image = cases[0].images[0]
    broken = b"not an image at all"
    bad = {
        "count": dataclasses.replace(image, length=image.length - 1),
        "hash": dataclasses.replace(image, digest=bytes(32)),
        "bytes": PromptImage(broken, hashlib.sha256(broken).digest(), image.offset,
                             image.length),
        "outside": dataclasses.replace(image, offset=len(cases[0].token_ids)),
    }
    messages = {"count": "becomes 16 embedding rows but the prompt has 15",
                "hash": "not the file's SHA-256", "bytes": "does not decode as an image",
                "outside": "inside the prompt"}
    for name, wrong in bad.items():
        with pytest.raises(InvalidRequestError, match=messages[name]):
            engine.add_request(name, cases[0].token_ids, GREEDY, images=[wrong])
    outputs = run_cases(engine, cases[:1], GREEDY)  # the engine serves on
    assert tokens_of(outputs["r0"]) == expected[0]
    text_only = make_engine(build_tiny_model(tmp_path / "llama", "llama"))
    with pytest.raises(InvalidRequestError, match="does not take images"):
        text_only.add_request("t", [5] * 20, GREEDY, images=[dataclasses.replace(
            image, offset=0)])


def test_image_counters_reach_metrics(llava) -> None:
    from prometheus_client import CollectorRegistry

    from meshserve.services.worker.serving.image_metrics import register_image_metrics

    folder, _, _, cases, _ = llava
    engine = make_engine(folder)
    registry = CollectorRegistry()
    register_image_metrics(registry, engine.runner.images, "tiny")
    run_cases(engine, [cases[0], cases[2]], GREEDY)  # images: wide; square, wide
    run_cases(engine, [cases[1]], GREEDY, prefix="again")  # tall, square
    labels = {"model_name": "tiny"}
    value = registry.get_sample_value
    # One step needs wide and square (wide twice: one query), both new; the next needs tall,
    # new, and square, cached.
    assert value("vllm:mm_cache_queries_total", labels) == 4
    assert value("vllm:mm_cache_hits_total", labels) == 1
    assert value("meshserve:worker_images_encoded_total", {**labels, "where": "worker"}) == 3
    assert value("meshserve:worker_images_encoded_total", {**labels, "where": "encoder"}) == 0
    assert value("meshserve:worker_image_encode_seconds_total", labels) > 0
    assert value("meshserve:worker_image_cache_bytes", labels) == 3 * 16 * 64 * 4
