"""CUDA graphs for decode steps: one captured forward per batch-size bucket.

A decode step launches a few hundred small kernels; replaying a captured graph
launches them all at once, so small batches stop being bound by the CPU. Graphs
read their inputs from static buffers: a step copies its inputs in, pads the
batch to the bucket (padding rows write no KV and attend to one slot of block
0), replays, and reads the first rows of the static output.

Speculative verify steps, where every sequence queries its last token and the
same number of drafts (q = 2..k+1 tokens each), replay whole-step graphs too, one
per (batch bucket, q): a verify step at a small batch is as memory-bound as a
decode step, so it must not pay eager or piecewise launch costs.

With multi-LoRA serving every key is captured twice: with the adapters' kernels
(2 x 4 per layer) and without them, for steps where no row has an adapter. The
kernels cost about 0.75 ms a step at batch 1 on an H100 even when they add nothing
(loadtest/reports/lora/README.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshserve.kernels.attention import AttentionMetadata
from meshserve.services.worker.engine.hooks import AdapterStack
from meshserve.services.worker.models.llama import CausalLM, DecoderLayer

log = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 256, capped at max_num_seqs."""
    sizes = [1, 2, 4] + list(range(8, 257, 8))
    capped = [b for b in sizes if b < max_num_seqs]
    return capped + [min(max_num_seqs, 256)]


# Verify steps replay whole-step graphs up to this many sequences; larger batches are long
# enough on the device for the piecewise graphs.
VERIFY_GRAPH_MAX_SEQS = 64


def verify_graph_key(query_lens: list[int], verify_lens: tuple[int, ...],
                     buckets: list[int]) -> tuple[int, int] | None:
    """(batch bucket, query length) of the captured verify graph for a step whose sequences
    query `query_lens` tokens, or None: the lengths differ, are not a captured q, or the batch
    is beyond every verify bucket."""
    q = query_lens[0] if query_lens else 0
    if q not in verify_lens or any(n != q for n in query_lens):
        return None
    return next(((b, q) for b in verify_buckets(buckets) if b >= len(query_lens)), None)


def verify_buckets(buckets: list[int]) -> list[int]:
    """The batch buckets that get verify graphs (up to VERIFY_GRAPH_MAX_SEQS)."""
    return [b for b in buckets if b <= VERIFY_GRAPH_MAX_SEQS]


@dataclass(frozen=True)
class CaptureReport:
    buckets: list[int]
    seconds: float
    memory_bytes: int


