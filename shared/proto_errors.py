"""Domain errors inside batched streams: MeshError <-> the `Error` message of common.proto.

A failed call carries its error as a gRPC status; a request that fails inside a session
stream (which goes on for the others) carries it as an `Error` entry instead, with the
same kind, message and parameter, so that the receiver rebuilds the same MeshError.
"""

from __future__ import annotations

from meshserve.proto.v1 import common_pb2
from meshserve.shared.errors import MeshError, OverloadedError, error_class_for_kind


def error_pb(error: MeshError) -> common_pb2.Error:
    """The wire form of a domain error (an OverloadedError's retry time and reason too)."""
    message = common_pb2.Error(kind=error.kind, message=error.message, param=error.param or "")
    if isinstance(error, OverloadedError):
        message.retry_after_s = error.retry_after_s or 0
        message.reason = error.reason
    return message


def error_from_pb(message: common_pb2.Error) -> MeshError:
    """The domain error an `Error` message stands for (InternalError for unknown kinds)."""
    cls = error_class_for_kind(message.kind or "internal")
    text = message.message or f"{message.kind or 'internal'} error"
    if issubclass(cls, OverloadedError):
        return cls(text, param=message.param or None,
                   retry_after_s=message.retry_after_s or None, reason=message.reason)
    return cls(text, param=message.param or None)
