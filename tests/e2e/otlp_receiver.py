"""A real OTLP/gRPC trace receiver for tests: collects every exported span."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    """The span's string attributes."""


class OTLPReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Runs a gRPC TraceService on 127.0.0.1; `wait_for` blocks on a condition over the spans."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OTLPReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    attributes = {a.key: a.value.string_value for a in span.attributes
                                  if a.value.HasField("string_value")}
                    received.append(ReceivedSpan(service, span.name, span.trace_id.hex(),
                                                 span.span_id.hex(), span.parent_span_id.hex(),
                                                 attributes))
        with self._changed:
            self.spans.extend(received)
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout_s: float) -> list[ReceivedSpan]:
        with self._changed:
            self._changed.wait_for(lambda: predicate(self.spans), timeout=timeout_s)
            return list(self.spans)
