"""The tiny vision-language folders of tiny_vlm.py load as transformers loads the published
ones and generate from images: the folders the tokenizer's and the worker's tests rely on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from tiny_vlm import IMAGE_PART, IMAGE_TOKEN, VLM_FAMILIES, build_tiny_vlm, load_processor
from transformers import AutoModelForImageTextToText

_CHAT = [{"role": "user", "content": [
    {"type": "image"}, {"type": "text", "text": "the quick brown fox"}, {"type": "image"}]}]


def _images(color: tuple[int, int, int]) -> list[Image.Image]:
    return [Image.new("RGB", (80, 50), color), Image.new("RGB", (40, 120), color[::-1])]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_each_family_loads_and_generates_from_images(tmp_path: Path, family: str) -> None:
    folder = build_tiny_vlm(tmp_path / family, family)
    processor = load_processor(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    text = processor.apply_chat_template(_CHAT, add_generation_prompt=True, tokenize=False)
    assert text.count(IMAGE_PART[family]) == 2, text
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[family])
    logits = []
    for color in ((200, 30, 40), (10, 220, 90)):
        inputs = processor(text=text, images=_images(color), return_tensors="pt")
        assert (inputs["input_ids"] == image_id).sum() > 2  # expanded per image
        with torch.no_grad():
            logits.append(model(**inputs).logits[0, -1])
        tokens = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4,
                                do_sample=False)
        assert tokens.shape[1] == inputs["input_ids"].shape[1] + 4
    # The images reach the answer: other pixels, other next-token logits.
    assert (logits[0] - logits[1]).abs().max() > 1e-2
