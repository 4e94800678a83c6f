"""The verify pass of speculating sequences: one query of [last token + k drafts] per
sequence in the step's batch; its k + 1 rows of logits accept or correct the drafts.

Each row is processed as the plain sampler would process that position (penalties, bad
words and min_tokens see the output followed by the drafts before it; temperature, top-k,
top-p, min-p), then the rejection sampler keeps the target distribution. Logprobs are the
raw logits' (as the sampler's), for the tokens finally emitted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshserve.services.worker.engine.hooks import Verified
from meshserve.services.worker.engine.sampler import (
    HostCopy,
    Sampler,
    SamplingRow,
    _draw_seed,
    logprob_entries,
    logprob_table,
)
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.services.worker.spec.rejection import RejectionSampler, accepted_lengths
from meshserve.shared.logprobs import TokenLogprobs


class PendingVerify:
    """The verify pass queued on the device; `read()` waits for it (one host copy, plus one
    for logprobs when any sequence asked)."""

    def __init__(self, requests: list[SequenceState], drafts: list[list[int]], tokens: Tensor,
                 accepted: Tensor, logprobs: list[tuple[int, HostCopy]]) -> None:
        self._requests = requests
        self._drafts = drafts
        # [2, R]: token ids, accepted flags
        self._copy = HostCopy(torch.stack([tokens, accepted.to(torch.long)]))
        self._logprobs = dict(logprobs)  # sequence index -> [k + 1, W] table

    def read(self) -> list[Verified]:
        tokens, accepted = self._copy.get().tolist()
        lengths = accepted_lengths([bool(a) for a in accepted], [len(d) for d in self._drafts])
        out = []
        row = 0
        for i, (request, drafts, a) in enumerate(zip(self._requests, self._drafts, lengths,
                                                     strict=True)):
            emitted = [int(t) for t in tokens[row : row + a + 1]]
            logprobs: list[TokenLogprobs | None] = [None] * len(emitted)
            if i in self._logprobs:
                entries = logprob_entries(self._logprobs[i].get().tolist()[: a + 1])
                count = request.params.logprobs or 0
                for entry in entries:
                    entry.top = entry.top if count == -1 else entry.top[:count]  # -1: all
                logprobs = list(entries)
            out.append(Verified(request, emitted, logprobs, len(drafts)))
            row += len(drafts) + 1
        return out


class Verifier:
    """Turns the verify rows' hidden states into accepted tokens."""

    def __init__(self, sampler: Sampler, rejection: RejectionSampler) -> None:
        self.sampler = sampler
        self.rejection = rejection

    @torch.inference_mode()
    def launch(self, logits: Tensor, requests: list[SequenceState]) -> PendingVerify:
        """logits: [R, V] float32, the k_i + 1 rows of each request in order (its drafts are
        `request.spec_token_ids`)."""
        drafts = [list(r.spec_token_ids) for r in requests]
        rows: list[SamplingRow] = []
        draft_ids: list[int | None] = []
        seeds: list[int | None] = []
        for request, draft in zip(requests, drafts, strict=True):
            generator: torch.Generator | None = request.generator  # type: ignore[assignment]
            for j in range(len(draft) + 1):
                rows.append(_position_row(request, draft, j))
                draft_ids.append(draft[j] if j < len(draft) else None)
                seeds.append(None if generator is None else _draw_seed(
                    generator.initial_seed(), request.num_output_tokens + j))
        final = self.sampler.process(logits, rows)  # [R, V]
        greedy = [row.params.greedy for row in rows]
        out = self.rejection.sample(final, greedy, draft_ids, seeds=seeds)
        tables = []
        start = 0
        for i, (request, draft) in enumerate(zip(requests, drafts, strict=True)):
            end = start + len(draft) + 1
            if request.params.logprobs is not None:
                table = logprob_table(logits[start:end], out.token_ids[start:end],
                                      request.params.logprobs)
                tables.append((i, HostCopy(table)))
            start = end
        return PendingVerify(requests, drafts, out.token_ids, out.accepted, tables)


def _position_row(request: SequenceState, drafts: list[int], j: int) -> SamplingRow:
    """The sampling row of the position after the first `j` drafts (as if they were output).

    The output is copied only where a processor reads its tokens (penalties, bad words) or
    its length decides (min_tokens not reached yet)."""
    params = request.params
    output = request.output_token_ids
    if j and (params.needs_penalties or request.bad_words
              or len(output) < params.min_tokens):
        output = output + drafts[:j]
    eos = () if params.ignore_eos else tuple(request.eos_token_ids)
    return SamplingRow(
        params=params,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=output,
        generator=request.generator,  # type: ignore[arg-type]
        stop_ids=eos + tuple(request.params.stop_token_ids),
        bad_words=request.bad_words,
    )
