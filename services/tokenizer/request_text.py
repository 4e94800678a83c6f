"""Text state of one request: its sequences' detokenizers and stop strings (pure logic).

`RequestText` is what the DetokenizeSession stream keeps per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshserve.services.tokenizer.detokenizer import TextDelta, TextStream
from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.sampling_params import SamplingParams


@dataclass(slots=True)
class SequenceUpdate:
    """What one sequence's new tokens turned into."""

    index: int
    text: str
    stopped: bool
    stop_string: str
    finished: bool
    num_output_tokens: int


@dataclass
class _Sequence:
    stream: TextStream
    num_tokens: int = 0  # output tokens that count (up to the stop string's token)
    finished: bool = False
    stop_string: str | None = None


class RequestText:
    """Text state of one request's sequences, from its first tokens to its end.

    With stop strings, a chunk is fed one token at a time so that the token that
    completes a stop string is known (it bounds `num_output_tokens`); without
    them the whole chunk is decoded at once. After a stop string, later tokens
    are ignored and the sequence answers empty, stopped and finished.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, num_sequences: int, *,
                 prompt_tails: Sequence[Sequence[int]], samples_per_prompt: int = 1) -> None:
        """Sequence i follows `prompt_tails[i // samples_per_prompt]` (the last tail when
        there are fewer; no context when there are none)."""
        self._per_token = bool(params.stop)
        tails = [prompt_tails[min(i // samples_per_prompt, len(prompt_tails) - 1)]
                 if prompt_tails else () for i in range(num_sequences)]
        self._sequences = [_Sequence(TextStream(tokenizer, params, tail)) for tail in tails]
        self._num_open = num_sequences
        self.num_tokens_received = 0

    @property
    def done(self) -> bool:
        """Whether every sequence has ended (stopped, or flushed after a final delta)."""
        return self._num_open == 0

    def update(self, index: int, token_ids: Sequence[int], final: bool,
               stopped_on_token: bool = False) -> SequenceUpdate:
        """Feed one sequence's new tokens (and its end, when `final`); return its new text."""
        if not 0 <= index < len(self._sequences):
            raise InvalidRequestError(f"sequence index {index} is out of range: the options "
                                      f"declared {len(self._sequences)} sequences",
                                      param="sequences.index")
        seq = self._sequences[index]
        self.num_tokens_received += len(token_ids)
        text = ""
        if not seq.finished:
            delta = self._feed(seq, token_ids, final, final and stopped_on_token)
            text = delta.text
            seq.finished = delta.stopped or final
            seq.stop_string = delta.stop_reason if delta.stopped else None
            if seq.finished:
                self._num_open -= 1
        elif token_ids and seq.stop_string is None:
            raise InvalidRequestError(f"sequence {index} got tokens after its final delta",
                                      param="sequences.token_ids")
        return SequenceUpdate(
            index=index, text=text, stopped=seq.stop_string is not None,
            stop_string=seq.stop_string or "", finished=seq.finished,
            num_output_tokens=seq.num_tokens)

    def _feed(self, seq: _Sequence, token_ids: Sequence[int], final: bool,
              stopped_on_token: bool) -> TextDelta:
        if not self._per_token or not token_ids:
            seq.num_tokens += len(token_ids)
            return seq.stream.feed(token_ids, finished=final, stopped_on_token=stopped_on_token)
        parts: list[str] = []
        last = len(token_ids) - 1
        for i, token_id in enumerate(token_ids):
            delta = seq.stream.feed((token_id,), finished=final and i == last,
                                    stopped_on_token=stopped_on_token and i == last)
            seq.num_tokens += 1
            parts.append(delta.text)
            if delta.stopped:
                return TextDelta("".join(parts), True, delta.stop_reason)
        return TextDelta("".join(parts))
