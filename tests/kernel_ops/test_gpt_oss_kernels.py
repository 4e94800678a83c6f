"""gpt-oss's kernel options: attention sinks (the PyTorch reference against a softmax written
out with the sink column, then the Triton kernel, run by Triton's interpreter, against the
reference), the experts' biases and clamped SwiGLU (the reference against a per-token sum and
transformers' own expert and router modules) and top-k-then-softmax routing.

As in test_triton_kernels.py, the interpreted cases run in a child pytest process started with
TRITON_INTERPRET=1 (Triton picks its interpreter when first imported).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_paged_attention import build_step
from test_triton_kernels import (  # noqa: F401 (an autouse fixture)
    CASES,
    AttentionTiles,
    InterpreterRun,
    Step,
    _interpreter_with_gpu_bf16_numerics,
    assert_attention_close,
    in_interpreter,
    make_step,
    outside_interpreter,
    run_attention,
    windowed_reference,
)

from meshserve.kernels import triton_attention
from meshserve.kernels.activation import swiglu_oai_reference
from meshserve.kernels.attention import paged_attention, paged_attention_reference, write_kv
from meshserve.kernels.moe import fused_experts, fused_experts_reference, route_topk_softmax

REPO_ROOT = Path(__file__).resolve().parents[2]


def _sinks(heads: int, seed: int) -> torch.Tensor:
    """Sink logits large enough to take a visible share of the softmax."""
    return 1.0 + 2.0 * torch.randn(heads, generator=torch.Generator().manual_seed(seed))


def dense_attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                               scale: float, sinks: torch.Tensor,
                               window: int | None) -> torch.Tensor:
    """q [Lq, Hq, D] at positions q_start.., k/v [L, Hkv, D], in float64: softmax over the
    visible scores and one more column holding the head's sink, which is then dropped."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).double()
    v = v.repeat_interleave(groups, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [Hq, Lq, L]
    q_pos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    hidden = (k_pos > q_pos) | ((q_pos - k_pos >= window) if window is not None else False)
    scores = scores.masked_fill(hidden, -math.inf)
    column = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)  # [Hq, Lq, 1]
    probs = torch.cat((scores, column), dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v).float()


REFERENCE_CASES = {  # (context lengths, query lengths)
    "decode": ([1, 17, 40], [1, 1, 1]),
    "prefill-fresh": ([7, 33], [7, 33]),
    "chunk-over-prefix": ([40, 20], [8, 20]),
    "mixed": ([50, 1, 9, 30], [1, 1, 9, 12]),
}


@outside_interpreter
@pytest.mark.parametrize("case", list(REFERENCE_CASES))
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("pass_new_kv", [False, True])
def test_sinks_reference_matches_a_softmax_with_a_sink_column(case: str, window: int | None,
                                                               pass_new_kv: bool) -> None:
    ctx_lens, q_lens = REFERENCE_CASES[case]
    hq, hkv, d = 8, 2, 32
    q, k, v, k_cache, v_cache, meta, full_k, full_v = build_step(
        ctx_lens, q_lens, hkv, hq, d, bs=16, num_blocks=64, seed=len(case))
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    sinks, scale = _sinks(hq, len(case)), 0.3
    kwargs = {"key": k, "value": v} if pass_new_kv else {}
    out = paged_attention(q, k_cache, v_cache, meta, scale, window=window, sinks=sinks,
                          **kwargs)
    plain = paged_attention(q, k_cache, v_cache, meta, scale, window=window)
    assert not torch.allclose(out, plain, atol=1e-3), "the sinks must change the output"
    start = 0
    for ctx, ql, fk, fv in zip(ctx_lens, q_lens, full_k, full_v):
        want = dense_attention_with_sinks(q[start : start + ql], fk, fv, ctx - ql, scale,
                                          sinks, window)
        torch.testing.assert_close(out[start : start + ql], want, atol=1e-5, rtol=1e-5)
        start += ql


@outside_interpreter
def test_very_negative_sinks_give_plain_attention() -> None:
    ctx_lens, q_lens = REFERENCE_CASES["mixed"]
    q, k, v, k_cache, v_cache, meta, _, _ = build_step(ctx_lens, q_lens, 2, 8, 32, bs=16,
                                                       num_blocks=64, seed=1)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(q, k_cache, v_cache, meta, 0.3, sinks=torch.full((8,), -1e4))
    torch.testing.assert_close(out, paged_attention(q, k_cache, v_cache, meta, 0.3),
                               atol=1e-5, rtol=1e-5)


def sinks_reference(step: Step, sinks: torch.Tensor, window: int | None) -> torch.Tensor:
    """The float32 reference of a step whose KV the kernel has written (run_attention)."""
    return paged_attention_reference(step.query.float(), step.k_cache.float(),
                                     step.v_cache.float(), step.meta,
                                     step.query.shape[-1] ** -0.5, window=window,
                                     sinks=sinks.float())


