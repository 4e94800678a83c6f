"""The LoRA manager's device slots and host cache: exact slots, LRU eviction order, pins by
the step, host-memory limit, and a removed adapter kept until its slot is reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import build_tiny_model

from meshserve.services.worker.loader import load_model_config, resolve_model
from meshserve.services.worker.lora.manager import LoraManager
from meshserve.services.worker.lora.stack import LoraStack
from meshserve.services.worker.models.config import ModelConfig
from meshserve.shared.errors import InvalidRequestError, NotFoundError
from meshserve.shared.lora_config import LoraModule, lora_id_for

PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    folder = build_tiny_model(tmp_path_factory.mktemp("m"), "llama")
    return load_model_config(resolve_model(str(folder), "auto"))


def write_adapter(folder: Path, value: float, config: ModelConfig, **extra: object) -> str:
    """A rank-2 adapter of layer 0's q_proj whose A is `value` everywhere (B ones)."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"], **extra}))
    save_file({f"{PREFIX}.lora_A.weight": torch.full((2, config.hidden_size), value),
               f"{PREFIX}.lora_B.weight": torch.ones(config.q_size, 2)},
              str(folder / "adapter_model.safetensors"))
    return str(folder)


def manager_with(tmp_path: Path, config: ModelConfig, names: list[str], *, slots: int = 2,
                 max_cpu: int = 8) -> tuple[LoraManager, LoraStack]:
    stack = LoraStack(config, num_slots=slots, rank=4, max_tokens=16, dtype=torch.float32,
                      device=torch.device("cpu"))
    manager = LoraManager(config, stack, max_cpu_loras=max_cpu)
    for i, name in enumerate(names):
        manager.add(LoraModule(name, write_adapter(tmp_path / name, float(i + 1), config)))
    return manager, stack


def slot_value(stack: LoraStack, slot: int) -> float:
    return float(stack.a[0]["qkv_proj"][slot, 0, 0])


def test_slots_fill_then_evict_the_least_recently_used(tmp_path: Path,
                                                       model_config: ModelConfig) -> None:
    manager, stack = manager_with(tmp_path, model_config, ["a", "b", "c"])
    a, b, c = (lora_id_for(n) for n in "abc")
    assert manager.slots_for([a]) == {a: 1}  # free slots are taken from the end
    assert manager.slots_for([b]) == {b: 0}
    manager.slots_for([a])  # a is now the most recently used
    assert manager.slots_for([c]) == {c: 0}  # b, the LRU, makes room
    assert (slot_value(stack, 0), slot_value(stack, 1)) == (3.0, 1.0)
    # A step using c and b: a (LRU, not in the step) goes, c keeps its slot.
    assert manager.slots_for([c, b]) == {c: 0, b: 1}
    assert slot_value(stack, 1) == 2.0
    # Rows of absent modules and ranks past the adapter's are zero.
    assert not stack.a[0]["qkv_proj"][1, 2:].any() and not stack.b[1]["qkv_proj"].any()


def test_step_grouping(tmp_path: Path, model_config: ModelConfig) -> None:
    manager, stack = manager_with(tmp_path, model_config, ["a", "b"])
    a, b = lora_id_for("a"), lora_id_for("b")
    manager.prepare_step([(a, 2), (None, 3), (b, 1), (a, 1)])
    slots = manager.slots_for([a, b])
    rows = {slots[a]: [0, 1, 6], slots[b]: [5]}
    starts, counts = stack.batch.slot_start.tolist(), stack.batch.slot_count.tolist()
    for slot, expected in rows.items():
        got = stack.batch.sorted_rows[starts[slot]:starts[slot] + counts[slot]].tolist()
        assert got == expected


def test_host_memory_limit_reads_dropped_adapters_again(tmp_path: Path,
                                                        model_config: ModelConfig) -> None:
    manager, stack = manager_with(tmp_path, model_config, ["a", "b", "c"], slots=1,
                                  max_cpu=2)
    a = lora_id_for("a")
    assert manager._adapters[a].weights is None  # the oldest beyond max_cpu_loras
    assert manager.slots_for([a]) == {a: 0} and slot_value(stack, 0) == 1.0
    assert manager._adapters[a].weights is not None


def test_removed_adapter_serves_its_running_requests_until_evicted(
        tmp_path: Path, model_config: ModelConfig) -> None:
    manager, _ = manager_with(tmp_path, model_config, ["a", "b"], slots=1)
    a, b = lora_id_for("a"), lora_id_for("b")
    manager.slots_for([a])
    manager.remove("a")
    assert not manager.is_served(a) and [m.name for m in manager.served()] == ["b"]
    assert manager.slots_for([a]) == {a: 0}  # still resident for requests already running
    manager.slots_for([b])  # its slot is reused: now it is gone
    assert a not in manager._adapters
    with pytest.raises(InvalidRequestError, match="already loaded"):
        manager.add(LoraModule("b", str(tmp_path / "b")))


def test_a_removed_adapter_stays_for_sequences_added_before(
        tmp_path: Path, model_config: ModelConfig) -> None:
    manager, stack = manager_with(tmp_path, model_config, ["a", "b", "c"], slots=1,
                                  max_cpu=1)
    a = lora_id_for("a")
    manager.acquire(a, 2)  # two sequences queued with it, never resident yet
    manager.remove("a")
    with pytest.raises(NotFoundError):
        manager.acquire(a)  # no new ones
    manager.add(LoraModule("d", write_adapter(tmp_path / "d", 4.0, model_config)))
    # Its weights (dropped past max_cpu_loras) were read back at removal, and stay.
    assert manager._adapters[a].weights is not None
    assert manager.slots_for([a]) == {a: 0} and slot_value(stack, 0) == 1.0
    manager.release(a)
    manager.release(a)
    assert a in manager._adapters  # still in its slot
    manager.slots_for([lora_id_for("b")])
    assert a not in manager._adapters
