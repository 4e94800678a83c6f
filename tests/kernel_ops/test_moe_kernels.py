"""The mixture-of-experts kernels: routing against a direct torch computation, the grouping
of pairs by expert, and the Triton grouped GEMMs (run by Triton's interpreter) against the
PyTorch reference.

As in test_triton_kernels.py, the interpreted cases run in a child pytest process started
with TRITON_INTERPRET=1 (Triton picks its interpreter when first imported).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_triton_kernels import (  # noqa: F401 (an autouse fixture)
    InterpreterRun,
    _interpreter_with_gpu_bf16_numerics,
    in_interpreter,
    outside_interpreter,
)

from meshserve.kernels import triton_moe, triton_moe_route
from meshserve.kernels.fp8_linear import quantize_per_channel
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


ALIGN_CASES = [
    # (expert ids [T, k], experts, tile rows)
    ([[0, 1]] * 20 + [[3, 1]] * 3, 4, 16),  # 46 pairs, one expert idle
    ([[2, 0], [0, 3], [2, 3]], 5, 16),
    ([[e % 7, (e * 3 + 1) % 7] for e in range(90)], 7, 32),  # several chunks of pairs
    ([[5]], 6, 16),
]


@pytest.fixture(params=["one_program", "presorted"])
def align_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways `align` places the pairs: in its one program, or by PyTorch's sort."""
    monkeypatch.setattr(triton_moe_route, "ALIGN_SORT_MIN_PAIRS",
                        10**9 if request.param == "one_program" else 0)
    return request.param


@in_interpreter
@pytest.mark.parametrize("case", range(len(ALIGN_CASES)))
def test_align_sorts_like_group_by_expert_and_tiles_every_pair_once(case: int,
                                                                    align_path: str) -> None:
    rows, experts, block_m = ALIGN_CASES[case]
    ids = torch.tensor(rows, dtype=torch.int32)
    groups = group_by_expert(ids, experts)
    sorted_pairs, offsets, tile_expert, start, end = triton_moe_route.align(
        ids, experts, block_m)
    assert torch.equal(sorted_pairs, groups.sorted_pairs)  # stable: token order kept
    assert torch.equal(offsets, groups.offsets)
    assert tile_expert.shape[0] == triton_moe_route.num_tiles(ids.numel(), experts, block_m)
    covered = []
    for e, s, t in zip(tile_expert.tolist(), start.tolist(), end.tolist()):
        assert 0 <= t - s <= block_m
        for pos in range(s, t):
            assert offsets[e] <= pos < offsets[e + 1]
            covered.append(pos)
    assert sorted(covered) == list(range(ids.numel()))


@in_interpreter
def test_align_puts_skipped_pairs_in_the_null_experts_tiles(align_path: str) -> None:
    ids = torch.tensor([[2, -1], [-1, 0], [2, 2], [-1, -1]], dtype=torch.int32)  # E=3
    sorted_pairs, offsets, tile_expert, start, end = triton_moe_route.align(ids, 3, 16)
    # pairs t*k + j: e0: 3; e2: 0, 4, 5; skipped: 1, 2, 6, 7
    assert offsets.tolist() == [0, 1, 1, 4]
    assert sorted_pairs.tolist() == [3, 0, 4, 5, 1, 2, 6, 7]
    tiles = {(e, s, t) for e, s, t in zip(tile_expert.tolist(), start.tolist(), end.tolist())
             if s < t}
    assert tiles == {(0, 0, 1), (2, 1, 4), (3, 4, 8)}  # expert 3: the null expert


@in_interpreter
@pytest.mark.parametrize("tokens", [3, 40])  # the matrix-vector path, then the grouped one
def test_pairs_with_negative_expert_ids_are_skipped(tokens: int, align_path: str) -> None:
    """As expert parallelism routes other ranks' pairs: id -1 adds nothing, whatever its
    weight, and the other pairs of its token still count."""
    g = torch.Generator().manual_seed(tokens + 7)
    w13, w2 = _weights(8, 64, 32, torch.float32, g)
    x = torch.randn(tokens, 64, generator=g)
    weights, ids = route(torch.randn(tokens, 8, generator=g), 3, True)
    skipped = ids >= 5  # experts 5..7 live on "another rank"
    local = ids.masked_fill(skipped, -1)
    got = triton_moe.fused_experts(x, w13, w2, weights, local)
    want = fused_experts_reference(x, w13, w2, weights.masked_fill(skipped, 0.0), ids)
    assert skipped.any() and not skipped.all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@in_interpreter
@pytest.mark.parametrize(("tokens", "experts", "top_k", "renormalize"), [
    (9, 6, 2, False), (9, 6, 2, True), (4, 128, 8, True), (3, 64, 6, False), (5, 5, 5, True)])
def test_route_kernel_matches_the_reference(tokens: int, experts: int, top_k: int,
                                            renormalize: bool) -> None:
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(experts))
    weights, ids = triton_moe_route.route(logits, top_k, renormalize)
    expected_w, expected_ids = route(logits, top_k, renormalize)  # the CPU reference
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_w, atol=1e-6, rtol=1e-5)


def _swiglu_oai_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        b13: torch.Tensor, b2: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert sum written per token and slot, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double() + b13[e].double()
            gate, up = h[:inter].clamp(max=limit), h[inter:].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(gate * alpha)
            out[t] += weights[t, j].double() * (w2[e].double() @ act + b2[e].double())
    return out


def _fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, N, K] -> (FP8 weights, float32 scales [E, N], the weights
    they stand for in float32)."""
    q, scales = zip(*(quantize_per_channel(w[e]) for e in range(w.shape[0])))
    wq, scale = torch.stack(q), torch.stack(scales)
    return wq, scale, wq.float() * scale[:, :, None]


@in_interpreter
@pytest.mark.parametrize("tokens", [3, 40])  # the matrix-vector path, then the grouped one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_equal_the_dequantized_reference(tokens: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(tokens + 1)
    w13, w2 = _weights(8, 64, 32, torch.float32, g)
    w13q, w13s, w13d = _fp8_experts(w13)
    w2q, w2s, w2d = _fp8_experts(w2)
    x = torch.randn(tokens, 64, generator=g).to(dtype)
    weights, ids = route(torch.randn(tokens, 8, generator=g), 2, True)
    got = triton_moe.fused_experts(x, w13q, w2q, weights, ids, w13_scale=w13s, w2_scale=w2s)
    want = fused_experts_reference(x, w13d.to(dtype), w2d.to(dtype), weights, ids)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@in_interpreter
@pytest.mark.parametrize("tokens", [3, 40])  # the matrix-vector path, then the grouped one
def test_biased_clamped_swiglu_experts(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    w13, w2 = _weights(8, 64, 32, torch.float32, g)
    b13, b2 = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    x = torch.randn(tokens, 64, generator=g) * 3  # large enough for the clamps to bite
    weights, ids = route(torch.randn(tokens, 8, generator=g), 2, True)
    got = triton_moe.fused_experts(x, w13, w2, weights, ids, b13=b13, b2=b2,
                                   activation="swiglu_oai", alpha=1.702, limit=1.5)
    want = _swiglu_oai_experts(x, w13, w2, b13, b2, weights, ids, 1.702, 1.5)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


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
def test_moe_kernels_under_the_interpreter(interpreter: InterpreterRun) -> None:
    # The align tests, the null expert's and the skipped pairs' run on both align paths.
    assert interpreter.passes(__file__) == (len(CASES) + 2 * len(ALIGN_CASES) + 5 + 4 + 2
                                            + 2 * 3 + 1)
