"""Typed service errors and the one table from exception type to HTTP status.

Every failure leaves the server in one shape, ``{"error": {"message", "type", "param", "code"}}``.
The engine raises these (plain exceptions, no HTTP objects); the app turns them into responses.
"""

from __future__ import annotations


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


class Unauthorized(ServiceError):
    type = "authentication_error"
    default_code = "unauthorized"


class NotFound(ServiceError):
    type = "not_found_error"
    default_code = "not_found"


class MethodNotAllowed(ServiceError):
    type = "invalid_request_error"
    default_code = "method_not_allowed"


class PayloadTooLarge(ServiceError):
    type = "invalid_request_error"
    default_code = "payload_too_large"


class InvalidInput(ServiceError):
    """The request is well-formed but breaks a limit or a rule (empty input, too long, ...)."""

    type = "invalid_request_error"
    default_code = "invalid_input"


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

    def __init__(self) -> None:
        super().__init__("internal server error; the server log has the details", code="internal")


# The one table. Lookup walks the exception's MRO, so subclasses inherit their parent's status.
STATUS: dict[type[ServiceError], int] = {
    MalformedRequest: 400,
    Unauthorized: 401,
    NotFound: 404,
    MethodNotAllowed: 405,
    PayloadTooLarge: 413,
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
