"""The mixture-of-experts kernels: routing against a direct torch computation, the grouping
of pairs by expert, and the Triton grouped GEMMs (run by Triton's interpreter) against the
PyTorch reference.

As in test_triton_kernels.py, the interpreted cases run in a child pytest process started
with TRITON_INTERPRET=1 (Triton picks its interpreter when first imported).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_triton_kernels import (  # noqa: F401 (an autouse fixture)
    _interpreter_with_gpu_bf16_numerics,
    in_interpreter,
    outside_interpreter,
)

from meshserve.kernels import triton_moe
from meshserve.kernels.moe import (
    fused_experts,
    fused_experts_reference,
    fused_moe,
    group_by_expert,
    route,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
             g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5  # [E, 2I, H]
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5  # [E, H, I]
    return w13.to(dtype), w2.to(dtype)


@outside_interpreter
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_is_softmax_top_k(renormalize: bool) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 6, generator=g)
    weights, ids = route(logits, 2, renormalize)
    probs = F.softmax(logits, dim=-1)
    expected_w, expected_ids = probs.topk(2, dim=-1)
    if renormalize:
        expected_w = expected_w / expected_w.sum(-1, keepdim=True)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_w)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(9))


@outside_interpreter
def test_route_of_bfloat16_logits_runs_in_float32() -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    weights, ids = route(logits, 3, False)
    expected_w, expected_ids = F.softmax(logits.float(), dim=-1).topk(3, dim=-1)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_w)


@outside_interpreter
def test_group_by_expert() -> None:
    ids = torch.tensor([[2, 0], [0, 3], [2, 3]], dtype=torch.int32)  # T=3, k=2, E=5
    groups = group_by_expert(ids, 5)
    # pairs t*k + j in expert order: e0: 1, 2; e2: 0, 4; e3: 3, 5
    assert groups.sorted_pairs.tolist() == [1, 2, 0, 4, 3, 5]
    assert groups.offsets.tolist() == [0, 2, 2, 4, 6, 6]


@outside_interpreter
def test_tile_schedule_covers_every_pair_once() -> None:
    ids = torch.tensor([[0, 1]] * 20 + [[3, 1]] * 3, dtype=torch.int32)  # 46 pairs
    groups = group_by_expert(ids, 4)
    schedule = triton_moe.tile_schedule(groups, 16)
    covered = []
    for e, s, t in zip(schedule.expert.tolist(), schedule.start.tolist(),
                       schedule.end.tolist()):
        assert t - s <= 16
        for pos in range(s, t):
            assert groups.offsets[e] <= pos < groups.offsets[e + 1]
            covered.append(pos)
    assert sorted(covered) == list(range(46))


@outside_interpreter
def test_reference_is_a_per_token_sum_of_experts() -> None:
    g = torch.Generator().manual_seed(2)
    w13, w2 = _weights(4, 32, 16, torch.float32, g)
    x = torch.randn(5, 32, generator=g)
    logits = torch.randn(5, 4, generator=g)
    out = fused_moe(x, w13, w2, logits, 2, True)
    weights, ids = route(logits, 2, True)
    for t in range(5):
        expected = torch.zeros(32)
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            expected += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
        torch.testing.assert_close(out[t], expected, atol=1e-5, rtol=1e-5)


CASES = [
    # (tokens, experts, top_k, hidden, intermediate, dtype, experts tokens are routed to)
    (1, 4, 2, 64, 32, torch.float32, None),  # one decode token
    (7, 8, 2, 64, 32, torch.float32, None),
    (40, 8, 2, 64, 48, torch.float32, None),  # several tiles, an odd intermediate
    (70, 6, 3, 80, 32, torch.float32, None),  # 64-row tiles, hidden not a tile multiple
    (12, 8, 2, 64, 32, torch.float32, (1, 5)),  # all tokens on two experts
    (5, 4, 1, 64, 32, torch.float32, (2,)),  # top-1, one expert
    (9, 8, 2, 64, 32, torch.bfloat16, None),
    (33, 4, 2, 128, 64, torch.bfloat16, (0, 3)),
]


@in_interpreter
@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_experts_match_reference(case: int) -> None:
    tokens, experts, top_k, hidden, inter, dtype, only = CASES[case]
    g = torch.Generator().manual_seed(case)
    w13, w2 = _weights(experts, hidden, inter, dtype, g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    if only is not None:  # the other experts get no token
        mask = torch.full((experts,), float("-inf"))
        mask[list(only)] = 0.0
        logits = logits + mask
    weights, ids = route(logits, top_k, renormalize=case % 2 == 0)
    expected = fused_experts_reference(x, w13, w2, weights, ids)
    got = triton_moe.fused_experts(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@in_interpreter
def test_cpu_entry_point_takes_the_reference() -> None:
    g = torch.Generator().manual_seed(9)
    w13, w2 = _weights(4, 64, 32, torch.float32, g)
    x = torch.randn(3, 64, generator=g)
    weights, ids = route(torch.randn(3, 4, generator=g), 2, False)
    assert torch.equal(fused_experts(x, w13, w2, weights, ids),
                       fused_experts_reference(x, w13, w2, weights, ids))


@outside_interpreter
def test_moe_kernels_under_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q",
         "-p", "no:cacheprovider"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed[1]) == len(CASES) + 1 and "skipped" not in summary, summary
