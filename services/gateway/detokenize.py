"""The Detokenize side of one request: bidi streams to a tokenizer replica.

One stream per prompt: a stream's options carry one prompt's tail as context (so the
first output token is spaced as after that prompt), and its sequences are that
prompt's n samples (stream index s is choice p * n + s). Each worker stream message
becomes one DetokenizeDelta per prompt it touches, answered by exactly one response.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence

import grpc

from meshserve.proto.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from meshserve.shared.errors import InternalError, UnavailableError
from meshserve.shared.grpc_client import mesh_errors
from meshserve.shared.sampling_params import SamplingParams

_log = logging.getLogger(__name__)
# Prompt tokens sent as detokenization context ("a few suffice").
PROMPT_CONTEXT_TOKENS = 8


class TokenLookup:
    """Token id -> raw bytes, as the detokenizer reported them; renders logprob tokens."""

    def __init__(self) -> None:
        self._bytes: dict[int, bytes] = {}

    def add(self, token_ids: Sequence[int], token_bytes: Sequence[bytes]) -> None:
        if len(token_ids) != len(token_bytes):
            raise InternalError(f"detokenizer returned {len(token_bytes)} token_bytes for "
                                f"{len(token_ids)} lookup_token_ids")
        self._bytes.update(zip(token_ids, token_bytes, strict=True))

    def token_bytes(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            raise InternalError(f"token {token_id} was not looked up by the detokenizer")
        return found

    def token_text(self, token_id: int) -> str:
        # A token holding part of a UTF-8 character shows as U+FFFD, as a decode of it would.
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def options_for(params: SamplingParams, *, model: str, request_id: str, num_sequences: int,
                prompt_token_ids: Sequence[int],
                skip_special_tokens: bool | None = None) -> tokenizer_pb2.DetokenizeRequest:
    """The first message of a Detokenize stream."""
    return tokenizer_pb2.DetokenizeRequest(options=tokenizer_pb2.DetokenizeOptions(
        model=model, request_id=request_id, num_sequences=num_sequences,
        prompt_token_ids=list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]),
        skip_special_tokens=(params.skip_special_tokens if skip_special_tokens is None
                             else skip_special_tokens),
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        stop=list(params.stop), include_stop_str_in_output=params.include_stop_str_in_output,
        min_tokens=params.min_tokens))


class DetokenizeSession:
    """The Detokenize streams of one request (one per prompt), and the token lookup."""

    def __init__(self, stubs: Sequence[tokenizer_pb2_grpc.TokenizerStub], n: int) -> None:
        """`stubs`: the replica of each prompt's stream; `n`: sequences per prompt."""
        self._stubs = list(stubs)
        self._n = n
        self._calls: list[grpc.aio.StreamStreamCall] = []
        self.lookup = TokenLookup()

    async def open(self, options: Sequence[tokenizer_pb2.DetokenizeRequest],
                   timeout_s: float) -> None:
        """Open every stream and send its options (one per prompt)."""
        assert len(options) == len(self._stubs), "one options message per prompt"
        for stub in self._stubs:
            self._calls.append(stub.Detokenize(timeout=timeout_s))
        with mesh_errors():
            await asyncio.gather(*(c.write(o) for c, o in zip(self._calls, options,
                                                              strict=True)))

    async def exchange(self, sequences: Sequence[tokenizer_pb2.SequenceTokens]
                       ) -> list[tokenizer_pb2.SequenceText]:
        """Send new tokens (choice indices), get the texts back in the same order."""
        by_prompt: dict[int, list[tokenizer_pb2.SequenceTokens]] = {}
        for seq in sequences:
            by_prompt.setdefault(seq.index // self._n, []).append(seq)
        if len(by_prompt) == 1:  # the usual case: no task per message
            (prompt, seqs), = by_prompt.items()
            answers = {prompt: await self._exchange_one(prompt, seqs)}
        else:
            results = await asyncio.gather(*(self._exchange_one(p, s)
                                              for p, s in by_prompt.items()))
            answers = dict(zip(by_prompt, results, strict=True))
        texts: list[tokenizer_pb2.SequenceText] = []
        for prompt, answer in answers.items():
            for text in answer:
                text.index += prompt * self._n  # back to choice indices
                texts.append(text)
        order = {seq.index: i for i, seq in enumerate(sequences)}
        texts.sort(key=lambda t: order.get(t.index, len(order)))
        return texts

    async def _exchange_one(self, prompt: int, sequences: list[tokenizer_pb2.SequenceTokens]
                            ) -> list[tokenizer_pb2.SequenceText]:
        base = prompt * self._n
        local = [tokenizer_pb2.SequenceTokens(
            index=s.index - base, token_ids=s.token_ids, final=s.final,
            lookup_token_ids=s.lookup_token_ids) for s in sequences]
        call = self._calls[prompt]
        with mesh_errors():
            await call.write(tokenizer_pb2.DetokenizeRequest(
                delta=tokenizer_pb2.DetokenizeDelta(sequences=local)))
            response = await call.read()
        if response is grpc.aio.EOF:
            raise UnavailableError("the tokenizer ended the Detokenize stream early")
        texts = list(response.sequences)
        if [t.index for t in texts] != [s.index for s in local]:
            raise InternalError("Detokenize answered other sequences than it was sent")
        for seq, text in zip(local, texts, strict=True):
            self.lookup.add(seq.lookup_token_ids, text.token_bytes)
        return texts

    async def finish(self) -> None:
        """End the streams normally (no more deltas); the tokenizer then closes them."""
        for call in self._calls:
            if call.done():
                continue
            try:
                await call.done_writing()
            except (grpc.RpcError, asyncio.InvalidStateError) as exc:
                # The stream ended on its own meanwhile; every answer was already read.
                _log.debug("Detokenize stream already closed: %s", exc)

    def cancel(self) -> None:
        """Cancel every stream at once (error, client gone)."""
        for call in self._calls:
            call.cancel()


async def detokenize_text(stub: tokenizer_pb2_grpc.TokenizerStub, token_ids: Sequence[int], *,
                          model: str, deadline_s: float) -> str:
    """The text of `token_ids` through one short Detokenize stream (special tokens kept)."""
    request_id = f"detok-{uuid.uuid4().hex}"
    session = DetokenizeSession([stub], 1)
    options = options_for(SamplingParams(max_tokens=None), model=model, request_id=request_id,
                          num_sequences=1, prompt_token_ids=(), skip_special_tokens=False)
    try:
        await session.open([options], deadline_s)
        texts = await session.exchange([tokenizer_pb2.SequenceTokens(
            index=0, token_ids=list(token_ids), final=True)])
    except BaseException:
        session.cancel()
        raise
    await session.finish()
    return texts[0].text
