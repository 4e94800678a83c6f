"""Structured logging: one JSON object per line (orjson), carrying the trace and span ids.

    setup_logging("worker", level="INFO")
    log.info("request admitted", extra={"request_id": rid, "prompt_tokens": 812})

prints

    {"ts":"2025-01-01T12:00:00.000Z","level":"INFO","service":"worker",
     "logger":"meshserve.services.worker.servicer","message":"request admitted",
     "trace_id":"4bf9…","span_id":"00f0…","request_id":"…","prompt_tokens":812}

The ids are those of the OpenTelemetry span current when the record is made (empty
outside a span), so a log line joins the trace of the request it belongs to.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

import orjson
from opentelemetry import trace

# Attributes every LogRecord has; anything else came in through `extra=`.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "trace_id", "span_id", "taskName"}
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [trace=%(trace_id)s span=%(span_id)s] " \
               "%(message)s"


class TraceContextFilter(logging.Filter):
    """Stamps each record with the current span's trace id and span id (hex, or "")."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        else:
            record.trace_id = record.span_id = ""
        return True


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line with the service name and trace context."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
            "trace_id": getattr(record, "trace_id", ""),
            "span_id": getattr(record, "span_id", ""),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(entry, default=str).decode()


def setup_logging(service: str, level: str = "INFO", *, fmt: Literal["json", "text"] = "json",
                  stream: TextIO | None = None) -> logging.Handler:
    """Send every log record of the process to `stream` (stderr) in `fmt`; returns the handler.

    Replaces a handler an earlier call installed, so calling it again reconfigures
    logging instead of duplicating lines; other handlers (a test's capture) stay.
    """
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(TraceContextFilter())
    handler.setFormatter(JsonFormatter(service) if fmt == "json"
                         else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        if any(isinstance(f, TraceContextFilter) for f in old.filters):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
