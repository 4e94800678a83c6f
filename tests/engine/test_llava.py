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
from vlm_reference import (
    FIRST_CHAT,
    check_all_vlm_logprobs,
    check_repeated_image,
    check_vlm_greedy,
    check_vlm_preemption,
    hf_vlm_greedy,
    image_file,
    run_cases,
    standard_chats,
    vlm_case,
)

from meshserve.services.worker.engine.images import PromptImage
from meshserve.services.worker.models.llava import LlavaForConditionalGeneration
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory):
    folder = build_tiny_vlm(tmp_path_factory.mktemp("llava"), "llava", seed=3)
    processor = AutoProcessor.from_pretrained(folder)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    token = hf.config.image_token_index
    wide, tall, square = image_file(80, 60, 1), image_file(40, 90, 2, "JPEG"), image_file(
        56, 56, 3)
    chats = standard_chats(wide, tall, square)
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
    check_vlm_greedy(engine, cases, expected, stagger=stagger)


def test_logprobs_equal_transformers_log_softmax(llava) -> None:
    folder, hf, _, cases, _ = llava
    check_all_vlm_logprobs(make_engine(folder, max_num_batched_tokens=24), hf, cases, MAX_NEW)


def test_a_repeated_image_hits_the_prefix_cache_and_a_changed_one_does_not(llava) -> None:
    folder, hf, processor, cases, expected = llava
    changed = vlm_case(processor, hf.config.image_token_index, FIRST_CHAT, [image_file(80, 60, 99)])
    check_repeated_image(make_engine(folder, block_size=8), hf, cases[0], changed, expected[0],
                         block_size=8)


def test_preempted_sequences_recompute_their_images(llava) -> None:
    folder, _, _, cases, expected = llava
    engine = make_engine(folder, num_kv_blocks=14, max_num_batched_tokens=24)
    check_vlm_preemption(engine, cases[:3], expected[:3])


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


def test_images_are_decoded_before_admission_off_the_engine_thread(llava, monkeypatch) -> None:
    import threading

    from meshserve.services.worker.vision import encoder as encoder_module

    folder, _, _, cases, expected = llava
    engine = make_engine(folder)
    images = engine.runner.images
    assert images is not None
    threads: list[str] = []
    decode = encoder_module.decode_image

    def recording(data: bytes, what: str):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return decode(data, what)

    monkeypatch.setattr(encoder_module, "decode_image", recording)
    prepared = images.prefetch(cases[1].images)
    assert prepared is not None and prepared.result(timeout=60) is True
    assert len(threads) == 2 and all(name.startswith("image-check") for name in threads)
    assert images.prefetch(cases[1].images) is None  # both known now: nothing to do
    outputs = run_cases(engine, [cases[1]], GREEDY)  # admitted with no decode of its own
    assert tokens_of(outputs["r0"]) == expected[1]
    assert len(threads) == 2  # admission checked them by hash, without decoding again
    junk = b"no image in here"
    bad = images.prefetch([PromptImage(junk, hashlib.sha256(junk).digest(), 0, 16)])
    assert bad is not None
    with pytest.raises(InvalidRequestError, match="does not decode as an image"):
        bad.result(timeout=60)
