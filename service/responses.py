"""Response helpers every route module shares: JSON with the timing headers, the one error shape,
and the disconnect watch the engine cancels queued work with."""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager
from typing import Callable

from fastapi import Request
from fastapi.responses import Response

from .errors import InvalidInput, ServiceError, error_response_parts
from .params import Usage
from .protocol import ErrorResponse

# The error statuses a work route can answer besides 200, for the OpenAPI document.
ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 413, 415, 422, 429, 503, 504)}


def error(exc: ServiceError, headers: dict[str, str] | None = None) -> Response:
    status, raw, body = error_response_parts(exc)
    return Response(body, status_code=status, headers={**{k.decode(): v.decode() for k, v in raw}, **(headers or {})})


def timing_headers(usage: Usage) -> dict[str, str]:
    return {"x-compute-tokens": str(usage.tokens), "x-hashes": str(usage.hashes),
            "x-tokenization-time": f"{usage.tokenize_ms:.2f}", "x-queue-time": f"{usage.queue_ms:.2f}",
            "x-inference-time": f"{usage.inference_ms:.2f}"}


def json_response(payload, usage: Usage | None = None, status: int = 200) -> Response:
    return Response(json.dumps(payload, separators=(",", ":")), status_code=status,
                    media_type="application/json", headers=timing_headers(usage) if usage else None)


async def json_response_off_loop(build: Callable[[], object], usage: Usage | None = None) -> Response:
    """:func:`json_response` of ``build()``, both run on a worker thread: for answers that may be large
    (a vector per token), whose conversion to Python lists and JSON would otherwise stall the event loop,
    and with it /health and every other request, for seconds."""
    body = await asyncio.to_thread(lambda: json.dumps(build(), separators=(",", ":")))
    return Response(body, media_type="application/json", headers=timing_headers(usage) if usage else None)


@contextmanager
def params_named(**names: str):
    """The engine names request fields by its own parameters (``inputs``, ``labels``); a route whose body
    calls them otherwise (/rerank's ``texts``, OpenAI's ``input``) renames them in the errors it passes on."""
    try:
        yield
    except InvalidInput as exc:
        exc.param = names.get(exc.param, exc.param)
        raise


def watch(request: Request):
    """An awaitable factory that completes when the client disconnects (the body is already read)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return disconnected