@in_interpreter
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("window", "splits"), [
    (None, None), (5, None), (None, 3), (20, 3),  # split-KV: the sink counted once
])
def test_triton_sinks_match_reference(case: str, window: int | None,
                                      splits: int | None) -> None:
    ctx_lens, q_lens = CASES[case]
    step = make_step(ctx_lens, q_lens, 8, 2, 64, bs=16, seed=(window or 0) + (splits or 0))
    sinks = _sinks(8, seed=len(case))
    tiles = AttentionTiles(block_m=16, tile_n=16, num_warps=4, num_stages=2)
    out, _ = run_attention(step, tiles=tiles, window=window, sinks=sinks, num_splits=splits)
    want = sinks_reference(step, sinks, window)
    assert_attention_close(out, want)
    without = windowed_reference(step, window, None)
    assert not torch.allclose(without, want, atol=1e-3), "the sinks must change the output"


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_sinks_in_half_precision(dtype: torch.dtype) -> None:
    ctx_lens, q_lens = CASES["mixed"]
    step = make_step(ctx_lens, q_lens, 4, 2, 64, bs=16, dtype=dtype, seed=11)
    sinks = _sinks(4, seed=2).to(dtype)
    out, _ = run_attention(step, window=12, sinks=sinks)
    assert_attention_close(out, sinks_reference(step, sinks, 12))


@in_interpreter
def test_triton_sinks_are_checked() -> None:
    step = make_step([9], [9], 4, 2, 64, bs=16)
    with pytest.raises(AssertionError, match="sinks must be"):
        triton_attention.paged_attention(step.query, step.k_cache, step.v_cache, step.meta,
                                         0.1, sinks=torch.zeros(2))


@outside_interpreter
def test_sink_kernels_under_the_interpreter(interpreter: InterpreterRun) -> None:
    assert interpreter.passes(__file__) == len(CASES) * 4 + 2 + 1


# -- experts --------------------------------------------------------------------------------


def _per_token_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       b13: torch.Tensor, b2: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor, activation: str, alpha: float,
                       limit: float) -> torch.Tensor:
    """The biased experts' sum written per token and slot, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double() + b13[e].double()
            gate, up = h[:inter], h[inter:]
            if activation == "silu":
                act = torch.nn.functional.silu(gate) * up
            else:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                act = (up + 1) * gate * torch.sigmoid(gate * alpha)
            out[t] += weights[t, j].double() * (w2[e].double() @ act + b2[e].double())
    return out


@outside_interpreter
@pytest.mark.parametrize("activation", ["swiglu_oai", "silu"])
def test_biased_experts_reference_is_a_per_token_sum(activation: str) -> None:
    g = torch.Generator().manual_seed(3)
    experts, hidden, inter = 6, 32, 16
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    b13, b2 = torch.randn(experts, 2 * inter, generator=g), torch.randn(experts, hidden, generator=g)
    x = 3 * torch.randn(7, hidden, generator=g)  # large enough for the clamps to bite
    weights, ids = route_topk_softmax(torch.randn(7, experts, generator=g), 2)
    want = _per_token_experts(x, w13, w2, b13, b2, weights, ids, activation, 1.702, 1.5)
    options = {"b13": b13, "b2": b2, "activation": activation, "alpha": 1.702, "limit": 1.5}
    got = fused_experts_reference(x, w13, w2, weights, ids, **options)  # type: ignore[arg-type]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    entry = fused_experts(x, w13, w2, weights, ids, **options)  # type: ignore[arg-type]
    assert torch.equal(entry, got)  # the CPU entry point is the reference
    unclamped = fused_experts_reference(x, w13, w2, weights, ids, b13=b13, b2=b2,
                                        activation=activation, limit=100.0)
    assert (activation == "silu") == torch.equal(unclamped, got), "the clamps must bite"


@outside_interpreter
def test_swiglu_oai_and_routing_equal_transformers_gpt_oss_modules() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    config = GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=6,
                          num_experts_per_tok=3, swiglu_limit=1.5)
    g = torch.Generator().manual_seed(5)
    router = GptOssTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(6, 32, generator=g))
        router.bias.copy_(torch.randn(6, generator=g))
    x = 3 * torch.randn(9, 32, generator=g)
    logits, want_weights, want_ids = router(x)
    weights, ids = route_topk_softmax(logits, 3)
    assert torch.equal(ids.long(), want_ids) and ids.dtype == torch.int32
    torch.testing.assert_close(weights, want_weights, atol=0, rtol=0)
    gate_up = torch.randn(9, 32, generator=g) * 3  # interleaved as transformers holds it
    want = GptOssExperts(config)._apply_gate(gate_up)
    ours = torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=-1)  # gate, then up
    torch.testing.assert_close(swiglu_oai_reference(ours, 1.702, 1.5), want, atol=0, rtol=0)


@outside_interpreter
def test_bias_shapes_and_activation_are_checked() -> None:
    w13, w2 = torch.zeros(4, 16, 8), torch.zeros(4, 8, 8)
    x, weights, ids = torch.zeros(2, 8), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(AssertionError, match="b13 must be"):
        fused_experts(x, w13, w2, weights, ids, b13=torch.zeros(4, 8))
    with pytest.raises(AssertionError, match="activation 'gelu'"):
        fused_experts(x, w13, w2, weights, ids, activation="gelu")
