"""Qwen2.5-VL against transformers on the same weights and images.

A tiny random folder written by transformers itself (tests/tiny_vlm.py: a 2-layer
window-attention tower merging 2x2 patches of 14 pixels, a 2-layer Qwen2 with M-RoPE split
2/3/3): chats with one image, two images of other sizes (other grids, one wider than tall
and one taller than wide), images across turns, and text only, rendered by transformers'
processor. transformers' M-RoPE positions, greedy `generate` and logits are the reference,
through the whole engine: batched and staggered requests, chunked prefill that cuts through
an image's rows, prefix-cache hits on a repeated image, preemption; both checkpoint and
config layouts; then what is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
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

from meshserve.services.worker.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from meshserve.services.worker.models.registry import refuse_unsupported
from meshserve.shared.errors import InvalidRequestError, ModelLoadError
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory):
    folder = build_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl", seed=3)
    processor = load_processor(folder)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    token = hf.config.image_token_id
    # Grids of merged patches (height x width): 2x3, 3x2 and 4x5.
    wide, tall, big = image_file(80, 60, 1), image_file(40, 90, 2, "JPEG"), image_file(
        150, 100, 3)
    chats = standard_chats(wide, tall, big)
    cases = [vlm_case(processor, token, messages, files) for messages, files in chats]
    expected = [hf_vlm_greedy(hf, case, MAX_NEW) for case in cases]
    return folder, hf, processor, cases, expected


def test_prompt_positions_equal_transformers_rope_index(qwen) -> None:
    folder, hf, _, cases, _ = qwen
    engine = make_engine(folder)
    for case in cases[:3]:
        inputs = case.hf_inputs
        want, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                              inputs["image_grid_thw"])
        got = engine.runner.prompt_positions(len(case.token_ids), case.images)
        assert got is not None
        n = len(case.token_ids)
        assert torch.equal(got.rows(0, n), want[:, 0])
        assert got.delta == int(delta) < 0
        # Any cut reads the same rows; past the prompt, index + delta for all three.
        assert torch.equal(torch.cat([got.rows(0, 30), got.rows(30, n + 4)], dim=1)[:, :n],
                           want[:, 0])
        assert got.rows(n, n + 2).tolist() == [[n + got.delta, n + 1 + got.delta]] * 3
    assert engine.runner.prompt_positions(len(cases[3].token_ids), []) is None


@pytest.mark.parametrize("setup", [
    {"max_num_batched_tokens": 16},  # chunks end inside images' 6- and 20-row runs
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
])
@pytest.mark.parametrize("stagger", [False, True])
def test_greedy_tokens_equal_transformers(qwen, setup: dict, stagger: bool) -> None:
    folder, _, _, cases, expected = qwen
    engine = make_engine(folder, **setup)
    assert isinstance(engine.runner.model, Qwen2_5_VLForConditionalGeneration)
    check_vlm_greedy(engine, cases, expected, stagger=stagger)


def test_logprobs_equal_transformers_log_softmax(qwen) -> None:
    folder, hf, _, cases, _ = qwen
    check_all_vlm_logprobs(make_engine(folder, max_num_batched_tokens=24), hf, cases, MAX_NEW)


def test_only_steps_with_image_rows_take_three_positions_a_token(qwen) -> None:
    """Image rows' steps pass positions [3, T] (and run eagerly); the others pass [T], the
    decode rows at their index + the prompt's delta."""
    folder, _, _, cases, expected = qwen
    engine = make_engine(folder, max_num_batched_tokens=16)
    runner = engine.runner
    seen: list[tuple[int, bool, list[int]]] = []
    original = runner.forward

    def spy(inputs):
        seen.append((inputs.positions.dim(), bool(inputs.image_rows),
                     inputs.positions.tolist()))
        return original(inputs)

    runner.forward = spy  # type: ignore[method-assign]
    outputs = run_cases(engine, cases[:1], GREEDY)
    assert tokens_of(outputs["r0"]) == expected[0]
    assert {(dim, rows) for dim, rows, _ in seen} == {(2, True), (1, False)}
    delta = runner.prompt_positions(len(cases[0].token_ids), cases[0].images).delta
    n = len(cases[0].token_ids)
    decodes = [positions for dim, _, positions in seen if dim == 1 and len(positions) == 1]
    assert decodes == [[n + k + delta] for k in range(MAX_NEW - 1)]


