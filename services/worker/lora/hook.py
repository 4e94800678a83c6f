"""Multi-LoRA serving as an engine step hook: a request's sequences hold their adapter
from admission until each finishes (an adapter in use stays resident)."""

from __future__ import annotations

from collections.abc import Sequence

from meshserve.services.worker.engine.hooks import NewRequest, StepHook
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.services.worker.lora.manager import LoraManager


class LoraHook(StepHook):
    """Counts each adapter's running sequences in the manager (which the runner also
    holds, to group each step's rows by adapter slot)."""

    def __init__(self, manager: LoraManager) -> None:
        self.manager = manager

    def admit(self, sequences: Sequence[SequenceState], request: NewRequest) -> None:
        if request.lora_id is not None:  # NotFoundError when the adapter is not served
            self.manager.acquire(request.lora_id, len(sequences))

    def release(self, sequence: SequenceState) -> None:
        if sequence.lora_id is not None:
            self.manager.release(sequence.lora_id)
