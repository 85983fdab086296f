"""text-embeddings-inference's routes with TEI's shapes, so a TEI deployment and its clients
(huggingface_hub's InferenceClient, LangChain's HuggingFaceEndpointEmbeddings) can switch to this one.

``POST /`` dispatches as TEI does: predictions for a model with a classification head, embeddings
otherwise, and sentence similarity for a body in that form; besides, the Inference API's zero-shot
body (huggingface_hub's zero_shot_classification) is answered as zero-shot /classify. /rerank scores
by embedding similarity (a bi-encoder: each text is one pass, chunked past the max length if asked),
not with a cross-encoder.
"""

from __future__ import annotations

import json

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from .engine import Engine
from .errors import InvalidInput, MalformedRequest, NotReady, empty_body
from .middleware import TOKENIZER_TAG
from .protocol import (DecodeRequest, EmbedRequest, PredictRequest, Rank, RerankRequest, ScoredLabel,
                       SimilarityRequest, ZeroShotRequest)
from .responses import ERRORS, json_response, params_named, watch
from .zero_shot import calibrated

# The bodies POST / takes; /openapi.json narrows them to the loaded model's (see schema.py).
ROOT_BODIES = (EmbedRequest, SimilarityRequest, PredictRequest, ZeroShotRequest)


def has_head(engine: Engine) -> bool | None:
    """Whether the served model has a classification head; None until it is loaded."""
    return None if engine.model is None else bool(engine.model.has_classifier)


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _loads(body: bytes):
    """The body's JSON, or a 400 naming what is wrong with it (worded as the app's handler words it)."""
    if not body.strip():
        raise empty_body()
    try:
        return json.loads(body)
    except RecursionError:
        raise MalformedRequest("malformed JSON body: nested too deeply to read", param="body") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, and a number over Python's digit limit
        raise MalformedRequest(f"malformed JSON body: {exc}", param="body") from None