def test_a_repeated_image_hits_the_prefix_cache_and_a_changed_one_does_not(qwen) -> None:
    folder, hf, processor, cases, expected = qwen
    changed = vlm_case(processor, hf.config.image_token_id, FIRST_CHAT, [image_file(80, 60, 7)])
    check_repeated_image(make_engine(folder, block_size=8), hf, cases[0], changed, expected[0],
                         block_size=8)


def test_preempted_sequences_keep_their_positions(qwen) -> None:
    folder, _, _, cases, expected = qwen
    engine = make_engine(folder, num_kv_blocks=14, max_num_batched_tokens=24)
    check_vlm_preemption(engine, cases[:3], expected[:3])


def _transformers_4_layout(folder: Path, dest: Path) -> Path:
    """The folder as transformers 4 wrote it: the text fields at the config's top level
    (rope_scaling of type "mrope") and the checkpoint's language model under
    `model.language_model.*`, its tower under `model.visual.*` (transformers 5's names)."""
    shutil.copytree(folder, dest)
    config = json.loads((folder / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config.update({**text, "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"],
                   "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}})
    (dest / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    renamed = {("model.language_model." + name[len("model."):]
                if name.startswith("model.") else
                "model." + name if name.startswith("visual.") else name): tensor
               for name, tensor in tensors.items()}
    assert any(n.startswith("model.language_model.layers.") for n in renamed)
    assert any(n.startswith("model.visual.blocks.") for n in renamed)
    save_file(renamed, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_the_other_config_and_checkpoint_layouts_load_the_same(qwen, tmp_path: Path) -> None:
    folder, _, _, cases, expected = qwen
    other = _transformers_4_layout(folder, tmp_path / "other")
    engine = make_engine(other, max_num_batched_tokens=16)
    assert engine.runner.model.config.mrope_section == (2, 3, 3)
    assert engine.runner.model.config.rope_scaling is None
    outputs = run_cases(engine, cases, GREEDY)
    assert [tokens_of(outputs[f"r{i}"]) for i in range(len(cases))] == expected


def test_bad_images_fail_their_request_alone(qwen) -> None:
    folder, _, _, cases, expected = qwen
    engine = make_engine(folder)
    image, big = cases[0].images[0], cases[1].images[1]
    strip = image_file(1, 201, 5)  # an aspect ratio over 200: transformers refuses it
    bad = {
        "strip": dataclasses.replace(image, data=strip, digest=hashlib.sha256(strip).digest()),
        "count": dataclasses.replace(image, data=big.data, digest=big.digest),
    }
    messages = {"strip": "aspect ratio", "count": "becomes 20 embedding rows but the prompt "
                                                  "has 6"}
    for name, wrong in bad.items():
        with pytest.raises(InvalidRequestError, match=messages[name]):
            engine.add_request(name, cases[0].token_ids, GREEDY, images=[wrong])
    outputs = run_cases(engine, cases[:1], GREEDY)  # the engine serves on
    assert tokens_of(outputs["r0"]) == expected[0]


@pytest.mark.parametrize("feature", ["tensor_parallel", "lora", "gguf", "fp8",
                                     "fp8_checkpoint"])
def test_features_not_supported_yet_are_refused_by_name(feature: str) -> None:
    with pytest.raises(ModelLoadError, match="vision-language.*Qwen2_5_VLForConditional"):
        refuse_unsupported("Qwen2_5_VLForConditionalGeneration", feature)
