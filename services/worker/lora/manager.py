"""Which adapters a worker serves, which sit in host memory, and which in device slots.

    manager = LoraManager(model_config, stack, max_cpu_loras=4)
    manager.add(LoraModule("sql", "/adapters/sql"))      # reads and checks it (any thread)
    slots = manager.slots_for({lora_id, ...})          # engine thread, once per step
    manager.remove("sql")

Served adapters are registered by name. Their weights stay in host memory for the
`max_cpu_loras` most recently used ones (others are read again from their folder when next
needed). A step's adapters are made resident in device slots, evicting the least recently
used adapter that the step does not use; the engine's scheduler admits at most `num_slots`
adapters among running requests, so a step always finds slots. A removed adapter stops
taking new requests; those already added (`acquire`d, until `release`d) finish with it, its
weights kept in host memory for them.

With tensor parallelism (`shard`), rank 0's manager decides; each slot write is also kept
for the other ranks (`take_writes`, sent with the step's plan), which put their own part of
the adapter into the same slot (`write_slot`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from meshserve.services.worker.lora.stack import LoraStack
from meshserve.services.worker.lora.weights import (
    LoraWeights,
    load_lora_weights,
    shard_lora_weights,
)
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.parallel.config import ShardPlan
from meshserve.shared.errors import InvalidRequestError, NotFoundError
from meshserve.shared.lora_config import LoraModule

log = logging.getLogger(__name__)


@dataclass
class _Adapter:
    module: LoraModule
    weights: LoraWeights | None  # None: not in host memory now
    served: bool = True
    users: int = 0  # sequences added with it and not finished


class LoraManager:
    """Registry, host cache and device-slot residency of LoRA adapters (thread-safe)."""

    def __init__(self, config: ModelConfig, stack: LoraStack, *, max_cpu_loras: int,
                 shard: ShardPlan | None = None) -> None:
        assert max_cpu_loras >= stack.num_slots, "max_cpu_loras must be at least max_loras"
        self._config = config  # the whole model's: adapters are checked against it
        self._stack = stack
        self._shard = shard
        self._writes: list[tuple[int, LoraWeights]] = []  # for the other ranks (with shard)
        self._max_cpu = max_cpu_loras
        self._lock = threading.Lock()
        self._adapters: dict[int, _Adapter] = {}  # by lora id
        self._host_lru: OrderedDict[int, None] = OrderedDict()  # ids with weights, LRU first
        self._slots: OrderedDict[int, int] = OrderedDict()  # resident id -> slot, LRU first
        self._free = list(range(stack.num_slots))

    @property
    def num_slots(self) -> int:
        return self._stack.num_slots

    @property
    def stack(self) -> LoraStack:
        """The device slots and the hooks' switch (CUDA graphs capture both ways)."""
        return self._stack

    def add(self, module: LoraModule) -> None:
        """Serve an adapter. Reads and checks its folder first (NotFoundError,
        InvalidRequestError); InvalidRequestError if the name is already served."""
        with self._lock:
            if module.lora_id in self._adapters and self._adapters[module.lora_id].served:
                raise InvalidRequestError(f"the LoRA adapter {module.name!r} is already loaded",
                                          param="lora_name")
        weights = load_lora_weights(module.path, self._config, self._stack.rank)
        with self._lock:
            self._adapters[module.lora_id] = _Adapter(module, weights)
            self._touch_host(module.lora_id)
        log.info("LoRA adapter %s (id %d, rank %d) loaded from %s", module.name,
                 module.lora_id, weights.config.rank, module.path)

    def remove(self, name: str) -> LoraModule:
        """Stop serving an adapter (NotFoundError if it is not served). Sequences added
        with it keep it: its weights are read back into host memory for them if they had
        been dropped, since its folder may go once it is unloaded."""
        with self._lock:
            adapter = next((a for a in self._adapters.values()
                            if a.served and a.module.name == name), None)
            if adapter is None:
                raise NotFoundError(f"the LoRA adapter {name!r} is not loaded",
                                    param="lora_name")
            adapter.served = False
            reload = adapter.users > 0 and adapter.weights is None
            self._forget_if_unused(adapter.module.lora_id)
        if reload:
            weights = load_lora_weights(adapter.module.path, self._config, self._stack.rank)
            with self._lock:
                if adapter.weights is None:
                    adapter.weights = weights
                    self._host_lru[adapter.module.lora_id] = None
        log.info("LoRA adapter %s unloaded", name)
        return adapter.module

    def served(self) -> list[LoraModule]:
        """The adapters served now, in the order they were added."""
        with self._lock:
            return [a.module for a in self._adapters.values() if a.served]

    def is_served(self, lora_id: int) -> bool:
        with self._lock:
            adapter = self._adapters.get(lora_id)
            return adapter is not None and adapter.served

    def acquire(self, lora_id: int, count: int = 1) -> None:
        """`count` sequences will run with the adapter (NotFoundError if it is not served)."""
        with self._lock:
            adapter = self._adapters.get(lora_id)
            if adapter is None or not adapter.served:
                raise NotFoundError(f"LoRA adapter {lora_id} is not loaded on this worker",
                                    param="model")
            adapter.users += count

    def release(self, lora_id: int) -> None:
        """One sequence that ran with the adapter finished."""
        with self._lock:
            adapter = self._adapters[lora_id]
            assert adapter.users > 0, f"LoRA id {lora_id} released more often than acquired"
            adapter.users -= 1
            self._forget_if_unused(lora_id)

    def slots_for(self, lora_ids: Iterable[int]) -> dict[int, int]:
        """Device slots of a step's adapters (at most num_slots), loading them as needed."""
        wanted = list(dict.fromkeys(lora_ids))
        assert len(wanted) <= self.num_slots, (
            f"a step with {len(wanted)} adapters, {self.num_slots} slots")
        with self._lock:
            for lora_id in wanted:
                if lora_id in self._slots:
                    self._slots.move_to_end(lora_id)
                else:
                    self._make_resident(lora_id, keep=wanted)
            return {lora_id: self._slots[lora_id] for lora_id in wanted}

    def _make_resident(self, lora_id: int, keep: list[int]) -> None:
        adapter = self._adapters.get(lora_id)
        assert adapter is not None, f"LoRA id {lora_id} is not known"
        if not self._free:
            victim = next(i for i in self._slots if i not in keep)
            self._free.append(self._slots.pop(victim))
            self._forget_if_unused(victim)
        if adapter.weights is None:  # dropped from host memory: read it again
            adapter.weights = load_lora_weights(adapter.module.path, self._config,
                                                self._stack.rank)
        self._touch_host(lora_id)
        slot = self._free.pop()
        self.write_slot(slot, adapter.weights)
        if self._shard is not None:
            self._writes.append((slot, adapter.weights))
        self._slots[lora_id] = slot

    def write_slot(self, slot: int, weights: LoraWeights) -> None:
        """Put `weights` (the whole adapter) into device slot `slot`: this rank's part of
        them with tensor parallelism. The other ranks call it with rank 0's writes."""
        self._stack.write(slot, weights if self._shard is None
                          else shard_lora_weights(weights, self._shard))

    def take_writes(self) -> list[tuple[int, LoraWeights]]:
        """The slot writes since the last call (tensor parallelism: for the other ranks)."""
        writes, self._writes = self._writes, []
        return writes

    def _touch_host(self, lora_id: int) -> None:
        """Mark the adapter's host weights used; drop the LRU ones over max_cpu_loras."""
        self._host_lru[lora_id] = None
        self._host_lru.move_to_end(lora_id)
        # Only served adapters can be read again: a removed one keeps its weights.
        droppable = [i for i in self._host_lru if self._adapters[i].served and i != lora_id]
        while len(self._host_lru) > self._max_cpu and droppable:
            oldest = droppable.pop(0)
            self._host_lru.pop(oldest)
            self._adapters[oldest].weights = None

    def _forget_if_unused(self, lora_id: int) -> None:
        """Drop a removed adapter once no sequence uses it and no slot holds it."""
        adapter = self._adapters[lora_id]
        if not adapter.served and adapter.users == 0 and lora_id not in self._slots:
            del self._adapters[lora_id]
            self._host_lru.pop(lora_id, None)

    def prepare_step(self, rows: list[tuple[int | None, int]]) -> list[tuple[int, int]]:
        """Group a step's rows for the kernels: (adapter id or None, number of rows) per
        scheduled sequence, in the order of the step's flat batch. Returns them as (slot,
        number of rows), slot -1 for none: what the other ranks pass to `set_step`."""
        slots = self.slots_for(lora_id for lora_id, _ in rows if lora_id is not None)
        groups = [(-1 if lora_id is None else slots[lora_id], count) for lora_id, count in rows]
        self.set_step(groups)
        return groups

    def set_step(self, groups: list[tuple[int, int]]) -> None:
        """Point the step's rows at their slots: (slot or -1, number of rows) per sequence."""
        row_slots: list[int] = []
        for slot, count in groups:
            row_slots.extend([slot] * count)
        self._stack.set_step(row_slots)
