"""Image parts of a chat conversation, read as vLLM's OpenAI server reads them.

An image part is one of
- `{"type": "image_url", "image_url": {"url": URL, "detail": "auto"}}` (OpenAI's form; a
  bare URL string as `image_url` is taken too),
- `{"image_url": URL}` or `{"image_url": {"url": URL}}` without a type (vLLM's short form),
- `{"type": "input_image", "image_url": URL}` (the Responses API's part, which vLLM also
  takes in chat messages).
`detail` is accepted (auto, low, high) and changes nothing, as in vLLM: the model's own
processor decides the resolution. `split_images` returns the conversation with each image
part replaced by `{"type": "image"}` (what chat templates render) and the images in
conversation order, each named by where it is (`messages[0].content[1]`). Media the mesh
cannot carry (video, audio, embeddings) and bare `{"type": "image"}` parts (a placeholder
with no image behind it) are refused here, naming the part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshserve.shared.errors import InvalidRequestError

IMAGE_PART: dict[str, Any] = {"type": "image"}
_IMAGE_TYPES = ("image_url", "input_image")
_DETAILS = ("auto", "low", "high")
_NOT_CARRIED = {
    "video_url": "video", "audio_url": "audio", "input_audio": "audio",
    "image_embeds": "image embeddings", "audio_embeds": "audio embeddings",
    "image_pil": "in-process PIL images", "file": "files", "input_file": "files"}


@dataclass(frozen=True)
class ImageRef:
    """One image part: where it is in the request and the URL (http(s) or data:) it gives."""

    where: str
    url: str

    @property
    def shown(self) -> str:
        """The URL as error messages show it (a data URL only up to its payload)."""
        if self.url[:5].lower() == "data:":
            return self.url.partition(",")[0] + ",..."
        return self.url if len(self.url) <= 120 else self.url[:117] + "..."


def split_images(messages: Sequence[dict[str, Any]]
                 ) -> tuple[tuple[dict[str, Any], ...], tuple[ImageRef, ...]]:
    """The messages with image parts as `{"type": "image"}`, and the images in order (the
    messages themselves when they hold none: a text chat is not copied)."""
    result: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        found = len(images)
        parts = []
        for j, part in enumerate(content if isinstance(content, list) else ()):
            url = _image_url(part, f"messages[{i}].content[{j}]")
            if url is None:
                parts.append(part)
            else:
                images.append(ImageRef(f"messages[{i}].content[{j}]", url))
                parts.append(dict(IMAGE_PART))
        result.append({**message, "content": parts} if len(images) > found else message)
    if not images:
        return tuple(messages), ()
    return tuple(result), tuple(images)


def _image_url(part: object, where: str) -> str | None:
    """The URL of an image part; None for any other part (the tokenizer checks those)."""
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    if kind in _NOT_CARRIED:
        raise _bad(where, f"{_NOT_CARRIED[kind]} ('{kind}' parts) cannot be sent; the "
                          "served models take text and images")
    if kind == "image":
        raise _bad(where, "an 'image' part carries no image; send the image as an "
                          "'image_url' part")
    if kind not in _IMAGE_TYPES and not (kind is None and "image_url" in part):
        return None
    if "uuid" in part:
        raise _bad(where, "'uuid' is not supported: images are identified by the SHA-256 "
                          "of their bytes")
    if kind == "input_image" and "image_url" not in part:
        raise _bad(where, "an input_image needs an image_url (file_id is not supported: "
                          "there is no file store)")
    value = part.get("image_url")
    if isinstance(value, Mapping) and kind != "input_image":
        detail = value.get("detail")
        if detail is not None and detail not in _DETAILS:
            raise _bad(where, f"image_url.detail must be one of {', '.join(_DETAILS)}, got "
                              f"{detail!r:.40}")
        value = value.get("url")
    else:
        detail = part.get("detail")
        if detail is not None and detail not in _DETAILS:
            raise _bad(where, f"detail must be one of {', '.join(_DETAILS)}, got "
                              f"{detail!r:.40}")
    if not isinstance(value, str) or not value:
        raise _bad(where, "an image part needs a URL: {'type': 'image_url', 'image_url': "
                          "{'url': 'https://... or data:image/...;base64,...'}}")
    return value


def _bad(where: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {why}", param=where)
