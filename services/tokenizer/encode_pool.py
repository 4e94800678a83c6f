"""Where prompts are rendered and encoded: on the event loop when small, on threads when large.

A Hugging Face fast tokenizer encodes well under a millisecond for an ordinary prompt,
less than a hop to a thread costs, so small prompts stay on the event loop. Megabytes take
seconds (an 8 MB text: about 5 s on one core) and would stall every other call of the
replica, detokenization included; they go to a bounded pool of threads. The Rust encoder
releases the GIL, and the chat template's Jinja rendering (which holds it) still gives the
event loop its turn every switch interval. A fast tokenizer is not safe to use from several
threads at once (the Rust side raises "Already borrowed"), so each pool thread borrows a
copy of its own.

Prompts are bounded in characters before any work: past the limit a request fails at once
with a clear error instead of queueing seconds of encoding that could only end in a
context-length error.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from meshserve.services.tokenizer.model import PromptInput, ServedModel, TokenizedPrompt
from meshserve.shared.errors import ContextLengthError, InvalidRequestError, OverloadedError

# No tokenizer we serve averages this many characters a token (English BPE: about 4), so a
# prompt of more than this many characters per context token cannot fit the context.
MAX_CHARS_PER_TOKEN = 32
# Large prompts waiting for (or on) a pool thread, per thread, before more are refused.
WAITING_PER_THREAD = 8


@dataclass(frozen=True)
class PromptLimits:
    """How prompts are tokenized and how large they may be (the tokenizer's flags)."""

    workers: int = 2  # threads for large prompts
    large_prompt_chars: int = 8192  # this many characters or more go to a thread
    max_prompt_chars: int | None = None  # None: MAX_CHARS_PER_TOKEN x the context length

    def __post_init__(self) -> None:
        assert self.workers >= 1, f"workers must be >= 1, got {self.workers}"
        assert self.large_prompt_chars >= 0, "large_prompt_chars must be >= 0"
        assert self.max_prompt_chars is None or self.max_prompt_chars >= 1, (
            f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")

    @property
    def max_waiting(self) -> int:
        """Large prompts accepted at once (running or queued) before refusing more."""
        return WAITING_PER_THREAD * self.workers


class EncodePool:
    """Tokenizes prompts for one served model under `PromptLimits`."""

    def __init__(self, limits: PromptLimits) -> None:
        self.limits = limits
        self._threads = ThreadPoolExecutor(max_workers=limits.workers,
                                           thread_name_prefix="tokenize")
        self._copies: queue.SimpleQueue[ServedModel] = queue.SimpleQueue()
        self._waiting = 0

    def set_model(self, model: ServedModel) -> None:
        """Make one tokenizer copy per thread of `model` (once it is loaded)."""
        for _ in range(self.limits.workers):
            self._copies.put(dataclasses.replace(model,
                                                 tokenizer=copy.deepcopy(model.tokenizer)))

    async def tokenize(self, model: ServedModel, prompt: PromptInput) -> TokenizedPrompt:
        """`model.tokenize(prompt)`, on a pool thread when the prompt is large.

        Raises ContextLengthError (or InvalidRequestError past an explicit
        `max_prompt_chars`) for a prompt over the character limit, and OverloadedError
        when `max_waiting` large prompts are in the pool already.
        """
        size = prompt.size
        self._check_size(size, prompt, model.max_model_len)
        if size < self.limits.large_prompt_chars:
            return model.tokenize(prompt)
        if self._waiting >= self.limits.max_waiting:
            raise OverloadedError(f"{self._waiting} large prompts are being tokenized "
                                  "already; retry later")
        self._waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._threads, self._tokenize_on_a_copy, prompt)
        finally:
            self._waiting -= 1

    def _check_size(self, size: int, prompt: PromptInput, max_model_len: int) -> None:
        param = "prompt" if prompt.text is not None else "messages"
        limit = self.limits.max_prompt_chars
        if limit is not None:
            if size > limit:
                raise InvalidRequestError(
                    f"the prompt has {size} characters, more than this server accepts "
                    f"({limit}, --max-prompt-chars)", param=param)
        elif not prompt.truncate_prompt_tokens and size > MAX_CHARS_PER_TOKEN * max_model_len:
            raise ContextLengthError(
                f"the prompt has {size} characters: far more than fit in this model's "
                f"context of {max_model_len} tokens (at most {MAX_CHARS_PER_TOKEN} characters "
                "a token are accepted); shorten it or set truncate_prompt_tokens", param=param)

    def _tokenize_on_a_copy(self, prompt: PromptInput) -> TokenizedPrompt:
        # One copy per thread exists, so a copy is always free here.
        model = self._copies.get_nowait()
        try:
            return model.tokenize(prompt)
        finally:
            self._copies.put(model)
