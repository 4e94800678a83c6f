"""The LoRA hooks follow each step's grouping and slot contents through buffers written in
place, as CUDA graphs need (a graph replays the launches it captured, with the tensors it
captured): the same hook object, fed different groupings and a slot rewritten between steps,
must give each step's own per-row LoRA, with no buffer re-allocated.

Both paths run: the hook as the CPU calls it (grouped torch path) and the Triton kernels on
the stack's buffers in Triton's interpreter (a child pytest process, as in
test_lora_kernels.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_triton_kernels import InterpreterRun, in_interpreter, outside_interpreter
from tiny_models import build_tiny_model

from meshserve.kernels import triton_lora
from meshserve.services.worker.loader import load_model_config, resolve_model
from meshserve.services.worker.lora.stack import LoraProjection, LoraStack
from meshserve.services.worker.lora.weights import (
    LoraWeights,
    load_lora_weights,
    module_shapes,
)
from meshserve.services.worker.models.config import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
RANK = 4
# Per-row slots of successive steps (-1: no adapter); fewer rows than before, none at all.
STEPS = [[0, -1, 1, 0, 1], [1, 1, -1, -1], [-1, -1, -1], [1, 0, 1, 0, 0, 1], [0]]


def _write_adapters() -> Callable[[Path, Path, int, int], list[str]]:
    spec = importlib.util.spec_from_file_location("lora_bench_adapters",
                                                  REPO_ROOT / "loadtest" / "lora_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    write: Callable[[Path, Path, int, int], list[str]] = module.write_adapters
    return write


def _expected(x: torch.Tensor, in_slots: list[LoraWeights], row_slots: list[int],
              config: ModelConfig) -> torch.Tensor:
    """Layer 0's q/k/v LoRA of each row, from its adapter's own tensors: [T, N]."""
    shapes = module_shapes(config)
    rows = []
    for row, slot in enumerate(row_slots):
        parts = []
        for module in ("q_proj", "k_proj", "v_proj"):
            if slot < 0:
                parts.append(torch.zeros(shapes[module][1]))
                continue
            a, b = in_slots[slot].a[(0, module)].float(), in_slots[slot].b[(0, module)].float()
            parts.append(b @ (a @ x[row]))  # [out] = [out, r] @ [r, in] @ [in]
        rows.append(torch.cat(parts))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, list[LoraWeights]]:
    root = tmp_path_factory.mktemp("step_buffers")
    folder = build_tiny_model(root / "model", "llama")
    config = load_model_config(resolve_model(str(folder), "auto"))
    _write_adapters()(folder, root / "adapters", 2, RANK)
    return config, [load_lora_weights(root / "adapters" / f"lora{i}", config, RANK)
                    for i in range(2)]


def _kernel(proj: LoraProjection) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def run(x: torch.Tensor, y: torch.Tensor) -> None:
        triton_lora.add_lora(y, x, proj.a, proj.b, proj.slices, proj.batch)
    return run


def _check_steps(setup: tuple[ModelConfig, list[LoraWeights]], use_kernel: bool) -> None:
    config, adapters = setup
    stack = LoraStack(config, num_slots=2, rank=RANK, max_tokens=8, dtype=torch.float32,
                      device=torch.device("cpu"))
    stack.write(0, adapters[0])
    stack.write(1, adapters[1])
    proj = LoraProjection(stack, 0, "qkv_proj")
    run = _kernel(proj) if use_kernel else proj
    buffers = [stack.batch.sorted_rows, stack.batch.slot_start, stack.batch.slot_count,
               proj.a, proj.b]
    pointers = [t.data_ptr() for t in buffers]
    x = torch.randn(8, config.hidden_size, generator=torch.Generator().manual_seed(0))
    in_slots = list(adapters)
    for n, row_slots in enumerate(STEPS):
        if n == 3:  # adapter 1 moves into slot 0 too, in place
            stack.write(0, adapters[1])
            in_slots[0] = adapters[1]
        stack.set_step(row_slots)
        t = len(row_slots)
        y = torch.zeros(t, sum(proj.slices))
        run(x[:t], y)
        expected = _expected(x[:t], in_slots, row_slots, config)
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
        assert [t.data_ptr() for t in buffers] == pointers, f"step {n} re-allocated a buffer"
        if any(s >= 0 for s in row_slots):
            assert y.abs().max() > 0  # the step's adapters did add something


@outside_interpreter
def test_hook_follows_each_steps_buffers(setup: tuple[ModelConfig, list[LoraWeights]]) -> None:
    _check_steps(setup, use_kernel=False)


@in_interpreter
def test_kernels_follow_each_steps_buffers(setup: tuple[ModelConfig, list[LoraWeights]]
                                           ) -> None:
    _check_steps(setup, use_kernel=True)


@outside_interpreter
def test_step_buffers_under_the_interpreter(interpreter: InterpreterRun) -> None:
    assert interpreter.passes(__file__, "kernels_follow") == 1
