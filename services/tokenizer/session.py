"""One gateway's DetokenizeSession stream: the text state of all its requests on this replica.

    texts = SessionTexts(model, tracer)
    async for message in request_iterator:
        yield texts.apply(message)          # exactly one answer per message, in order
    texts.close()                           # the stream ended: forget everything

A request is opened once (`opens`), then each message carries, for every sequence with
news, its new tokens (columnar arrays). The answer is columnar too, entry for entry. A
request is forgotten once all its sequences have ended, or when the gateway closes it.
A bad entry or open fails its own request (an error entry names the handle); the others
go on. A request the gateway moved here from a session that broke opens with where each
sequence stood (`resumed`), and its text goes on from there (RequestText.resume). Each request gets a `detokenize` span under the trace context it was opened with.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from meshserve.proto.v1 import tokenizer_pb2
from meshserve.services.tokenizer.model import ServedModel
from meshserve.services.tokenizer.request_text import RequestText
from meshserve.services.tokenizer.wire import sampling_params
from meshserve.shared.errors import InvalidRequestError, MeshError
from meshserve.shared.proto_errors import error_pb


@dataclass
class _Open:
    """One open request: its text state and its span."""

    text: RequestText
    span: Span


class SessionTexts:
    """The requests of one DetokenizeSession stream (see the module doc)."""

    def __init__(self, model: ServedModel, tracer: trace.Tracer) -> None:
        self._model = model
        self._tracer = tracer
        self._open: dict[int, _Open] = {}
        self.num_tokens_received = 0
        self.num_requests_opened = 0

    @property
    def num_open(self) -> int:
        """Requests open on this stream."""
        return len(self._open)

    def apply(self, message: tokenizer_pb2.DetokenizeSessionRequest
              ) -> tokenizer_pb2.DetokenizeSessionResponse:
        """Open, feed and close as the message says; the answer, entry for entry."""
        errors: list[tokenizer_pb2.HandleError] = []
        for request in message.opens:
            self._open_request(request, errors)
        handles = message.handles
        count = len(handles)
        if not (len(message.indices) == len(message.num_tokens) == len(message.finals)
                == len(message.stopped_on_tokens) == count):
            raise InvalidRequestError("the per-entry arrays of a DetokenizeSessionRequest "
                                      "must all have one element per entry", param="handles")
        token_ids = message.token_ids
        texts: list[str] = []
        stopped: list[bool] = []
        finished: list[bool] = []
        counts: list[int] = []
        stop_strings: list[str] = []
        position = 0
        for handle, index, size, final, on_token in zip(
                handles, message.indices, message.num_tokens, message.finals,
                message.stopped_on_tokens, strict=True):
            ids = token_ids[position:position + size]
            position += size
            entry = self._open.get(handle)
            if entry is None:  # closed, failed, or never opened: nothing to say
                texts.append("")
                stopped.append(False)
                finished.append(True)
                counts.append(0)
                continue
            try:
                update = entry.text.update(index, ids, final, on_token)
            except MeshError as exc:
                errors.append(tokenizer_pb2.HandleError(handle=handle, error=error_pb(exc)))
                self._forget(handle, exc)
                texts.append("")
                stopped.append(False)
                finished.append(True)
                counts.append(0)
                continue
            texts.append(update.text)
            stopped.append(update.stopped)
            finished.append(update.finished)
            counts.append(update.num_output_tokens)
            if update.stopped:
                stop_strings.append(update.stop_string)
            if entry.text.done:
                self._forget(handle, None)
        if position != len(token_ids):
            raise InvalidRequestError(f"num_tokens add up to {position}, but the message "
                                      f"holds {len(token_ids)} token ids", param="num_tokens")
        self.num_tokens_received += position
        for handle in message.closes:
            self._forget(handle, None)
        tokenizer = self._model.tokenizer
        token_bytes = [tokenizer.token_bytes(t) for t in message.lookup_token_ids]
        return tokenizer_pb2.DetokenizeSessionResponse(
            texts=texts, stopped=stopped, finished=finished, num_output_tokens=counts,
            stop_strings=stop_strings, token_bytes=token_bytes, errors=errors)

    def _open_request(self, request: tokenizer_pb2.DetokenizeOpen,
                      errors: list[tokenizer_pb2.HandleError]) -> None:
        handle = request.handle
        options = request.options
        parent = None
        if request.traceparent:
            parent = TraceContextTextMapPropagator().extract({"traceparent": request.traceparent})
        span = self._tracer.start_span("detokenize", context=parent, attributes={
            "gen_ai.request.id": options.request_id, "gen_ai.request.model": self._model.name,
            "meshserve.num_sequences": options.num_sequences})
        try:
            if handle in self._open:
                raise InvalidRequestError(f"handle {handle} is already open on this stream",
                                          param="handle")
            self._model.check_name(options.model)
            params = sampling_params(options)
            tails = [list(t.token_ids) for t in request.prompt_tails]
            tokenizer = self._model.tokenizer
            text = RequestText(tokenizer, params, options.num_sequences, prompt_tails=tails,
                               samples_per_prompt=max(request.samples_per_prompt, 1),
                               vocab_size=(tokenizer.vocab_size if options.check_vocabulary
                                           else None))
            for resumed in request.resumed:
                text.resume(resumed.index, resumed.token_ids, resumed.text,
                            finished=resumed.finished, entry_sizes=resumed.entry_sizes)
        except MeshError as exc:
            errors.append(tokenizer_pb2.HandleError(handle=handle, error=error_pb(exc)))
            span.set_attribute("meshserve.error_kind", exc.kind)
            span.end()
            return
        self._open[handle] = _Open(text, span)
        self.num_requests_opened += 1

    def _forget(self, handle: int, error: MeshError | None) -> None:
        entry = self._open.pop(handle, None)
        if entry is None:
            return
        entry.span.set_attribute("gen_ai.usage.output_tokens", entry.text.num_tokens_received)
        if error is not None:
            entry.span.set_attribute("meshserve.error_kind", error.kind)
        entry.span.end()

    def close(self) -> None:
        """The stream ended: forget every open request."""
        for handle in list(self._open):
            self._forget(handle, None)

