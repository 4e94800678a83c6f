"""Images in run-batch chats: loaded and checked as the gateway does, placed as the
tokenizer does, handed to the engine as the worker takes them.

    images = batch_images(tokenizer, placeholders, max_model_len, settings)  # None: text
    ids, placed = images.tokenize(messages, refs, prompt)

The image parts of a chat (`image_url`, data: or http(s) URLs) go through the gateway's
MediaLoader (SSRF guard, size and pixel caps, `--limit-mm-per-prompt`); the conversation
with `{"type": "image"}` parts through the tokenizer's ServedModel, which expands each
image's placeholder tokens; the result is the prompt's token ids and its PromptImages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry

from meshserve.services.gateway.media.loader import LoadedImage, MediaLoader
from meshserve.services.gateway.media.parts import ImageRef
from meshserve.services.gateway.media.policy import MediaSettings
from meshserve.services.gateway.metrics import GatewayMetrics
from meshserve.services.tokenizer.images import ImagePlaceholders, ImageSize
from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.services.tokenizer.model import PromptInput, ServedModel
from meshserve.services.worker.engine.images import PromptImage
from meshserve.shared.errors import InvalidRequestError


class BatchImages:
    """A vision-language model's image handling for run-batch."""

    def __init__(self, model: ServedModel, settings: MediaSettings) -> None:
        self.model = model
        self.settings = settings

    def tokenize(self, messages: Sequence[dict[str, Any]], refs: Sequence[ImageRef],
                 prompt: PromptInput) -> tuple[list[int], list[PromptImage]]:
        """Load the images of a chat and tokenize it; its ids and placed images."""
        loaded = asyncio.run(self._load(refs))
        sizes = tuple(ImageSize(image.width, image.height) for image in loaded)
        done = self.model.tokenize(PromptInput(
            messages=list(messages), tools=prompt.tools,
            add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message,
            chat_template_kwargs=prompt.chat_template_kwargs, images=sizes))
        return done.token_ids, [PromptImage(image.data, image.sha256, placed.offset,
                                             placed.length)
                                for image, placed in zip(loaded, done.image_ranges,
                                                         strict=True)]

    async def _load(self, refs: Sequence[ImageRef]) -> list[LoadedImage]:
        loader = MediaLoader(self.settings, GatewayMetrics(CollectorRegistry()),
                             trace.get_tracer("meshserve.run_batch"))
        try:
            return await loader.load(refs)
        finally:
            await loader.close()


def batch_images(tokenizer: Tokenizer, placeholders: ImagePlaceholders | None,
                 max_model_len: int, settings: MediaSettings) -> BatchImages | None:
    """The image handling of a vision-language model (None for a text model)."""
    if placeholders is None:
        return None
    return BatchImages(ServedModel(tokenizer, ("",), max_model_len, None, placeholders),
                       settings)


def refuse_images(refs: Sequence[ImageRef]) -> None:
    """A text model's chat with image parts: a 400 naming the first."""
    if refs:
        raise InvalidRequestError(f"{refs[0].where}: this model does not take images",
                                  param=refs[0].where)
