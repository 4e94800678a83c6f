"""What the gateway runs for one generation request, and what comes back from it.

`GenerationJob` is built from a parsed OpenAI body (shared/openai_protocol.py) once the
model is known; the orchestrator turns it into a Tokenize call, a route, and entries on
the worker and detokenize session streams, and yields `GenerationUpdate`s, one per worker
stream message, which the renderers turn into SSE chunks or one aggregated response.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from meshserve.services.gateway.media.loader import LoadedImage
from meshserve.services.gateway.media.parts import ImageRef, split_images
from meshserve.services.gateway.parsers.chat_output import ChatOutputSettings
from meshserve.shared.errors import ContextLengthError
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestOptions,
)
from meshserve.shared.prompt_embeds import PromptEmbeds
from meshserve.shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation to render through the chat template.

    Its image parts are `{"type": "image"}` in `messages`; `images` says where each came
    from and its URL, in conversation order (media/parts.py).
    """

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # this request's own template (None: the model's)
    images: tuple[ImageRef, ...] = ()

    @classmethod
    def of(cls, parsed: ChatCompletionRequest) -> ChatPrompt:
        """The prompt of a validated chat body, its image parts set apart."""
        messages, images = split_images(parsed.messages)
        return cls(messages, parsed.tools, parsed.add_generation_prompt,
                   parsed.continue_final_message, parsed.chat_template_kwargs,
                   parsed.chat_template, images)


PromptInput = str | tuple[int, ...] | ChatPrompt | PromptEmbeds
"""Plain text, token ids (sent straight through), a chat conversation, or embeddings."""


@dataclass(frozen=True)
class GenerationJob:
    """One request across the mesh: prompts, sampling and how to answer.

    `max_tokens` is the client's own value (None when it gave none); `default_max_tokens`
    applies otherwise (None: up to the context). `deadline` is on the event loop's clock.
    """

    model: str
    prompts: tuple[PromptInput, ...]
    params: SamplingParams
    options: RequestOptions
    deadline: float
    arrival: float
    chat: bool = False
    max_tokens: int | None = None
    default_max_tokens: int | None = None
    echo: bool = False
    add_special_tokens: bool = True
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    chat_output: ChatOutputSettings | None = None  # how chat choices are read back
    suffix: str | None = None  # fill-in-the-middle: the text after the completion
    # A LoRA adapter's request: `model` is the adapter's name (as answers show it), these
    # the model it adapts (what tokenizers and the scheduler know) and the adapter's id.
    base_model: str | None = None
    lora_id: int | None = None
    role: str = "assistant"  # a chat answer's role (vLLM: the final message's, continuing it)
    echo_text: str = ""  # what a chat answer starts with (vLLM's chat `echo`)

    @property
    def target_model(self) -> str:
        """The served model that runs the request (the adapter's base for an adapter)."""
        return self.base_model or self.model

    @classmethod
    def for_completion(cls, parsed: CompletionRequest, body: dict[str, Any], *, model: str,
                       default_max_tokens: int | None, arrival: float,
                       deadline: float, embeds: tuple[PromptEmbeds, ...] = ()
                       ) -> GenerationJob:
        """A /v1/completions job (`body` tells whether max_tokens was given); `embeds`:
        the body's prompt_embeds, read, which come before its text prompts (as vLLM)."""
        explicit = parsed.params.max_tokens if body.get("max_tokens") is not None else None
        return cls(model=model, prompts=(*embeds, *parsed.prompts), params=parsed.params,
                   options=parsed.options, deadline=deadline, arrival=arrival,
                   max_tokens=explicit, default_max_tokens=default_max_tokens,
                   echo=parsed.echo, add_special_tokens=parsed.add_special_tokens,
                   suffix=parsed.suffix)

    @classmethod
    def for_chat(cls, parsed: ChatCompletionRequest, *, model: str,
                 default_max_tokens: int | None, arrival: float,
                 deadline: float, chat_output: ChatOutputSettings | None = None
                 ) -> GenerationJob:
        """A /v1/chat/completions job."""
        return cls(model=model, prompts=(ChatPrompt.of(parsed),), params=parsed.params, options=parsed.options,
                   deadline=deadline, arrival=arrival, chat=True,
                   max_tokens=parsed.params.max_tokens, default_max_tokens=default_max_tokens,
                   add_special_tokens=parsed.add_special_tokens,
                   chat_output=chat_output if chat_output and chat_output.active else None,
                   role=parsed.response_role, echo_text=parsed.echo_text)

    @property
    def num_choices(self) -> int:
        """Sequences of the request: prompt p's sample s is choice p * n + s."""
        return len(self.prompts) * self.params.n

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    @property
    def prompt_param(self) -> str:
        """The body key that holds the prompt (for error messages)."""
        return "messages" if self.chat else "prompt"


@dataclass(frozen=True)
class PlacedImage:
    """An image of a tokenized prompt: the file, and the run of placeholder tokens
    (`length` from `offset`) its embeddings replace."""

    image: LoadedImage
    offset: int
    length: int


@dataclass(frozen=True)
class PreparedPrompt:
    """A tokenized prompt: its ids, its text (for echo), its model's context length and its
    images; or a prompt given as embeddings (one placeholder id a row, no text)."""

    token_ids: list[int]
    text: str | None = None
    max_model_len: int | None = None
    images: tuple[PlacedImage, ...] = ()
    embeds: PromptEmbeds | None = None

    @property
    def context_ids(self) -> list[int]:
        """The tokens the detokenizer reads output text after (none after embeddings)."""
        return [] if self.embeds is not None else self.token_ids


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained from one worker stream message.

    `token_ids` and `logprobs` hold only tokens that count (none past a stop string);
    `prompt_logprobs` (None for the first prompt token) come with a choice's first delta
    when the worker sent them.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class GenerationUpdate:
    """Every choice delta of one worker stream message (choices without news left out)."""

    choices: list[ChoiceDelta]


def resolve_max_tokens(job: GenerationJob, prompts: list[PreparedPrompt]) -> int | None:
    """The max_tokens sent to the worker (None: up to the context); checks the context.

    A prompt that fills the context, or an explicit max_tokens past what it leaves, is a
    ContextLengthError (400), as in vLLM; a default is capped at the room left instead.
    Prompts whose context length is unknown here are checked by the worker.
    """
    rooms: list[int] = []
    for prompt in prompts:
        if prompt.max_model_len is None:
            continue
        size, limit = len(prompt.token_ids), prompt.max_model_len
        if size >= limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt has {size} tokens, which leaves no room for a completion. Please "
                "reduce the length of the prompt.", param=job.prompt_param)
        if job.max_tokens is not None and size + job.max_tokens > limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {size + job.max_tokens} tokens ({size} in the prompt, "
                f"{job.max_tokens} for the completion). Please reduce the length of the "
                "prompt or max_tokens.", param="max_tokens")
        rooms.append(limit - size)
    if job.max_tokens is not None:
        return job.max_tokens
    if job.default_max_tokens is None:
        return None
    return min([job.default_max_tokens, *rooms])
