"""CUDA graphs for decode steps: one captured forward per batch-size bucket.

A decode step launches a few hundred small kernels; replaying a captured graph
launches them all at once, so small batches stop being bound by the CPU. Graphs
read their inputs from static buffers: a step copies its inputs in, pads the
batch to the bucket (padding rows write no KV and attend to one slot of block
0), replays, and reads the first rows of the static output.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from meshserve.kernels.attention import AttentionMetadata

log = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 256, capped at max_num_seqs."""
    sizes = [1, 2, 4] + list(range(8, 257, 8))
    capped = [b for b in sizes if b < max_num_seqs]
    return capped + [min(max_num_seqs, 256)]


@dataclass(frozen=True)
class CaptureReport:
    buckets: list[int]
    seconds: float
    memory_bytes: int


class CudaGraphRunner:
    """Captures and replays decode forwards for every bucket up to the largest."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], *, max_num_seqs: int,
                 max_blocks_per_seq: int, max_model_len: int, hidden_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        largest = self.buckets[-1]
        # Static inputs, sized for the largest bucket.
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.hidden_size = hidden_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the graphs' shared memory pool handle

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], query_start_loc=self.query_start_loc[:batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * batch, seq_lens_cpu=[1] * batch)

    def _forward(self, batch: int) -> torch.Tensor:
        return self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches,
                          self._meta(batch))

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture every bucket, largest first so that smaller ones reuse its memory pool."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        started = time.perf_counter()
        for batch in reversed(self.buckets):
            self._forward(batch)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[batch] = self._forward(batch)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        report = CaptureReport(list(self.buckets), time.perf_counter() - started,
                               free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("captured %d decode CUDA graphs (batch 1..%d) in %.1fs using %.0f MiB",
                 len(self.buckets), self.max_batch, report.seconds, report.memory_bytes / 2**20)
        return report

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            ) -> torch.Tensor:  # [B, H]
        """Replay the graph of the smallest bucket that holds this decode batch."""
        num_seqs = meta.num_seqs
        batch = self.bucket_for(num_seqs)
        assert batch is not None and meta.decode_only, (
            f"no captured graph for a decode batch of {num_seqs} (largest {self.max_batch})")
        width = meta.block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(input_ids, non_blocking=True)
        self.positions[:num_seqs].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables, non_blocking=True)
        if batch > num_seqs:  # padding rows: write nothing, attend to one slot
            self.slot_mapping[num_seqs:batch].fill_(-1)
            self.seq_lens[num_seqs:batch].fill_(1)
        self.graphs[batch].replay()
        return self.outputs[batch][:num_seqs]
