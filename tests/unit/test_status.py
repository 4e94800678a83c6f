"""The status tables: error kind -> gRPC code -> HTTP status and OpenAI error body."""

from __future__ import annotations

import grpc
import pytest

from meshserve.shared import errors
from meshserve.shared.status import (
    ERROR_KIND_KEY,
    ERROR_PARAM_KEY,
    HTTP_BY_GRPC_CODE,
    error_from_status,
    error_metadata,
    grpc_code_for,
    http_error,
    http_status_for,
    openai_error_body,
)

_C = grpc.StatusCode

# The mapping the design fixes: error -> (gRPC code, HTTP status, OpenAI type).
EXPECTED = [
    (errors.InvalidRequestError, _C.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (errors.ContextLengthError, _C.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (errors.NotFoundError, _C.NOT_FOUND, 404, "not_found_error"),
    (errors.OverloadedError, _C.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (errors.UnavailableError, _C.UNAVAILABLE, 503, "service_unavailable_error"),
    (errors.AuthenticationError, _C.UNAUTHENTICATED, 401, "authentication_error"),
    (errors.DeadlineExceededError, _C.DEADLINE_EXCEEDED, 504, "timeout_error"),
    (errors.InternalError, _C.INTERNAL, 500, "server_error"),
    (errors.ModelLoadError, _C.INTERNAL, 500, "server_error"),
    (errors.ConfigError, _C.INTERNAL, 500, "server_error"),
]


@pytest.mark.parametrize(("cls", "code", "http", "error_type"), EXPECTED,
                         ids=[row[0].__name__ for row in EXPECTED])
def test_error_kind_to_grpc_to_http(cls: type[errors.MeshError], code: grpc.StatusCode,
                                    http: int, error_type: str) -> None:
    error = cls("something is off", param="max_tokens")
    assert grpc_code_for(error) == code
    assert http_status_for(code) == (http, error_type)
    assert http_error(error) == (http, {"error": {
        "message": "something is off", "type": error_type, "param": "max_tokens",
        "code": cls.kind}})


def test_context_length_error_is_a_400_with_its_code() -> None:
    status, body = http_error(errors.ContextLengthError("prompt has 9000 tokens", param="messages"))
    assert status == 400
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["type"] == "invalid_request_error"


def test_every_status_code_but_ok_has_an_http_status() -> None:
    assert set(HTTP_BY_GRPC_CODE) == set(grpc.StatusCode) - {_C.OK}
    assert all(400 <= status < 600 for status, _ in HTTP_BY_GRPC_CODE.values())


@pytest.mark.parametrize("cls", [row[0] for row in EXPECTED], ids=lambda c: c.__name__)
def test_metadata_round_trip_rebuilds_the_class(cls: type[errors.MeshError]) -> None:
    error = cls("bad top_p", param="top_p")
    rebuilt = error_from_status(grpc_code_for(error), error.message, error_metadata(error))
    assert type(rebuilt) is cls
    assert (rebuilt.message, rebuilt.param) == ("bad top_p", "top_p")


def test_metadata_without_param() -> None:
    assert error_metadata(errors.OverloadedError("busy")) == ((ERROR_KIND_KEY, "overloaded"),)
    rebuilt = error_from_status(_C.RESOURCE_EXHAUSTED, "busy", [(ERROR_KIND_KEY, "overloaded")])
    assert isinstance(rebuilt, errors.OverloadedError) and rebuilt.param is None


def test_non_ascii_param_is_escaped_for_metadata() -> None:
    pairs = dict(error_metadata(errors.InvalidRequestError("x", param="stop[é]")))
    assert pairs[ERROR_PARAM_KEY] == "stop[\\xe9]"
    assert pairs[ERROR_PARAM_KEY].isascii()


@pytest.mark.parametrize(("code", "cls"), [
    (_C.UNAVAILABLE, errors.UnavailableError),
    (_C.DEADLINE_EXCEEDED, errors.DeadlineExceededError),
    (_C.RESOURCE_EXHAUSTED, errors.OverloadedError),
    (_C.INVALID_ARGUMENT, errors.InvalidRequestError),
    (_C.NOT_FOUND, errors.NotFoundError),
    (_C.UNAUTHENTICATED, errors.AuthenticationError),
    (_C.CANCELLED, errors.UnavailableError),
    (_C.UNIMPLEMENTED, errors.InternalError),
    (_C.UNKNOWN, errors.InternalError),
])
def test_status_without_kind_maps_by_code(code: grpc.StatusCode,
                                          cls: type[errors.MeshError]) -> None:
    rebuilt = error_from_status(code, "connection refused", None)
    assert type(rebuilt) is cls
    assert rebuilt.message == "connection refused" and rebuilt.param is None


def test_unknown_kind_becomes_internal_and_empty_details_get_a_message() -> None:
    rebuilt = error_from_status(_C.INTERNAL, "", [(ERROR_KIND_KEY, "from_the_future")])
    assert type(rebuilt) is errors.InternalError
    assert rebuilt.message == "gRPC call failed with INTERNAL"


def test_kind_lookup_ignores_subclasses_that_only_inherit_a_kind() -> None:
    class AdapterMissing(errors.NotFoundError):
        pass

    assert errors.error_class_for_kind("not_found") is errors.NotFoundError
    assert errors.error_class_for_kind("internal") is errors.InternalError


def test_openai_error_body_shape() -> None:
    assert openai_error_body("m", "invalid_request_error") == {
        "error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
