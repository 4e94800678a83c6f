"""Incremental, UTF-8-safe detokenization and stop-string matching.

Pure logic: the only dependency is an object that decodes token ids to text
(`meshserve.services.tokenizer.loader.Tokenizer` in production, anything with
the same `decode` signature in tests).

`IncrementalDetokenizer` decodes a sliding window of token ids with a prefix
offset and a read offset, the way vLLM and text-generation-inference do: the
text of the new tokens is the decoded window minus the decoded prefix, so
decoders that depend on context (a sentencepiece leading space, bytes of one
character spread over several tokens) come out exactly as a full decode would.
`StopChecker` finds stop strings across chunk boundaries. `TextStream` chains
both and is what the tokenizer service and the offline runner use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from meshserve.shared.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character has at most 4 bytes, so at most 4 trailing tokens can hold
# the start of a character that later tokens complete.
_MAX_PARTIAL_TOKENS = 4
# Tokens held back while the text keeps ending in U+FFFD before the tail is
# taken as really broken (stray bytes) and emitted as it decodes.
_MAX_HELD_TOKENS = 16
# Prompt tokens decoded ahead of the output as context (vLLM uses 5 too): enough
# for a sentencepiece leading space or a character split across the boundary.
_PROMPT_CONTEXT_TOKENS = 5


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of stable text.

    Each `feed` costs O(tokens fed + tokens of the previous emission): only the
    window from the prefix offset on is decoded, never the whole output. Text
    whose last character is still incomplete (decodes to U+FFFD) is held back
    until later tokens complete it or `flush` is called.
    """

    def __init__(self, tokenizer: TokenDecoder, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._spaces_between_special = spaces_between_special_tokens
        # Ids from the prompt's tail (context only, never emitted) followed by the output.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode of ids[prefix_offset:read_offset]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens fed whose text has not been emitted yet."""
        return len(self._ids) - self._read_offset

    def feed(self, token_ids: Sequence[int]) -> str:
        """Add new token ids; return the text that became stable."""
        self._ids.extend(token_ids)
        force = self.num_pending_tokens > _MAX_HELD_TOKENS
        return self._advance(final=force)

    def flush(self) -> str:
        """Return all text still held back (the stream has ended)."""
        return self._advance(final=True)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], self._skip_special,
                                      self._spaces_between_special)

    def _advance(self, final: bool) -> str:
        end = len(self._ids)
        if end == self._read_offset:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        prefix_len = len(self._prefix_text)
        # Try the whole window first; if it ends inside a character, try windows
        # that stop before the last few tokens so complete text is not delayed.
        lowest = end if final else max(self._read_offset + 1, end - _MAX_PARTIAL_TOKENS)
        for stop in range(end, lowest - 1, -1):
            text = self._decode(self._prefix_offset, stop)
            complete = not text.endswith(REPLACEMENT_CHAR)
            if len(text) > prefix_len and (complete or final):
                self._prefix_offset, self._read_offset = self._read_offset, stop
                self._prefix_text = None
                return text[prefix_len:]
            if complete:
                break  # nothing new to show (e.g. skipped special tokens); wait for more
        return ""


@dataclass(frozen=True)
class StopMatch:
    """What `StopChecker.feed` lets through."""

    text: str
    stopped: bool = False
    stop_str: str | None = None


class StopChecker:
    """Finds stop strings in a stream of text chunks.

    The stop string that completes first wins (the earliest end; on a tie, the
    one that starts first), so the result does not depend on how the text was
    chunked. A tail that could still begin a stop string is held back until it
    is decided or the stream ends.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stop = tuple(s for s in stop if s)
        self._include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str, final: bool = False) -> StopMatch:
        """Add text; return what may be emitted now and whether a stop string hit."""
        if self._stopped:
            return StopMatch("", True, None)
        buffer = self._pending + text
        match = self._find(buffer)
        if match is not None:
            start, stop_str = match
            self._stopped = True
            self._pending = ""
            end = start + len(stop_str) if self._include else start
            return StopMatch(buffer[:end], True, stop_str)
        hold = 0 if final else self._held_tail(buffer)
        self._pending = buffer[len(buffer) - hold:] if hold else ""
        return StopMatch(buffer[:len(buffer) - hold])

    def _find(self, buffer: str) -> tuple[int, str] | None:
        # The pending part holds no complete stop string, so a search of the
        # buffer finds only matches that end in the new text: O(len(text)).
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in self._stop:
            start = buffer.find(stop_str)
            if start < 0:
                continue
            key = (start + len(stop_str), start, stop_str)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _held_tail(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        for size in range(min(self._max_hold, len(buffer)), 0, -1):
            tail = buffer[-size:]
            if any(s.startswith(tail) for s in self._stop):
                return size
        return 0


@dataclass(slots=True)
class TextDelta:
    """New output text of one sequence, and whether a stop string ended it."""

    text: str
    stopped: bool = False
    stop_reason: str | None = None  # the stop string that matched


class TextStream:
    """Token ids in, stop-checked text out: the detokenizer then the stop checker.

    `feed(token_ids, finished)` takes every token a sequence produced since the
    last call. When the engine finished the sequence on a stop token (EOS or
    one of `stop_token_ids`), pass `stopped_on_token=True`: that last token's
    text is left out unless `include_stop_str_in_output`, as in vLLM. Stop
    strings are looked for only in the text of tokens after the first
    `min_tokens`, as in vLLM.
    """

    def __init__(self, tokenizer: TokenDecoder, params: SamplingParams,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            prompt_token_ids=prompt_token_ids)
        self._stop = StopChecker(params.stop, params.include_stop_str_in_output)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        self._stop_reason: str | None = None
        self._closed = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the stream."""
        return self._stop.stopped

    def feed(self, token_ids: Sequence[int], finished: bool = False,
             stopped_on_token: bool = False) -> TextDelta:
        """Detokenize new tokens; after a stop string or the end, return empty deltas."""
        if self._closed:
            return TextDelta("", self._stop.stopped, self._stop_reason)
        ids = list(token_ids)
        if stopped_on_token and finished and ids and not self._include_stop:
            ids.pop()
        # Tokens still inside min_tokens bypass the stop checker.
        free = max(0, min(len(ids), self._min_tokens - self._num_tokens))
        self._num_tokens += len(ids)
        head = self._detokenizer.feed(ids[:free]) if free else ""
        text = self._detokenizer.feed(ids[free:]) if free < len(ids) else ""
        if finished:
            text += self._detokenizer.flush()
        match = self._stop.feed(text, final=finished)
        if match.stopped:
            self._stop_reason = match.stop_str
        self._closed = match.stopped or finished
        return TextDelta(head + match.text, match.stopped, self._stop_reason)