class CudaGraphRunner:
    """Captures and replays decode forwards for every bucket up to the largest, and verify
    forwards of q tokens per sequence (q in `verify_lens`) for the buckets up to
    VERIFY_GRAPH_MAX_SEQS. Graphs are keyed by (batch bucket, tokens per sequence, whether
    the LoRA hooks run); `lora` is the adapters' stack when the model has them."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], *, max_num_seqs: int,
                 max_blocks_per_seq: int, max_model_len: int, hidden_size: int,
                 device: torch.device, verify_lens: tuple[int, ...] = (),
                 lora: AdapterStack | None = None) -> None:
        self.model = model
        self.lora = lora
        self.kv_caches = kv_caches
        self.device = device
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.verify_lens = tuple(q for q in verify_lens if q > 1)
        largest = self.buckets[-1]
        # Static inputs: [largest] sequences, [max_tokens] tokens (a verify bucket's B * q).
        max_tokens = max([largest] + [b * q for b in verify_buckets(self.buckets)
                                      for q in self.verify_lens])
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        # Per query length q: [largest + 1] starts 0, q, 2q, ...
        self.query_start_locs = {q: torch.arange(largest + 1, dtype=torch.int32,
                                                 device=device) * q
                                 for q in (1, *self.verify_lens)}
        self.hidden_size = hidden_size
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, bool], torch.Tensor] = {}
        self.pool: Any = None  # the graphs' shared memory pool handle

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def keys(self) -> list[tuple[int, int]]:
        """Every (batch bucket, tokens per sequence) to capture, largest step first."""
        keys = [(b, 1) for b in self.buckets]
        keys += [(b, q) for b in verify_buckets(self.buckets) for q in self.verify_lens]
        return sorted(keys, key=lambda key: (key[0] * key[1], key[1]), reverse=True)

    def capture_keys(self) -> list[tuple[int, int, bool]]:
        """`keys()`, each with the LoRA hooks on and, with adapters, off as well."""
        variants = (True, False) if self.lora is not None else (False,)
        return [(batch, q, with_lora) for batch, q in self.keys() for with_lora in variants]

    def _lora_active(self) -> bool:
        return self.lora is not None and self.lora.active

    def _meta(self, batch: int, q: int, seq_lens_cpu: list[int] | None = None
              ) -> AttentionMetadata:
        """Metadata over the static buffers. A graph's attention reads only the device
        tensors; the host lists matter to the CPU reference path (uncaptured runs), and for
        q > 1 say "context before the queries" so that no fresh-prefill path is taken."""
        tokens = batch * q
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens],
            query_start_loc=self.query_start_locs[q][:batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch],
            max_query_len=q, max_seq_len=self.max_model_len,
            query_lens_cpu=[q] * batch,
            seq_lens_cpu=seq_lens_cpu or [1 if q == 1 else self.max_model_len] * batch)

    def _forward(self, batch: int, q: int, seq_lens_cpu: list[int] | None = None
                 ) -> torch.Tensor:
        tokens = batch * q
        return self.model(self.input_ids[:tokens], self.positions[:tokens], self.kv_caches,
                          self._meta(batch, q, seq_lens_cpu))

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture every key, largest first so that smaller ones reuse its memory pool."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        started = time.perf_counter()
        for batch, q, with_lora in self.capture_keys():
            if self.lora is not None:
                self.lora.active = with_lora
            self.seq_lens.fill_(q)  # every query row sees at least its own key
            self._forward(batch, q)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[batch, q, with_lora] = self._forward(batch, q)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch, q, with_lora] = graph
        if self.lora is not None:
            self.lora.active = True
        torch.cuda.synchronize(self.device)
        report = CaptureReport(list(self.buckets), time.perf_counter() - started,
                               free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("captured %d decode and verify CUDA graphs (batch 1..%d, verify lengths %s%s) "
                 "in %.1fs using %.0f MiB", len(self.graphs), self.max_batch,
                 list(self.verify_lens), ", with and without LoRA" if self.lora else "",
                 report.seconds, report.memory_bytes / 2**20)
        return report

    def verify_key(self, meta: AttentionMetadata) -> tuple[int, int] | None:
        """The verify graph for this step, if one was made for its shape."""
        return verify_graph_key(meta.query_lens_cpu, self.verify_lens, self.buckets)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            ) -> torch.Tensor:  # [T, H]
        """Replay the graph of the smallest bucket that holds this decode batch, or the verify
        graph of its (bucket, q); uncaptured (CPU tests), the same padded forward runs
        eagerly."""
        num_seqs, num_tokens = meta.num_seqs, input_ids.shape[0]
        bucket = self.bucket_for(num_seqs)
        key = self.verify_key(meta) if not meta.decode_only else (
            None if bucket is None else (bucket, 1))
        assert key is not None, (f"no captured graph for a step of {num_seqs} sequences with "
                                 f"query lengths {meta.query_lens_cpu[:4]}...")
        batch, q = key
        width = meta.block_tables.shape[1]
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables, non_blocking=True)
        if batch > num_seqs:  # padding sequences: write nothing, attend to their q slots
            self.slot_mapping[num_tokens:batch * q].fill_(-1)
            self.seq_lens[num_seqs:batch].fill_(q)
        graph_key = (batch, q, self._lora_active())
        graph = self.graphs.get(graph_key)
        if graph is None:
            pad = [q] * (batch - num_seqs)
            return self._forward(batch, q, list(meta.seq_lens_cpu) + pad)[:num_tokens]
        graph.replay()
        return self.outputs[graph_key][:num_tokens]


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture piecewise graphs for: 16..128 by 16, then 160..256 by 32,
    320..512 by 64 and so on, capped at max_tokens, so that a step is padded by less than 16
    tokens or a quarter of its tokens."""
    sizes: list[int] = []
    step, size = 16, 16
    while size < max_tokens:
        sizes.append(size)
        if size >= 8 * step:
            step *= 2
        size += step
    return sizes + [max_tokens]


