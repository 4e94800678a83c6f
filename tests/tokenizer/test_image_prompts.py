"""A vision-language model's prompts in the tokenizer (`ServedModel.tokenize`): chat parts
rendered as transformers' processors render them, each image marker expanded to as many
placeholder tokens as the processor makes for an image of that size, and where they lie.

The reference is the folder's own processor (tests/tiny_vlm.py's four families) called on
the rendered text and blank images of the chat's sizes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from image_prompts import CHATS, IMAGE, ImageChat, reference, text
from tiny_vlm import IMAGE_PART, VLM_FAMILIES, build_tiny_vlm, load_processor
from transformers import ProcessorMixin

from meshserve.services.tokenizer.__main__ import load_served_model
from meshserve.services.tokenizer.config import TokenizerConfig
from meshserve.services.tokenizer.images import ImageSize, processor_class_of
from meshserve.services.tokenizer.model import PromptInput, ServedModel
from meshserve.shared.errors import InvalidRequestError, ModelLoadError

Family = tuple[str, ServedModel, ProcessorMixin]


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name = request.param
    folder = build_tiny_vlm(tmp_path_factory.mktemp(name), name)
    served = load_served_model(TokenizerConfig(model=str(folder), max_model_len=256))
    return name, served, load_processor(folder)


def _chat(chat: ImageChat, **options: object) -> PromptInput:
    return PromptInput(messages=chat.messages, add_special_tokens=False,
                       images=tuple(ImageSize(w, h) for w, h in chat.sizes),
                       **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("chat", CHATS, ids=[chat.name for chat in CHATS])
def test_token_ids_and_ranges_equal_the_processors(family: Family, chat: ImageChat) -> None:
    name, served, processor = family
    want = reference(processor, name, chat)
    got = served.tokenize(_chat(chat))
    assert got.text == want.text
    assert got.token_ids == want.token_ids
    assert len(got.image_ranges) == len(chat.sizes)
    covered = [i for r in got.image_ranges for i in range(r.offset, r.end)]
    assert covered == want.image_positions
    if name == "llava_next":  # any-resolution: the count follows each image's size
        assert len({r.length for r in got.image_ranges}) == len(got.image_ranges)


def test_the_family_is_read_from_the_processor_config(family: Family) -> None:
    name, served, processor = family
    assert served.images is not None
    assert served.images.processor_class == type(processor).__name__.replace("Images", "")
    rendered = served.tokenize(_chat(CHATS[0])).text
    assert rendered.count(IMAGE_PART[name]) == 1


def test_image_parts_must_match_the_sizes(family: Family) -> None:
    _, served, _ = family
    chat = CHATS[1]
    for sizes in ((), (ImageSize(10, 10),), (ImageSize(10, 10),) * 3):
        with pytest.raises(InvalidRequestError, match="2 image parts but") as info:
            served.tokenize(PromptInput(messages=chat.messages, images=sizes))
        assert info.value.param == "images"
    with pytest.raises(InvalidRequestError, match="at least 1 pixel"):
        served.tokenize(PromptInput(messages=CHATS[0].messages, images=(ImageSize(0, 5),)))


def test_a_text_holding_the_image_marker_is_refused(family: Family) -> None:
    _, served, _ = family
    marker = served.images.marker if served.images is not None else ""
    messages = [{"role": "user", "content": [text(f"look: {marker}"), IMAGE]}]
    with pytest.raises(InvalidRequestError, match="2 image markers") as info:
        served.tokenize(PromptInput(messages=messages, images=(ImageSize(30, 30),)))
    assert info.value.param == "images"
    with pytest.raises(InvalidRequestError, match="1 image markers"):
        served.tokenize(PromptInput(text=f"plain {marker} text"))


def test_truncation_keeps_images_whole_or_is_refused(family: Family) -> None:
    _, served, _ = family
    chat = CHATS[2]
    whole = served.tokenize(_chat(chat))
    first = whole.image_ranges[0]
    keep = len(whole.token_ids) - first.offset  # cut exactly up to the first image
    kept = served.tokenize(_chat(chat, truncate_prompt_tokens=keep))
    assert kept.token_ids == whole.token_ids[first.offset:]
    assert [(r.offset + first.offset, r.length) for r in kept.image_ranges] == [
        (r.offset, r.length) for r in whole.image_ranges]
    with pytest.raises(InvalidRequestError, match="would cut into the prompt's images") as info:
        served.tokenize(_chat(chat, truncate_prompt_tokens=keep - 1))
    assert info.value.param == "truncate_prompt_tokens"


def test_text_parts_of_other_kinds_are_refused(family: Family) -> None:
    _, served, _ = family
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    with pytest.raises(InvalidRequestError, match="only text and image parts") as info:
        served.tokenize(PromptInput(messages=messages))
    assert info.value.param == "messages[0].content"


def test_a_text_only_model_refuses_images_and_keeps_its_rendering(tiny_llama_dir: Path) -> None:
    served = load_served_model(TokenizerConfig(model=str(tiny_llama_dir),
                                               served_model_name="tiny"))
    assert served.images is None and processor_class_of(tiny_llama_dir) is None
    with pytest.raises(InvalidRequestError, match="model 'tiny' does not take images") as info:
        served.tokenize(_chat(CHATS[0]))
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="does not take images") as info:
        served.tokenize(PromptInput(messages=CHATS[3].messages, images=(ImageSize(8, 8),)))
    assert info.value.param == "images"
    # Text parts still join with newlines, as before.
    parts = [{"role": "user", "content": [text("a"), text("b")]}]
    assert served.tokenize(PromptInput(messages=parts)).text == (
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n")
    assert served.tokenize(PromptInput(messages=parts)).image_ranges == ()


@pytest.mark.parametrize(("family_name", "edit", "match"), [
    ("llava", lambda config: config.pop("patch_size"), "cannot load the image processor"),
    ("gemma3", lambda config: config["image_processor"].update(do_pan_and_scan=True),
     "pan-and-scan"),
])
def test_processor_configs_it_cannot_follow_fail_at_load(
        tmp_path: Path, family_name: str, edit: Callable[[dict[str, Any]], object],
        match: str) -> None:
    folder = build_tiny_vlm(tmp_path / family_name, family_name)
    path = folder / "processor_config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=match):
        load_served_model(TokenizerConfig(model=str(folder), max_model_len=256))
