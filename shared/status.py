"""The one status table of meshserve: error kind → gRPC status → HTTP status and OpenAI body.

Errors cross the mesh as gRPC statuses: the code comes from `GRPC_CODE_BY_KIND`,
the message is the status details, and the domain kind and offending parameter
ride in trailing metadata (`ERROR_KIND_KEY`, `ERROR_PARAM_KEY`) so that the
receiver rebuilds the same MeshError subclass. The gateway turns a gRPC code into
an HTTP status and OpenAI error type with `HTTP_BY_GRPC_CODE`.

Choices, written down:
- Every invalid request is 400 `invalid_request_error`, as OpenAI and vLLM answer
  (the openai client raises BadRequestError). 422 is not used: OpenAI never sends
  it for parameter errors, so clients would see an unfamiliar UnprocessableEntity.
- A deadline that passes inside the mesh is 504 (the server gave up waiting on an
  upstream hop); 408 would blame the client for sending its request slowly.
- The body's `code` is the error kind (e.g. "context_length_exceeded",
  "overloaded"), so clients can tell apart errors that share a status.
- A request cancelled before it finished is 499 (client closed request), the
  status proxies log for it; the client is usually gone and never sees it.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import MappingProxyType
from typing import Any

import grpc

from meshserve.shared.errors import MeshError, error_class_for_kind

ERROR_KIND_KEY = "meshserve-error-kind"
ERROR_PARAM_KEY = "meshserve-error-param"

_C = grpc.StatusCode

GRPC_CODE_BY_KIND = MappingProxyType({
    "invalid_request": _C.INVALID_ARGUMENT,
    "context_length_exceeded": _C.INVALID_ARGUMENT,
    "not_found": _C.NOT_FOUND,
    "overloaded": _C.RESOURCE_EXHAUSTED,
    "unavailable": _C.UNAVAILABLE,
    "authentication": _C.UNAUTHENTICATED,
    "deadline_exceeded": _C.DEADLINE_EXCEEDED,
    # Neither the client's fault nor worth retrying: the server is set up wrong.
    "model_load": _C.INTERNAL,
    "invalid_config": _C.INTERNAL,
    "internal": _C.INTERNAL,
})
"""MeshError kind → gRPC status code (unknown kinds are INTERNAL)."""

HTTP_BY_GRPC_CODE = MappingProxyType({
    _C.CANCELLED: (499, "request_cancelled_error"),
    _C.UNKNOWN: (500, "server_error"),
    _C.INVALID_ARGUMENT: (400, "invalid_request_error"),
    _C.DEADLINE_EXCEEDED: (504, "timeout_error"),
    _C.NOT_FOUND: (404, "not_found_error"),
    _C.ALREADY_EXISTS: (409, "conflict_error"),
    _C.PERMISSION_DENIED: (403, "permission_error"),
    _C.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    _C.FAILED_PRECONDITION: (400, "invalid_request_error"),
    _C.ABORTED: (409, "conflict_error"),
    _C.OUT_OF_RANGE: (400, "invalid_request_error"),
    _C.UNIMPLEMENTED: (501, "not_implemented_error"),
    _C.INTERNAL: (500, "server_error"),
    _C.UNAVAILABLE: (503, "service_unavailable_error"),
    _C.DATA_LOSS: (500, "server_error"),
    _C.UNAUTHENTICATED: (401, "authentication_error"),
})
"""gRPC status code → (HTTP status, OpenAI error type); every code but OK."""

KIND_BY_GRPC_CODE = MappingProxyType({
    _C.CANCELLED: "unavailable",
    _C.INVALID_ARGUMENT: "invalid_request",
    _C.OUT_OF_RANGE: "invalid_request",
    _C.FAILED_PRECONDITION: "invalid_request",
    _C.DEADLINE_EXCEEDED: "deadline_exceeded",
    _C.NOT_FOUND: "not_found",
    _C.RESOURCE_EXHAUSTED: "overloaded",
    _C.UNAVAILABLE: "unavailable",
    _C.UNAUTHENTICATED: "authentication",
    _C.PERMISSION_DENIED: "authentication",
})
"""Kind of an error that carries none (made by gRPC itself, e.g. connection refused)."""


def grpc_code_for(error: MeshError) -> grpc.StatusCode:
    """The gRPC status code an error travels as."""
    return GRPC_CODE_BY_KIND.get(error.kind, _C.INTERNAL)


def http_status_for(code: grpc.StatusCode) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of a gRPC status code."""
    return HTTP_BY_GRPC_CODE.get(code, (500, "server_error"))


def _ascii(value: str) -> str:
    # Plain (non "-bin") metadata values must be printable ASCII.
    return value.encode("ascii", "backslashreplace").decode("ascii")


def error_metadata(error: MeshError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that carries an error's kind and parameter."""
    pairs = [(ERROR_KIND_KEY, _ascii(error.kind))]
    if error.param is not None:
        pairs.append((ERROR_PARAM_KEY, _ascii(error.param)))
    return tuple(pairs)


def error_from_status(
    code: grpc.StatusCode, details: str | None, metadata: Iterable[tuple[str, Any]] | None
) -> MeshError:
    """Rebuild the MeshError a gRPC status stands for (the sender's class when it said)."""
    values = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    kind = values.get(ERROR_KIND_KEY) or KIND_BY_GRPC_CODE.get(code, "internal")
    message = details or f"gRPC call failed with {code.name}"
    return error_class_for_kind(kind)(message, param=values.get(ERROR_PARAM_KEY))


def openai_error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def http_error(error: MeshError) -> tuple[int, dict[str, dict[str, str | None]]]:
    """(HTTP status, OpenAI error body) for a domain error."""
    status, error_type = http_status_for(grpc_code_for(error))
    return status, openai_error_body(error.message, error_type, param=error.param,
                                     code=error.kind)
