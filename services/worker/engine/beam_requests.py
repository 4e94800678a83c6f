"""The engine's beam-search requests: each beam a sequence, forked with shared KV blocks.

A beam-search request starts as one sequence over its prompt. Each step, every live beam's
sequence computes one position and reports its top next-token logprobs (the token its step
sampled is dropped: the search picks); once every live beam has reported, `BeamSearch`
ranks the continuations. A parent's first continuation extends its own sequence; each
further one forks it: the fork shares the parent's full blocks by reference
(`KVCacheManager.fork`) and recomputes only the tokens of the parent's partial last block.
Beams no continuation extends are freed. A beam that has reported waits for its siblings
(it has no token left to compute), so a beam forked late or preempted holds the others back
one step at most each time.

Nothing is emitted while the search runs; when it ends, the request's `n` outputs are its
best hypotheses, best first, whole: tokens (the stop token only with
include_stop_str_in_output, as vLLM), logprobs where asked, finish and stop reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from meshserve.services.worker.engine.beam_search import BeamSearch, Hypothesis
from meshserve.services.worker.engine.hooks import NewRequest
from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.sequence import SequenceOutput, SequenceState
from meshserve.services.worker.engine.step_scheduler import StepScheduler
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import SamplingParams


def beam_sequence_params(params: SamplingParams, eos_token_ids: tuple[int, ...],
                         vocab_size: int) -> SamplingParams:
    """What each beam's sequence runs with: greedy (its sampled token is dropped), with the
    logprobs of as many top candidates as the search ranks (or the more the request asks to
    see; at most the vocabulary), and the prompt's logprobs where asked (forks leave them
    out). Other sampling parameters do not apply to beam search (as in vLLM)."""
    num_candidates = max(2, 1 + len(stop_token_ids(params, eos_token_ids))) * params.n
    wanted = params.logprobs
    logprobs = -1 if wanted == -1 else min(max(wanted or 0, num_candidates), vocab_size)
    return SamplingParams(n=1, temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True,
                          logprobs=logprobs, prompt_logprobs=params.prompt_logprobs,
                          use_beam_search=True,
                          length_penalty=params.length_penalty,
                          early_stopping=params.early_stopping)


def stop_token_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """The tokens that end a beam: the model's EOS (unless ignore_eos) and stop_token_ids."""
    eos = () if params.ignore_eos else eos_token_ids
    return frozenset(eos) | frozenset(params.stop_token_ids)


@dataclass
class _BeamGroup:
    request: NewRequest  # as the hooks admitted the first beam
    params: SamplingParams  # the request's own
    search: BeamSearch
    live: list[SequenceState]  # aligned with search.beams
    first: SequenceState  # the prompt's sequence (its prefix-cache hits are the request's)
    rows: dict[str, TokenLogprobs] = field(default_factory=dict)  # reported, by sequence id
    num_forks: int = 0


