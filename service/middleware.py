"""The edge of every request, as one plain ASGI middleware (no BaseHTTPMiddleware: it would
buffer responses and break the disconnect watch).

In order: request id, API key, the client's deadline (``x-request-timeout``, kept for the engine in
a context variable), body size (before any parsing, chunked bodies included), admission (a request of
model work meets the queue's 429 before the app parses it), then the app;
afterwards request metrics. Anything the app lets escape becomes a sanitised 500 here, with
the traceback in the server log only.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from .admission import client_deadline, parse_client_timeout, request_arrival
from .errors import (BodyTimeout, ClientGone, InternalError, PayloadTooLarge, ServiceError, Unauthorized,
                     UnsupportedMediaType, error_response_parts, failure_reason)
from .metrics import ServiceMetrics

log = logging.getLogger("yoso_serve.service")

# Seconds a request body may go without a byte arriving (nginx's client_body_timeout): a client that stops
# part-way holds a connection and an in-flight slot until then, and gets a 408.
BODY_IDLE_TIMEOUT_S = 60.0

# The OpenAPI tag of the routes that only run the tokenizer: never refused for the model's queue.
TOKENIZER_TAG = "tokenizer"


@dataclass(frozen=True)
class RouteTable:
    """The app's routes as the edge sorts them, read from what the app registered (:meth:`of`)."""

    work: frozenset[str]  # POST routes: counted in flight, may carry x-request-timeout
    model: frozenset[str]  # work that queues the model: admitted at the edge
    open: frozenset[str]  # answered without the API key
    known: frozenset[str]  # metric labels; any other path is "other"

    @classmethod
    def of(cls, app) -> "RouteTable":
        """Every POST route is work; model work unless tagged ``tokenizer`` (/tokenize, /decode). Open: the
        routes that declare no security (``openapi_extra={"security": []}``: the probes and the scrape,
        documented in docs/api.md) and FastAPI's own docs routes (the ones left out of the schema)."""
        routes = [r for r in app.routes if getattr(r, "methods", None)]
        work = {r.path for r in routes if "POST" in r.methods}
        open_ = {r.path for r in routes if not r.include_in_schema
                 or (getattr(r, "openapi_extra", None) or {}).get("security") == []}
        model = {r.path for r in routes if r.path in work and TOKENIZER_TAG not in (r.tags or ())}
        return cls(frozenset(work), frozenset(model), frozenset(open_), frozenset(r.path for r in routes))


def _request_id(raw: bytes | None) -> str:
    """Echo a client's id when it is short and printable (it lands in logs), else make one."""
    if raw:
        text = raw.decode("latin-1")
        if len(text) <= 128 and text.isprintable():
            return text
    return uuid.uuid4().hex


class EdgeMiddleware:
    def __init__(self, app, *, routes: RouteTable, api_key: str | None, payload_limit: int,
                 metrics: ServiceMetrics, admit: Callable[[], None] | None = None) -> None:
        self.app = app
        self.admit = admit
        self.routes = routes
        self._key = api_key.encode() if api_key else None
        self.payload_limit = payload_limit
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = dict(scope["headers"])
        request_id = _request_id(headers.get(b"x-request-id"))
        path = scope["path"]
        route = path if path in self.routes.known else "other"
        state = {"status": 500, "started": False}

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                state["status"], state["started"] = message["status"], True
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        work = path in self.routes.work
        arrival_token = None
        if work:
            self.metrics.in_flight.inc()
            arrival_token = request_arrival.set(time.monotonic())
        deadline_token = None
        try:
            error = self._check_key(path, headers)
            if error is None and work and scope["method"] == "POST":  # another method is the router's 405
                error = _check_media(headers)
            if error is None and work:
                error, deadline_token = self._client_deadline(headers)
            body = b""
            if error is None:
                body, error = await self._read_body(headers, receive)
            if error is None and path in self.routes.model and self.admit is not None:
                error = self._refusal()
            if error is not None:
                await self._send_error(error, send_with_id)
            else:
                await self.app(scope, _replay(body, receive), send_with_id)
        except Exception:  # noqa: BLE001 - the last line of defence: never a traceback to clients
            log.exception("unhandled error on %s %s (request %s)", scope["method"], path, request_id)
            if not state["started"]:
                await self._send_error(InternalError(), send_with_id)
        finally:
            if deadline_token is not None:
                client_deadline.reset(deadline_token)
            if arrival_token is not None:
                request_arrival.reset(arrival_token)
            if work:
                self.metrics.in_flight.dec()
            status = state["status"]
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.request_duration.labels(route, str(status)).observe(time.perf_counter() - start)
            if status >= 400:
                self.metrics.failures.labels(failure_reason(status)).inc()

    def _check_key(self, path: str, headers: dict) -> ServiceError | None:
        if self._key is None or path in self.routes.open:
            return None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return Unauthorized("missing API key: send `Authorization: Bearer <key>`")
        if not hmac.compare_digest(token.strip(), self._key):
            return Unauthorized("wrong API key")
        return None

    def _refusal(self) -> ServiceError | None:
        """The queue's 429 for this request, decided before the app parses it (None: admitted so far; the
        engine checks again, with the request's own tokens, once it has them)."""
        try:
            self.admit()
        except ServiceError as exc:
            return exc
        return None

    @staticmethod
    def _client_deadline(headers: dict):
        """(error, context token): the client's deadline, counted from the request's arrival."""
        try:
            seconds = parse_client_timeout(headers.get(b"x-request-timeout"))
        except ServiceError as exc:
            return exc, None
        if seconds is None:
            return None, None
        return None, client_deadline.set(time.monotonic() + seconds)

    async def _read_body(self, headers: dict, receive) -> tuple[bytes, ServiceError | None]:
        too_large = PayloadTooLarge(f"request body is over payload_limit ({self.payload_limit} bytes); "
                                    "send fewer or shorter inputs", param="body")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.payload_limit:
            return b"", too_large
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), BODY_IDLE_TIMEOUT_S)
            except asyncio.TimeoutError:
                return b"", BodyTimeout(f"no byte of the request body arrived for {BODY_IDLE_TIMEOUT_S:g} s; "
                                        "send the whole body at once", param="body")
            if message["type"] == "http.disconnect":  # what came is not the whole body: nothing to answer
                return b"", ClientGone("the client disconnected before sending the whole body", param="body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.payload_limit:  # a chunked body has no content-length to check up front
                return b"", too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), None

    @staticmethod
    async def _send_error(exc: ServiceError, send) -> None:
        status, headers, body = error_response_parts(exc)
        headers = [*headers, (b"content-length", str(len(body)).encode())]  # not chunked: the length is known
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _check_media(headers: dict) -> UnsupportedMediaType | None:
    """Work routes take plain JSON (as text-embeddings-inference does): content-type application/json (or a
    +json type, parameters such as charset allowed) and no content-encoding."""
    raw = headers.get(b"content-type", b"").decode("latin-1")
    media = raw.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        what = f"content-type {raw!r}" if raw else "no content-type"
        return UnsupportedMediaType(f"the body must be JSON sent with content-type: application/json; got {what}",
                                    param="content-type")
    encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
    if encoding not in ("", "identity"):
        return UnsupportedMediaType(f"content-encoding {encoding!r} is not supported; send the body uncompressed "
                                    "(--payload-limit is counted on it as sent)", param="content-encoding")
    return None


def _replay(body: bytes, receive):
    """The app reads the buffered body once; later reads go to the server (to see a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
