"""The gateway's DetokenizeSession stream to one tokenizer replica (decision 5).

    stream = DetokenizeStream(stub)                 # one per replica, opened on first use
    stream.add(sink, handle, index, ids, ...)       # entries of one worker step ...
    await stream.flush()                            # ... go out as one message
    # the answer arrives on the stream's reader: sink.on_text(...) per entry, then
    # sink.publish(now) once per sink touched by that message

Every request the gateway binds to this replica is multiplexed on one bidirectional
stream: each message carries one worker step's new tokens for all of them (columnar),
and the replica answers each message with exactly one message, in order, so the reader
pairs answers with the batches it sent (a FIFO). A request is opened in the message that
carries its first tokens; it is forgotten by the tokenizer when all its sequences have
ended, or when the gateway closes it. Token bytes for logprobs are asked for once per
token id and kept (`TokenLookup`, one for all replicas: they serve one tokenizer). If the
stream breaks, every request bound to it is told (`on_detokenize_lost`) and forgotten here:
a generation opens again on another stream, carrying where its text stood (the Generation's
detokenizer failover); what was waiting for an answer here is its to send again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from meshserve.proto.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from meshserve.services.gateway.links.bidi_link import BidiLink
from meshserve.shared.errors import InternalError, MeshError
from meshserve.shared.proto_errors import error_from_pb
from meshserve.shared.sampling_params import SamplingParams

_log = logging.getLogger(__name__)
# Prompt tokens sent as detokenization context ("a few suffice").
PROMPT_CONTEXT_TOKENS = 8
_one_shot_handles = itertools.count(1 << 62)  # far from the generations' handles


class TokenLookup:
    """Token id -> raw bytes, as the detokenizer reported them; renders logprob tokens."""

    def __init__(self) -> None:
        self._bytes: dict[int, bytes] = {}

    def __contains__(self, token_id: int) -> bool:
        return token_id in self._bytes

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


def open_request(handle: int, params: SamplingParams, *, model: str, request_id: str,
                 prompts: Sequence[Sequence[int]], samples_per_prompt: int,
                 traceparent: str = "", skip_special_tokens: bool | None = None,
                 check_vocabulary: bool = False) -> tokenizer_pb2.DetokenizeOpen:
    """How the tokenizer must turn one request's tokens into text (`check_vocabulary`:
    refuse ids outside the vocabulary, for /detokenize)."""
    options = tokenizer_pb2.DetokenizeOptions(
        model=model, request_id=request_id, num_sequences=len(prompts) * samples_per_prompt,
        skip_special_tokens=(params.skip_special_tokens if skip_special_tokens is None
                             else skip_special_tokens),
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        stop=list(params.stop), include_stop_str_in_output=params.include_stop_str_in_output,
        min_tokens=params.min_tokens, check_vocabulary=check_vocabulary)
    return tokenizer_pb2.DetokenizeOpen(
        handle=handle, options=options, samples_per_prompt=samples_per_prompt,
        prompt_tails=[tokenizer_pb2.TokenIds(token_ids=list(p[-PROMPT_CONTEXT_TOKENS:]))
                      for p in prompts], traceparent=traceparent)


@dataclass(slots=True)
class SequenceText:
    """What the tokenizer made of one entry."""

    text: str
    stopped: bool
    finished: bool
    num_output_tokens: int
    stop_string: str


class TextSink(Protocol):
    """Who gets the texts of the entries it added (a generation)."""

    def on_text(self, ref: object, text: SequenceText) -> None:
        """The text of one entry (`ref`: what the sink passed to `add`)."""

    def publish(self, now: float) -> None:
        """Every entry of one answer has been given (called once per answer per sink; `now`:
        the event loop's time, read once per answer)."""

    def on_detokenize_error(self, error: MeshError) -> None:
        """The request failed at the tokenizer."""

    def on_detokenize_lost(self, error: MeshError) -> None:
        """The stream broke: the request is no longer open on it, and no entry it sent
        that was not answered yet will be."""


@dataclass
class _Batch:
    """One message being built, then awaiting its answer."""

    opens: list[tokenizer_pb2.DetokenizeOpen] = field(default_factory=list)
    handles: list[int] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finals: list[bool] = field(default_factory=list)
    stopped_on_tokens: list[bool] = field(default_factory=list)
    lookups: list[int] = field(default_factory=list)
    closes: list[int] = field(default_factory=list)
    owners: list[tuple[TextSink, object]] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.opens or self.handles or self.closes or self.lookups)

    def message(self) -> tokenizer_pb2.DetokenizeSessionRequest:
        return tokenizer_pb2.DetokenizeSessionRequest(
            opens=self.opens, handles=self.handles, indices=self.indices,
            num_tokens=self.num_tokens, token_ids=self.token_ids, finals=self.finals,
            stopped_on_tokens=self.stopped_on_tokens, lookup_token_ids=self.lookups,
            closes=self.closes)


