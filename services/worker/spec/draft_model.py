"""The draft-model proposer: a second, smaller model of the same vocabulary in this worker,
with its own small paged KV cache, drafting k tokens greedily for each sequence.

Each sequence has a shadow sequence in the draft's cache. Before drafting, the shadow's
KV is kept only as far as the tokens it was computed on still agree with the sequence's
(rejected drafts are dropped), the rest of the sequence is caught up in the same forward
pass as the first draft, then each further draft is one decode step of the whole batch.
On a GPU (unless --enforce-eager) the draft's runner has CUDA graphs of its own, as the
target's does: whole-step graphs for the one-token draft steps, piecewise graphs for the
catch-up steps (`capture_graphs`); otherwise the draft runs eagerly.
"""

from __future__ import annotations

from collections import Counter

import torch

from meshserve.services.worker.engine.cuda_graphs import CaptureReport
from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.model_runner import ModelRunner
from meshserve.services.worker.engine.sequence import SequenceState, SequenceStatus
from meshserve.services.worker.engine.step_scheduler import ScheduledSequence, SchedulerOutput
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import CausalLM
from meshserve.shared.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


class DraftModelProposer:
    """Greedy k-token drafts from the draft model, batched over the speculating sequences."""

    def __init__(self, model: CausalLM, config: ModelConfig, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
        self.runner = ModelRunner(model, config, self.kv, dtype, device)
        self._shadows: dict[str, SequenceState] = {}  # sequence id -> its shadow in the draft cache
        self._owners: dict[str, SequenceState] = {}
        self.paths: Counter[str] = Counter()  # forward path of each draft step (runner's)

    def propose_batch(self, requests: list[SequenceState], ks: list[int]) -> list[list[int]]:
        self._forget_stopped()
        shadows = [self._shadow(r) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        for step in range(max(ks, default=0)):
            batch = [i for i in range(len(requests))
                     if ks[i] > step and self._allocate(shadows[i])]
            if not batch:
                break
            tokens = self._step([shadows[i] for i in batch])
            for i, token in zip(batch, tokens, strict=True):
                drafts[i].append(token)
                shadows[i].prompt_token_ids.append(token)
        return drafts

    def may_draft(self, request: SequenceState) -> bool:
        """Always: the draft model proposes for every sequence that may speculate."""
        del request
        return True

    def _forget_stopped(self) -> None:
        for rid, owner in list(self._owners.items()):
            if owner.status != SequenceStatus.RUNNING:
                self.kv.free(self._shadows.pop(rid))
                del self._owners[rid]

    def _shadow(self, request: SequenceState) -> SequenceState:
        """The request's shadow, its KV kept where its tokens agree with the request's."""
        tokens = request.all_token_ids
        shadow = self._shadows.get(request.request_id)
        if shadow is None:
            shadow = SequenceState(request.request_id, [], _GREEDY, max_tokens=1)
            self._shadows[request.request_id] = shadow
            self._owners[request.request_id] = request
        agree = _common_prefix(shadow.prompt_token_ids, tokens)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, agree, len(tokens) - 1)
        shadow.prompt_token_ids = list(tokens)
        self.kv.trim(shadow, shadow.num_computed_tokens)
        return shadow

    def _allocate(self, shadow: SequenceState) -> bool:
        """Room for the shadow's uncomputed tokens; without it the sequence stops drafting
        this step (its shadow is computed again from the start when room comes back)."""
        num_new = shadow.num_tokens - shadow.num_computed_tokens
        if self.kv.allocate_slots(shadow, num_new):
            return True
        self.kv.free(shadow)
        shadow.num_computed_tokens = 0
        return False

    def capture_graphs(self, max_num_seqs: int, max_model_len: int,
                       piecewise_tokens: int) -> tuple[CaptureReport, CaptureReport]:
        """The draft's decode graphs (batches up to `max_num_seqs`) and piecewise graphs
        (steps up to `piecewise_tokens`), as the target's runner captures its own."""
        return (self.runner.capture_graphs(max_num_seqs, max_model_len),
                self.runner.capture_piecewise_graphs(piecewise_tokens))

    @torch.inference_mode()
    def _step(self, shadows: list[SequenceState]) -> list[int]:
        """One forward of the shadows' uncomputed tokens; each one's greedy next token."""
        out = SchedulerOutput([ScheduledSequence(s, s.num_tokens - s.num_computed_tokens)
                               for s in shadows])
        inputs = self.runner.prepare(out)
        hidden = self.runner.forward(inputs)  # [T, H]: a graph replay where one fits
        self.paths[self.runner.last_path] += 1
        rows = torch.tensor(inputs.sample_rows, dtype=torch.long, device=hidden.device)
        logits = self.runner.model.compute_logits(hidden[rows])  # [S, V]
        for s in shadows:
            s.num_computed_tokens = s.num_tokens
        return logits.argmax(dim=-1).tolist()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
