"""Fake tokenizer, scheduler and worker servicers for the gateway's contract tests, and a
harness that starts them (real grpc.aio servers on 127.0.0.1) with a real gateway.

The fake tokenizer is byte-level: token id b < 256 is the byte b, 256 is EOS, 257 is
BOS. The fake worker answers every sequence i with the UTF-8 bytes of `script(i)`,
CHUNK tokens per stream message, so a test knows exactly what text, how many tokens
and how many messages each request must give. Every fake records what it received,
including the invocation metadata (trace context).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from meshserve.proto.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from meshserve.services.gateway.app import Gateway
from meshserve.services.gateway.config import GatewayConfig
from meshserve.shared.errors import InternalError, MeshError, NotFoundError, UnavailableError
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.proto_errors import error_pb
from meshserve.shared.telemetry import Telemetry

MODEL = "tiny"
MAX_MODEL_LEN = 128
EOS, BOS = 256, 257
CHUNK = 3  # tokens per sequence per worker message
CACHED_TOKENS = 4


def script(index: int) -> str:
    """What the fake worker generates for sequence `index` ("ö" spans two tokens)."""
    return f"s{index} hello wörld, the end"


def token_bytes(token_id: int) -> bytes:
    return bytes([token_id]) if token_id < 256 else f"<special{token_id}>".encode()


def token_logprob(token_id: int) -> float:
    """The fake worker's logprob of a token (distinct per token, exact in float32)."""
    return -(token_id % 8) / 4


def metadata_of(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}


