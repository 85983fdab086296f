"""The served /openapi.json: the protocol models' schema plus this deployment's limits.

The fixed rules are the pydantic models' own. What depends on the settings or on the loaded model
(inputs per request, hash range, hidden size, input length, vocabulary, whether a classification head
exists) is checked by the engine and written in here, so that what validation rejects, the schema
rejects too.
Until the model is loaded only the settings are known; the document is cached once it is.
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .engine import Engine
from .tei import ROOT_BODIES

# Request fields that hold one entry per input, so max_client_batch_size bounds them.
BATCH_FIELDS = ("inputs", "input", "texts", "labels", "candidate_labels", "ids")


def _branches(prop: dict) -> list[dict]:
    """The alternatives of a property's schema (itself when it has none)."""
    return prop.get("oneOf") or prop.get("anyOf") or [prop]


def _limit_batches(props: dict, name: str, batch: int) -> None:
    for branch in _branches(props[name]):
        if branch.get("type") != "array":
            continue
        # a single token-id list is one input, however long; only a list of them is a batch
        if name != "ids" or branch["items"].get("type") == "array":
            branch["maxItems"] = batch


def _limit_ids(props: dict, vocab: int) -> None:
    for branch in _branches(props["ids"]):
        items = branch["items"]
        (items["items"] if items.get("type") == "array" else items)["maximum"] = vocab - 1


def _add_root_bodies(schemas: dict) -> None:
    """POST / reads its body by hand, so FastAPI lists only the bodies other routes declare too."""
    for body in ROOT_BODIES:
        if body.__name__ not in schemas:
            schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[body.__name__] = schema


def tailor(doc: dict, engine: Engine) -> dict:
    """Write the deployment's limits into ``doc`` (an OpenAPI document of this app), in place."""
    s, model = engine.settings, engine.model
    schemas = doc["components"]["schemas"]
    _add_root_bodies(schemas)
    for name, schema in schemas.items():
        props = schema.get("properties", {})
        for field in BATCH_FIELDS:
            if field in props:
                _limit_batches(props, field, s.max_client_batch_size)
        if "hashes" in props:
            hashes = props["hashes"]["anyOf"][0]
            hashes["maximum"] = s.max_hashes
            fixed = None if model is None else model.fixed_hashes
            if model is not None and model.config.attention_type != "yoso":
                del props["hashes"]  # no hash count to set (additionalProperties is false)
            elif fixed is not None:
                hashes["minimum"] = hashes["maximum"] = fixed
        if model is None:
            continue
        if "dimensions" in props:
            props["dimensions"]["anyOf"][0]["maximum"] = model.config.hidden_size
        if "piece_tokens" in props:
            props["piece_tokens"]["anyOf"][0]["maximum"] = engine.max_length
        if "ids" in props:
            _limit_ids(props, model.tokenizer.vocab_size)
    if "SimilarityInput" in schemas:  # the source sentence is one of the request's inputs
        schemas["SimilarityInput"]["properties"]["sentences"]["maxItems"] = s.max_client_batch_size - 1
    if model is not None:
        _tailor_to_head(doc, bool(model.has_classifier))
    return doc


def _tailor_to_head(doc: dict, head: bool) -> None:
    schemas = doc["components"]["schemas"]
    body = doc["paths"]["/"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    wanted = {"ZeroShotRequest", *(["PredictRequest"] if head else ["EmbedRequest", "SimilarityRequest"])}
    body["oneOf"] = [b for b in body["oneOf"] if b["$ref"].rsplit("/", 1)[1] in wanted]
    if not head:
        # no head: /classify needs labels, and /predict has nothing to answer with
        classify = schemas["ClassifyRequest"]
        classify["required"] = [*classify.get("required", []), "labels"]
        labels = classify["properties"]["labels"]
        classify["properties"]["labels"] = {**labels["anyOf"][0], "description": labels["description"]}
        doc["paths"].pop("/predict", None)


def deployment_openapi(app: FastAPI, engine: Engine) -> Callable[[], dict]:
    """A replacement for ``app.openapi``: built per call until the model is loaded, then cached."""
    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = tailor(get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes), engine)
        if engine.model is not None:
            app.openapi_schema = doc
        return doc

    return openapi
