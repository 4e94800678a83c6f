"""The one domain error hierarchy of meshserve.

Every service raises these; the gRPC layer maps them to status codes and the
gateway maps those to HTTP statuses and OpenAI error bodies (tables live beside
the transport code, keyed by `MeshError.kind`).
"""

from __future__ import annotations


class MeshError(Exception):
    """Base of every error meshserve raises on purpose."""

    kind = "internal"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(MeshError):
    """The request itself is wrong; retrying it unchanged fails again."""

    kind = "invalid_request"


class ContextLengthError(InvalidRequestError):
    """The prompt (plus requested output) does not fit the model's context."""

    kind = "context_length_exceeded"


class NotFoundError(MeshError):
    """A named thing (model, request, block) does not exist."""

    kind = "not_found"


class OverloadedError(MeshError):
    """No capacity now; the same request may succeed later.

    `retry_after_s`: when it may (the HTTP answer's Retry-After; None: no estimate);
    `reason`: which bound refused it ("ceiling", "queue_full", "queue_delay"; "": not said).
    """

    kind = "overloaded"

    def __init__(self, message: str, *, param: str | None = None,
                 retry_after_s: int | None = None, reason: str = "") -> None:
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s
        self.reason = reason


class UnavailableError(MeshError):
    """A service needed for the request is down or not ready."""

    kind = "unavailable"


class AuthenticationError(MeshError):
    """Missing or wrong credentials."""

    kind = "authentication"


class DeadlineExceededError(MeshError):
    """The request ran past its deadline."""

    kind = "deadline_exceeded"


class ModelLoadError(MeshError):
    """Model files are missing, corrupt, mismatched or of an unsupported architecture."""

    kind = "model_load"


class InternalError(MeshError):
    """A bug or an unexpected failure inside meshserve."""

    kind = "internal"


class ConfigError(MeshError):
    """A service's configuration (flags, environment, files) is invalid."""

    kind = "invalid_config"


def error_class_for_kind(kind: str) -> type[MeshError]:
    """The MeshError subclass whose `kind` is `kind` (InternalError when none is).

    Among classes that declare the kind themselves, the most derived wins
    (InternalError over MeshError), so a kind read back from the wire rebuilds
    the class that declared it.
    """
    matches: list[type[MeshError]] = []
    pending: list[type[MeshError]] = [MeshError]
    while pending:
        cls = pending.pop(0)
        # Only a class that names the kind itself: a subclass that merely inherits
        # it (a service's narrower error) must not replace the class that defines it.
        if cls.__dict__.get("kind") == kind:
            matches.append(cls)
        pending.extend(cls.__subclasses__())
    # Breadth-first order: the last match is the most derived one.
    return matches[-1] if matches else InternalError
