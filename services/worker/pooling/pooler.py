"""Pooling: the hidden states of a flat batch of sequences -> one vector per sequence.

The model's forward returns [T, H] hidden states (after the final norm) for T tokens of
B sequences laid end to end, sequence i owning rows `starts[i] : starts[i] + lens[i]`.
Pooling picks or averages each sequence's rows; `finish` then keeps a Matryoshka prefix
of the dimensions and L2-normalises (in that order, as vLLM and sentence-transformers
do: a truncated vector is normalised again).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from meshserve.services.worker.models.pooling_config import PoolingType


def pool(hidden: torch.Tensor, seq_lens: Sequence[int],
         pooling_type: PoolingType) -> torch.Tensor:
    """[T, H] hidden states of sequences of `seq_lens` tokens -> [B, H] float32."""
    assert hidden.dim() == 2 and hidden.shape[0] == sum(seq_lens), (
        f"hidden {tuple(hidden.shape)} does not hold {sum(seq_lens)} tokens")
    assert all(n > 0 for n in seq_lens), f"every sequence needs a token, got {list(seq_lens)}"
    lens = torch.tensor(list(seq_lens), device=hidden.device)  # [B]
    ends = torch.cumsum(lens, 0)  # [B], one past each sequence's last row
    if pooling_type == "LAST":
        return hidden.index_select(0, ends - 1).float()
    if pooling_type == "CLS":
        return hidden.index_select(0, ends - lens).float()
    assert pooling_type == "MEAN", f"unknown pooling type {pooling_type!r}"
    # Sum each sequence's rows with one scatter-add over a row -> sequence map, in float32
    # so that long sequences in bf16 do not lose the small terms.
    owner = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lens)
    sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32,
                       device=hidden.device)
    sums.index_add_(0, owner, hidden.float())  # [B, H]
    return sums / lens[:, None].to(torch.float32)


def finish(pooled: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """[B, H] pooled vectors -> [B, dimensions]: the first `dimensions`, then L2 norm."""
    assert 0 < dimensions <= pooled.shape[-1], (
        f"dimensions {dimensions} outside 1..{pooled.shape[-1]}")
    out = pooled[:, :dimensions]
    return F.normalize(out, p=2, dim=-1) if normalize else out
