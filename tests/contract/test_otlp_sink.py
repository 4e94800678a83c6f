"""loadtest/otlp_sink.py: spans two services export over real OTLP/gRPC come out as
JSON lines of one trace, each naming its service, the child naming its parent."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
from pathlib import Path

from opentelemetry import trace

from meshserve.shared.telemetry import Telemetry

SCRIPT = Path(__file__).resolve().parents[2] / "loadtest" / "otlp_sink.py"


def load_sink_module():
    spec = importlib.util.spec_from_file_location("otlp_sink", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_spans_of_two_services_arrive_as_one_trace() -> None:
    sink_module = load_sink_module()
    out = io.StringIO()
    sink = sink_module.SpanSink(out)
    server, port = await sink_module.start(sink, "127.0.0.1", 0)
    gateway = Telemetry("gateway", otlp_endpoint=f"127.0.0.1:{port}")
    tokenizer = Telemetry("tokenizer", otlp_endpoint=f"http://127.0.0.1:{port}")
    try:
        with gateway.tracer.start_as_current_span("POST /v1/chat/completions") as root:
            parent = trace.set_span_in_context(root)
            with tokenizer.tracer.start_as_current_span("Tokenize", context=parent):
                pass
        # shutdown flushes the batch exporter, a blocking call: off the loop serving the sink.
        await asyncio.to_thread(tokenizer.shutdown)
        await asyncio.to_thread(gateway.shutdown)
    finally:
        await server.stop(grace=None)

    records = [json.loads(line) for line in out.getvalue().splitlines()]
    by_service = {record["service"]: record for record in records}
    assert sorted(by_service) == ["gateway", "tokenizer"]
    root_record, child = by_service["gateway"], by_service["tokenizer"]
    assert root_record["name"] == "POST /v1/chat/completions"
    assert root_record["parent_span_id"] == ""
    assert child["name"] == "Tokenize"
    assert child["trace_id"] == root_record["trace_id"] != ""
    assert child["parent_span_id"] == root_record["span_id"]
    assert child["end_unix_nano"] >= child["start_unix_nano"] > 0
    assert sink.spans == 2
