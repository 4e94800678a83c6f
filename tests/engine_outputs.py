"""Helpers of the engine tests: run an engine dry and read the tokens of its outputs."""

from __future__ import annotations

from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.sequence import SequenceOutput


def drain(engine: LLMEngine) -> dict[tuple[str, int], list[SequenceOutput]]:
    """Step until nothing is left; the outputs of each (request id, sequence index)."""
    outputs: dict[tuple[str, int], list[SequenceOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
    return outputs


def tokens(outs: list[SequenceOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]
