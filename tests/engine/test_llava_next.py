"""LLaVA-NeXT against transformers on the same weights and images.

A tiny random folder written by transformers itself (tests/tiny_vlm.py: a 2-layer CLIP tower
of 56-pixel tiles, 16 patches each, the projector, image_newline, a 2-layer Llama; tile grids
chosen among 112x56, 56x112, 112x112, 168x56 and 56x168): chats with one image, two images of
other sizes and aspects (other tile grids, other row counts), images across turns, and text
only, rendered by transformers' processor. transformers' greedy `generate` and its logits
are the reference, through the whole engine: batched and staggered requests, chunked
prefill that cuts through an image's rows, prefix-cache hits on a repeated image,
preemption; the vision half built alone as the encoder service builds it; the row count
against the tokenizer's; both checkpoint layouts; then what is refused.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_vs_hf import make_engine, tokens_of
from tiny_vlm import build_tiny_vlm, load_processor
from transformers import AutoModelForImageTextToText, AutoTokenizer
from vlm_reference import (
    check_all_vlm_logprobs,
    check_repeated_image,
    check_vlm_greedy,
    check_vlm_preemption,
    hf_vlm_greedy,
    image_file,
    run_cases,
    vlm_case,
)

from meshserve.services.encoder.config import EncoderConfig
from meshserve.services.encoder.model import load_served_vision
from meshserve.services.tokenizer.images import ImageSize, load_image_placeholders
from meshserve.services.worker.models.llava import LlavaNextForConditionalGeneration
from meshserve.services.worker.models.registry import refuse_unsupported
from meshserve.shared.errors import ModelLoadError
from meshserve.shared.image_encoding import RowsEncoder, load_image_processor
from meshserve.shared.model_config import text_config_of
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.vision_models import LlavaNextVision, build_vision_part

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
IMAGE = {"type": "image"}
# (width, height) -> (tile rows, tile columns) of its grid, and its embedding rows.
SIZES = {"wide": ((80, 60), (2, 2), 70), "tall": ((40, 90), (2, 1), 56),
         "square": ((56, 56), (1, 2), 36), "strip": ((170, 50), (1, 3), 68)}


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def _file(name: str, seed: int, fmt: str = "PNG") -> bytes:
    (width, height), _, _ = SIZES[name]
    return image_file(width, height, seed, fmt)


# A text turn first, so that the image starts past the first 8-token block.
FIRST = [{"role": "user", "content": [_text("Look closely at the next picture, please.")]},
         {"role": "assistant", "content": [_text("I will.")]},
         {"role": "user", "content": [IMAGE, _text("What is in it?")]}]


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory: pytest.TempPathFactory):
    folder = build_tiny_vlm(tmp_path_factory.mktemp("llava_next"), "llava_next", seed=3)
    processor = load_processor(folder)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    token = hf.config.image_token_id
    wide, tall = _file("wide", 1), _file("tall", 2, "JPEG")
    square, strip = _file("square", 3), _file("strip", 4)
    chats = [
        (FIRST, [wide]),
        ([{"role": "user", "content": [IMAGE, IMAGE, _text("Compare the two.")]}],
         [tall, square]),
        ([{"role": "user", "content": [IMAGE, _text("Describe it.")]},
          {"role": "assistant", "content": [_text("A pattern of dots.")]},
          {"role": "user", "content": [_text("And this one?"), IMAGE]}], [strip, wide]),
        ([{"role": "user", "content": [_text("No picture today, only words.")]}], []),
    ]
    cases = [vlm_case(processor, token, messages, files) for messages, files in chats]
    expected = [hf_vlm_greedy(hf, case, MAX_NEW) for case in cases]
    return folder, hf, processor, cases, expected


def test_images_of_other_sizes_take_other_grids_and_rows(llava_next) -> None:
    _, _, _, cases, _ = llava_next
    lengths = [[image.length for image in case.images] for case in cases]
    rows = {name: count for name, (_, _, count) in SIZES.items()}
    assert lengths == [[rows["wide"]], [rows["tall"], rows["square"]],
                       [rows["strip"], rows["wide"]], []]


@pytest.mark.parametrize("setup", [
    {"max_num_batched_tokens": 20},  # chunks end inside images' runs of 36 to 70 rows
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
])
@pytest.mark.parametrize("stagger", [False, True])
def test_greedy_tokens_equal_transformers(llava_next, setup: dict, stagger: bool) -> None:
    folder, _, _, cases, expected = llava_next
    engine = make_engine(folder, **setup)
    assert isinstance(engine.runner.model, LlavaNextForConditionalGeneration)
    check_vlm_greedy(engine, cases, expected, stagger=stagger)


def test_logprobs_equal_transformers_log_softmax(llava_next) -> None:
    folder, hf, _, cases, _ = llava_next
    check_all_vlm_logprobs(make_engine(folder, max_num_batched_tokens=24), hf, cases, MAX_NEW)


def test_a_repeated_image_hits_the_prefix_cache_and_a_changed_one_does_not(
        llava_next) -> None:
    folder, hf, processor, cases, expected = llava_next
    changed = vlm_case(processor, hf.config.image_token_id, FIRST, [_file("wide", 99)])
    check_repeated_image(make_engine(folder, block_size=8), hf, cases[0], changed, expected[0],
                         block_size=8)


def test_preempted_sequences_recompute_their_images(llava_next) -> None:
    folder, _, _, cases, expected = llava_next
    # Room for the longest of the three alone, not for all three at once.
    blocks = math.ceil((max(len(c.token_ids) for c in cases[:3]) + MAX_NEW) / 16) + 1
    engine = make_engine(folder, num_kv_blocks=blocks, max_num_batched_tokens=24)
    check_vlm_preemption(engine, cases[:3], expected[:3])


def test_the_vision_half_alone_gives_the_worker_models_rows(llava_next) -> None:
    """The encoder service's half (build_vision_part + load, services/encoder/model.py) and
    the worker model's own give the same rows, and transformers' image features."""
    folder, hf, _, cases, _ = llava_next
    served = load_served_vision(EncoderConfig(model=str(folder), device="cpu",
                                              dtype="float32"))
    assert isinstance(served.encoder.model, LlavaNextVision)
    engine = make_engine(folder)
    worker = RowsEncoder(engine.runner.model, load_image_processor(folder),  # type: ignore[arg-type]
                         torch.device("cpu"))
    images = [image for case in cases for image in case.images]
    files = [(image.digest, image.data) for image in images]
    alone, own = served.encoder.encode(files), worker.encode(files)
    for image in images:
        assert alone[image.digest].shape == (image.length, 64)
        assert torch.equal(alone[image.digest], own[image.digest])
    for case in cases[:3]:  # transformers' packed features, in the prompt's order
        with torch.no_grad():
            features = hf.model.get_image_features(
                case.hf_inputs["pixel_values"], case.hf_inputs["image_sizes"]).pooler_output
        ours = [alone[image.digest] for image in case.images]
        assert len(features) == len(ours)
        for want, got in zip(features, ours, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rows_for_equals_the_tokenizers_count_and_the_packing(llava_next) -> None:
    folder, _, _, _, _ = llava_next
    with torch.device("meta"):
        part = build_vision_part(json.loads((folder / "config.json").read_text()))
    assert isinstance(part, LlavaNextVision)
    placeholders = load_image_placeholders(folder, AutoTokenizer.from_pretrained(folder))
    assert placeholders is not None
    sides = (1, 2, 13, 28, 55, 56, 57, 70, 111, 112, 113, 168, 200, 333, 1000)
    sizes = [ImageSize(w, h) for w in sides for h in sides]
    counts = placeholders.token_counts(sizes)
    assert [part.rows_for(s.width, s.height) for s in sizes] == counts
    assert len(set(counts)) > 10
    for name, ((width, height), grid, rows) in SIZES.items():
        assert part.tile_grid(width, height) == grid, name
        assert part.rows_for(width, height) == rows, name


def _transformers_5_layout(folder: Path, dest: Path) -> Path:
    """The folder with the checkpoint as transformers 5 names it: `model.image_newline`,
    `model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*` and
    `lm_head.*` (the fixture's folder is saved in transformers 4's names)."""
    shutil.copytree(folder, dest)
    tensors = load_file(folder / "model.safetensors")
    renames = (("language_model.model.", "model.language_model."),
               ("language_model.lm_head.", "lm_head."), ("vision_tower.", "model.vision_tower."),
               ("multi_modal_projector.", "model.multi_modal_projector."),
               ("image_newline", "model.image_newline"))
    renamed = {}
    for name, tensor in tensors.items():
        old, new = next((old, new) for old, new in renames if name.startswith(old))
        renamed[new + name[len(old):]] = tensor
    save_file(renamed, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_the_transformers_5_checkpoint_layout_loads_the_same(llava_next,
                                                             tmp_path: Path) -> None:
    folder, _, _, cases, expected = llava_next
    other = _transformers_5_layout(folder, tmp_path / "other")
    engine = make_engine(other, max_num_batched_tokens=32)
    outputs = run_cases(engine, cases[:2], GREEDY)
    assert [tokens_of(outputs[f"r{i}"]) for i in range(2)] == expected[:2]
    served = load_served_vision(EncoderConfig(model=str(other), device="cpu",
                                              dtype="float32"))
    image = cases[0].images[0]
    rows = served.encoder.encode([(image.digest, image.data)])[image.digest]
    own = engine.runner.images.local.encode(  # type: ignore[union-attr]
        [(image.digest, image.data)])[image.digest]
    assert torch.equal(rows, own)


@pytest.mark.parametrize(("model_type", "architecture"), [
    ("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"), (None, "LlamaForCausalLM")])
def test_the_language_model_runs_as_its_text_config_names(model_type: str | None,
                                                          architecture: str) -> None:
    text = {"hidden_size": 64} | ({"model_type": model_type} if model_type else {})
    config = {"architectures": ["LlavaNextForConditionalGeneration"], "text_config": text}
    assert text_config_of(config, "config.json")["architectures"] == [architecture]


def test_a_class_embedding_in_the_features_is_refused(llava_next) -> None:
    folder, _, _, _, _ = llava_next
    config = json.loads((folder / "config.json").read_text())
    config["vision_feature_select_strategy"] = "full"
    with torch.device("meta"), pytest.raises(ModelLoadError, match="'default', not 'full'"):
        build_vision_part(config)


@pytest.mark.parametrize("feature", ["tensor_parallel", "lora", "gguf", "fp8",
                                     "fp8_checkpoint"])
def test_features_not_supported_yet_are_refused_by_name(feature: str) -> None:
    with pytest.raises(ModelLoadError, match="vision-language.*LlavaNextForConditional"):
        refuse_unsupported("LlavaNextForConditionalGeneration", feature)
