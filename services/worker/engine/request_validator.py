"""Admission checks of a request against the model and the KV cache."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from meshserve.shared.errors import ContextLengthError, InvalidRequestError
from meshserve.shared.sampling_params import MAX_LOGPROBS, SamplingParams


class RequestValidator:
    """Rejects what could never run, so that a bad request fails alone and at once."""

    def __init__(self, vocab_size: int, max_model_len: int, capacity: int,
                 max_logprobs: int = MAX_LOGPROBS) -> None:
        """`capacity`: most tokens one sequence can reach in the KV cache
        (`KVCacheManager.sequence_capacity`: every block's worth, or more where blocks
        behind a sliding window are freed); `max_logprobs`: most logprobs a request may
        ask for per position (-1: the whole vocabulary)."""
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.capacity = capacity
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs

    def _check_logprobs(self, params: SamplingParams) -> None:
        """vLLM's bound: -1 asks for the whole vocabulary, and no count may pass
        --max-logprobs (-1 there: the vocabulary)."""
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            wanted = getattr(params, name)
            wanted = self.vocab_size if wanted == -1 else wanted
            if wanted is not None and wanted > self.max_logprobs:
                raise InvalidRequestError(
                    f"Requested {kind} logprobs of {wanted}, which is greater than max "
                    f"allowed: {self.max_logprobs}", param=name)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Validate; return the resolved max_tokens of each sequence."""
        num_prompt = len(prompt_token_ids)
        # The texts of vLLM's errors, which clients match.
        if num_prompt == 0:
            raise InvalidRequestError("The decoder prompt cannot be empty", param="prompt")
        if max(prompt_token_ids) >= self.vocab_size or min(prompt_token_ids) < 0:
            raise InvalidRequestError(
                f"Token id {max(prompt_token_ids)} is out of vocabulary", param="prompt")
        outside = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if outside:
            raise InvalidRequestError(
                f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. "
                f"Vocabulary size: {self.vocab_size}", param="logit_bias")
        self._check_logprobs(params)
        if params.max_token_id() >= self.vocab_size:
            raise InvalidRequestError(
                f"token id {params.max_token_id()} in stop_token_ids, logit_bias or allowed_token_ids is outside "
                f"the vocabulary (0..{self.vocab_size - 1})", param="stop_token_ids")
        if num_prompt >= self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {num_prompt} tokens; nothing is left for the completion",
                param="prompt")
        max_tokens = params.max_tokens
        if max_tokens is not None and num_prompt + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens")
        capacity = self.capacity
        if max_tokens is None:
            # Up to the context length, and never more than one sequence can hold in the cache.
            max_tokens = min(self.max_model_len, capacity) - num_prompt
        if num_prompt + max(max_tokens, 1) > capacity:
            raise InvalidRequestError(
                f"the request needs {num_prompt + max_tokens} tokens of KV cache ({num_prompt} "
                f"prompt + {max_tokens} output) but the whole cache holds {capacity}; lower "
                f"max_tokens or give the worker more KV-cache memory", param="max_tokens")
        return max_tokens

    def check_resumed(self, resumed: Mapping[int, Sequence[int]], num_prompt: int, n: int,
                      max_tokens: int) -> None:
        """Validate the output tokens of sequences resumed from another worker: each must
        still have a token to generate."""
        if not resumed:
            raise InvalidRequestError("a resumed request needs at least one sequence",
                                      param="resumed")
        for index, tokens in resumed.items():
            if not 0 <= index < n:
                raise InvalidRequestError(f"resumed sequence {index} is not one of the "
                                          f"request's {n}", param="resumed")
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} of resumed sequence {index} is outside the "
                    f"vocabulary (0..{self.vocab_size - 1})", param="resumed")
            if len(tokens) >= max_tokens or num_prompt + len(tokens) >= self.max_model_len:
                raise InvalidRequestError(
                    f"resumed sequence {index} already has {len(tokens)} output tokens: "
                    f"nothing is left to generate (max_tokens {max_tokens}, context "
                    f"{self.max_model_len})", param="resumed")
