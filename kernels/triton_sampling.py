"""Triton sampling: one token per row of a logits batch by the Gumbel-max race, in one read.

A token drawn with probability softmax(logits) is the argmax of logits - log(q) with
q = -log(u), u ~ U[0, 1) per token (the exponential race; see the sampler). PyTorch needs a
pass over the [S, V] logits for each of uniform, log, neg, log, neg, add and argmax; here
program (row, chunk) reads its chunk of the row once, makes its uniforms with Philox
(`tl.rand`) keyed by the row's seed and the token id, and keeps the chunk's best score and its
token. A second, tiny pass picks the best chunk of each row. The draw of a row depends only on
its logits and its seed, never on the other rows of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

BLOCK_V = 4096


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Token ids [S] int64 drawn from softmax(logits [S, V] float32), row i with the uniforms
    of seed `seeds[i]` (int64, in [0, 2**63)); -inf logits are never drawn."""
    assert logits.device == seeds.device, f"logits on {logits.device}, seeds on {seeds.device}"
    assert logits.is_cuda or isinstance(_gumbel_argmax_kernel, InterpretedFunction), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {logits.device}")
    assert logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1, (
        f"logits must be [S, V] float32, contiguous in V, got {tuple(logits.shape)} "
        f"{logits.dtype}")
    assert seeds.shape == (logits.shape[0],) and seeds.dtype == torch.int64, (
        f"seeds must be [{logits.shape[0]}] int64, got {tuple(seeds.shape)} {seeds.dtype}")
    rows, vocab = logits.shape
    block = min(BLOCK_V, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, block)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    where = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows, chunks)](
            logits, seeds, best, where, vocab, logits.stride(0), BLOCK=block, num_warps=8)
    chunk = best.argmax(dim=1, keepdim=True)  # the first best chunk: the lowest id on ties
    return where.gather(1, chunk).squeeze(1)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, seeds_ptr, best_ptr, where_ptr, vocab, stride_row,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    x = tl.load(logits_ptr + row * stride_row + cols, mask=ok, other=float("-inf"))
    seed = tl.load(seeds_ptr + row)
    u = tl.rand(seed, cols)  # [0, 1)
    # -log(u) is in (0, inf]; u = 0 gives +inf, a log of +inf and a score of -inf.
    score = x - tl.log(-tl.log(u))
    score = tl.where(ok, score, float("-inf"))
    value, index = tl.max(score, axis=0, return_indices=True,
                          return_indices_tie_break_left=True)
    tl.store(best_ptr + row * tl.num_programs(1) + chunk, value)
    tl.store(where_ptr + row * tl.num_programs(1) + chunk, chunk * BLOCK + index)
