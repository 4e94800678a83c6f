"""Chats with images for the tokenizer's tests, and transformers' processor as the reference
for their token ids (tests/tiny_vlm.py's folders)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image
from tiny_vlm import IMAGE_TOKEN
from transformers import ProcessorMixin

IMAGE: dict[str, str] = {"type": "image"}


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


@dataclass(frozen=True)
class ImageChat:
    """A chat and the (width, height) of each of its image parts, in order."""

    name: str
    messages: list[dict[str, Any]]
    sizes: list[tuple[int, int]]


CHATS = [
    ImageChat("one image", [{"role": "user", "content": [IMAGE, text("What is in it?")]}],
              [(80, 50)]),
    ImageChat("two sizes", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [text("Compare"), IMAGE, text("with"), IMAGE,
                                     text("please.")]}], [(40, 120), (200, 33)]),
    ImageChat("two turns", [
        {"role": "user", "content": [IMAGE, text("The first one?")]},
        {"role": "assistant", "content": "A brown dog."},
        {"role": "user", "content": [text("And the second?"), IMAGE]}], [(56, 56), (300, 100)]),
    ImageChat("no image", [{"role": "user", "content": [text("Only words today.")]}], []),
]


@dataclass(frozen=True)
class Reference:
    """What transformers makes of a chat: the rendered text, the token ids, and the
    positions of the image placeholder token."""

    text: str
    token_ids: list[int]
    image_positions: list[int]


def reference(processor: ProcessorMixin, family: str, chat: ImageChat) -> Reference:
    """The processor's rendering and `processor(text=..., images=...)` over blank images of
    the chat's sizes (the count of placeholders depends on the size only)."""
    rendered = processor.apply_chat_template(chat.messages, add_generation_prompt=True,
                                             tokenize=False)
    images = [Image.new("RGB", size, (90, 140, 200)) for size in chat.sizes] or None
    ids = [int(i) for i in processor(text=rendered, images=images)["input_ids"][0]]
    token = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[family])
    return Reference(rendered, ids, [i for i, t in enumerate(ids) if t == token])
