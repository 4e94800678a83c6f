"""Images in prompts: how many placeholder tokens each takes, and where they lie.

A vision-language model's prompt holds, for each image, a run of placeholder tokens that the
image's embeddings replace. The chat template writes one marker per image part (LLaVA's
`<image>`, Qwen2.5-VL's `<|image_pad|>` between its vision markers, Gemma 3's
`<start_of_image>`), and the model folder's Hugging Face processor expands each marker
before tokenization by a count that depends on the image's pixel size. `ImagePlaceholders`
does that expansion from the sizes alone (the gateway decoded the images), counting with the
processor's own methods, so that the token ids equal what
`processor(text=..., images=...)["input_ids"]` gives for images of those sizes.

It loads with torch forbidden: transformers' PIL image processors and the processors'
counting need no torch. Qwen2.5-VL's processor cannot be built without torchvision (its video
processor needs it), so that family counts with its image processor, as the processor does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshserve.shared.errors import InvalidRequestError, ModelLoadError

# Processor classes whose image placeholders are known, by family.
_LLAVA = ("LlavaProcessor", "LlavaNextProcessor")
_QWEN = ("Qwen2_5_VLProcessor",)
_GEMMA = ("Gemma3Processor",)
# Where a folder names its processor class, in the order transformers reads them.
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ImageSize:
    """The pixel size of one image of a prompt."""

    width: int
    height: int


@dataclass(frozen=True)
class PlaceholderRange:
    """Where one image's placeholder tokens lie in a prompt's token ids."""

    offset: int  # position of the first placeholder token
    length: int  # placeholder tokens (the image's embedding rows)

    @property
    def end(self) -> int:
        return self.offset + self.length


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="images")


class ImagePlaceholders:
    """A vision-language model's image markers and placeholder tokens.

    `expand` turns each marker of a rendered prompt into the image's placeholder text;
    `ranges` finds each image's run of placeholder tokens in the encoded prompt.
    """

    def __init__(self, processor_class: str, marker: str, placeholder_id: int,
                 count: Callable[[list[tuple[int, int]]], list[int]],
                 expansion: Callable[[int], str]) -> None:
        self.processor_class = processor_class
        self.marker = marker  # what the template writes per image, the processor expands
        self.placeholder_id = placeholder_id  # the token each embedding row replaces
        self._count = count  # (height, width) per image -> placeholder tokens per image
        self._expansion = expansion  # placeholder tokens -> the marker's replacement text

    def token_counts(self, sizes: Sequence[ImageSize]) -> list[int]:
        """Placeholder tokens each image of `sizes` takes."""
        for i, size in enumerate(sizes):
            if size.width < 1 or size.height < 1:
                raise _bad(f"image {i}: width and height must be at least 1 pixel, got "
                           f"{size.width}x{size.height}")
        try:
            return [int(n) for n in self._count([(s.height, s.width) for s in sizes])]
        except ValueError as exc:  # e.g. Qwen's aspect ratio limit of 200
            raise _bad(f"cannot take an image of this size: {exc}") from exc

    def expand(self, text: str, sizes: Sequence[ImageSize]) -> tuple[str, list[int]]:
        """`text` with each image marker replaced as the processor replaces it, and the
        placeholder tokens of each image. The markers must be as many as the images."""
        pieces = text.split(self.marker)
        if len(pieces) - 1 != len(sizes):
            raise _bad(f"the prompt holds {len(pieces) - 1} image markers {self.marker!r} for "
                       f"{len(sizes)} images: the chat's image parts make the markers, and "
                       "its texts may not contain one")
        counts = self.token_counts(sizes) if sizes else []
        out = [pieces[0]]
        for count, piece in zip(counts, pieces[1:], strict=True):
            out += (self._expansion(count), piece)
        return "".join(out), counts

    def ranges(self, token_ids: Sequence[int], counts: Sequence[int]) -> list[PlaceholderRange]:
        """Each image's run of placeholder tokens in `token_ids`, in order (the images of
        `counts`, as `expand` returned them)."""
        positions = [i for i, token in enumerate(token_ids) if token == self.placeholder_id]
        if len(positions) != sum(counts):
            raise _bad(f"the prompt holds {len(positions)} image placeholder tokens where its "
                       f"{len(counts)} images take {sum(counts)}: its texts may not contain "
                       "the placeholder token")
        out, first = [], 0
        for i, count in enumerate(counts):
            offset = positions[first]
            if positions[first + count - 1] != offset + count - 1:
                raise _bad(f"image {i}: its placeholder tokens are not one run")
            out.append(PlaceholderRange(offset, count))
            first += count
        return out


def processor_class_of(folder: Path) -> str | None:
    """The processor class a model folder names (None when it names none)."""
    for name in _PROCESSOR_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get("processor_class")
        except (OSError, ValueError, AttributeError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        if isinstance(value, str):
            return value
    return None


def load_image_placeholders(folder: Path, tokenizer: Any) -> ImagePlaceholders | None:
    """The image placeholders of the model in `folder` (`tokenizer`: its Hugging Face
    tokenizer); None for a model that takes no images (or whose processor is unknown)."""
    name = processor_class_of(folder)
    try:
        if name in _LLAVA:
            placeholders = _llava(name, _processor(folder), tokenizer)
        elif name in _QWEN:
            placeholders = _qwen(name, folder, tokenizer)
        elif name in _GEMMA:
            placeholders = _gemma(name, _processor(folder), tokenizer)
        else:
            return None
        placeholders.token_counts([ImageSize(64, 48)])  # fails here, not per request
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"cannot load the image processor {name} of {folder}: "
                             f"{exc}") from exc
    return placeholders


def _processor(folder: Path) -> Any:
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(str(folder), local_files_only=True)


def _token_id(tokenizer: Any, token: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ModelLoadError(f"the image token {token!r} is not one token of the tokenizer")
    return int(ids[0])


def _counter(processor: Any) -> Callable[[list[tuple[int, int]]], list[int]]:
    def count(sizes: list[tuple[int, int]]) -> list[int]:
        return list(processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens)
    return count


def _llava(name: str, processor: Any, tokenizer: Any) -> ImagePlaceholders:
    """LLaVA-1.5 and LLaVA-NeXT: each marker becomes the image token, repeated."""
    token = str(processor.image_token)
    return ImagePlaceholders(name, token, _token_id(tokenizer, token), _counter(processor),
                             lambda count: token * count)


def _qwen(name: str, folder: Path, tokenizer: Any) -> ImagePlaceholders:
    """Qwen2.5-VL: each `<|image_pad|>` becomes grid / merge² of them, as the processor's
    `_get_num_multimodal_tokens` counts from the image processor."""
    from transformers import AutoImageProcessor
    images = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    token = str(getattr(tokenizer, "image_token", None) or "<|image_pad|>")
    merge = int(images.merge_size)

    def count(sizes: list[tuple[int, int]]) -> list[int]:
        return [images.get_number_of_image_patches(h, w, {}) // merge**2 for h, w in sizes]

    return ImagePlaceholders(name, token, _token_id(tokenizer, token), count,
                             lambda n: token * n)


def _gemma(name: str, processor: Any, tokenizer: Any) -> ImagePlaceholders:
    """Gemma 3: each `<start_of_image>` becomes the processor's full image sequence
    ("\\n\\n<start_of_image>", the soft tokens, "<end_of_image>\\n\\n")."""
    if processor.image_processor.do_pan_and_scan:
        raise ModelLoadError("Gemma 3's pan-and-scan (do_pan_and_scan in the image "
                             "processor's config) is not supported: turn it off")
    sequence, per_image = str(processor.full_image_sequence), int(processor.image_seq_length)

    def expansion(count: int) -> str:
        assert count == per_image, f"Gemma 3 images take {per_image} tokens, not {count}"
        return sequence

    soft = str(tokenizer.image_token)
    return ImagePlaceholders(name, str(processor.boi_token), _token_id(tokenizer, soft),
                             _counter(processor), expansion)
