"""Latency of the all-reduce a tensor-parallel decode step makes after every o_proj and
down_proj: NCCL's `all_reduce` against PyTorch symmetric memory's one-shot and two-shot
all-reduces, each captured 64 times in one CUDA graph (as a decode step replays them).

Driver part: `tp` (step probe).

Then what a step actually does with each sum, up to 64 rows: the sum, the residual add and
RMSNorm, unfused (a copy into the symmetric buffer, the one-shot all-reduce, the add +
RMSNorm kernel) against the fused kernel (kernels/triton_rank_sum_norm.py) at 64 call
sites, with the largest difference between the two results.

    python3 loadtest/tp_allreduce_probe.py --out probe.json      # on a host with 2+ GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPEATS = 64  # all-reduces in one graph: two per layer of a 32-layer model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time_graph(fn, iters: int = 20) -> float:
    """Microseconds per call of `fn`, replayed inside a CUDA graph REPEATS times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (iters * REPEATS)


def _nccl(x: torch.Tensor) -> None:
    dist.all_reduce(x)


def _one_shot(x: torch.Tensor, view: torch.Tensor, group_name: str) -> None:
    view.copy_(x)  # into the symmetric buffer, then every rank reads every peer's
    torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", group_name, x)


def _two_shot(x: torch.Tensor, view: torch.Tensor, group_name: str) -> None:
    view.copy_(x)
    torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group_name)
    x.copy_(view)


def _unfused_sum_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      buf: torch.Tensor, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What a step did before the fused kernel: copy, one-shot all-reduce, add + RMSNorm."""
    from meshserve.kernels import triton_norm

    view = buf[: x.numel()].view_as(x)
    view.copy_(x)
    summed = torch.empty_like(x)
    torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", group_name, summed)
    return triton_norm.fused_add_rms_norm(summed, residual, weight, 1e-5)


def _fused_sum_norm(fused, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    calls) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel; consecutive calls take consecutive sites, as a model's norms do."""
    return fused(x, residual, weight, 1e-5, next(calls) % REPEATS)


def _fused_rows(device: torch.device, group_name: str,
                buf: torch.Tensor) -> dict[str, object]:
    """Unfused against fused sum + add + RMSNorm, each call at its own site as in a model."""
    from meshserve.services.worker.parallel.device_sum import FusedSumNorm

    hidden, dtype = 4096, torch.bfloat16
    fused = FusedSumNorm.create(device, dtype, hidden, REPEATS, group_name)
    if fused is None:
        return {"error": "the fused kernel's buffers could not be set up"}
    rows: dict[str, object] = {"rows_per_site": fused.rows_per_site}
    same = torch.Generator(device=device).manual_seed(7)  # the norm weight: one on all ranks
    weight = (1 + 0.1 * torch.randn(hidden, generator=same, device=device)).to(dtype)
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    for tokens in (1, 8, 32, 64):
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
        residual = (3 * torch.randn(tokens, hidden, generator=g, device=device)).to(dtype)
        unfused = partial(_unfused_sum_norm, x, residual, weight, buf, group_name)
        one_fused = partial(_fused_sum_norm, fused, x, residual, weight, iter(range(1 << 30)))
        want, got = unfused(), one_fused()
        torch.cuda.synchronize()
        row: dict[str, object] = {
            "max_diff_normed": float((want[0].float() - got[0].float()).abs().max()),
            "max_diff_residual": float((want[1].float() - got[1].float()).abs().max())}
        try:
            row["unfused_us"] = _time_graph(unfused)
            row["fused_us"] = _time_graph(one_fused)
        except Exception as exc:  # noqa: BLE001 - the probe records what fails
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows[f"tokens_{tokens}"] = row
    return rows


def _run(rank: int, world: int, port: int, out: str) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    group = dist.group.WORLD
    results: dict[str, object] = {"world_size": world, "device": torch.cuda.get_device_name()}
    import torch.distributed._symmetric_memory as symm_mem
    max_numel = 4096 * 512
    buf = symm_mem.empty(max_numel, dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(buf, group.group_name)
    results["symm_mem"] = handle is not None
    name = group.group_name
    for tokens in (1, 8, 32, 128, 512):
        numel = tokens * 4096
        x = torch.full((tokens, 4096), float(rank + 1), dtype=torch.bfloat16, device=device)
        expect = float(sum(range(1, world + 1)))
        row: dict[str, object] = {"bytes": numel * 2}

        view = buf[:numel].view(tokens, 4096)
        variants = {"nccl": partial(_nccl, x), "one_shot": partial(_one_shot, x, view, name),
                    "two_shot": partial(_two_shot, x, view, name)}
        for variant, fn in variants.items():
            try:
                x.fill_(rank + 1)
                fn()
                torch.cuda.synchronize()
                row[f"{variant}_ok"] = bool((x == expect).all())
                row[f"{variant}_us"] = _time_graph(fn)
            except Exception as exc:  # noqa: BLE001 - the probe records what fails
                row[f"{variant}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        results[f"tokens_{tokens}"] = row
    results["sum_add_rms_norm"] = _fused_rows(device, name, buf)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        print(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="allreduce_probe.json")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(_run, args=(args.world_size, _free_port(), args.out), nprocs=args.world_size)


if __name__ == "__main__":
    main()
