"""Structured outputs in the engine core, the applying side: each step, the logits rows of
constrained sequences are masked to what their grammars allow (one batched bitmask fill
over all constrained rows, xgrammar's C++ threads, and one masking op on the device), and
the sampled tokens are fed to their matchers. The matchers come from the structured-outputs
feature (services/worker/structured/), which compiles the grammars.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def accept_tokens(matchers: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
    """Feed token i to matcher i, all in one call into xgrammar; whether each took it."""
    import xgrammar as xgr

    return list(xgr.BatchGrammarMatcher.batch_accept_token(list(matchers), list(tokens)))


class BitmaskApplier:
    """Masks the logits rows of constrained sequences to what their grammars allow."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._words = (vocab_size + 31) // 32
        self._host: Tensor | None = None  # [rows, words] int32, pinned off the CPU
        self._batch: Any = None

    def apply(self, logits: Tensor, matchers: Sequence[Any | None]) -> None:
        """Set logits [B, V] to -inf where row i's matcher forbids the token (rows whose
        matcher is None, or has terminated, are left as they are)."""
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if not rows:
            return
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        bitmask = self._bitmask(logits.shape[0])
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask,
                                                  indices=rows)
        if logits.is_cuda:
            on_device = bitmask.to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, on_device, vocab_size=self.vocab_size,
                                            indices=rows, backend="triton")
        else:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                            indices=rows, backend="cpu")

    def _bitmask(self, num_rows: int) -> Tensor:
        if self._host is None or self._host.shape[0] < num_rows:
            size = max(num_rows, 2 * (0 if self._host is None else self._host.shape[0]))
            self._host = torch.empty((size, self._words), dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        return self._host[:num_rows]
