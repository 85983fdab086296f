"""FastAPI app factory and the routes. Routes are thin: parse, call the engine, shape the response."""

from __future__ import annotations

import asyncio
import base64
import logging
import re
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from yoso_serve.model.version import package_version

from .engine import Engine
from .errors import InvalidInput, MalformedRequest, MethodNotAllowed, NotFound, NotReady, ServiceError, empty_body
from .metrics import CONTENT_TYPE, ServiceMetrics
from .middleware import TOKENIZER_TAG, EdgeMiddleware, RouteTable
from .protocol import (PATTERN_MEANS, UNION_TAGS, ClassifyRequest, EmbedAllRequest, EmbedPiecesRequest, EmbedRequest,
                       ErrorResponse, OpenAIEmbeddingRequest, OpenAIEmbeddingResponse, PiecedEmbedding, ScoredLabel,
                       Token, TokenizeRequest)
from .responses import (ERRORS as _ERRORS, error as _error, json_response as _json, json_response_off_loop,
                        params_named, watch as _watch)
from .schema import deployment_openapi
from .settings import ServeSettings
from .tei import add_tei_routes

log = logging.getLogger("yoso_serve.service")

# the installed distribution's, so /info, OpenAPI and the package never disagree
VERSION = package_version()


def _default_loader(settings: ServeSettings) -> tuple[Callable, str]:
    """Load from --model, or the bundled default model, for the runtime --runtime resolves to."""
    from .loading import load_served_model

    def load():
        return load_served_model(settings)

    name = str(settings.model) if settings.model is not None else "yoso-default"
    return load, name