class BeamRequests:
    """Every running beam-search request of one engine."""

    def __init__(self, kv: KVCacheManager, scheduler: StepScheduler,
                 groups: dict[str, list[SequenceState]], *,
                 admit: Callable[[list[SequenceState], NewRequest], None],
                 finish: Callable[[SequenceState], None]) -> None:
        """`groups`: the engine's live sequences per request, kept in step here; `admit`
        and `finish` run the engine's hooks for a fork and a dropped beam."""
        self.kv = kv
        self.scheduler = scheduler
        self.groups = groups
        self._admit = admit
        self._finish = finish
        self._beams: dict[str, _BeamGroup] = {}
        # Requests whose every live beam has reported (a beam preempted after it reported
        # may report again in the same step: a set, in order).
        self._ready: dict[str, None] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._beams

    def open(self, params: SamplingParams, first: SequenceState, max_tokens: int,
             request: NewRequest) -> None:
        """Start the search of `first`'s request (`params`: the request's own)."""
        search = BeamSearch(params.n, max_tokens, stop_token_ids(params, first.eos_token_ids),
                            length_penalty=params.length_penalty,
                            early_stopping=params.early_stopping)
        self._beams[first.group_id] = _BeamGroup(request, params, search, [first], first)

    def report(self, seq: SequenceState, row: TokenLogprobs) -> None:
        """A beam's step: its next-token logprobs; the token sampled in its place is dropped."""
        assert seq.num_pending == 1 and seq.output_token_ids[-1] < 0, (
            f"{seq.request_id}: a beam reports with its one pending token last")
        seq.output_token_ids.pop()
        seq.num_pending = 0
        group = self._beams[seq.group_id]
        group.rows[seq.request_id] = row
        if len(group.rows) == len(group.live):
            self._ready[seq.group_id] = None

    def advance(self) -> list[SequenceOutput]:
        """Run a search step for every request whose beams have all reported; the outputs
        of those whose search ended."""
        outputs: list[SequenceOutput] = []
        ready, self._ready = self._ready, {}
        for request_id in ready:
            group = self._beams[request_id]
            picks = group.search.step([group.rows[s.request_id] for s in group.live])
            group.rows.clear()
            if group.search.done:
                outputs.extend(self._close(group))
            else:
                self._regroup(group, picks)
        return outputs

    def _regroup(self, group: _BeamGroup, picks: list[tuple[int, int]]) -> None:
        """The next live beams: a parent's first pick extends it, later picks fork it
        (before any parent takes its new token); parents not picked are freed."""
        children: list[SequenceState] = []
        for parent_index, _ in picks:
            parent = group.live[parent_index]
            children.append(self._fork(group, parent) if parent in children else parent)
        for seq in group.live:
            if seq not in children:
                self._finish(seq)
        for index, (child, (_, token)) in enumerate(zip(children, picks, strict=True)):
            child.output_token_ids.append(token)
            child.index = index
        group.live = children
        self.groups[group.first.group_id] = list(children)

    def _fork(self, group: _BeamGroup, parent: SequenceState) -> SequenceState:
        group.num_forks += 1
        child = SequenceState(
            f"{parent.group_id}#beam{group.num_forks}", parent.prompt_token_ids,
            replace(parent.params, prompt_logprobs=None),
            group_id=parent.group_id, priority=parent.priority, arrival_time=parent.arrival_time,
            eos_token_ids=parent.eos_token_ids, max_tokens=parent.max_tokens,
            extra_keys=parent.extra_keys, lora_id=parent.lora_id, images=parent.images,
            mrope=parent.mrope)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        child.first_token_time = parent.first_token_time
        child.store_checked = True
        self._admit([child], group.request)
        self.kv.fork(parent, child)
        self.scheduler.fork(parent, child)
        return child

    def _close(self, group: _BeamGroup) -> list[SequenceOutput]:
        for seq in group.live:
            self._finish(seq)
        request_id = group.first.group_id
        del self._beams[request_id]
        self.groups.pop(request_id, None)
        return [self._output(group, index, hypothesis)
                for index, hypothesis in enumerate(group.search.results())]

    def _output(self, group: _BeamGroup, index: int, hypothesis: Hypothesis) -> SequenceOutput:
        params, first = group.params, group.first
        tokens = list(hypothesis.token_ids)
        entries = list(hypothesis.logprobs)
        if hypothesis.stopped and not params.include_stop_str_in_output:
            del tokens[-1], entries[-1]
        logprobs = None
        if params.logprobs is not None:
            shown = len(entries[0].top) if entries and params.logprobs == -1 else params.logprobs
            logprobs = [TokenLogprobs(e.token_id, e.logprob, e.rank, e.top[:shown])
                        for e in entries]
        return SequenceOutput(
            request_id=first.group_id, group_id=first.group_id, index=index,
            new_token_ids=tokens, new_logprobs=logprobs,
            prompt_logprobs=(first.prompt_logprobs or [None]
                             if params.prompt_logprobs is not None else None),
            finish_reason="stop" if hypothesis.stopped else "length",
            stop_reason=hypothesis.token_ids[-1] if hypothesis.stopped else None,
            num_prompt_tokens=first.num_prompt_tokens,
            num_cached_tokens=min(max(first.num_cached_tokens, 0), first.num_prompt_tokens),
            num_output_tokens=len(tokens), beam_score=hypothesis.score)

    def forget(self, request_id: str) -> None:
        """The request was aborted (the engine finished its live beams)."""
        self._beams.pop(request_id, None)
        self._ready.pop(request_id, None)
