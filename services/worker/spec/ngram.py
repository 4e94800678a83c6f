"""The n-gram (prompt lookup) proposer: drafts are the tokens that followed the latest
earlier occurrence of the context's suffix.

Pure logic over token ids. For n from `max_n` down to `min_n`, the last n tokens of the
context are looked up among its earlier n-grams; the latest match wins (a repeated loop's
most recent turn), and the up to `k` tokens after it are the draft. No match: no draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes up to `k` draft tokens per context by suffix lookup."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n and k >= 1, "need 1 <= min_n <= max_n and k >= 1"
        self.k = k
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, context: Sequence[int], k: int | None = None) -> list[int]:
        """Up to `k` (default: the configured count) tokens likely to follow `context`."""
        want = self.k if k is None else min(k, self.k)
        if want <= 0 or len(context) < self.min_n + 1:
            return []
        tokens = np.asarray(context, dtype=np.int64)  # [L]
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._latest_match(tokens, n)
            if start is not None:
                return tokens[start + n : start + n + want].tolist()
        return []

    @staticmethod
    def _latest_match(tokens: np.ndarray, n: int) -> int | None:
        """Start of the latest n-gram before the suffix equal to the last n tokens."""
        suffix = tokens[-n:]
        # windows: [L - n, n], every n-gram that ends before the last token.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        return int(hits[-1]) if hits.size else None
