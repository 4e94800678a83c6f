"""Gemma 3 with images against transformers on the same weights and images.

A tiny random folder written by transformers itself (tests/tiny_vlm.py: a 2-layer SigLIP
tower of 16 patches average-pooled to 4 rows, the projector, a 4-layer Gemma 3 with sliding
windows of 8): chats with one image, two images of other sizes, images across turns, and text
only, rendered by transformers' processor. transformers' greedy `generate` and its logits
are the reference, with its mask: an image's rows attend to each other both ways during
prefill. Through the whole engine: batched and staggered requests, chunked prefill with budgets
smaller and larger than an image's run (no chunk ends inside one), prefix-cache hits on a
repeated image (one ending inside the image, one stopping before a changed image),
preemption, both checkpoint layouts and a published config's sparse text_config; then what is
refused.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_vs_hf import make_engine, tokens_of
from tiny_vlm import build_tiny_vlm, load_processor
from transformers import AutoModelForImageTextToText
from vlm_reference import (
    VlmCase,
    check_all_vlm_logprobs,
    check_repeated_image,
    check_vlm_greedy,
    check_vlm_logprobs,
    check_vlm_preemption,
    hf_vlm_greedy,
    image_file,
    run_cases,
    vlm_case,
)

from meshserve.services.encoder.model import vision_tensors
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.images import ImageSlice
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.gemma3_vlm import Gemma3ForConditionalGeneration
from meshserve.services.worker.models.registry import refuse_unsupported
from meshserve.shared.errors import InvalidRequestError, ModelLoadError
from meshserve.shared.image_encoding import RowsEncoder, load_image_processor
from meshserve.shared.model_config import ModelFiles, max_model_len_of
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.vision_models import Gemma3Vision, build_vision_part

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
IMAGE = {"type": "image"}


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


# A system turn long enough that the image starts past the first blocks (at 95, 4 rows).
SYSTEM = {"role": "system", "content": "You look very closely at pictures, at their colours, "
                                      "their shapes and their edges, before you answer."}
FIRST = [SYSTEM, {"role": "user", "content": [IMAGE, _text("What is in it?")]}]
# The same image with another question: its tokens part from FIRST's 3 after the image.
SECOND = [SYSTEM, {"role": "user", "content": [IMAGE, _text("Describe its colours.")]}]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory):
    folder = build_tiny_vlm(tmp_path_factory.mktemp("gemma3"), "gemma3", seed=3)
    processor = load_processor(folder)
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


def _record_image_slices(engine: LLMEngine) -> list[ImageSlice]:
    """Every image slice the engine's steps compute, as the runner prepares them."""
    seen: list[ImageSlice] = []
    prepare = engine.runner.prepare

    def spy(out, previous=None):  # type: ignore[no-untyped-def]
        inputs = prepare(out, previous)
        seen.extend(inputs.image_slices)
        return inputs

    engine.runner.prepare = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("setup", [
    {"max_num_batched_tokens": 6},  # chunks end before images; an image waits for room
    {"max_num_batched_tokens": 40},
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
])
@pytest.mark.parametrize("stagger", [False, True])
def test_greedy_tokens_equal_transformers(gemma3, setup: dict, stagger: bool) -> None:
    folder, _, _, cases, expected = gemma3
    engine = make_engine(folder, **setup)
    assert isinstance(engine.runner.model, Gemma3ForConditionalGeneration)
    assert engine.scheduler.config.whole_images
    slices = _record_image_slices(engine)
    check_vlm_greedy(engine, cases, expected, stagger=stagger)
    assert len(slices) == 5 and all(s.first == 0 and s.count == 4 for s in slices)


def _assert_logprobs_equal(hf: torch.nn.Module, case: VlmCase, outs: list) -> None:
    check_vlm_logprobs(hf, case, outs, MAX_NEW)


def test_logprobs_equal_transformers_log_softmax(gemma3) -> None:
    folder, hf, _, cases, _ = gemma3
    check_all_vlm_logprobs(make_engine(folder, max_num_batched_tokens=24), hf, cases, MAX_NEW)


def test_images_attend_to_their_whole_image(gemma3) -> None:
    """The mask matters here: image rows kept causal give other logprobs than
    transformers'."""
    folder, hf, _, cases, _ = gemma3
    engine = make_engine(folder)
    engine.runner.model.bidirectional_images = False  # type: ignore[misc]
    outs = run_cases(engine, cases[:1], LOGPROBS)["r0"]
    with pytest.raises(AssertionError):
        _assert_logprobs_equal(hf, cases[0], outs)


def test_a_repeated_image_hits_the_prefix_cache_and_a_changed_one_does_not(gemma3) -> None:
    folder, hf, processor, cases, expected = gemma3
    changed = vlm_case(processor, hf.config.image_token_index, FIRST,
                       [image_file(80, 60, 99)])
    assert (changed.images[0].offset, changed.images[0].length) == (95, 4)
    check_repeated_image(make_engine(folder, block_size=8), hf, cases[0], changed, expected[0],
                         block_size=8)


def test_a_prefix_hit_ending_inside_an_image_equals_transformers(gemma3) -> None:
    """The same image with another question: the hit ends at 96, one row into the image
    (95..98): those blocks were computed with the whole image in their step, so the rest of
    the image is computed over them and equals a fresh prefill's."""
    folder, hf, processor, cases, _ = gemma3
    engine = make_engine(folder, block_size=8)
    run_cases(engine, [cases[0]], GREEDY, prefix="a")
    other = vlm_case(processor, hf.config.image_token_index, SECOND, [image_file(80, 60, 1)])
    assert other.token_ids[:102] == cases[0].token_ids[:102] != other.token_ids[:103]
    slices = _record_image_slices(engine)
    out = run_cases(engine, [other], LOGPROBS, prefix="b")["b0"]
    assert out[-1].num_cached_tokens == 96
    assert [(s.first, s.count) for s in slices] == [(1, 3)]
    assert tokens_of(out) == hf_vlm_greedy(hf, other, MAX_NEW)
    _assert_logprobs_equal(hf, other, out)