def _validate(data, model: type[BaseModel]) -> BaseModel:
    """Validate a body read by hand the way FastAPI validates declared ones (same 422 answers)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def _root_kind(data, head: bool) -> type[BaseModel]:
    """Which body POST / got, by the shape of its JSON."""
    data = data if isinstance(data, dict) else {}
    parameters = data.get("parameters")
    if isinstance(parameters, dict) and "candidate_labels" in parameters:
        return ZeroShotRequest
    if head:
        return PredictRequest
    return SimilarityRequest if isinstance(data.get("inputs"), dict) else EmbedRequest


def _predictions(rows: list[list[tuple[str, float]]], top_k: int | None) -> list[list[dict]]:
    return [[{"score": score, "label": label} for label, score in row[:top_k]] for row in rows]


def add_tei_routes(app: FastAPI, engine: Engine) -> None:
    async def predict(body: PredictRequest, request: Request) -> Response:
        if has_head(engine) is False:
            raise InvalidInput("this model has no classification head, so it has nothing to predict; "
                               "use /classify with labels (zero-shot) or /rerank", param="inputs")
        out = await engine.classify(body.to_params(), watch(request))
        rows = _predictions(out.value, body.parameters.top_k if body.parameters else None)
        # TEI answers a single text with one list; the Inference API form (with parameters), as a batch
        single = isinstance(body.inputs, str) and body.parameters is None
        return json_response(rows[0] if single else rows, out.usage)

    async def similarity(body: SimilarityRequest, request: Request) -> Response:
        try:
            out = await engine.embed(body.params(), watch(request))
        except InvalidInput as exc:  # the engine numbers the source sentence input 0
            if exc.index is not None:
                exc.name_input("inputs.source_sentence" if exc.index == 0 else f"inputs.sentences.{exc.index - 1}")
            raise
        return json_response([float(s) for s in out.value[1:] @ out.value[0]], out.usage)

    async def embed(body: EmbedRequest, request: Request) -> Response:
        out = await engine.embed(body.to_params(), watch(request))
        return json_response(out.value.tolist(), out.usage)

    async def zero_shot(body: ZeroShotRequest, request: Request) -> Response:
        params = body.to_params()
        with params_named(labels="parameters.candidate_labels"):
            out = await engine.classify(params, watch(request))
        names = dict(zip(params.labels, body.parameters.candidate_labels))  # templated → as sent
        return json_response([{"label": names[label], "score": score} for label, score in out.value[0]], out.usage)

    @app.post("/", response_model=list[list[float]] | list[float] | list[ScoredLabel] | list[list[ScoredLabel]],
              responses=ERRORS, openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": {"oneOf": [_ref(m) for m in ROOT_BODIES]}}}}})
    async def root(request: Request) -> Response:
        """TEI's default route: /predict for a classifier, else /embed, or /similarity for
        ``{"inputs": {"source_sentence", "sentences"}}``; and the Inference API's zero-shot
        classification for ``{"inputs", "parameters": {"candidate_labels"}}`` on any model."""
        raw = await request.body()
        head = has_head(engine)
        if head is None:  # the body's form depends on the model
            raise NotReady(f"not ready ({engine.state}); retry later or on another replica")
        data = _loads(raw)  # parsed once: its shape picks the body, which then validates it
        kind = _root_kind(data, head)
        if kind is ZeroShotRequest:
            return await zero_shot(_validate(data, ZeroShotRequest), request)
        if kind is PredictRequest:
            return await predict(_validate(data, PredictRequest), request)
        if kind is SimilarityRequest:
            return await similarity(_validate(data, SimilarityRequest), request)
        return await embed(_validate(data, EmbedRequest), request)

    app.post("/predict", response_model=list[ScoredLabel] | list[list[ScoredLabel]], responses=ERRORS,
             summary="Predict (TEI)")(predict)
    app.post("/similarity", response_model=list[float], responses=ERRORS, summary="Similarity (TEI)")(similarity)

    @app.post("/rerank", response_model=list[Rank], responses=ERRORS, response_model_exclude_none=True)
    async def rerank(body: RerankRequest, request: Request) -> Response:
        """Texts ranked by cosine similarity to the query, best first: of each text's embedding, or with
        ``piece_tokens`` of its best piece (named in the answer)."""
        query_params, text_params = body.params()
        with params_named(inputs="texts"):  # refused before the query runs, as a request, not half-way
            await engine.check_all(text_params)
        with params_named(inputs="query"):
            query = await engine.embed(query_params, watch(request))
        q = query.value[0]
        with params_named(inputs="texts"):
            if body.piece_tokens is None:
                texts = await engine.embed(text_params, watch(request))
                cosines, best = texts.value @ q, None
            else:
                texts = await engine.embed_pieces(text_params, watch(request))
                sims = [pieces @ q for _, pieces, _, _ in texts.value]
                best = [int(np.argmax(s)) for s in sims]
                cosines = np.array([s[b] for s, b in zip(sims, best)])
        scores = cosines if body.raw_scores else calibrated(cosines, engine.score_center)

        def rank(i: int) -> dict:
            out = {"index": i, "score": float(scores[i]), **({"text": body.texts[i]} if body.return_text else {})}
            if best is not None:
                _, _, tokens, chars = texts.value[i]
                out["piece"] = {"tokens": list(tokens[best[i]]), "chars": list(chars[best[i]])}
            return out

        ranks = [rank(i) for i in np.argsort(-scores, kind="stable").tolist()]
        usage = texts.usage
        usage.tokens += query.usage.tokens
        usage.inference_ms += query.usage.inference_ms
        return json_response(ranks, usage)

    @app.post("/decode", response_model=list[str], responses=ERRORS, tags=[TOKENIZER_TAG])
    async def decode(body: DecodeRequest) -> Response:
        """Token ids back to text (the inverse of /tokenize)."""
        return json_response(await engine.decode(body.batch(), body.skip_special_tokens))
