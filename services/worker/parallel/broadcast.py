"""Each step's inputs, from rank 0 (which schedules) to the other ranks (which follow).

Rank 0 sends one `StepPlan` per step: the flat batch as host lists, pickled through a
gloo group (a host-to-host send that never waits for a device). Tokens that the previous
step sampled are still on rank 0's device when the step is queued (the overlapped loop);
for such steps the token ids follow as one device-to-device broadcast, queued behind the
sampling that produces them, so no rank waits on its host for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class StepPlan:
    """One step's flat batch, as `ModelRunner.prepare` builds it (host lists)."""

    ids: list[int]  # [T] token ids (rows in pending_rows are placeholders)
    positions: list[int]  # [T]
    slots: list[int]  # [T] KV cache slot of each token
    query_lens: list[int]  # per sequence
    seq_lens: list[int]  # per sequence
    tables: list[list[int]]  # per sequence, its block ids
    sample_rows: list[int]  # rows whose logits are sampled
    prompt_rows: list[list[int]] = field(default_factory=list)  # rows scored for prompt logprobs
    pending_rows: list[int] = field(default_factory=list)  # rows whose ids are on the device
    # Rows of speculating sequences' [last token + drafts] queries, scored before sample_rows.
    verify_rows: list[int] = field(default_factory=list)
    # Multi-LoRA: (slot or -1, rows) per sequence, and adapters rank 0 put into slots for
    # this step (slot, whole adapter; each rank takes its part).
    lora_groups: list[tuple[int, int]] = field(default_factory=list)
    # The writes are the LoRA feature's own objects (lora/weights.py LoraWeights), carried
    # through without this layer knowing them.
    lora_writes: list[tuple[int, Any]] = field(default_factory=list)


class StepSync:
    """The step hand-off between rank 0 and the others, over `group` (gloo)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def send(self, plan: StepPlan, input_ids: torch.Tensor) -> None:
        """Rank 0: hand `plan` to every other rank, then its device token ids [T] if some
        are pending there."""
        dist.broadcast_object_list([plan], src=0, group=self.group)
        if plan.pending_rows:
            dist.broadcast(input_ids, src=0)

    def receive(self) -> StepPlan | None:
        """The other ranks: the next step's plan (None: stop)."""
        box: list[StepPlan | None] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def receive_ids(self, input_ids: torch.Tensor) -> None:
        """The other ranks: fill [T] `input_ids` with rank 0's (for a plan with pending rows)."""
        dist.broadcast(input_ids, src=0)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (all ranks call it)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def stop(self) -> None:
        """Rank 0: tell the other ranks to leave their loops."""
        dist.broadcast_object_list([None], src=0, group=self.group)
