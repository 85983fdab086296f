"""Typed service errors and the one table from exception type to HTTP status.

Every failure leaves the server in one shape, ``{"error": {"message", "type", "param", "code"}}``.
The engine raises these (plain exceptions, no HTTP objects); the app turns them into responses.
"""

from __future__ import annotations

import json


class ServiceError(Exception):
    """Base: ``message`` is safe to show clients; ``param`` names the offending request field."""

    type = "server_error"
    default_code = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code


class MalformedRequest(ServiceError):
    type = "invalid_request_error"
    default_code = "bad_request"


def empty_body() -> MalformedRequest:
    """The one answer to a request without a body, whichever parser found it out."""
    return MalformedRequest("the request body is empty; send a JSON object", param="body")


class Unauthorized(ServiceError):
    type = "authentication_error"
    default_code = "unauthorized"


class NotFound(ServiceError):
    type = "not_found_error"
    default_code = "not_found"


class MethodNotAllowed(ServiceError):
    type = "invalid_request_error"
    default_code = "method_not_allowed"


class BodyTimeout(ServiceError):
    """The client stopped sending its body part-way (or never started)."""

    type = "timeout_error"
    default_code = "body_timeout"


class PayloadTooLarge(ServiceError):
    type = "invalid_request_error"
    default_code = "payload_too_large"


class UnsupportedMediaType(ServiceError):
    """The body is not plain JSON: another content-type, or compressed (content-encoding)."""

    type = "invalid_request_error"
    default_code = "unsupported_media_type"


class InvalidInput(ServiceError):
    """The request is well-formed but breaks a limit or a rule (empty input, too long, ...). ``index``: the
    input it is about, which the message calls "input {index}" (a route may rename it: :meth:`name_input`)."""

    type = "invalid_request_error"
    default_code = "invalid_input"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 index: int | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.index = index

    def name_input(self, name: str) -> None:
        """Call the input this error is about ``name``, as the route's body spells it."""
        if self.index is not None:
            self.message = self.message.replace(f"input {self.index}", name, 1)
            self.args = (self.message,)


class Overloaded(ServiceError):
    """Refused at admission: the queue is over its token cap (code ``queue_full``) or predicted to
    outlast the request's deadline (``predicted_wait``). ``retry_after`` (s) becomes the Retry-After
    header."""

    type = "overloaded_error"
    default_code = "overloaded"

    def __init__(self, message: str, *, retry_after: int = 1, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class NotReady(ServiceError):
    """Model still loading/warming up, or the server is draining after SIGTERM."""

    type = "unavailable_error"
    default_code = "not_ready"


class DeadlineExceeded(ServiceError):
    type = "timeout_error"
    default_code = "deadline_exceeded"


class ClientGone(ServiceError):
    """The client disconnected before its input ran; nobody reads the answer."""

    type = "client_closed_request"
    default_code = "client_closed"


class InternalError(ServiceError):
    """Anything unexpected. The client sees only this sanitised message; the log has the traceback."""

    default_code = "internal"

    def __init__(self) -> None:
        super().__init__("internal server error; the server log has the details")


# The one table. Lookup walks the exception's MRO, so subclasses inherit their parent's status; where
# two classes share a status (500), the first listed names it in the failures metric.
STATUS: dict[type[ServiceError], int] = {
    MalformedRequest: 400,
    Unauthorized: 401,
    NotFound: 404,
    MethodNotAllowed: 405,
    BodyTimeout: 408,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    InvalidInput: 422,
    Overloaded: 429,
    ClientGone: 499,
    InternalError: 500,
    NotReady: 503,
    DeadlineExceeded: 504,
    ServiceError: 500,
}


def status_of(exc: ServiceError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_body(exc: ServiceError) -> dict:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                      "code": exc.code}}


def error_response_parts(exc: ServiceError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, headers, body) of the one error shape, with the headers some statuses need."""
    headers = [(b"content-type", b"application/json")]
    if isinstance(exc, Unauthorized):
        headers.append((b"www-authenticate", b"Bearer"))
    if isinstance(exc, Overloaded):
        headers.append((b"retry-after", str(exc.retry_after).encode()))
    return status_of(exc), headers, json.dumps(error_body(exc)).encode()


# yoso_failures_total's reason per status: the code of the error class that answers with it.
_REASONS = {status: cls.default_code for cls, status in reversed(STATUS.items())}  # reversed: first wins


def failure_reason(status: int) -> str:
    """The failures metric's reason for an error ``status`` (the status itself when no class has it)."""
    return _REASONS.get(status, str(status))