def create_app(settings: ServeSettings | None = None, *, load_model: Callable | None = None,
               model_name: str | None = None, on_fatal: Callable[[BaseException], None] | None = None,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    """Build one app with its own engine and metrics registry.

    ``load_model`` (tests) replaces loading from ``settings.model``; ``on_fatal`` is called when the
    model fails to load or warm up (the CLI uses it to exit non-zero); ``on_ready`` once it has warmed up,
    just before it turns ready (the CLI freezes the heap: :func:`.cli.freeze_heap`).
    """
    settings = settings or ServeSettings()
    if load_model is None:
        load_model, default_name = _default_loader(settings)
        model_name = model_name or default_name
    metrics = ServiceMetrics(settings.max_batch_tokens)
    engine = Engine(settings, metrics, load_model, model_name=model_name or "model", on_ready=on_ready)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.startup = asyncio.create_task(engine.start())
        app.state.startup.add_done_callback(lambda t: _report_start(t, on_fatal))
        metrics_server = None
        if settings.metrics_port is not None:
            from prometheus_client import start_http_server

            metrics_server, _ = start_http_server(settings.metrics_port, addr=settings.host,
                                                  registry=metrics.registry)
        try:
            yield
        finally:
            engine.begin_drain()
            if not app.state.startup.done():
                app.state.startup.cancel()
            await asyncio.to_thread(engine.close, settings.drain_timeout)
            if metrics_server is not None:
                metrics_server.shutdown()

    app = FastAPI(title="yoso-serve", version=VERSION, lifespan=lifespan,
                  description="Embeddings and classification with YOSO-attention encoders.")
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.settings = settings
    _add_error_handlers(app)
    _add_routes(app, engine, metrics)
    add_tei_routes(app, engine)
    # after the routes: the edge sorts requests by what the app registered
    app.add_middleware(EdgeMiddleware, routes=RouteTable.of(app), payload_limit=settings.payload_limit,
                       api_key=settings.api_key.get_secret_value() if settings.api_key else None, metrics=metrics,
                       admit=engine.admit_now)
    app.openapi = deployment_openapi(app, engine)
    return app


def _report_start(task: asyncio.Task, on_fatal) -> None:
    if task.cancelled() or task.exception() is None:
        return
    if on_fatal is not None:
        on_fatal(task.exception())


_BRANCH = re.compile(r"[\w-]+\[.*\]")  # pydantic's name of one form of a union field


def _client_path(error: dict) -> list[str]:
    """An error's location as the client wrote it: without "body", our union tags (protocol.UNION_TAGS) and
    pydantic's names for the forms a field may take (``function-before[...]``, ``literal['auto']``)."""
    return [str(p) for p in error.get("loc", ()) if p != "body" and p not in UNION_TAGS
            and not (isinstance(p, str) and _BRANCH.fullmatch(p))]


def _message(error: dict) -> str:
    if error.get("type") == "string_pattern_mismatch":
        return PATTERN_MEANS.get((error.get("ctx") or {}).get("pattern"), error.get("msg"))
    return error.get("msg")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(_: Request, exc: ServiceError) -> Response:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
        if bad_json is not None:
            detail = (bad_json.get("ctx") or {}).get("error", "invalid JSON")
            return _error(MalformedRequest(f"malformed JSON body: {detail}", param="body"))
        if errors[0].get("type") == "missing" and tuple(errors[0].get("loc", ())) == ("body",):
            return _error(empty_body())
        loc = _client_path(errors[0])
        # a field that takes one of several forms fails once per form: say them together
        alike = [e for e in errors if _client_path(e) == loc]
        words = [_message(e) for e in alike]
        message = " or ".join([words[0], *(w.removeprefix("Input should be ") for w in words[1:])])
        more = f" (and {len(errors) - len(alike)} more)" if len(errors) > len(alike) else ""
        # param names the top-level field; the message the full path
        return _error(InvalidInput(f"{'.'.join(loc) or 'body'}: {message}{more}", param=loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return _error(NotFound("no such route; see /docs", code="not_found"))
        if exc.status_code == 405:  # RFC 9110: a 405 lists the methods the route does take
            allowed = sorted({m for r in request.app.router.routes if getattr(r, "methods", None)
                              and r.path_regex.match(request.url.path) for m in r.methods})
            return _error(MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}; "
                                           f"it takes {', '.join(allowed)}"), {"Allow": ", ".join(allowed)})
        if exc.status_code == 400:
            detail = str(exc.detail)
            if detail == "There was an error parsing the body":  # FastAPI's words for any failure but a syntax error
                detail = ("malformed JSON body: it could not be read (nested too deeply, a number over Python's "
                          "4300-digit limit, or not JSON)")
            return _error(MalformedRequest(detail, param="body"))
        response = _error(ServiceError(str(exc.detail), code=str(exc.status_code)))
        response.status_code = exc.status_code
        return response


# Probes and scrapers carry no key (docs/api.md): OpenAPI's "no security" on the operation, which
# the edge's RouteTable reads.
_OPEN = {"security": []}


def _add_routes(app: FastAPI, engine: Engine, metrics: ServiceMetrics) -> None:
    @app.post("/embed", response_model=list[list[float]], responses=_ERRORS)
    async def embed(body: EmbedRequest, request: Request) -> Response:
        out = await engine.embed(body.to_params(), _watch(request))
        return _json(out.value.tolist(), out.usage)

    @app.post("/embed_all", response_model=list[list[list[float]]], responses=_ERRORS)
    async def embed_all(body: EmbedAllRequest, request: Request) -> Response:
        out = await engine.embed_all(body.to_params(), _watch(request))
        return await json_response_off_loop(lambda: out.value, out.usage)  # arrays: encoded row by row

    @app.post("/embed_pieces", response_model=list[PiecedEmbedding], responses=_ERRORS)
    async def embed_pieces(body: EmbedPiecesRequest, request: Request) -> Response:
        out = await engine.embed_pieces(body.to_params(), _watch(request))
        return await json_response_off_loop(lambda: [
            {"embedding": vector,
             "pieces": [{"embedding": e, "tokens": list(t), "chars": list(c)} for e, t, c in zip(pieces, tokens, chars)]}
            for vector, pieces, tokens, chars in out.value], out.usage)

    @app.post("/classify", response_model=list[list[ScoredLabel]], responses=_ERRORS)
    async def classify(body: ClassifyRequest, request: Request) -> Response:
        out = await engine.classify(body.to_params(), _watch(request))
        return _json([[{"label": label, "score": score} for label, score in row] for row in out.value],
                     out.usage)

    @app.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, responses=_ERRORS)
    async def openai_embeddings(body: OpenAIEmbeddingRequest, request: Request) -> Response:
        with params_named(inputs="input"):
            out = await engine.embed(body.to_params(), _watch(request))
        if body.encoding_format == "base64":  # OpenAI's encoding: little-endian float32 bytes
            data = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in out.value]
        else:
            data = out.value.tolist()
        return _json({"object": "list", "model": body.model or engine.model_name,
                      "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                      "usage": {"prompt_tokens": out.usage.tokens, "total_tokens": out.usage.tokens}},
                     out.usage)

    @app.post("/tokenize", response_model=list[list[Token]], responses=_ERRORS, tags=[TOKENIZER_TAG])
    async def tokenize(body: TokenizeRequest) -> Response:
        tokens = await engine.tokenize(body.texts(), body.add_special_tokens)
        return await json_response_off_loop(lambda: tokens)

    @app.get("/info")
    async def info() -> Response:
        return _json({**engine.info(), "version": VERSION})

    # HEAD too: load balancers and uptime checkers probe with it
    @app.api_route("/health", methods=["GET", "HEAD"], responses={503: {"model": ErrorResponse}}, openapi_extra=_OPEN)
    async def health() -> Response:
        if engine.state == "failed":
            return _error(NotReady(f"model failed to load ({engine.failure})"))
        return _json({"status": "ok"})

    @app.api_route("/ready", methods=["GET", "HEAD"], responses={503: {"model": ErrorResponse}}, openapi_extra=_OPEN)
    async def ready() -> Response:
        if engine.state != "ready":
            return _error(NotReady(f"not ready: {engine.state}"))
        return _json({"status": "ready"})

    @app.get("/metrics", response_class=Response, openapi_extra=_OPEN,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics_route() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