class DetokenizeStream:
    """One DetokenizeSession stream to one tokenizer replica (see the module doc)."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub, address: str,
                 lookup: TokenLookup | None = None) -> None:
        self.address = address
        self.lookup = lookup if lookup is not None else TokenLookup()
        self._link = BidiLink(stub.DetokenizeSession, name=f"tokenizer {address}",
                              on_message=self._on_answer, on_break=self._break)
        self._batch = _Batch()
        self._cut: list[_Batch] = []  # messages closed by `cut`, sent by the next flush
        self._sent: deque[_Batch] = deque()
        self._sinks: dict[int, TextSink] = {}  # handle -> its sink, while open
        self._asked: set[int] = set()  # token ids asked for, answer pending
        self._flush_task: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()

    @property
    def usable(self) -> bool:
        """False once the stream has broken (a new one must be opened)."""
        return self._link.usable

    @property
    def failure(self) -> MeshError | None:
        return self._link.failure

    def open(self, sink: TextSink, request: tokenizer_pb2.DetokenizeOpen) -> None:
        """Bind a request to this stream; it opens with the next message."""
        if self.failure is not None:
            sink.on_detokenize_lost(self.failure)
            return
        self._sinks[request.handle] = sink
        self._batch.opens.append(request)

    def add(self, sink: TextSink, ref: object, handle: int, index: int, token_ids: list[int],
            final: bool, stopped_on_token: bool, lookups: Sequence[int] = ()) -> None:
        """One entry of the next message; its text goes to `sink.on_text(ref, ...)`."""
        batch = self._batch
        batch.handles.append(handle)
        batch.indices.append(index)
        batch.num_tokens.append(len(token_ids))
        batch.token_ids.extend(token_ids)
        batch.finals.append(final)
        batch.stopped_on_tokens.append(stopped_on_token)
        batch.owners.append((sink, ref))
        for token_id in lookups:
            if token_id not in self.lookup and token_id not in self._asked:
                self._asked.add(token_id)
                batch.lookups.append(token_id)

    def close(self, handle: int) -> None:
        """Forget a request (aborted, failed, retried); sent with the next message."""
        if self._sinks.pop(handle, None) is not None and self.usable:
            self._batch.closes.append(handle)
            self._flush_soon()

    def release(self, handle: int) -> None:
        """The request ended on its own (the tokenizer forgot it): drop its sink."""
        self._sinks.pop(handle, None)

    def _flush_soon(self) -> None:
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.ensure_future(self.flush())

    def cut(self) -> None:
        """Close the message being built: what is added next goes into another one (sent
        again after a failover, entries keep the messages of their worker steps)."""
        if not self._batch.empty():
            self._cut.append(self._batch)
            self._batch = _Batch()

    async def flush(self) -> None:
        """Send what was added since the previous flush as one message (if anything), after
        the messages `cut` closed."""
        self.cut()
        batches, self._cut = self._cut, []
        if not batches or self.failure is not None:
            # On a broken stream, every sink of these entries was told it is lost (at the
            # break, or when it opened here after it): each sends its entries elsewhere.
            return
        async with self._write_lock:  # messages go out in the order their batches closed
            self._link.open()
            for batch in batches:
                self._sent.append(batch)
                if not await self._link.write(batch.message()):  # the link broke
                    return

    async def _on_answer(self, response: tokenizer_pb2.DetokenizeSessionResponse) -> None:
        if not self._sent:
            raise InternalError("the tokenizer answered a message never sent")
        self._answer(self._sent.popleft(), response)

    def _answer(self, batch: _Batch, response: tokenizer_pb2.DetokenizeSessionResponse) -> None:
        self.lookup.add(batch.lookups, response.token_bytes)
        self._asked.difference_update(batch.lookups)
        for failed in response.errors:
            sink = self._sinks.pop(failed.handle, None)
            if sink is not None:
                sink.on_detokenize_error(error_from_pb(failed.error))
        if len(response.texts) != len(batch.owners):
            raise InternalError(f"the tokenizer answered {len(response.texts)} entries of "
                                f"{len(batch.owners)}")
        stop_strings = iter(response.stop_strings)
        touched: dict[int, TextSink] = {}
        for (sink, ref), text, stopped, finished, count in zip(
                batch.owners, response.texts, response.stopped, response.finished,
                response.num_output_tokens, strict=True):
            stop = next(stop_strings, "") if stopped else ""
            sink.on_text(ref, SequenceText(text, stopped, finished, count, stop))
            touched[id(sink)] = sink
        now = asyncio.get_running_loop().time()
        for sink in touched.values():
            sink.publish(now)

    def _break(self, error: MeshError) -> None:
        """The stream is gone: every request bound to it is told, and forgotten here."""
        _log.warning("detokenize stream to %s broke: %s", self.address, error)
        sinks = list(self._sinks.values())
        self._sinks.clear()
        self._sent.clear()
        for sink in {id(s): s for s in sinks}.values():
            sink.on_detokenize_lost(error)

    async def aclose(self) -> None:
        """End the stream (gateway shutdown)."""
        await self._link.aclose()

    async def detokenize(self, token_ids: Sequence[int], *, model: str, request_id: str,
                         timeout_s: float) -> str:
        """The text of `token_ids` (special tokens kept), as one finished sequence."""
        sink = _OneShot()
        handle = next(_one_shot_handles)
        self.open(sink, open_request(handle, SamplingParams(max_tokens=None), model=model,
                                     request_id=request_id, prompts=[()],
                                     samples_per_prompt=1, skip_special_tokens=False,
                                     check_vocabulary=True))
        self.add(sink, None, handle, 0, list(token_ids), True, False)
        await self.flush()
        try:
            async with asyncio.timeout(timeout_s):
                return await sink.result
        finally:
            self.release(handle)


class _OneShot:
    """A sink for one finished sequence (the /detokenize endpoint, echo of token prompts)."""

    def __init__(self) -> None:
        self.result: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._text = ""

    def on_text(self, ref: object, text: SequenceText) -> None:
        self._text += text.text

    def publish(self, now: float) -> None:
        if not self.result.done():
            self.result.set_result(self._text)

    def on_detokenize_error(self, error: MeshError) -> None:
        if not self.result.done():
            self.result.set_exception(error)

    def on_detokenize_lost(self, error: MeshError) -> None:
        self.on_detokenize_error(error)  # one call: the caller may simply try again