class PiecewiseGraphRunner:
    """CUDA graphs for steps of any shape, cut at attention (prefill, chunked prefill, mixed).

    Attention's launch shape depends on the step's sequences, so it runs eagerly; everything
    between two attentions (o_proj, residual add, norm, MLP, the next layer's norm, QKV
    projection, rotary and KV write) depends only on the number of tokens, and is captured
    once per token bucket. A step of T tokens replays the pieces of the smallest bucket B >= T
    with T real rows and B - T padding rows (no KV write, outputs ignored), and launches L
    attentions in between: L + 1 graph replays and L attention launches instead of about ten
    eager launches per layer. Pieces exchange q/k/v, the attention output and the residual
    stream through static buffers sized for the largest bucket, in the shapes the layers'
    attention declares (`piece_shapes`: llama.py's heads, or latent attention's latent
    queries and outputs, models/deepseek_v2.py).
    """

    def __init__(self, model: CausalLM, kv_caches: list[KVCache], *, max_tokens: int,
                 device: torch.device) -> None:
        self.model = model
        self.decoder = model.model
        self.layers: list[DecoderLayer] = list(self.decoder.layers)  # type: ignore[arg-type]
        self.kv_caches = kv_caches
        self.device = device
        self.buckets = token_buckets(max_tokens)
        largest = self.buckets[-1]
        attn = self.layers[0].self_attn
        dtype = self.decoder.embed_tokens.weight.dtype
        hidden_size = self.decoder.embed_tokens.weight.shape[1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(largest, *shape, dtype=dtype, device=device)

        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        # What the attention's project returns and its attend returns, per token.
        shapes = attn.piece_shapes()
        self.q = buffer(*shapes.q)
        self.k = buffer(*shapes.k)
        self.v = buffer(*shapes.v)
        self.attn_out = buffer(*shapes.out)
        self.residual = buffer(hidden_size)
        self.hidden = buffer(hidden_size)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool: Any = None
        self.after_layer: Callable[[int], None] | None = None
        """Called once each layer's KV write is queued (`watch_layers`)."""

    def watch_layers(self, written: Callable[[int], None]) -> None:
        """Call `written(i)` as soon as layer i's piece (its KV write) is queued."""
        self.after_layer = written

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def _project(self, index: int, hidden: torch.Tensor, residual: torch.Tensor | None,
                 batch: int) -> None:
        """Layer `index` up to attention; q/k/v and the residual stream into the buffers."""
        layer = self.layers[index]
        normed, residual = layer.input_norm(hidden, residual)
        q, k, v = layer.self_attn.project(self.positions[:batch], normed, self.kv_caches[index],
                                          self.slot_mapping[:batch],
                                          self.decoder.rotary_for(index))
        self.q[:batch].copy_(q)
        self.k[:batch].copy_(k)
        self.v[:batch].copy_(v)
        self.residual[:batch].copy_(residual)

    def _finish(self, index: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index` after attention: (MLP output, residual stream)."""
        layer = self.layers[index]
        attn_out = layer.self_attn.output(self.attn_out[:batch])
        return layer.finish(attn_out, self.residual[:batch])

    def _piece(self, index: int, batch: int) -> None:
        """Piece `index` of L + 1: from attention index - 1 to attention index."""
        if index == 0:
            self._project(0, self.decoder.embed(self.input_ids[:batch]), None, batch)
            return
        hidden, residual = self._finish(index - 1, batch)
        if index < len(self.layers):
            self._project(index, hidden, residual, batch)
        else:
            self.hidden[:batch].copy_(self.decoder.norm.add_forward(hidden, residual)[0])

    def _attention(self, index: int, meta: AttentionMetadata, num_tokens: int) -> None:
        out = self.layers[index].self_attn.attend(
            self.q[:num_tokens], self.k[:num_tokens], self.v[:num_tokens],
            self.kv_caches[index], meta)
        self.attn_out[:num_tokens].copy_(out)

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture the L + 1 pieces of every bucket, largest first (smaller ones reuse its
        pool memory)."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        started = time.perf_counter()
        num_pieces = len(self.layers) + 1
        for batch in reversed(self.buckets):
            for index in range(num_pieces):  # warm-up: compiles kernels, settles allocations
                self._piece(index, batch)
            torch.cuda.synchronize(self.device)
            graphs = []
            for index in range(num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._piece(index, batch)
                if self.pool is None:
                    self.pool = graph.pool()
                graphs.append(graph)
            self.graphs[batch] = graphs
        torch.cuda.synchronize(self.device)
        report = CaptureReport(list(self.buckets), time.perf_counter() - started,
                               free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("captured %d piecewise CUDA graphs (%d token buckets up to %d) in %.1fs "
                 "using %.0f MiB", num_pieces * len(self.buckets), len(self.buckets),
                 self.max_tokens, report.seconds, report.memory_bytes / 2**20)
        return report

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            ) -> torch.Tensor:  # [T, H]
        num_tokens = input_ids.shape[0]
        batch = next(b for b in self.buckets if b >= num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping, non_blocking=True)
        if batch > num_tokens:  # padding rows write no KV
            self.input_ids[num_tokens:batch].fill_(0)
            self.positions[num_tokens:batch].fill_(0)
            self.slot_mapping[num_tokens:batch].fill_(-1)
        graphs = self.graphs.get(batch)  # uncaptured (CPU tests): the pieces run eagerly
        for index in range(len(self.layers) + 1):
            if graphs is not None:
                graphs[index].replay()
            else:
                self._piece(index, batch)
            if index < len(self.layers):
                if self.after_layer is not None:  # piece `index` wrote layer index's KV
                    self.after_layer(index)
                self._attention(index, meta, num_tokens)
        return self.hidden[:num_tokens]
