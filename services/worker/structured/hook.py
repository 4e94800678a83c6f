"""Structured outputs and bad words as an engine step hook: at admission, each sequence of
a constrained request gets its grammar matcher (past the tokens a resumed sequence already
has), and a request with bad words gets them tokenized."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshserve.services.worker.engine.hooks import NewRequest, StepHook
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.services.worker.structured.grammars import GrammarCompiler, new_matcher
from meshserve.shared.errors import InvalidRequestError


class StructuredOutputsHook(StepHook):
    """Owns the worker's grammar compiler (`grammars`, which the engine thread also uses to
    compile ahead of admission)."""

    def __init__(self, grammars: GrammarCompiler) -> None:
        self.grammars = grammars

    def admit(self, sequences: Sequence[SequenceState], request: NewRequest) -> None:
        params = request.params
        grammar = request.grammar
        if params.structured is not None and grammar is None:
            grammar = self.grammars.compile(params.structured)
        bad_words_ids = request.bad_words_ids
        if params.bad_words and bad_words_ids is None:
            bad_words_ids = self.grammars.bad_word_ids(params.bad_words)
        for seq in sequences:
            if grammar is not None:
                seq.grammar = _matcher(grammar, seq)
            seq.bad_words = bad_words_ids or ()


def _matcher(grammar: Any, seq: SequenceState) -> Any:
    """The sequence's grammar matcher, past the output tokens it already has."""
    stop_ids = list(dict.fromkeys([*seq.eos_token_ids, *seq.params.stop_token_ids]))
    matcher = new_matcher(grammar, stop_ids)
    for token in seq.output_token_ids:  # a resumed sequence's tokens
        if not matcher.accept_token(token):
            raise InvalidRequestError("a resumed sequence's output does not follow its "
                                      "structured output constraint",
                                      param="structured_outputs")
    return matcher