def test_preempted_sequences_recompute_their_images(gemma3) -> None:
    folder, _, _, cases, expected = gemma3
    engine = make_engine(folder, num_kv_blocks=22, max_num_batched_tokens=24)
    check_vlm_preemption(engine, cases[:3], expected[:3])


def _other_layout(folder: Path, dest: Path, transformers_5: bool) -> Path:
    """The folder with its checkpoint named as transformers 5 holds the model
    (model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*, lm_head)
    or as transformers 4 saved it (language_model.model.*, vision_tower.vision_model.*)."""
    shutil.copytree(folder, dest)
    tensors = load_file(folder / "model.safetensors")

    def rename(name: str) -> str:
        if transformers_5:
            for old, new in (("language_model.model.", "model.language_model."),
                             ("vision_tower.", "model.vision_tower."),
                             ("multi_modal_projector.", "model.multi_modal_projector.")):
                if name.startswith(old):
                    return new + name[len(old):]
            return name
        if name.startswith("vision_tower."):
            return "vision_tower.vision_model." + name[len("vision_tower."):]
        return name

    renamed = {rename(name): tensor for name, tensor in tensors.items()}
    if transformers_5:  # (tied, but some checkpoints store it anyway)
        renamed["lm_head.weight"] = renamed["model.language_model.embed_tokens.weight"].clone()
    assert set(renamed) != set(tensors)
    save_file(renamed, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("transformers_5", [True, False])
def test_both_checkpoint_layouts_load_the_same(gemma3, tmp_path: Path,
                                               transformers_5: bool) -> None:
    folder, _, _, cases, expected = gemma3
    other = _other_layout(folder, tmp_path / "other", transformers_5)
    engine = make_engine(other, max_num_batched_tokens=16)
    outputs = run_cases(engine, cases[:2], GREEDY)
    assert [tokens_of(outputs[f"r{i}"]) for i in range(2)] == expected[:2]


# gemma-3-4b-it's config.json: its text_config names only what differs from
# Gemma3TextConfig's defaults.
PUBLISHED_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "mm_tokens_per_image": 256, "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}


def test_a_published_config_takes_transformers_text_defaults() -> None:
    config = ModelConfig.from_hf(PUBLISHED_4B)
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (
        262_208, 2560, 34)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4,
                                                                                         256)
    assert config.layer_windows == tuple(None if (i + 1) % 6 == 0 else 1024
                                         for i in range(34))
    assert config.rope_theta == 1_000_000.0 and config.rope_local_theta == 10_000.0
    assert config.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert config.query_pre_attn_scalar == 256 and config.tie_word_embeddings
    assert config.eos_token_ids == (1, 106)
    assert max_model_len_of(ModelFiles(PUBLISHED_4B, None, "config.json")) == 131_072


def test_the_vision_half_alone_makes_the_workers_rows(gemma3) -> None:
    """As the encoder service builds it: on the meta device, then only its tensors read."""
    folder, _, _, cases, _ = gemma3
    with torch.device("meta"):
        part = build_vision_part(json.loads((folder / "config.json").read_text()))
    assert isinstance(part, Gemma3Vision)
    part = part.to_empty(device="cpu")
    with torch.no_grad():
        part.reset_buffers()
        part.load(vision_tensors(folder, type(part)))
    model = make_engine(folder).runner.model
    processor = load_image_processor(folder)
    files = [(image.digest, image.data) for image in cases[1].images]
    alone = RowsEncoder(part.eval(), processor, torch.device("cpu")).encode(files)
    assert isinstance(model, Gemma3ForConditionalGeneration)
    worker = RowsEncoder(model, processor, torch.device("cpu")).encode(files)
    assert all(alone[d].shape == (4, 64) and torch.equal(alone[d], worker[d]) for d, _ in files)


def test_bad_images_fail_their_request_alone(gemma3) -> None:
    folder, _, _, cases, expected = gemma3
    engine = make_engine(folder)
    image = cases[0].images[0]
    with pytest.raises(InvalidRequestError, match="becomes 4 embedding rows but the prompt "
                                                  "has 3"):
        engine.add_request("count", cases[0].token_ids, GREEDY,
                           images=[dataclasses.replace(image, length=3)])
    outputs = run_cases(engine, cases[:1], GREEDY)  # the engine serves on
    assert tokens_of(outputs["r0"]) == expected[0]


@pytest.mark.parametrize("feature", ["tensor_parallel", "lora", "gguf", "fp8",
                                     "fp8_checkpoint"])
def test_features_not_supported_yet_are_refused_by_name(feature: str) -> None:
    with pytest.raises(ModelLoadError, match="vision-language.*Gemma3ForConditional"):
        refuse_unsupported("Gemma3ForConditionalGeneration", feature)


def test_the_config_round_trips_through_json(gemma3) -> None:
    """(The folder's own config: what the loader reads.)"""
    folder = gemma3[0]
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert config.layer_windows == (8, 8, None, 8) and config.vision is not None


def test_a_step_budget_below_one_image_is_refused_at_start(gemma3) -> None:
    """An image is computed in one step; a budget that cannot hold one would overshoot the
    activation memory sized for it."""
    folder, _, _, _, _ = gemma3
    with pytest.raises(ModelLoadError, match="smaller than one image's 4 rows") as refused:
        make_engine(folder, max_num_batched_tokens=3)
    assert refused.value.param == "max_num_batched_tokens"
