"""A "copy model" for speculative-decoding benchmarks, and prompts that quote its output.

Driver part: `spec` (through spec_bench.py).

Dummy weights (uniform +-1e-3) give nearly flat logits: greedy argmax is decided by bf16
rounding, so a verify pass of k + 1 tokens and a decode pass disagree and acceptance means
nothing. The copy model rewrites an already-loaded model (same shapes, same kernels, same cost
per step) so that greedy decoding follows a fixed chain t -> successor[t] with a wide logit gap:

- the layers' output projections (o_proj, down_proj) are damped, so the residual stream at a
  position stays close to the embedding of that position's token;
- the final norm's weight is set to 1, so the normed hidden state is that embedding scaled to
  unit RMS;
- lm_head row successor[t] is the unit-RMS embedding of t / sqrt(hidden): the logit of the
  successor is about sqrt(hidden) (64 for Llama-3.1-8B), every other logit is a dot product of
  unrelated random rows, about N(0, 1).

Only benchmarks use this (loadtest/spec_bench.py); the engine never does. Weights change in
place, so CUDA graphs captured before keep reading them.
"""

from __future__ import annotations

import random

import torch

from meshserve.services.worker.models.llama import CausalLM, Linear


@torch.inference_mode()
def make_copy_model(model: CausalLM, seed: int = 0, damping: float = 1e-2) -> list[int]:
    """Rewrite `model` in place into a copy model; returns successor (a permutation of the
    vocabulary, successor[t] = the greedy next token after t)."""
    decoder = model.model
    embed = decoder.embed_tokens.weight  # [V, H]
    vocab, hidden = embed.shape
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    for layer in decoder.layers:
        layer.self_attn.o_proj.weight.mul_(damping)  # type: ignore[union-attr]
        layer.mlp.down_proj.weight.mul_(damping)  # type: ignore[union-attr]
    decoder.norm.weight.fill_(1.0)
    if model.lm_head is None:  # tied embeddings: the output matrix becomes its own
        model.lm_head = Linear(hidden, vocab, bias=False).to(embed.device, embed.dtype)
    head = model.lm_head.weight  # [V, H]
    rows = successor.to(embed.device)
    for start in range(0, vocab, 16384):  # in slices: float32 copies of [V, H] are GBs
        part = embed[start : start + 16384].float()
        unit = part / part.pow(2).mean(-1, keepdim=True).sqrt()  # each row: RMS 1
        head[rows[start : start + 16384]] = (unit / hidden**0.5).to(head.dtype)
    return successor.tolist()


def chain(successor: list[int], start: int, length: int) -> list[int]:
    """start, successor[start], successor[successor[start]], ... (`length` tokens)."""
    out = [start]
    while len(out) < length:
        out.append(successor[out[-1]])
    return out


def quoting_prompt(successor: list[int], quote_len: int, corrupt_every: int = 0,
                   filler_len: int = 32, seed: int = 0) -> tuple[list[int], list[int]]:
    """(prompt, the copy model's greedy continuation of it).

    The prompt quotes `quote_len` tokens of a chain c, then unrelated filler, then c[0]: the
    greedy answer is c[1], c[2], ..., which the quote holds, as an edited file or a summary
    quotes its prompt. With `corrupt_every` = n, every n-th quoted token is replaced by an
    unrelated one, so n-gram drafts that run into it are rejected (partial acceptance)."""
    rng = random.Random(seed)
    vocab = len(successor)
    start = rng.randrange(vocab)
    c = chain(successor, start, quote_len + 1)
    quote = list(c[:quote_len])
    if corrupt_every:
        for i in range(corrupt_every - 1, quote_len, corrupt_every):
            quote[i] = rng.randrange(vocab)
    filler = [rng.randrange(vocab) for _ in range(filler_len)]
    return quote + filler + [c[0]], c[1:]
