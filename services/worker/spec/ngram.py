"""The n-gram (prompt lookup) proposer: drafts are the tokens that followed the latest
earlier occurrence of the context's suffix.

Pure logic over token ids. For n from `max_n` down to `min_n`, the last n tokens of the
context are looked up among its earlier n-grams; the latest match wins (a repeated loop's
most recent turn), and the up to `k` tokens after it are the draft. No match: no draft.

The lookup is one vectorised pass over the context (where does its last token occur
before?) and then a check of one more token per n, over those few places only. A
sequence's tokens are kept as an array that each step only appends to (`TokenHistory`),
so a step costs the new tokens, not a copy of the whole context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


class NgramProposer:
    """Proposes up to `k` draft tokens per context by suffix lookup."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n and k >= 1, "need 1 <= min_n <= max_n and k >= 1"
        self.k = k
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, context: Sequence[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to `k` (default: the configured count) tokens likely to follow `context`."""
        want = self.k if k is None else min(k, self.k)
        if want <= 0 or len(context) < self.min_n + 1:
            return []
        tokens = np.asarray(context, dtype=np.int64)  # [L]; no copy for an int64 array
        end = self._latest_match_end(tokens)
        return [] if end is None else tokens[end + 1 : end + 1 + want].tolist()

    def _latest_match_end(self, tokens: np.ndarray) -> int | None:
        """Where the latest earlier occurrence of the longest matching suffix (of min_n to
        max_n tokens) ends, before the last token; None without one."""
        last = len(tokens) - 1
        # ends: [C] positions j <= L-2 where an earlier n-gram could end, kept while
        # tokens[j-i] == tokens[last-i] for every i < n.
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        found = None
        for n in range(1, self.max_n + 1):
            if n > 1:
                ends = ends[ends >= n - 1]
                ends = ends[tokens[ends - (n - 1)] == tokens[last - (n - 1)]]
            if not ends.size:
                break
            if n >= self.min_n:
                found = int(ends[-1])
        return found


class TokenHistory:
    """A sequence's known tokens as one int64 array, appended to as the sequence grows."""

    def __init__(self) -> None:
        self._buffer = np.empty(256, dtype=np.int64)
        self.length = 0

    def tokens(self, read: Callable[[int, int], list[int]], length: int) -> np.ndarray:
        """The sequence's first `length` tokens as a view of the buffer; `read(start, end)`
        gives the sequence's tokens [start, end), asked only for those not here yet."""
        if length < self.length:  # the sequence is shorter than what is here: start again
            self.length = 0
        if length > self.length:
            if length > len(self._buffer):
                grown = np.empty(max(length, 2 * len(self._buffer)), dtype=np.int64)
                grown[: self.length] = self._buffer[: self.length]
                self._buffer = grown
            self._buffer[self.length : length] = read(self.length, length)
            self.length = length
        return self._buffer[:length]
