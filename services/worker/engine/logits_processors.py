"""Logits processors of the sampler, each one tensor op over the rows that use it:
penalties, top-k / top-p, min-p, and the bans of bad words."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from meshserve.shared.errors import InternalError

_NEG_INF = float("-inf")


def banned_tokens(output: Sequence[int], bad_words: Sequence[Sequence[int]]) -> list[int]:
    """Tokens a bad word bans next: its last token, where `output` ends with the others."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix == 0 or (len(output) >= prefix and list(output[-prefix:]) == list(word[:-1])):
            banned.append(word[-1])
    return banned


def apply_penalties(
    logits: Tensor,
    prompt_ids: Sequence[Sequence[int]] | None,
    output_ids: Sequence[Sequence[int]],
    repetition: Sequence[float] | None,
    frequency: Sequence[float] | None,
    presence: Sequence[float] | None,
) -> Tensor:
    """Penalised copy of `logits` [P, V], one list of token ids and one factor per row.

    repetition (HF/vLLM): tokens seen in the prompt or output have logit / r if positive, else
    logit * r. frequency and presence (OpenAI): logit -= f * count + p * (count > 0) over output
    tokens. A None factor list skips that penalty (repetition needs prompt_ids). Token ids
    must lie in [0, V); the engine checks prompts against the vocabulary on admission.
    """
    vocab = logits.shape[1]
    out_counts = _token_counts(output_ids, vocab, logits.device)  # [P, V]
    seen = out_counts > 0
    if repetition is not None:
        if prompt_ids is None:
            raise InternalError("repetition penalty needs the prompt token ids")
        seen_any = seen | (_token_counts(prompt_ids, vocab, logits.device) > 0)
        rep = to_device(repetition, torch.float32, logits.device).unsqueeze(1)  # [P, 1]
        logits = torch.where(seen_any, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if frequency is not None:
        freq = to_device(frequency, torch.float32, logits.device).unsqueeze(1)
        logits = logits - freq * out_counts
    if presence is not None:
        pres = to_device(presence, torch.float32, logits.device).unsqueeze(1)
        logits = logits - pres * seen
    return logits


def apply_top_k_top_p(
    logits: Tensor, top_k: Sequence[int] | None, top_p: Sequence[float] | None
) -> Tensor:
    """Copy of `logits` [F, V] with tokens outside each row's top_k and top_p set to -inf.

    top_k keeps the k largest logits; top_p then keeps the smallest set of the most likely
    tokens whose probability (renormalised after top_k) reaches p, at least one token. Both cut
    at a threshold value, so tokens tied with the last kept one stay. k = V and p = 1 leave a
    row as it is; all rows need a k in [1, V] when top_k is given. With neither, `logits` is
    returned as it is.
    """
    vocab = logits.shape[1]
    if top_p is None:
        if top_k is None:
            return logits
        # Only top_k: the k-th largest value comes from a partial top-k, no full sort.
        ks = to_device(top_k, torch.long, logits.device).unsqueeze(1)  # [F, 1]
        kth = logits.topk(max(top_k), dim=-1).values.gather(1, ks - 1)  # [F, 1]
        return logits.masked_fill(logits < kth, _NEG_INF)
    ascending = _sorted_values(logits)  # [F, V]
    threshold = torch.full((logits.shape[0], 1), _NEG_INF, device=logits.device)
    if top_k is not None:
        ks = to_device(top_k, torch.long, logits.device).unsqueeze(1)
        threshold = ascending.gather(1, vocab - ks)  # [F, 1], the k-th largest
        ascending = ascending.masked_fill(ascending < threshold, _NEG_INF)
    ps = to_device(top_p, torch.float32, logits.device).unsqueeze(1)  # [F, 1]
    # vLLM's rule: drop the low end while its cumulative mass stays <= 1 - p; keep the max.
    # Masses stay unnormalised (the row max is the last entry, the total the last cumulative
    # sum), and as the sum never decreases a binary search counts the dropped entries.
    cumulative = (ascending - ascending[:, -1:]).exp_().cumsum_(dim=-1)  # [F, V]
    limit = (1 - ps) * cumulative[:, -1:]  # [F, 1]
    dropped = torch.searchsorted(cumulative, limit, right=True).clamp_(max=vocab - 1)  # [F, 1]
    smallest_kept = ascending.gather(1, dropped)  # [F, 1]
    threshold = torch.maximum(threshold, smallest_kept)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_min_p(logits: Tensor, min_p: Sequence[float]) -> Tensor:
    """Copy of `logits` [M, V] without tokens whose probability is below min_p x the row's max.

    In log space, p < min_p * p_max is logit < max_logit + log(min_p): no softmax needed.
    """
    offset = to_device([math.log(m) for m in min_p], torch.float32, logits.device)  # [M]
    floor = logits.amax(dim=-1, keepdim=True) + offset.unsqueeze(1)  # [M, 1]
    return logits.masked_fill(logits < floor, _NEG_INF)


def to_device(values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
               dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of `values` on `device`, copied up without blocking the host off the CPU."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _token_counts(token_ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> Tensor:
    """Occurrences [P, V] float32 of each token id in each row's list."""
    width = max((len(ids) for ids in token_ids), default=0)
    # Rows are padded with id `vocab`, counted in an extra column that is then dropped.
    padded = [list(ids) + [vocab] * (width - len(ids)) for ids in token_ids]
    index = to_device(padded, torch.long, device).view(len(token_ids), width)  # [P, L]
    counts = torch.zeros(len(token_ids), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def _sorted_values(logits: Tensor) -> Tensor:
    """Each row of `logits` [F, V] sorted ascending (values only).

    On CPU numpy's SIMD sort of values is several times faster than torch.sort, which also
    builds indices nobody needs here; on accelerators torch.sort stays on the device.
    """
    if logits.device.type == "cpu":
        return torch.from_numpy(np.sort(logits.numpy(), axis=-1))
    return torch.sort(logits, dim=-1).values
