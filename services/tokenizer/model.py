"""The model a tokenizer replica serves, and the prompts it turns into token ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshserve.services.tokenizer.loader import Tokenizer
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
    """Token ids of a prompt and the text they were made from."""

    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class ServedModel:
    """The one model a tokenizer replica serves: its tokenizer, names and context length."""

    tokenizer: Tokenizer
    names: tuple[str, ...]  # names a request's `model` may use ("" always means this one)
    max_model_len: int
    chat_template: str | None = None  # the server's replacement for the model's template

    @property
    def name(self) -> str:
        """The served model name."""
        return self.names[0]

    def check_name(self, model: str) -> None:
        """Raise NotFoundError unless `model` is empty or one of this model's names."""
        if model and model not in self.names:
            raise NotFoundError(f"model {model!r} is not served here (serving {self.name!r})",
                                param="model")

    def tokenize(self, prompt: PromptInput) -> TokenizedPrompt:
        """Render (chat) and encode a prompt, keeping the last `truncate_prompt_tokens`."""
        if prompt.messages is not None:
            text = self.tokenizer.render_chat(
                prompt.messages, prompt.tools, prompt.add_generation_prompt,
                prompt.continue_final_message, prompt.chat_template_kwargs,
                chat_template=prompt.chat_template or self.chat_template)
        else:
            assert prompt.text is not None, "a prompt needs text or messages"
            text = prompt.text
            if prompt.suffix is not None:
                text = self.tokenizer.fill_in_middle(text, prompt.suffix)
        ids = self.tokenizer.encode(text, add_special_tokens=prompt.add_special_tokens)
        if prompt.truncate_prompt_tokens and len(ids) > prompt.truncate_prompt_tokens:
            if prompt.suffix is not None:  # cutting the left would cut the FIM prefix token
                raise InvalidRequestError(
                    f"the fill-in-the-middle prompt has {len(ids)} tokens, more than "
                    f"'truncate_prompt_tokens' keeps ({prompt.truncate_prompt_tokens}); "
                    "shorten the prompt or the suffix instead", param="truncate_prompt_tokens")
            ids = ids[-prompt.truncate_prompt_tokens:]
        return TokenizedPrompt(ids, text)
