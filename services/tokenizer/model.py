"""The model a tokenizer replica serves, and the prompts it turns into token ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshserve.services.tokenizer.images import ImagePlaceholders, ImageSize, PlaceholderRange
from meshserve.services.tokenizer.loader import Tokenizer, count_image_parts
from meshserve.shared.errors import InvalidRequestError, NotFoundError

# Role markers and separators a chat template adds per message (ChatML: about 30; the
# default model's rendering of 1000 two-character messages is 32,620 characters).
TEMPLATE_CHARS_PER_MESSAGE = 32


@dataclass(frozen=True)
class PromptInput:
    """A prompt to tokenize: `text`, or chat `messages` rendered through a chat template."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    truncate_prompt_tokens: int = 0
    suffix: str | None = None  # fill-in-the-middle: the text after the completion
    images: tuple[ImageSize, ...] = ()  # one per {"type": "image"} part, in order

    @property
    def size(self) -> int:
        """Characters to render and encode: the text, or every message's content and tools
        plus what a chat template adds around each message."""
        if self.text is not None:
            return len(self.text)
        total = TEMPLATE_CHARS_PER_MESSAGE * len(self.messages or ())
        for message in [*(self.messages or ()), *(self.tools or ())]:
            for value in message.values():
                total += len(value) if isinstance(value, str) else len(repr(value))
        return total


@dataclass(frozen=True)
class TokenizedPrompt:
    """Token ids of a prompt, the text they were made from, and where each image's
    placeholder tokens lie."""

    token_ids: list[int]
    text: str
    image_ranges: tuple[PlaceholderRange, ...] = ()


@dataclass(frozen=True)
class ServedModel:
    """The one model a tokenizer replica serves: its tokenizer, names and context length."""

    tokenizer: Tokenizer
    names: tuple[str, ...]  # names a request's `model` may use ("" always means this one)
    max_model_len: int
    chat_template: str | None = None  # the server's replacement for the model's template
    images: ImagePlaceholders | None = None  # a vision-language model's; None: text only

    @property
    def name(self) -> str:
        """The served model name."""
        return self.names[0]

    def check_name(self, model: str) -> None:
        """Raise NotFoundError unless `model` is empty or one of this model's names."""
        if model and model not in self.names:
            raise NotFoundError(f"model {model!r} is not served here (serving {self.name!r})",
                                param="model")

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's init arguments without the vocabulary and
        merges file paths, added tokens as their text, its class, and the server's chat
        template when it has one (the model's own is among the init arguments)."""
        config = dict(getattr(self.tokenizer.hf, "init_kwargs", None) or {})
        config.pop("vocab_file", None)
        config.pop("merges_file", None)
        info: dict[str, Any] = _json_ready(config)
        info["tokenizer_class"] = type(self.tokenizer.hf).__name__
        if self.chat_template:
            info["chat_template"] = self.chat_template
        return info

    def tokenize(self, prompt: PromptInput) -> TokenizedPrompt:
        """Render (chat) and encode a prompt, keeping the last `truncate_prompt_tokens`;
        a vision-language model's image markers expanded to each image's placeholders."""
        self._check_images(prompt)
        text = self._render(prompt)
        counts: list[int] = []
        encoded = text
        if self.images is not None:
            encoded, counts = self.images.expand(text, prompt.images)
        ids = self.tokenizer.encode(encoded, add_special_tokens=prompt.add_special_tokens)
        ranges = self.images.ranges(ids, counts) if self.images is not None else []
        if prompt.truncate_prompt_tokens and len(ids) > prompt.truncate_prompt_tokens:
            cut = len(ids) - prompt.truncate_prompt_tokens
            self._check_truncation(prompt, len(ids), cut, ranges)
            ids = ids[cut:]
            ranges = [PlaceholderRange(r.offset - cut, r.length) for r in ranges]
        return TokenizedPrompt(ids, text, tuple(ranges))

    def _render(self, prompt: PromptInput) -> str:
        if prompt.messages is not None:
            return self.tokenizer.render_chat(
                prompt.messages, prompt.tools, prompt.add_generation_prompt,
                prompt.continue_final_message, prompt.chat_template_kwargs,
                chat_template=prompt.chat_template or self.chat_template,
                content_parts=self.images is not None)
        assert prompt.text is not None, "a prompt needs text or messages"
        if prompt.suffix is not None:
            return self.tokenizer.fill_in_middle(prompt.text, prompt.suffix)
        return prompt.text

    def _check_images(self, prompt: PromptInput) -> None:
        parts = count_image_parts(prompt.messages)
        if self.images is None:
            if parts or prompt.images:
                raise InvalidRequestError(f"model {self.name!r} does not take images",
                                          param="messages" if parts else "images")
        elif prompt.messages is not None and parts != len(prompt.images):
            raise InvalidRequestError(
                f"the chat has {parts} image parts but {len(prompt.images)} image sizes were "
                "given: one per image part, in order", param="images")

    @staticmethod
    def _check_truncation(prompt: PromptInput, num_tokens: int, cut: int,
                          ranges: list[PlaceholderRange]) -> None:
        if prompt.suffix is not None:  # cutting the left would cut the FIM prefix token
            raise InvalidRequestError(
                f"the fill-in-the-middle prompt has {num_tokens} tokens, more than "
                f"'truncate_prompt_tokens' keeps ({prompt.truncate_prompt_tokens}); "
                "shorten the prompt or the suffix instead", param="truncate_prompt_tokens")
        if ranges and cut > ranges[0].offset:
            raise InvalidRequestError(
                f"'truncate_prompt_tokens' ({prompt.truncate_prompt_tokens}) would cut into "
                f"the prompt's images: its {num_tokens} tokens hold image placeholders from "
                f"position {ranges[0].offset}; keep at least {num_tokens - ranges[0].offset} "
                "tokens or send fewer images", param="truncate_prompt_tokens")


def _json_ready(value: Any) -> Any:
    """`value` as JSON can hold it: an added token as its text (vLLM reads `.content`),
    other objects as their str()."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(item) for item in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
