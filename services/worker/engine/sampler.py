"""Turns one step's logits into tokens and logprobs, each row under its own sampling parameters.

Per row, in vLLM/OpenAI order: grammar mask -> logit_bias -> min_tokens and bad_words
masking -> penalties -> temperature ->
top_k -> top_p -> min_p -> sample. Greedy rows (temperature 0) take the argmax of the logits
after penalties, which the filters cannot change. Logprobs come from the raw logits as passed in
(vLLM's default "raw_logprobs").

Each processor is one tensor op over the rows that need it, and work no row needs is skipped.
Nothing waits on the device per row: parameter tensors go up once per call (pinned,
non-blocking off the CPU), and the token ids and logprobs come back once at the end.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from meshserve.services.worker.engine.logits_processors import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    banned_tokens,
    to_device,
)
from meshserve.services.worker.engine.structured_output import BitmaskApplier
from meshserve.shared.errors import InternalError, InvalidRequestError
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One row of the logits batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The sequence's own generator when params.seed is set. Only its seed is used: with the
    # number of output tokens so far it keys each draw (the same alone or in any batch, after
    # a preemption, or on another worker continuing the sequence).
    generator: torch.Generator | None = None
    # EOS ids + params.stop_token_ids: masked while len(output) < min_tokens.
    stop_ids: tuple[int, ...] = ()
    # The sequence's grammar matcher (xgrammar) when its output is constrained.
    grammar: object | None = None
    # Token sequences never generated: each one's last token is banned where the output
    # ends with its others (vLLM's bad_words).
    bad_words: tuple[tuple[int, ...], ...] = ()


@dataclass
class SamplerOutput:
    """One token per row, and its logprobs where the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class HostCopy:
    """A device tensor on its way to pinned host memory; `get()` waits for it alone.

    The copy is queued behind the work that produces the tensor, so later work can be
    queued before anyone waits. On a CPU device the tensor is already there.
    """

    def __init__(self, tensor: Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def get(self) -> Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


class PendingSample:
    """The tokens of one sample call: on the device at once (the next step can take its
    inputs from `token_ids` there), on the host after `read()`, the step's one wait."""

    def __init__(self, token_ids: Tensor, table: Tensor | None, wanted: list[int],
                 counts: list[int]) -> None:
        self.token_ids = token_ids  # [B] int64, on the logits' device
        self._wanted = wanted
        self._counts = counts
        packed = token_ids if table is None else torch.cat(
            [token_ids.to(torch.float64), table.flatten()])
        self._copy = HostCopy(packed)
        self._output: SamplerOutput | None = None

    def read(self) -> SamplerOutput:
        if self._output is None:
            host = self._copy.get().tolist()
            num_rows = self.token_ids.shape[0]
            if not self._wanted:
                self._output = SamplerOutput(token_ids=host, logprobs=[None] * num_rows)
            else:
                self._output = _unpack(host, num_rows, self._wanted, self._counts)
        return self._output


def make_generator(seed: int, device: torch.device, index: int = 0) -> torch.Generator:
    """The generator of sequence `index` of a request seeded with `seed`.

    Sequence 0 uses the seed itself; siblings (n > 1) use a 64-bit hash of (seed, index), so
    they differ from each other and from requests seeded with neighbouring values.
    """
    value = seed % 2**64  # negative seeds fold into the unsigned range manual_seed takes
    if index:
        digest = hashlib.blake2b(f"{value}:{index}".encode(), digest_size=8).digest()
        value = int.from_bytes(digest, "little")
    generator = torch.Generator(device=device)
    generator.manual_seed(value)
    return generator


def compute_logprobs(logits: Tensor, token_ids: Tensor, num_top: int) -> list[TokenLogprobs]:
    """Logprob, rank and the `num_top` best alternatives of each chosen token.

    logits: [N, V] float32, token_ids: [N]. Rank is 1-based among all V tokens by logit (1 for
    the argmax); `top` is sorted by descending logprob. Used for output and prompt logprobs.
    """
    return logprob_entries(logprob_table(logits, token_ids, num_top).tolist())


def logprob_table(logits: Tensor, token_ids: Tensor, num_top: int) -> Tensor:
    """[N, 3 + 2 * num_top] float64: token id, logprob, rank, num_top ids, num_top logprobs.

    One tensor, so that it comes back to the host in one copy; float64 holds the ids, ranks
    and float32 logprobs exactly. `num_top` -1: every token of the vocabulary.
    """
    if num_top == -1:
        num_top = logits.shape[1]
    if not 0 <= num_top <= logits.shape[1]:
        raise InternalError(f"num_top must be in [0, {logits.shape[1]}], got {num_top}")
    logprobs = torch.log_softmax(logits, dim=-1)  # [N, V]
    ids = token_ids.to(device=logits.device, dtype=torch.long).unsqueeze(1)  # [N, 1]
    chosen = logprobs.gather(1, ids)  # [N, 1]
    ranks = (logits > logits.gather(1, ids)).sum(dim=1, keepdim=True) + 1  # [N, 1]
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [N, num_top], descending
    columns = (ids, chosen, ranks, top_ids, top_values)
    return torch.cat([c.to(torch.float64) for c in columns], dim=1)


def logprob_entries(table: list[list[float]]) -> list[TokenLogprobs]:
    """TokenLogprobs from the rows of a `logprob_table` read back to the host."""
    entries = []
    for row in table:
        num_top = (len(row) - 3) // 2
        top_ids = [int(t) for t in row[3:3 + num_top]]
        entries.append(TokenLogprobs(token_id=int(row[0]), logprob=row[1], rank=int(row[2]),
                                     top=list(zip(top_ids, row[3 + num_top:]))))
    return entries


@dataclass
class _Processed:
    """Logits after the processors: `adjusted` [B, V] (bias, min_tokens, penalties) for greedy
    rows, `sampled` [S, V] (also temperature and filters) for the rows listed in `sampled_rows`."""

    adjusted: Tensor
    sampled: Tensor | None
    sampled_rows: list[int]


class Sampler:
    """Samples one token per row of a logits batch, with per-row parameters and generators."""

    def __init__(self, vocab_size: int, device: torch.device, *, seed: int | None = None) -> None:
        """`seed` fixes the source shared by rows without a generator (random when None)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed % 2**64)
        # Seeds of the GPU draw for rows without a generator (drawn on the host: no sync).
        self._host_rng = random.Random(seed)
        # Reseeded for each seeded row's draw on a CPU (see _draw).
        self._keyed = torch.Generator(device=self.device)
        self._bitmask: BitmaskApplier | None = None  # made on the first constrained row

    @torch.inference_mode()
    def sample(self, logits: Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """One token per row of `logits` [B, V] float32, and logprobs where asked."""
        return self.sample_async(logits, rows).read()

    @torch.inference_mode()
    def sample_async(self, logits: Tensor, rows: list[SamplingRow]) -> PendingSample:
        """`sample` without waiting: the work is queued on the device, read() waits."""
        processed = self._process(logits, rows)
        tokens = self._pick(processed, rows)  # [B]
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if not wanted:
            return PendingSample(tokens, None, [], [])
        counts = [rows[i].params.logprobs or 0 for i in wanted]
        counts = [self.vocab_size if c == -1 else c for c in counts]  # -1: every token
        table = self._wanted_logprob_table(logits, tokens, wanted, max(counts))  # [L, W]
        return PendingSample(tokens, table, wanted, counts)

    @torch.inference_mode()
    def process(self, logits: Tensor, rows: list[SamplingRow]) -> Tensor:
        """The logits [B, V] each row is finally drawn from (greedy rows: argmax of them)."""
        processed = self._process(logits, rows)
        if processed.sampled is None:
            return processed.adjusted
        out = processed.adjusted.clone()
        out[self._index(processed.sampled_rows)] = processed.sampled
        return out

    def _process(self, logits: Tensor, rows: list[SamplingRow]) -> _Processed:
        self._check(logits, rows)
        if any(row.grammar is not None for row in rows):
            # In place and first, as vLLM does: logprobs then describe the masked logits.
            self._grammar_mask().apply(logits, [row.grammar for row in rows])
        adjusted = self._adjust(logits, rows)
        sampled_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not sampled_rows:
            return _Processed(adjusted, None, [])
        temperatures = [rows[i].params.temperature for i in sampled_rows]
        divisor = to_device(temperatures, torch.float32, self.device).unsqueeze(1)  # [S, 1]
        # `scaled` [S, V] is always a fresh tensor, so the filters may write into it.
        if len(sampled_rows) == len(rows):
            scaled = adjusted / divisor
        else:
            scaled = adjusted[self._index(sampled_rows)].div_(divisor)
        params = [rows[i].params for i in sampled_rows]
        return _Processed(adjusted, self._filter(scaled, params), sampled_rows)

    def _grammar_mask(self) -> BitmaskApplier:
        if self._bitmask is None:
            self._bitmask = BitmaskApplier(self.vocab_size, self.device)
        return self._bitmask

    def _check(self, logits: Tensor, rows: list[SamplingRow]) -> None:
        if logits.dim() != 2 or logits.shape != (len(rows), self.vocab_size):
            raise InternalError(f"logits must be [{len(rows)}, {self.vocab_size}] for "
                                f"{len(rows)} rows, got {list(logits.shape)}")
        if logits.dtype != torch.float32:
            raise InternalError(f"logits must be float32, got {logits.dtype}")
        for row in rows:
            bias = row.params.logit_bias or {}
            if any(token >= self.vocab_size for token in bias):
                raise InvalidRequestError(f"logit_bias names a token id outside the vocabulary "
                                          f"of {self.vocab_size}", param="logit_bias")
            if any(token >= self.vocab_size for token in row.stop_ids):
                raise InvalidRequestError(f"stop_token_ids names a token id outside the "
                                          f"vocabulary of {self.vocab_size}",
                                          param="stop_token_ids")

    def _adjust(self, logits: Tensor, rows: list[SamplingRow]) -> Tensor:
        """allowed_token_ids, logit_bias, then min_tokens and bad_words masking, then
        penalties; copies only when one applies."""
        out = self._allow_only(logits, rows)
        bias = [(i, token, value) for i, row in enumerate(rows)
                for token, value in (row.params.logit_bias or {}).items()]
        if bias:
            out = logits.clone() if out is logits else out
            r, c, v = zip(*bias)
            out.index_put_((self._index(r), self._index(c)),
                           to_device(v, torch.float32, self.device), accumulate=True)
        masked = [(i, token) for i, row in enumerate(rows)
                  if len(row.output_token_ids) < row.params.min_tokens for token in row.stop_ids]
        masked += [(i, token) for i, row in enumerate(rows) if row.bad_words
                   for token in banned_tokens(row.output_token_ids, row.bad_words)]
        if masked:
            out = out.clone() if out is logits else out
            r, c = zip(*masked)
            out[self._index(r), self._index(c)] = _NEG_INF
        penalised = [i for i, row in enumerate(rows) if row.params.needs_penalties]
        if not penalised:
            return out
        if len(penalised) == len(rows):
            return self._penalise(out, rows)
        out = out.clone() if out is logits else out
        index = self._index(penalised)
        out[index] = self._penalise(out[index], [rows[i] for i in penalised])
        return out

    def _allow_only(self, logits: Tensor, rows: list[SamplingRow]) -> Tensor:
        """`logits`, or a copy where rows with allowed_token_ids keep only those tokens."""
        allowed = [(i, token) for i, row in enumerate(rows)
                   for token in row.params.allowed_token_ids]
        if not allowed:
            return logits
        r, c = zip(*allowed)
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[self._index(r), self._index(c)] = True
        limited = to_device([bool(row.params.allowed_token_ids) for row in rows], torch.bool,
                             self.device)
        keep |= ~limited.unsqueeze(1)
        return logits.masked_fill(~keep, _NEG_INF)

    @staticmethod
    def _penalise(logits: Tensor, rows: list[SamplingRow]) -> Tensor:
        params = [row.params for row in rows]
        repetition = [p.repetition_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        presence = [p.presence_penalty for p in params]
        use_repetition = any(r != 1.0 for r in repetition)
        return apply_penalties(
            logits,
            [row.prompt_token_ids for row in rows] if use_repetition else None,
            [row.output_token_ids for row in rows],
            repetition if use_repetition else None,
            frequency if any(frequency) else None,
            presence if any(presence) else None,
        )

    def _filter(self, logits: Tensor, params: list[SamplingParams]) -> Tensor:
        """top_k, top_p, then min_p on the sampled rows [S, V], each over the rows using it."""
        vocab = self.vocab_size
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        cut = [j for j, p in enumerate(params) if top_k[j] < vocab or p.top_p < 1.0]
        if cut:
            ks = [top_k[j] for j in cut]
            ps = [params[j].top_p for j in cut]
            logits = self._update(logits, cut, lambda sub: apply_top_k_top_p(
                sub, ks if min(ks) < vocab else None, ps if min(ps) < 1.0 else None))
        floor = [j for j, p in enumerate(params) if p.min_p > 0.0]
        if floor:
            min_p = [params[j].min_p for j in floor]
            logits = self._update(logits, floor, lambda sub: apply_min_p(sub, min_p))
        return logits

    def _update(self, logits: Tensor, rows: list[int], op: Callable[[Tensor], Tensor]) -> Tensor:
        """logits with logits[rows] = op(logits[rows]); no gather when all rows take part."""
        if len(rows) == logits.shape[0]:
            return op(logits)
        index = self._index(rows)
        logits[index] = op(logits[index])
        return logits

    def _pick(self, processed: _Processed, rows: list[SamplingRow]) -> Tensor:
        """Token ids [B]: argmax for greedy rows (lowest id on ties), a draw for the others."""
        if processed.sampled is None:
            return argmax_rows(processed.adjusted)
        sampled_rows = [rows[i] for i in processed.sampled_rows]
        if processed.sampled.is_cuda:
            drawn = self._draw_on_gpu(processed.sampled, sampled_rows)  # [S]
        else:
            drawn = self._draw(processed.sampled, [_row_seed(row) for row in sampled_rows])
        if len(processed.sampled_rows) == len(rows):
            return drawn
        tokens = argmax_rows(processed.adjusted)
        tokens[self._index(processed.sampled_rows)] = drawn
        return tokens

    def _draw_on_gpu(self, logits: Tensor, rows: list[SamplingRow]) -> Tensor:
        """The exponential race of `_draw` in one Triton kernel, whose uniforms come from a
        64-bit seed per row: for a seeded sequence a hash of its generator's seed and the
        number of tokens it has, so the draw is the same alone or in any batch (and again
        after a preemption); for the others, fresh values of the sampler's own source."""
        from meshserve.kernels.triton_sampling import gumbel_argmax  # GPU only

        base = self._host_rng.getrandbits(62)
        seeds = [base + j if seed is None else seed
                 for j, seed in enumerate(map(_row_seed, rows))]
        return gumbel_argmax(logits, to_device(seeds, torch.int64, self.device))

    def _draw(self, logits: Tensor, seeds: list[int | None]) -> Tensor:
        """Exponential race: argmax(p / q) with q ~ Exp(1) per token picks a token with
        probability p. q = -log(u), u ~ U[0, 1) from a generator seeded with the row's draw
        seed (a seeded row), or from the sampler's shared source.

        log is monotonic and log p = logit - logsumexp(row), so the race is won by
        argmax(logit - log q): no softmax is needed (the Gumbel-max form of the same draw).
        """
        noise = torch.empty_like(logits)
        shared = [j for j, seed in enumerate(seeds) if seed is None]
        if len(shared) == len(seeds):
            noise.uniform_(generator=self._generator)
        elif shared:
            block = torch.empty(len(shared), noise.shape[1], device=noise.device)
            noise[self._index(shared)] = block.uniform_(generator=self._generator)
        # Each seeded row's V numbers are a function of its draw seed alone: whatever the
        # batch, and whichever draws the sequence made before (here or on another worker).
        for j, seed in enumerate(seeds):
            if seed is not None:
                self._keyed.manual_seed(seed)
                noise[j].uniform_(generator=self._keyed)
        # u = 0 gives q = inf, log q = inf and a score of -inf: that token never wins. u < 1,
        # so q > 0 and log q is finite otherwise; filtered (-inf) logits stay -inf.
        log_q = noise.log_().neg_().log_()
        return argmax_rows(log_q.neg_().add_(logits))

    def _wanted_logprob_table(self, logits: Tensor, tokens: Tensor, wanted: list[int],
                       num_top: int) -> Tensor:
        """The raw logits' logprob table for the rows in `wanted`."""
        if len(wanted) == logits.shape[0]:
            return logprob_table(logits, tokens, num_top)
        index = self._index(wanted)
        return logprob_table(logits[index], tokens[index], num_top)

    def _index(self, values: Sequence[int]) -> Tensor:
        return to_device(values, torch.long, self.device)


# A single row's argmax over a large vocabulary is one slow reduction on a GPU; rows of at
# least this many entries, in batches of at most _SPLIT_ARGMAX_ROWS, are reduced in two passes.
_SPLIT_ARGMAX_MIN_VOCAB = 8192
_SPLIT_ARGMAX_ROWS = 64


def argmax_rows(x: Tensor) -> Tensor:
    """argmax over the last dim of x [B, V], the lowest index on ties (as torch.argmax).

    On a GPU, few long rows are cut into C chunks: the max of each chunk, then the first chunk
    holding the row's max. The first maximal chunk's first maximal entry is the first maximal
    entry of the row, so ties resolve exactly as one argmax would.
    """
    rows, vocab = x.shape
    chunks = _argmax_chunks(vocab)
    if x.device.type == "cpu" or rows > _SPLIT_ARGMAX_ROWS or chunks == 1:
        return x.argmax(dim=-1)
    return split_argmax(x, chunks)


def split_argmax(x: Tensor, chunks: int) -> Tensor:
    """`argmax_rows` in two passes over `chunks` equal chunks of each row (chunks divides V)."""
    rows, vocab = x.shape
    width = vocab // chunks
    values, inner = x.reshape(rows, chunks, width).max(dim=-1)  # [B, C] each
    chunk = values.argmax(dim=-1, keepdim=True)  # [B, 1]
    return (chunk * width + inner.gather(1, chunk)).squeeze(1)


@functools.cache
def _argmax_chunks(vocab: int) -> int:
    """The largest divisor of vocab up to 1024 that leaves chunks of at least 64 entries
    (1: no split)."""
    if vocab < _SPLIT_ARGMAX_MIN_VOCAB:
        return 1
    return next((c for c in range(min(1024, vocab // 64), 1, -1) if vocab % c == 0), 1)


def _row_seed(row: SamplingRow) -> int | None:
    """The draw seed of a seeded row's next token (None for an unseeded row)."""
    if row.generator is None:
        return None
    return _draw_seed(row.generator.initial_seed(), len(row.output_token_ids))


def _draw_seed(generator_seed: int, position: int) -> int:
    """The draw's seed for a seeded sequence's token at output `position`: 63 bits of a
    hash."""
    digest = hashlib.blake2b(f"{generator_seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _unpack(host: list[float], num_rows: int, wanted: list[int],
            counts: list[int]) -> SamplerOutput:
    """Token ids [B] and the logprob table [L, W] of rows `wanted`, read back in one copy."""
    width = (len(host) - num_rows) // len(wanted)
    entries = logprob_entries([host[num_rows + k * width:num_rows + (k + 1) * width]
                                for k in range(len(wanted))])
    logprobs: list[TokenLogprobs | None] = [None] * num_rows
    for i, count, entry in zip(wanted, counts, entries):
        entry.top = entry.top[:count]
        logprobs[i] = entry
    return SamplerOutput(token_ids=[int(t) for t in host[:num_rows]], logprobs=logprobs)