def free_port() -> int:
    """A port nothing listens on (bound then released): calls to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- tokenizer ------------------------------------------------------------------------------

def render_chat(messages: Any, add_generation_prompt: bool) -> str:
    parts = []
    for m in messages:
        content = m.content if m.HasField("content") else ""
        if m.content_parts_json:
            content = "".join(p["text"] for p in orjson.loads(m.content_parts_json))
        parts.append(f"<{m.role}>{content}\n")
    return "".join(parts) + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Text:
    """What one entry of a DetokenizeSession message turned into."""

    text: str = ""
    stopped: bool = False
    stop_string: str = ""
    finished: bool = False
    num_output_tokens: int = 0


@dataclass
class _DetokState:
    data: bytearray = field(default_factory=bytearray)
    ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the decoded text already sent
    done: bool = False


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Byte-level tokenization; detokenization with UTF-8 hold-back and stop strings."""

    def __init__(self) -> None:
        self.tokenize_calls: list[tokenizer_pb2.TokenizeRequest] = []
        self.detokenize_options: list[tokenizer_pb2.DetokenizeOptions] = []
        self.detokenize_opens: list[tokenizer_pb2.DetokenizeOpen] = []
        self.metadata: list[dict[str, str]] = []  # per call, and per opened request
        self.session_metadata: list[dict[str, str]] = []  # of the session streams

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        self.tokenize_calls.append(request)
        self.metadata.append(metadata_of(context))
        if request.model not in ("", MODEL):
            raise NotFoundError(f"no tokenizer for {request.model}", param="model")
        if request.WhichOneof("input") == "chat":
            text = render_chat(request.chat.messages, request.add_generation_prompt)
            special = request.HasField("add_special_tokens") and request.add_special_tokens
        else:
            text = request.text
            special = not request.HasField("add_special_tokens") or request.add_special_tokens
        ids = ([BOS] if special else []) + list(text.encode())
        return tokenizer_pb2.TokenizeResponse(token_ids=ids, prompt_text=text,
                                              max_model_len=MAX_MODEL_LEN)

    async def DetokenizeSession(self, request_iterator: Any,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        self.session_metadata.append(metadata_of(context))
        requests: dict[int, tuple[tokenizer_pb2.DetokenizeOptions, dict[int, _DetokState]]] = {}
        async for message in request_iterator:
            for opened in message.opens:
                self.detokenize_opens.append(opened)
                self.detokenize_options.append(opened.options)
                if opened.traceparent:
                    self.metadata.append({"traceparent": opened.traceparent})
                requests[opened.handle] = (opened.options, {
                    i: _DetokState() for i in range(opened.options.num_sequences)})
            response = tokenizer_pb2.DetokenizeSessionResponse(
                token_bytes=[token_bytes(t) for t in message.lookup_token_ids])
            position = 0
            for handle, index, size, final in zip(message.handles, message.indices,
                                                  message.num_tokens, message.finals,
                                                  strict=True):
                ids = list(message.token_ids[position:position + size])
                position += size
                options, states = requests[handle]
                text = self._advance(options, states[index], ids, final)
                response.texts.append(text.text)
                response.stopped.append(text.stopped)
                response.finished.append(text.finished)
                response.num_output_tokens.append(text.num_output_tokens)
                if text.stopped:
                    response.stop_strings.append(text.stop_string)
            for handle in message.closes:
                requests.pop(handle, None)
            yield response

    @staticmethod
    def _advance(options: tokenizer_pb2.DetokenizeOptions, state: _DetokState,
                 token_ids: list[int], final: bool) -> _Text:
        if state.done:
            return _Text(stopped=True, finished=True, num_output_tokens=len(state.ids))
        for token in token_ids:
            state.ids.append(token)
            if token < 256:
                state.data.append(token)
        data = bytes(state.data)
        text = data.decode("utf-8", errors="replace") if final else _valid_prefix(data)
        for stop in options.stop:
            at = text.find(stop)
            if at >= 0:
                end = at + len(stop)
                cut = end if options.include_stop_str_in_output else at
                # Tokens (one per byte here) up to the one completing the stop string.
                used = len(text[:end].encode())
                state.done = True
                out = text[state.emitted:cut]
                return _Text(text=out, stopped=True, stop_string=stop, finished=True,
                             num_output_tokens=used)
        # Hold back a tail that may still become a stop string.
        held = 0 if final else max(
            (k for stop in options.stop for k in range(1, len(stop))
             if text.endswith(stop[:k])), default=0)
        ready = len(text) - held
        out, state.emitted = text[state.emitted:ready], max(state.emitted, ready)
        state.done = final
        return _Text(text=out, finished=final, num_output_tokens=len(state.ids))


def _valid_prefix(data: bytes) -> str:
    """The longest prefix of `data` that is complete UTF-8."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="ignore")


# -- scheduler ------------------------------------------------------------------------------

class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Routes to the first listed worker not excluded; lists those workers."""

    def __init__(self, workers: list[tuple[str, str]]) -> None:
        self.workers = workers  # (worker_id, address)
        self.degraded = False  # what ListWorkers reports (Redis lost)
        self.routes: list[scheduler_pb2.RouteRequest] = []
        self.released: list[str] = []
        self.release_seen = asyncio.Event()
        self.metadata: list[dict[str, str]] = []  # the trace context of each route
        self.session_metadata: list[dict[str, str]] = []  # of the route streams
        self.route_error: MeshError | None = None
        self.lists_none = False  # ListWorkers answers no worker (a registry emptied)

    def _route(self, request: scheduler_pb2.RouteRequest) -> scheduler_pb2.RouteResponse:
        self.routes.append(request)
        if self.route_error is not None:
            raise self.route_error
        for worker_id, address in self.workers:
            if worker_id not in request.exclude_worker_ids:
                return scheduler_pb2.RouteResponse(worker_id=worker_id, address=address,
                                                   epoch=1, block_size=16)
        raise UnavailableError("every worker excluded")

    async def RouteSession(self, request_iterator: Any,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Routes and releases on one stream, tickets answered in the order they came."""
        self.session_metadata.append(metadata_of(context))
        async for message in request_iterator:
            outcomes = []
            for ticket in message.routes:
                self.metadata.append({"traceparent": ticket.traceparent})
                try:
                    route = self._route(ticket.request)
                except MeshError as exc:
                    outcomes.append(scheduler_pb2.RouteOutcome(ticket=ticket.ticket,
                                                               error=error_pb(exc)))
                else:
                    outcomes.append(scheduler_pb2.RouteOutcome(ticket=ticket.ticket,
                                                               route=route))
            for release in message.releases:
                self.released.append(release.request_id)
                self.release_seen.set()
            if outcomes:
                yield scheduler_pb2.RouteSessionResponse(outcomes=outcomes)

    async def ListWorkers(self, request: scheduler_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> scheduler_pb2.ListWorkersResponse:
        return scheduler_pb2.ListWorkersResponse(workers=[scheduler_pb2.WorkerStatus(
            info=common_pb2.WorkerInfo(worker_id=wid, address=addr, model_names=[MODEL],
                                       max_model_len=MAX_MODEL_LEN))
            for wid, addr in ([] if self.lists_none else self.workers)], degraded=self.degraded)


# -- worker ---------------------------------------------------------------------------------

@dataclass
class _Output:
    """What one sequence produced in one step of the fake worker (an entry of its message)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: common_pb2.FinishReason = common_pb2.FINISH_REASON_UNSPECIFIED
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    cached_tokens: int = 0


def _logprobs(token_id: int, top: int) -> common_pb2.TokenLogprobs:
    alternatives = [token_id, *(t for t in (32, 33) if t != token_id)][:top]
    return common_pb2.TokenLogprobs(
        token_id=token_id, logprob=token_logprob(token_id), rank=1,
        top_token_ids=alternatives, top_logprobs=[token_logprob(t) for t in alternatives])


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Streams `script(i)` then EOS for every sequence i, CHUNK tokens per message.

    Serves the Session stream: each added request runs on its own and every one of its
    messages goes out as one SessionResponse. `hold_after_first`: after the first
    message, wait until aborted (a long generation). `pause_after_first`: after the first
    message, wait until this event is set (a test acts mid-stream). `break_after_first`:
    end the whole Session stream with UNAVAILABLE after the first message with tokens (the
    worker died). `fail_after_first`: fail the request with this error after the first
    message. `raise_first`: fail with this
    exception before any message (a MeshError keeps its kind, anything else is
    internal), for prompts that hold `raise_marker`'s byte (every prompt when None).
    A resumed add (SessionAdd.resumed) runs only the sequences listed, each from the
    position of its resumed tokens (which must be its script's), as a real worker would.
    """

    def __init__(self, encode: Callable[[str], list[int]] | None = None, eos: int = EOS) -> None:
        """`encode`: the tokenizer of the scripts (default: one token per byte)."""
        self.encode = encode or (lambda text: list(text.encode()))
        self.script: Callable[[int], str] = script  # what sequence i generates
        self.eos = eos
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.resumed: list[dict[int, list[int]]] = []  # of each add ({} for a new request)
        self.metadata: list[dict[str, str]] = []  # the trace context of each request
        self.session_metadata: list[dict[str, str]] = []  # of the session streams
        self.messages_sent = 0
        self.aborts: list[worker_pb2.AbortRequest] = []
        self.aborted = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.hold_after_first = False
        self.pause_after_first: asyncio.Event | None = None
        self.fail_after_first: MeshError | None = None
        self.break_after_first = False
        self.raise_first: BaseException | None = None
        self.raise_marker: str | None = None
        self._abort_indices: dict[str, set[int] | None] = {}

    async def Session(self, request_iterator: Any,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        self.session_metadata.append(metadata_of(context))
        out: asyncio.Queue[worker_pb2.SessionResponse] = asyncio.Queue()
        running: dict[int, tuple[str, asyncio.Task[None]]] = {}

        async def read() -> None:
            async for message in request_iterator:
                for add in message.adds:
                    self.requests.append(add.request)
                    resumed = {r.index: list(r.token_ids) for r in add.resumed}
                    self.resumed.append(resumed)
                    self.metadata.append({"traceparent": add.traceparent})
                    self.started.set()
                    task = asyncio.ensure_future(self._run(add.handle, add.request, out,
                                                           resumed))
                    running[add.handle] = (add.request.request_id, task)
                for abort in message.aborts:
                    request_id, task = running.get(abort.handle, ("", None))
                    self._abort(request_id, list(abort.indices))
                    if not abort.indices and task is not None and self.hold_after_first:
                        task.cancel()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                message = await out.get()
                yield message
                if self.break_after_first and message.handles:
                    # The worker is gone mid-generation: the whole stream breaks.
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "worker lost")
        finally:
            reader.cancel()
            for _, task in running.values():
                task.cancel()

    async def _run(self, handle: int, request: worker_pb2.GenerateRequest,
                   out: asyncio.Queue[worker_pb2.SessionResponse],
                   resumed: dict[int, list[int]] | None = None) -> None:
        marked = (self.raise_marker is None
                  or ord(self.raise_marker) in request.prompts[0].token_ids)
        try:
            if self.raise_first is not None and marked:
                raise self.raise_first
            seen: set[int] = set()
            async for message in self._messages(request, resumed or {}):
                out.put_nowait(_session_response(handle, message, seen))
                self.messages_sent += 1
                if self.fail_after_first is not None:
                    raise self.fail_after_first
                if self.hold_after_first:
                    await asyncio.Event().wait()
                if self.pause_after_first is not None:
                    await self.pause_after_first.wait()
            out.put_nowait(worker_pb2.SessionResponse(done=[worker_pb2.RequestDone(
                handle=handle, timings=common_pb2.Timings(queued_ns=1000))]))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        except Exception as exc:  # noqa: BLE001 (the fake reports it as the worker would)
            error = exc if isinstance(exc, MeshError) else InternalError(
                f"internal error: {type(exc).__name__}: {exc}")
            out.put_nowait(worker_pb2.SessionResponse(errors=[worker_pb2.RequestError(
                handle=handle, error=error_pb(error))]))

    async def _messages(self, request: worker_pb2.GenerateRequest,
                        resumed: dict[int, list[int]]
                        ) -> AsyncIterator[list[_Output]]:
        params = request.params
        n = params.n if params.HasField("n") else 1
        # Each script ends with EOS, which finishes its sequence with FINISH_REASON_STOP.
        seqs = {p * n + s: (list(prompt.token_ids), [*self.encode(self.script(p * n + s)), self.eos])
                for p, prompt in enumerate(request.prompts) for s in range(n)}
        limit = params.max_tokens if params.HasField("max_tokens") else 10**9
        sent = dict.fromkeys(seqs, 0)
        live = set(seqs)
        if resumed:
            for index, tokens in resumed.items():
                assert seqs[index][1][:len(tokens)] == tokens, "resumed tokens off script"
                sent[index] = len(tokens)
            live = set(resumed)
        while live:
            outputs = [self._output(request, i, seqs[i], sent, limit) for i in sorted(live)]
            live -= {o.index for o in outputs if o.finish_reason}
            yield outputs
            await asyncio.sleep(0)  # let an abort in between messages

    def _output(self, request: worker_pb2.GenerateRequest, index: int,
                seq: tuple[list[int], list[int]], sent: dict[int, int],
                limit: int) -> _Output:
        prompt, tokens = seq
        aborted = self._abort_indices.get(request.request_id, set())
        if aborted is None or index in aborted:
            return _Output(index, finish_reason=common_pb2.FINISH_REASON_ABORT)
        start = sent[index]
        end = min(start + CHUNK, len(tokens), limit)
        sent[index] = end
        params = request.params
        output = _Output(index, tokens[start:end], cached_tokens=CACHED_TOKENS)
        if params.HasField("logprobs"):
            output.logprobs.extend(_logprobs(t, params.logprobs) for t in tokens[start:end])
        if start == 0 and params.HasField("prompt_logprobs"):
            output.prompt_logprobs.extend(_logprobs(t, params.prompt_logprobs)
                                          for t in prompt[1:])
        if end >= limit:
            output.finish_reason = common_pb2.FINISH_REASON_LENGTH
        elif end == len(tokens):
            output.finish_reason = common_pb2.FINISH_REASON_STOP
        return output

    def _abort(self, request_id: str, indices: list[int]) -> None:
        self.aborts.append(worker_pb2.AbortRequest(request_id=request_id, indices=indices))
        current = self._abort_indices.setdefault(request_id, set())
        if not indices:
            self._abort_indices[request_id] = None
        elif current is not None:
            current.update(indices)
        self.aborted.set()


def _session_response(handle: int, outputs: list[_Output],
                      seen: set[int]) -> worker_pb2.SessionResponse:
    """One step's outputs of a request as a Session message (columnar, with details)."""
    response = worker_pb2.SessionResponse(num_steps=1)
    for entry, output in enumerate(outputs):
        response.handles.append(handle)
        response.indices.append(output.index)
        response.num_tokens.append(len(output.token_ids))
        response.token_ids.extend(output.token_ids)
        response.finish_reasons.append(output.finish_reason)
        detail = worker_pb2.EntryDetail(entry=entry, logprobs=output.logprobs,
                                        prompt_logprobs=output.prompt_logprobs)
        if output.index not in seen:
            seen.add(output.index)
            detail.cached_tokens = output.cached_tokens
        response.details.append(detail)
    return response


# -- harness --------------------------------------------------------------------------------

@dataclass
class Mesh:
    """The fakes, the gateway on 127.0.0.1, and the span exporter of the gateway."""

    tokenizer: Any  # FakeTokenizer unless a test brought the real servicer
    scheduler: FakeScheduler
    worker: FakeWorker
    servers: dict[str, GrpcServer]
    gateway: Gateway
    port: int
    spans: InMemorySpanExporter

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def _serve(name: str, add: Any, servicer: Any) -> tuple[GrpcServer, str]:
    server = GrpcServer("127.0.0.1:0", service_names=[f"meshserve.v1.{name}"], grace_s=0)
    add(servicer, server.server)
    port = await server.start()
    await server.set_serving()
    return server, f"127.0.0.1:{port}"


@asynccontextmanager
async def start_mesh(*, dead_workers: int = 0, tokenizer_down: bool = False,
                     tokenizer: Any = None, worker: FakeWorker | None = None,
                     spare: FakeWorker | None = None, **config: Any) -> AsyncIterator[Mesh]:
    """Start the fakes and a gateway (GatewayConfig fields as keyword overrides).

    `dead_workers` workers that refuse connections are listed before the live one;
    `tokenizer_down` points the gateway at a tokenizer address nobody listens on;
    `tokenizer` / `worker` replace the fake servicers (e.g. the real tokenizer); `spare`
    is a second live worker ("w1"), listed after the first (routed to when it is excluded).
    """
    tokenizer = tokenizer if tokenizer is not None else FakeTokenizer()
    worker = worker if worker is not None else FakeWorker()
    servers: dict[str, GrpcServer] = {}
    servers["tokenizer"], tok_addr = await _serve(
        "Tokenizer", tokenizer_pb2_grpc.add_TokenizerServicer_to_server, tokenizer)
    servers["worker"], worker_addr = await _serve(
        "Worker", worker_pb2_grpc.add_WorkerServicer_to_server, worker)
    workers = [(f"dead{i}", f"127.0.0.1:{free_port()}") for i in range(dead_workers)]
    workers.append(("w0", worker_addr))
    if spare is not None:
        servers["spare"], spare_addr = await _serve(
            "Worker", worker_pb2_grpc.add_WorkerServicer_to_server, spare)
        workers.append(("w1", spare_addr))
    scheduler = FakeScheduler(workers)
    servers["scheduler"], sched_addr = await _serve(
        "Scheduler", scheduler_pb2_grpc.add_SchedulerServicer_to_server, scheduler)
    spans = InMemorySpanExporter()
    settings = {"host": "127.0.0.1", "port": 0, "served_model_names": (MODEL,),
                "tokenizer_addresses": (f"127.0.0.1:{free_port()}" if tokenizer_down
                                        else tok_addr,),
                "scheduler_address": sched_addr, "drain_grace_s": 1.0, **config}
    gateway = Gateway(GatewayConfig(**settings), Telemetry("gateway", span_exporter=spans))
    port = await gateway.start()
    try:
        yield Mesh(tokenizer, scheduler, worker, servers, gateway, port, spans)
    finally:
        await gateway.stop()
        for server in servers.values():
            await server.drain(grace_s=0)
