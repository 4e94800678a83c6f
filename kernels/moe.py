"""Mixture-of-experts MLP: routing, experts grouped by token, and the weighted combine.

    router logits [T, E] --route--> weights [T, k] float32, expert ids [T, k] int32
    x [T, H] --experts--> sum_j weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t))), [T, H]

Expert weights are stacked: w13 [E, 2I, H] (each expert's gate rows, then its up rows, the
layout `silu_and_mul` reads) and w2 [E, H, I], optionally with biases b13 [E, 2I] and b2 [E, H]
(gpt-oss). `act` is "silu" (silu(gate) * up) or "swiglu_oai", gpt-oss's clamped SwiGLU with its
alpha and limit (kernels/activation.py). On CUDA tensors the experts run as two grouped
GEMMs of `meshserve.kernels.triton_moe` over the (token, slot) pairs sorted by expert; the
PyTorch code here (a loop over the experts) is the reference and the CPU path.

Routing follows transformers' Qwen2-MoE / Qwen3-MoE / Mixtral routers: a float32 softmax over
the experts, the top k probabilities, optionally renormalised to sum to 1 (on CUDA one Triton
launch, kernels/triton_moe_route.py). gpt-oss's router takes the top k logits and a softmax over
those k (`route_topk_softmax`): the same experts and, up to rounding, the renormalised weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshserve.kernels.activation import (
    SWIGLU_OAI_ALPHA,
    SWIGLU_OAI_LIMIT,
    silu_and_mul_reference,
    swiglu_oai_reference,
)

ACTIVATIONS = ("silu", "swiglu_oai")


def route(router_logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32).

    Ties go to the lower expert id, as torch.topk picks them."""
    num_experts = router_logits.shape[-1]
    assert 1 <= top_k <= num_experts, f"top_k {top_k} must be in 1..{num_experts}"
    if router_logits.is_cuda:
        from meshserve.kernels import triton_moe_route  # GPU only: one launch

        return triton_moe_route.route(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def route_topk_softmax(router_logits: torch.Tensor,
                       top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k]
    int32): the k largest logits, then a softmax over those k in the logits' dtype, as
    transformers' `GptOssTopKRouter`. On CUDA the routing kernel's renormalised top k, which is
    that softmax computed in float32."""
    num_experts = router_logits.shape[-1]
    assert 1 <= top_k <= num_experts, f"top_k {top_k} must be in 1..{num_experts}"
    if router_logits.is_cuda:
        return route(router_logits, top_k, renormalize=True)
    top, ids = torch.topk(router_logits, top_k, dim=-1)  # [T, k] each
    weights = torch.softmax(top, dim=-1, dtype=router_logits.dtype)
    return weights.float(), ids.to(torch.int32)


@dataclass(frozen=True)
class ExpertGroups:
    """The T*k (token, slot) pairs of a step sorted by expert, all on the device.

    `sorted_pairs[p]` is the flat index t*k + j of the p-th pair in expert order; expert e's
    pairs are positions offsets[e]:offsets[e+1]. Computed without reading anything back to the
    host, so the step stays capturable in a CUDA graph."""

    sorted_pairs: torch.Tensor  # [T*k] int32
    offsets: torch.Tensor  # [E+1] int32

    @property
    def num_pairs(self) -> int:
        return self.sorted_pairs.shape[0]


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """expert_ids [T, k] -> the pairs grouped by expert (stable: token order within one)."""
    flat = expert_ids.reshape(-1).to(torch.int64)  # [T*k]
    order = torch.sort(flat, stable=True).indices  # [T*k]
    # scatter_add, not bincount: bincount reads the largest id back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return ExpertGroups(order.to(torch.int32), offsets)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, expert_ids: torch.Tensor, *,
                  w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  activation: str = "silu", alpha: float = SWIGLU_OAI_ALPHA,
                  limit: float = SWIGLU_OAI_LIMIT) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/expert_ids [T, k] -> [T, H] in x's dtype.

    FP8 expert weights come with float32 scales per expert and output row, w13_scale
    [E, 2I] and w2_scale [E, H]. Biases b13 [E, 2I] and b2 [E, H] are added to the products;
    `activation` is one of ACTIVATIONS, `alpha` and `limit` those of "swiglu_oai". The Triton
    kernels on CUDA (reading the FP8 bytes), the reference elsewhere (on the dequantized
    weights)."""
    _check_shapes(x, w13, w2, weights, expert_ids)
    _check_biases(w13, w2, b13, b2, activation)
    if x.is_cuda:
        from meshserve.kernels import triton_moe  # GPU only

        return triton_moe.fused_experts(x, w13, w2, weights, expert_ids, w13_scale=w13_scale,
                                        w2_scale=w2_scale, b13=b13, b2=b2,
                                        activation=activation, alpha=alpha, limit=limit)
    if w13_scale is not None and w2_scale is not None:
        w13 = (w13.float() * w13_scale[..., None]).to(x.dtype)
        w2 = (w2.float() * w2_scale[..., None]).to(x.dtype)
    return fused_experts_reference(x, w13, w2, weights, expert_ids, b13=b13, b2=b2,
                                   activation=activation, alpha=alpha, limit=limit)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
              w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Route x [T, H] by router_logits [T, E] and run its top-k experts: [T, H]."""
    weights, expert_ids = route(router_logits, top_k, renormalize)
    return fused_experts(x, w13, w2, weights, expert_ids, w13_scale=w13_scale,
                         w2_scale=w2_scale)


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            weights: torch.Tensor, expert_ids: torch.Tensor, *,
                            b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                            activation: str = "silu", alpha: float = SWIGLU_OAI_ALPHA,
                            limit: float = SWIGLU_OAI_LIMIT) -> torch.Tensor:
    """A loop over the experts, each over the tokens routed to it (transformers' order of
    operations: the expert's output in x's dtype, scaled by the routing weight in that dtype,
    summed into a zero [T, H] of x's dtype). Biases are added in the products (F.linear's,
    as the Triton kernels add them to the float32 accumulator)."""
    out = torch.zeros_like(x)  # [T, H]
    scale = weights.to(x.dtype)  # [T, k]
    for expert in range(w13.shape[0]):
        tokens, slots = torch.where(expert_ids == expert)  # [n] each
        if tokens.numel() == 0:
            continue
        gate_up = F.linear(x[tokens], w13[expert], None if b13 is None else b13[expert])
        if activation == "silu":
            hidden = silu_and_mul_reference(gate_up)  # [n, I]
        else:
            hidden = swiglu_oai_reference(gate_up, alpha, limit)  # [n, I]
        y = F.linear(hidden, w2[expert], None if b2 is None else b2[expert])  # [n, H]
        out.index_add_(0, tokens, y * scale[tokens, slots, None])
    return out


def _check_biases(w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None,
                  b2: torch.Tensor | None, activation: str) -> None:
    assert activation in ACTIVATIONS, f"activation {activation!r} is not one of {ACTIVATIONS}"
    for bias, w, name in ((b13, w13, "b13"), (b2, w2, "b2")):
        assert bias is None or tuple(bias.shape) == tuple(w.shape[:2]), (
            f"{name} must be [E, N] = {tuple(w.shape[:2])} for its weights, got "
            f"{tuple(bias.shape)}")


def _check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, expert_ids: torch.Tensor) -> None:
    assert x.dim() == 2, f"x must be [T, H], got {tuple(x.shape)}"
    assert w13.dim() == 3 and w2.dim() == 3, (
        f"w13 and w2 must be [E, 2I, H] and [E, H, I], got {tuple(w13.shape)}, "
        f"{tuple(w2.shape)}")
    num_experts, two_inter, hidden = w13.shape
    assert hidden == x.shape[1] and two_inter % 2 == 0, (
        f"w13 {tuple(w13.shape)} does not fit x {tuple(x.shape)}")
    assert tuple(w2.shape) == (num_experts, hidden, two_inter // 2), (
        f"w2 {tuple(w2.shape)} does not fit w13 {tuple(w13.shape)}")
    assert weights.shape == expert_ids.shape and weights.shape[0] == x.shape[0], (
        f"weights {tuple(weights.shape)} and ids {tuple(expert_ids.shape)} for {x.shape[0]} "
        "tokens")
