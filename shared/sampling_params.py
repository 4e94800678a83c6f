"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.structured_outputs import StructuredOutputs

# Most sequences one request may fan out to; each holds its own KV blocks.
MAX_N = 128
# Default of the worker's --max-logprobs: most top alternatives a request may ask for per
# position (OpenAI allows 20; vLLM's default cap is 20 as well). The worker checks it, as it
# knows the vocabulary that `logprobs=-1` (every token) stands for.
MAX_LOGPROBS = 20
# `logprobs` / `prompt_logprobs` of -1 (the whole vocabulary) as the wire's uint32 carries it.
WHOLE_VOCAB_WIRE = 2**32 - 1


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Defaults match OpenAI and vLLM.

    `top_k` <= 0 and `top_p` == 1 and `min_p` == 0 switch those filters off;
    `temperature` == 0 means greedy. `logprobs` is the number of top
    alternatives returned per output token (0: only the chosen token's
    logprob; -1: every token of the vocabulary; None: no logprobs). `stop` strings are matched by the
    detokenizer, not by the engine. `structured` constrains every output token to a
    schema, regex, choice or grammar (compiled and applied by the worker); the tokens of
    `bad_words` are never generated (vLLM's meaning: a word's last token is banned where
    its other tokens were just generated); with `allowed_token_ids`, only those tokens are.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    min_tokens: int = 0
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured: StructuredOutputs | None = None
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token
    # Beam search (n beams; engine/beam_search.py): a finished beam scores
    # cumulative_logprob / length ** length_penalty; early_stopping is True, False or "never".
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(1 <= self.n <= MAX_N, f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}",
               "temperature")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check(self.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {self.top_k}",
               "top_k")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
               "presence_penalty")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
               "frequency_penalty")
        _check(self.repetition_penalty > 0.0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty}",
               "repetition_penalty")
        _check(self.max_tokens is None or self.max_tokens >= 1,
               f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}",
               "min_tokens")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
               "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):  # -1: the whole vocabulary (vLLM's)
            value = getattr(self, name)
            _check(value is None or -1 <= value < WHOLE_VOCAB_WIRE,
                   f"`{name}` must be a positive value or -1, got {value}", name)
        # vLLM's bounds: a signed 64-bit integer.
        _check(self.seed is None or -(2**63) <= self.seed < 2**63,
               f"seed must be between {-(2**63)} and {2**63 - 1}, got {self.seed}", "seed")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers", "stop_token_ids")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop must be a list of non-empty strings", "stop")
        _check(all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
               "allowed_token_ids must be non-negative integers", "allowed_token_ids")
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words),
               "bad_words must be a list of non-empty strings", "bad_words")
        _check(self.early_stopping in (True, False, "never"),
               f"early_stopping must be true, false or 'never', got {self.early_stopping!r}",
               "early_stopping")
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                _check(isinstance(token, int) and token >= 0,
                       f"logit_bias keys must be token ids, got {token!r}", "logit_bias")
                _check(-100.0 <= bias <= 100.0,
                       f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_history(self) -> bool:
        """Whether sampling needs every earlier output token on the host (beam search: the
        search picks each step's tokens before the next step)."""
        return self.needs_penalties or bool(self.bad_words) or self.use_beam_search

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def max_token_id(self) -> int:
        """Largest token id the parameters name (-1 if none), for vocabulary checks."""
        ids = (list(self.stop_token_ids) + list((self.logit_bias or {}).keys())
               + list(self.allowed_token_ids))
        return max(ids, default=-1)
