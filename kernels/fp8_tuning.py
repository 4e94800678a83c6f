"""Launch shapes of the skinny FP8 product chosen by measurement, once per shape.

The fastest tile depends on the GPU and on (N, K) in ways a fixed table measured elsewhere
misses (how many programs an N gives per SM, how much widening a tile needs), so the first
eager call for each (N, K, one row or several) times every candidate of
`triton_fp8_linear.CANDIDATES` on the real operands, inside a CUDA graph as the engine runs
them, and keeps the fastest. The engine runs
every captured shape eagerly before capturing its CUDA graphs (cuda_graphs.py), so the
measurement happens there. A candidate whose result differs from the fallback's by more
than 1% (relative norm) is left aside. A call made while a stream is capturing never
measures (it would launch outside the graph) and takes the fallback table `fp8_config_for`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from meshserve.kernels import knobs
from meshserve.kernels.triton_fp8_linear import (
    CANDIDATES,
    Fp8Config,
    fp8_config_for,
    skinny_fp8_linear,
)

log = logging.getLogger(__name__)

# (N, K, one row) -> the fastest measured launch shape.
_chosen: dict[tuple[int, int, bool], Fp8Config] = {}
# (N, K, one row) -> {config: milliseconds}, for reports.
measured: dict[tuple[int, int, bool], dict[Fp8Config, float]] = {}


def candidates(rows: int) -> list[Fp8Config]:
    """The launch shapes that can run `rows` rows (the FMA tiles take one); those that
    widen FP8 by integer instructions only with `--fp8-widen bits`."""
    cvt_only = knobs.current().fp8_widen != "bits"
    return [c for c in CANDIDATES
            if (c.mode != "fma" or rows == 1) and not (cvt_only and c.widen == "bits")]


def config_for(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> Fp8Config:
    """The launch shape for x [M <= 16, K] @ weight [N, K]^T: measured on the first eager
    call for its (N, K, M == 1), the fallback table while a CUDA graph is being captured."""
    rows, k = x.shape
    n = weight.shape[0]
    key = (n, k, rows == 1)
    chosen = _chosen.get(key)
    if chosen is not None:
        return chosen
    if not x.is_cuda or torch.cuda.is_current_stream_capturing():
        return fp8_config_for(rows, n, k)
    reference = skinny_fp8_linear(x, weight, scale, fp8_config_for(rows, n, k)).float()
    copies = weight_copies(weight)
    times = {c: _time_ms(x, weight, scale, c, copies) if _agrees(x, weight, scale, c, reference)
             else float("inf") for c in candidates(rows)}
    del copies
    chosen = min(times, key=times.__getitem__)
    _chosen[key], measured[key] = chosen, times
    log.info("fp8 skinny product N=%d K=%d rows%s: %s (%.1f us; fallback %.1f us)", n, k,
             "=1" if rows == 1 else ">1", chosen, times[chosen] * 1e3,
             times.get(fp8_config_for(rows, n, k), float("nan")) * 1e3)
    return chosen


def _agrees(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
            reference: torch.Tensor) -> bool:
    """Whether `config` gives the fallback's result within 1% (relative norm): a launch
    shape the GPU's compiler gets wrong is never chosen."""
    try:
        got = skinny_fp8_linear(x, weight, scale, config).float()
    except Exception as error:  # noqa: BLE001 - Triton raises several kinds of errors
        log.warning("fp8 launch shape %s failed: %s", config, error)
        return False
    difference = ((got - reference).norm() / reference.norm().clamp(min=1e-30)).item()
    if not difference <= 1e-2:  # also false for NaN
        log.warning("fp8 launch shape %s left aside: relative difference %.3g (N=%d K=%d, "
                    "%d rows, max |x| %.3g, |y| %.3g against the fallback's %.3g)", config,
                    difference, weight.shape[0], weight.shape[1], x.shape[0],
                    x.abs().max().item(), got.norm().item(), reference.norm().item())
        return False
    return True


def _time_ms(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             config: Fp8Config, copies: list[torch.Tensor] | None = None) -> float:
    """Milliseconds per product with `config`, as the engine runs it: back to back inside a
    CUDA graph (no host launch in the figure), cycling over copies of the weight that
    together exceed twice the L2 cache (each product reads its weight from memory)."""
    weights = copies if copies is not None else weight_copies(weight)
    # A shape that does not compile or launch here (shared memory, registers) just loses.
    try:
        return graph_time_ms(
            lambda i: skinny_fp8_linear(x, weights[i % len(weights)], scale, config),
            max(len(weights), 16 // len(weights) * len(weights)), x.device)
    except Exception as error:  # noqa: BLE001 - Triton raises several kinds of errors
        log.warning("fp8 launch shape %s failed: %s", config, error)
        return float("inf")


def graph_time_ms(launch: Callable[[int], object], calls: int, device: torch.device) -> float:
    """Median milliseconds per call of `launch(0..calls-1)` captured in one CUDA graph and
    replayed 5 times (each call is made once before the capture: compiles, workspaces)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for i in range(calls):
            launch(i)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            launch(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    return sorted(per_call)[len(per_call) // 2]


def weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and as many copies as make more than twice the GPU's L2 cache (at most 8)."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    count = min(8, max(1, -(-2 * l2 // max(weight.numel() * weight.element_size(), 1)) + 1))
    return [weight, *(weight.clone() for _ in range(count - 1))]
