"""An OTLP/gRPC trace receiver that writes each span it is sent as one JSON line.

Driver part: `mesh` (VARIANTS=traced); also compose/smoke.sh.

For hosts where no tracing backend can be had (no registry to pull Jaeger from): the
services export to it exactly as they would to Jaeger's or a collector's OTLP port, and
`compose/smoke.sh --trace-file FILE` reads what it wrote to find one request's trace
with spans from several services. It stores nothing else and answers no queries.

    python loadtest/otlp_sink.py --port 14317 --out /tmp/spans.jsonl

Each line: {"trace_id", "span_id", "parent_span_id" (hex; "" for a root), "service"
(the resource's service.name), "name", "start_unix_nano", "end_unix_nano"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import Iterator
from typing import Any, TextIO

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def span_records(request: trace_service_pb2.ExportTraceServiceRequest) -> Iterator[dict]:
    """One flat record per span of an export request."""
    for resource_spans in request.resource_spans:
        service = next((kv.value.string_value for kv in resource_spans.resource.attributes
                        if kv.key == "service.name"), "")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield {"trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                       "parent_span_id": span.parent_span_id.hex(), "service": service,
                       "name": span.name, "start_unix_nano": span.start_time_unix_nano,
                       "end_unix_nano": span.end_time_unix_nano}


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """Appends every exported span to `out`, flushed after each request."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.spans = 0

    async def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
                     context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        for record in span_records(request):
            self.out.write(json.dumps(record) + "\n")
            self.spans += 1
        self.out.flush()  # readers look while the sink runs
        return trace_service_pb2.ExportTraceServiceResponse()


async def start(sink: SpanSink, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A started server for `sink` and the port it got (port 0: any free one)."""
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound


async def serve(host: str, port: int, out: TextIO) -> None:
    """Receive until SIGINT or SIGTERM."""
    sink = SpanSink(out)
    server, bound = await start(sink, host, port)
    print(f"OTLP/gRPC sink on {host}:{bound}, spans to {out.name}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2)
    print(f"sink stopped after {sink.spans} spans", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4317)
    parser.add_argument("--out", required=True, help="JSON-lines file the spans go to")
    args = parser.parse_args()
    with open(args.out, "a", encoding="utf-8") as out:
        asyncio.run(serve(args.host, args.port, out))


if __name__ == "__main__":
    main()
