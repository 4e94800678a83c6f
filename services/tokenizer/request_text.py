"""Text state of one request: its sequences' detokenizers and stop strings (pure logic).

`RequestText` is what the DetokenizeSession stream keeps per request. A request carried
over from a session that broke is rebuilt with `resume`: the tokens the old session
answered are replayed in the entries that brought them, which restores the held-back
bytes, the stop checker's pending text and the token counts as they were; the replayed
text is then squared with the text the old session sent, so the next answers go on from
exactly where the client's text ends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from meshserve.services.tokenizer.detokenizer import TextDelta, TextStream
from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.sampling_params import SamplingParams

_log = logging.getLogger(__name__)


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
    # After a resume: text of answered tokens the old session had not sent yet (owed), or
    # characters it had sent ahead of the replay (to skip); at most one is non-empty.
    owed: str = ""
    skip: int = 0


class RequestText:
    """Text state of one request's sequences, from its first tokens to its end.

    With stop strings, a chunk is fed one token at a time so that the token that
    completes a stop string is known (it bounds `num_output_tokens`); without
    them the whole chunk is decoded at once. After a stop string, later tokens
    are ignored and the sequence answers empty, stopped and finished.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, num_sequences: int, *,
                 prompt_tails: Sequence[Sequence[int]], samples_per_prompt: int = 1,
                 vocab_size: int | None = None) -> None:
        """Sequence i follows `prompt_tails[i // samples_per_prompt]` (the last tail when
        there are fewer; no context when there are none). With `vocab_size`, token ids
        from it on are refused rather than decoded to nothing."""
        self._vocab_size = vocab_size
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
        seq = self._sequence(index)
        self._check_vocabulary(token_ids)
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
            index=index, text=_settle(seq, text), stopped=seq.stop_string is not None,
            stop_string=seq.stop_string or "", finished=seq.finished,
            num_output_tokens=seq.num_tokens)

    def resume(self, index: int, token_ids: Sequence[int], sent_text: str, *,
               finished: bool = False, entry_sizes: Sequence[int] = ()) -> None:
        """Carry sequence `index` over from a session that broke, before any update: it had
        answered `token_ids`, in entries of `entry_sizes` tokens (none: one token each),
        with `sent_text` in all (see the module doc); a `finished` sequence gets no more
        tokens and is only marked ended."""
        seq = self._sequence(index)
        if seq.finished or seq.num_tokens:
            raise InvalidRequestError(f"sequence {index} is resumed twice, or after its "
                                      f"first tokens", param="resumed.index")
        if finished:
            self._end(seq, None)
            return
        sizes = list(entry_sizes) or [1] * len(token_ids)
        if sum(sizes) != len(token_ids) or 0 in sizes:
            raise InvalidRequestError(f"the entry sizes of sequence {index} must be positive "
                                      f"and add up to its {len(token_ids)} tokens",
                                      param="resumed.entry_sizes")
        parts: list[str] = []
        start = 0
        for size in sizes:
            delta = self._feed(seq, token_ids[start:start + size], False, False)
            start += size
            parts.append(delta.text)
            if delta.stopped:
                self._end(seq, delta.stop_reason)
                break
        replayed = "".join(parts)
        if not (replayed.startswith(sent_text) or sent_text.startswith(replayed)):
            _log.warning("sequence %d resumed with a replayed text that is not an extension "
                         "of the text sent (%d and %d characters)", index, len(replayed),
                         len(sent_text))
        seq.owed = replayed[len(sent_text):]
        seq.skip = max(0, len(sent_text) - len(replayed))

    def _sequence(self, index: int) -> _Sequence:
        if not 0 <= index < len(self._sequences):
            raise InvalidRequestError(f"sequence index {index} is out of range: the options "
                                      f"declared {len(self._sequences)} sequences",
                                      param="sequences.index")
        return self._sequences[index]

    def _end(self, seq: _Sequence, stop_string: str | None) -> None:
        seq.finished = True
        seq.stop_string = stop_string
        self._num_open -= 1

    def _check_vocabulary(self, token_ids: Sequence[int]) -> None:
        if self._vocab_size is None or not token_ids:
            return
        outside = [t for t in token_ids if t >= self._vocab_size]
        if outside:  # vLLM's text for an out-of-vocabulary token id
            raise InvalidRequestError(f"Token id {outside[0]} is out of vocabulary",
                                      param="tokens")

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


def _settle(seq: _Sequence, text: str) -> str:
    """`text` squared with a resume: what was owed goes first, what was sent ahead is cut."""
    if seq.owed:
        text, seq.owed = seq.owed + text, ""
    if seq.skip:
        cut = min(seq.skip, len(text))
        text, seq.skip = text[cut:], seq.skip - cut
    return text
