"""Rejection sampling of draft tokens: the output keeps the target model's distribution.

For a sequence with drafts x_0..x_{k-1}, the target gives k + 1 distributions p_0..p_k
(rows of the verify pass). Draft x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j));
at the first rejection the token is drawn from norm(max(0, p_j - q_j)) instead and the rest
is dropped; when all k are accepted, a bonus token is drawn from p_k. Each output token is
then distributed exactly as p (the speculative sampling theorem). Greedy rows use the
one-hot p of their argmax: a draft is accepted iff it is the argmax, and the correction is
the argmax itself, so greedy output is token for token that of decoding without drafts.

Proposers here draft deterministically (n-gram lookup, a greedy draft model), so q_j is the
one-hot of x_j: acceptance with probability p_j(x_j), correction from p_j with x_j removed.
A full q (`draft_probs`) is taken too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from meshserve.services.worker.engine.logits_processors import to_device


@dataclass
class RejectionOutput:
    """Per row of the verify batch, on the device until read."""

    # [R] int64: the row's draft token where it was accepted, else the drawn token (the
    # correction of a rejected draft, or the bonus token on a sequence's last row)
    token_ids: Tensor
    # [R] bool: whether the row's draft was accepted (always False on last rows)
    accepted: Tensor


class RejectionSampler:
    """Accepts or corrects draft tokens row by row; its draws come from its own source,
    or from a per-row seed (the same draws alone or in any batch)."""

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed % 2**64)
        self._keyed = torch.Generator(device=self.device)

    @torch.inference_mode()
    def sample(self, logits: Tensor, greedy: list[bool], draft_ids: list[int | None],
               draft_probs: Tensor | None = None,
               seeds: list[int | None] | None = None) -> RejectionOutput:
        """Accept or correct each row's draft.

        logits: [R, V] float32, the final logits each row is drawn from (after penalties,
        temperature and top-k/top-p/min-p; -inf where filtered). greedy: [R], whether the
        row takes the argmax. draft_ids: [R], the draft token the row verifies, None on a
        sequence's last row (its bonus token). draft_probs: [R, V] q of each row (rows
        without a draft ignored), None: one-hot q at the draft. seeds: [R] per-row draw
        seeds (None: the sampler's own source).
        """
        rows, vocab = logits.shape
        assert len(greedy) == len(draft_ids) == rows, "one greedy flag and draft per row"
        p = _target_probs(logits, greedy)  # [R, V]
        has_draft = [d is not None for d in draft_ids]
        ids = to_device([d if d is not None else 0 for d in draft_ids], torch.long, self.device)
        drafted = to_device(has_draft, torch.bool, self.device)  # [R]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[torch.arange(rows, device=p.device), ids] = 1.0
        else:
            q = draft_probs.to(torch.float32).clone()
        q[~drafted] = 0.0  # last rows: nothing to subtract, the bonus comes from p itself
        p_x = p.gather(1, ids[:, None]).squeeze(1)  # [R]
        q_x = q.gather(1, ids[:, None]).squeeze(1)  # [R]
        uniform, exponential = self._noise(rows, vocab, seeds)  # [R], [R, V]
        # u < p(x) / q(x) without dividing (q(x) > 0 for a token drafted from q).
        accepted = drafted & (uniform * q_x < p_x)
        residual = (p - q).clamp_(min=0.0)  # [R, V]
        empty = residual.sum(dim=1, keepdim=True) <= 0.0  # p == q: never used (accepted)
        residual = torch.where(empty, p, residual)
        # Exponential race: argmax(w / E) with E ~ Exp(1) picks index i with prob w_i / sum w
        # (normalizing is not needed).
        drawn = (residual / exponential).argmax(dim=1)  # [R]
        return RejectionOutput(token_ids=torch.where(accepted, ids, drawn), accepted=accepted)

    def _noise(self, rows: int, vocab: int, seeds: list[int | None] | None
               ) -> tuple[Tensor, Tensor]:
        """A uniform [R] and Exp(1) noise [R, V] per row; a seeded row's from its seed alone."""
        noise = torch.empty(rows, vocab + 1, device=self.device)
        noise.uniform_(generator=self._generator)
        for j, seed in enumerate(seeds or ()):
            if seed is not None:
                self._keyed.manual_seed(seed)
                noise[j].uniform_(generator=self._keyed)
        # uniform in [0, 1): -log(1 - u) in [0, inf) is Exp(1); a zero E only ever meets
        # weights that are themselves zero (0/0 = nan is replaced) or wins, which is exact
        # in the limit and has probability 2^-24 per entry.
        exponential = noise[:, 1:].neg().log1p_().neg_()
        exponential = exponential.clamp_(min=torch.finfo(torch.float32).tiny)
        return noise[:, 0], exponential


def _target_probs(logits: Tensor, greedy: list[bool]) -> Tensor:
    """p per row [R, V]: the softmax of sampled rows, the one-hot argmax of greedy rows."""
    p = torch.softmax(logits, dim=-1)
    if any(greedy):
        mask = to_device(greedy, torch.bool, logits.device)
        one_hot = torch.zeros_like(p)
        one_hot[torch.arange(p.shape[0], device=p.device), logits.argmax(dim=-1)] = 1.0
        p = torch.where(mask[:, None], one_hot, p)
    return p


def accepted_lengths(accepted: list[bool], num_drafts: list[int]) -> list[int]:
    """Leading accepted drafts of each sequence, from the per-row flags read back; rows of
    sequence i are its num_drafts[i] draft rows, then its last row."""
    lengths = []
    row = 0
    for k in num_drafts:
        a = 0
        while a < k and accepted[row + a]:
            a += 1
        lengths.append(a)
        row += k + 1
    return lengths
