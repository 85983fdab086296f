"""Every error status in the one error shape, in-process against a tiny model."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time

import pytest

from yoso_serve.model import load_pretrained
from yoso_serve.service import EmbedParams, ServeSettings, create_app
from yoso_serve.service.errors import ClientGone
from yoso_serve.service.middleware import EdgeMiddleware

SHAPE = {"message", "type", "param", "code"}


def error_of(r, status):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == SHAPE
    return body["error"]


def embed_scope(*headers: tuple[bytes, bytes]) -> dict:
    """The ASGI scope of a JSON POST /embed, for tests that play the client's side of the protocol by hand."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/embed", "raw_path": b"/embed", "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), *headers], "client": ("127.0.0.1", 1),
            "server": ("test", 80)}


def slow_loader(path, delay: float = 0.3, *, fail: bool = False, gate: threading.Event | None = None,
                started: threading.Event | None = None):
    """The real tiny model with a forward that takes ``delay`` s (or raises), to fill the queue on purpose;
    ``started`` is set as each forward begins."""
    def load():
        if gate is not None:
            gate.wait(10)
        model = load_pretrained(path)
        real = model.embed
        calls = itertools.count()

        def embed(*args, **kw):
            if fail and next(calls) >= 2:  # the two warm-up batches pass, requests fail
                raise RuntimeError("secret internal detail /srv/weights")
            if started is not None:
                started.set()
            time.sleep(delay)
            return real(*args, **kw)

        model.embed = embed
        return model

    return load


def test_400_malformed_json_and_404_405(tiny_dir, serve, metric):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            bad = await c.post("/embed", content=b'{"inputs": ["a",', headers={"content-type": "application/json"})
            bad_root = await c.post("/", content=b'{"inputs": ["a",', headers={"content-type": "application/json"})
            methods = {(verb, path): await c.request(verb, path)
                       for verb, path in [("GET", "/embed"), ("PUT", "/"), ("TRACE", "/rerank"), ("POST", "/health")]}
            missing = await c.get("/nope")
            reasons = {code: metric(c, "yoso_failures_total", reason=code)
                       for code in ("bad_request", "not_found", "method_not_allowed")}
            return bad, bad_root, missing, methods, reasons

    bad, bad_root, missing, methods, reasons = asyncio.run(main())
    # the failures metric counts each under the code its error body carries
    assert reasons == {error_of(bad, 400)["code"]: 2, error_of(missing, 404)["code"]: 1,
                       error_of(methods["GET", "/embed"], 405)["code"]: 4}
    assert "malformed JSON" in error_of(bad, 400)["message"]
    assert "malformed JSON" in error_of(bad_root, 400)["message"]
    assert error_of(missing, 404)["code"] == "not_found"
    allowed = {("GET", "/embed"): "POST", ("PUT", "/"): "POST", ("TRACE", "/rerank"): "POST",
               ("POST", "/health"): "GET, HEAD"}
    for (verb, path), r in methods.items():  # RFC 9110: a 405 carries Allow
        err = error_of(r, 405)
        assert err["code"] == "method_not_allowed" and f"{verb} is not allowed on {path}" in err["message"]
        assert r.headers["allow"] == allowed[verb, path]


def test_routes_are_sorted_by_what_the_app_registers(tiny_dir):
    """Work routes (in flight, deadline header) and open routes (no key), as the README and docs/api.md
    list them, are exactly what the app's registered routes give."""
    app = create_app(ServeSettings(model=tiny_dir, runtime="torch"))
    table = next(m.kwargs["routes"] for m in app.user_middleware if m.cls is EdgeMiddleware)
    assert table.work == {"/embed", "/embed_all", "/embed_pieces", "/classify", "/v1/embeddings", "/tokenize", "/", "/predict",
                          "/rerank", "/similarity", "/decode"}
    assert table.open == {"/health", "/ready", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc",
                          "/openapi.json"}
    assert table.known == table.work | table.open | {"/info"}


def test_401_without_or_with_wrong_key_and_open_probes(tiny_dir, serve):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16, api_key="s3cret-key") as c:
            body = {"inputs": "hi"}
            return {"none": await c.post("/embed", json=body),
                    "wrong": await c.post("/embed", json=body, headers={"authorization": "Bearer nope"}),
                    "basic": await c.post("/embed", json=body, headers={"authorization": "Basic s3cret-key"}),
                    "good": await c.post("/embed", json=body, headers={"authorization": "Bearer s3cret-key"}),
                    "info": await c.get("/info"),
                    "root": await c.post("/", json=body),
                    "rerank": await c.post("/rerank", json={"query": "q", "texts": ["a"]}),
                    **{p: await c.get(p) for p in ("/health", "/ready", "/metrics")}}

    r = asyncio.run(main())
    for key in ("none", "wrong", "basic", "info", "root", "rerank"):
        assert error_of(r[key], 401)["type"] == "authentication_error"
        assert r[key].headers["www-authenticate"] == "Bearer"
    assert r["good"].status_code == 200
    assert all(r[p].status_code == 200 for p in ("/health", "/ready", "/metrics"))
    assert "s3cret-key" not in r["/metrics"].text and "s3cret-key" not in r["none"].text


def test_413_by_content_length_and_by_chunked_body(tiny_dir, serve):
    big = b'{"inputs": "' + b"x" * 5000 + b'"}'

    async def chunks():
        for i in range(0, len(big), 500):
            yield big[i:i + 500]

    async def main():
        async with serve(tiny_dir, chunk_overlap=16, payload_limit=1000) as c:
            sized = await c.post("/embed", content=big, headers={"content-type": "application/json"})
            chunked = await c.post("/embed", content=chunks(), headers={"content-type": "application/json"})
            small = await c.post("/embed", json={"inputs": "x" * 100})
            return sized, chunked, small

    sized, chunked, small = asyncio.run(main())
    assert "payload_limit (1000 bytes)" in error_of(sized, 413)["message"]
    assert error_of(chunked, 413)["code"] == "payload_too_large"
    assert small.status_code == 200


@pytest.mark.parametrize("path,body,param,words", [
    ("/embed", {"inputs": []}, "inputs", "at least 1 item"),
    ("/embed", {"inputs": ["ok", ""]}, "inputs", "inputs.1: String should have at least 1 character"),
    ("/embed", {"inputs": ["a"] * 5}, "inputs", "max_client_batch_size 4"),
    ("/embed", {"inputs": "word " * 100, "long_input": "error"}, "inputs", "limit of 64"),
    ("/embed", {"inputs": "word " * 100, "truncate": False}, "inputs", "limit of 64"),
    ("/embed", {"inputs": "hi", "hashes": 17}, "hashes", "[0, 16]"),
    ("/embed", {"inputs": "hi", "hashes": -1}, "hashes", "greater than or equal to 0"),
    ("/embed", {"inputs": "hi", "pooling": "max"}, "pooling", "mean"),
    ("/embed", {"inputs": 3}, "inputs", "string"),
    ("/embed", {"text": "hi"}, "inputs", "required"),
    ("/embed_all", {"inputs": "hi", "long_input": "chunk"}, "long_input", "truncate"),
    ("/embed_pieces", {"inputs": "hi", "long_input": "chunk"}, "long_input", "truncate"),
    ("/embed_pieces", {"inputs": "hi", "piece_tokens": 0}, "piece_tokens", "greater than or equal to 1"),
    ("/embed_pieces", {"inputs": "hi", "piece_tokens": 65}, "piece_tokens", "[1, 64] (the model's input length)"),
    ("/embed_pieces", {"inputs": "word " * 100, "truncate": False}, "inputs", "limit of 64"),
    ("/embed_pieces", {"inputs": ["a"] * 5}, "inputs", "max_client_batch_size 4"),
    ("/classify", {"inputs": "hi"}, "labels", "no classification head"),
    ("/classify", {"inputs": "hi", "labels": []}, "labels", "at least 1 item"),
    ("/classify", {"inputs": "hi", "labels": ["a", " \x1c"]}, "labels",
     "labels.1: String should contain a character that is not blank"),
    ("/", {"inputs": "hi", "parameters": {"candidate_labels": ["a"], "hypothesis_template": "no slot"}},
     "parameters", "parameters.hypothesis_template: String should contain {}"),
    # a field of several forms: each form's words once, pydantic's names for the forms left out
    ("/embed", {"inputs": "hi", "hashes": "AUTO"}, "hashes", "hashes: Input should be a valid integer or 'auto'"),
    ("/embed", {"inputs": "hi", "hashes": 4.5}, "hashes", "hashes: Input should be a valid integer or 'auto'"),
    ("/embed", {"inputs": "hi", "hashes": -2}, "hashes",
     "hashes: Input should be greater than or equal to 0 or 'auto'"),
    # the field as the route's body names it
    ("/v1/embeddings", {"input": ["a"] * 5}, "input", "max_client_batch_size 4"),
    ("/", {"inputs": "hi", "parameters": {"candidate_labels": list("abcde")}}, "parameters.candidate_labels",
     "5 labels is above max_client_batch_size 4"),
    # over the input length with truncation off: the way out the route offers
    ("/embed", {"inputs": "word " * 100, "truncate": False}, "inputs", "or send long_input='chunk'"),
    ("/rerank", {"query": "q", "texts": ["word " * 100], "long_input": "error"}, "texts",
     "or send long_input='chunk'"),
    ("/classify", {"inputs": "hi", "labels": ["a", "a"]}, "labels", "distinct"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
    ("/tokenize", {"inputs": []}, "inputs", "at least 1 item"),
    ("/embed", {"inputs": "hi", "dimensions": 33}, "dimensions", "[1, 32]"),
    ("/predict", {"inputs": "hi"}, "inputs", "no classification head"),
    ("/predict", {"inputs": ["a", "b"]}, "inputs", "need a cross-encoder"),
    ("/", {"inputs": {"source_sentence": "a", "sentences": []}}, "inputs", "inputs.sentences: List should have at least 1"),
    ("/", {"inputs": "hi", "raw_scores": True}, "raw_scores", "Extra inputs are not permitted"),
    ("/rerank", {"query": "q", "texts": ["a"] * 5}, "texts", "max_client_batch_size 4"),
    ("/rerank", {"query": "word " * 100, "texts": ["a"], "truncate": False}, "query", "limit of 64"),
    ("/rerank", {"query": "", "texts": ["a"]}, "query", "at least 1 character"),
    ("/rerank", {"query": "q", "texts": ["word " * 100], "long_input": "error"}, "texts", "limit of 64"),
    ("/rerank", {"query": "q", "texts": ["a"], "piece_tokens": 65}, "piece_tokens", "[1, 64]"),
    ("/rerank", {"query": "q", "texts": ["a"], "piece_tokens": 0}, "piece_tokens", "greater than or equal to 1"),
    ("/rerank", {"query": "q", "texts": ["a"], "piece_tokens": 8, "long_input": "chunk"}, "long_input",
     "only for pooled embeddings"),
    ("/decode", {"ids": [[1], [1], [1], [1], [1]]}, "ids", "max_client_batch_size 4"),
    ("/decode", {"ids": [5, 10 ** 6]}, "ids", "[0, 30522)"),
    ("/decode", {"ids": [[1], []]}, "ids", "ids.1: List should have at least 1 item"),
])
def test_422_names_the_field_and_the_limit(tiny_dir, serve, path, body, param, words):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16, max_client_batch_size=4, max_hashes=16) as c:
            return await c.post(path, json=body)

    err = error_of(asyncio.run(main()), 422)
    assert err["param"] == param and words in err["message"], err
    assert "function-before" not in err["message"] and "literal[" not in err["message"], err


@pytest.mark.parametrize("path,body", [
    ("/embed_all", {"inputs": "word " * 100, "long_input": "error"}),
    ("/embed_pieces", {"inputs": "word " * 100, "truncate": False}),
    ("/classify", {"inputs": "word " * 100, "labels": ["a"], "truncate": False}),
    ("/similarity", {"inputs": {"source_sentence": "word " * 100, "sentences": ["a"]}, "parameters": {"truncate": False}}),
    ("/rerank", {"query": "q", "texts": ["word " * 100], "truncate": False, "piece_tokens": 8}),
])
def test_over_length_error_offers_only_what_the_route_takes(tiny_dir, serve, path, body):
    """Routes that cannot chunk (whole-input outputs, pieces, fields without long_input) do not suggest it."""
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            return await c.post(path, json=body)

    message = error_of(asyncio.run(main()), 422)["message"]
    assert "limit of 64 (the model's input length)" in message and "allow truncation" in message, message
    assert "chunk" not in message, message


def test_similarity_names_the_over_length_sentence_as_its_body_does(tiny_dir, serve):
    """The engine numbers the source sentence input 0; /similarity's client wrote it apart from the rest."""
    long, off = "word " * 100, {"truncate": False}

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            return [await c.post("/similarity", json={"inputs": body, "parameters": off}) for body in (
                {"source_sentence": long, "sentences": ["a"]}, {"source_sentence": "a", "sentences": ["b", long]})]

    source, second = (error_of(r, 422) for r in asyncio.run(main()))
    assert source["message"].startswith("inputs.source_sentence has 102 tokens"), source
    assert second["message"].startswith("inputs.sentences.1 has 102 tokens"), second
    assert source["param"] == second["param"] == "inputs"


def test_vectors_per_answer_are_capped_at_max_batch_tokens(tiny_dir, serve):
    """/embed_all answers a vector per token and /embed_pieces one per piece: a request may ask for one full
    batch's worth (max_batch_tokens), so one legal request cannot build gigabytes of JSON."""
    text = "word " * 40  # 42 tokens with the specials

    async def main():
        async with serve(tiny_dir, chunk_overlap=16, max_batch_tokens=64) as c:
            return (await c.post("/embed_all", json={"inputs": [text, text]}),
                    await c.post("/embed_pieces", json={"inputs": [text, text], "piece_tokens": 1}),
                    await c.post("/embed_pieces", json={"inputs": [text, text], "piece_tokens": 8}),
                    await c.post("/embed_all", json={"inputs": text}))

    states, small_pieces, pieces, one = asyncio.run(main())
    err = error_of(states, 422)
    assert err["param"] == "inputs" and "84 vectors (one per token), above max_batch_tokens (64)" in err["message"], err
    assert "84 vectors (one per 1-token piece), above max_batch_tokens (64)" in error_of(small_pieces, 422)["message"]
    assert pieces.status_code == 200 and len(pieces.json()[0]["pieces"]) == 6  # 12 pieces in all
    assert one.status_code == 200 and len(one.json()[0]) == 42


def test_rerank_refuses_a_bad_texts_field_before_the_query_runs(tiny_dir, serve, metric):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            query = "word " * 50
            before = metric(c, "yoso_tokens_processed_total")  # the warm-up's
            bad = [await c.post("/rerank", json={"query": query, "texts": ["a"], "piece_tokens": 65}),
                   await c.post("/rerank", json={"query": query, "texts": ["a"] * 65}),
                   await c.post("/rerank", json={"query": query, "texts": ["a"], "piece_tokens": 8,
                                                 "long_input": "chunk"}),
                   # over the input length with truncation off: known only once tokenised, still before the query
                   await c.post("/rerank", json={"query": query, "texts": ["a", "word " * 100], "long_input": "error"}),
                   await c.post("/rerank", json={"query": query, "texts": ["word " * 100], "truncate": False,
                                                 "piece_tokens": 8})]
            return bad, metric(c, "yoso_tokens_processed_total") - before

    bad, tokens = asyncio.run(main())
    assert [r.status_code for r in bad] == [422] * 5
    assert "input 1 has 102 tokens" in error_of(bad[3], 422)["message"] and error_of(bad[3], 422)["param"] == "texts"
    assert tokens == 0  # the query was never run


@pytest.mark.parametrize("path", ["/", "/embed", "/similarity"])
@pytest.mark.parametrize("raw,words", [
    (b'{"inputs":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"inputs": "x", "hashes": ' + b"1" * 5000 + b"}", "4300"),
])
def test_unreadable_json_is_a_400_on_every_route(tiny_dir, serve, path, raw, words):
    """Nesting past the parser's recursion limit and integers past Python's digit limit: a 400 that says
    so, on the routes FastAPI parses and on /, which parses by hand."""
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            return await c.post(path, content=raw, headers={"content-type": "application/json"})

    err = error_of(asyncio.run(main()), 400)
    assert err["param"] == "body" and words in err["message"], err


def test_a_body_cut_short_by_a_disconnect_is_a_499_and_runs_nothing(tiny_dir, serve, metric):
    """The client sends part of the body and leaves: what came is not parsed as if it were the request."""
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            app, before = c.app, metric(c, "yoso_tokens_processed_total")  # the warm-up's
            sent = []
            messages = iter([{"type": "http.request", "body": b'{"inputs": "abc"}', "more_body": True},
                             {"type": "http.disconnect"}])

            async def receive():
                return next(messages, {"type": "http.disconnect"})

            async def send(message):
                sent.append(message)

            await app(embed_scope((b"content-length", b"100")), receive, send)
            return sent, metric(c, "yoso_requests_total", route="/embed", status="499"), \
                metric(c, "yoso_tokens_processed_total") - before

    sent, closed, tokens = asyncio.run(main())
    assert sent[0]["status"] == 499 and closed == 1 and tokens == 0


def test_429_when_the_queue_is_full_with_retry_after(tiny_dir, serve, metric):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16, load_model=slow_loader(tiny_dir, 0.3),
                         max_batch_requests=1, max_queue_tokens=20) as c:
            rs = await asyncio.gather(*(c.post("/embed", json={"inputs": "one two three four five six"})
                                        for _ in range(6)))
            return rs, metric(c, "yoso_failures_total", reason="overloaded"), metric(
                c, "yoso_rejections_total", reason="queue_full")

    rs, overloaded, queue_full = asyncio.run(main())
    statuses = sorted(r.status_code for r in rs)
    assert 200 in statuses and 429 in statuses and set(statuses) <= {200, 429}
    refused = [r for r in rs if r.status_code == 429]
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert "max_queue_tokens=20" in error_of(refused[0], 429)["message"]
    assert {r.json()["error"]["code"] for r in refused} <= {"queue_full", "predicted_wait"}
    assert overloaded == len(refused) and queue_full >= 1


def root_bodies(doc: dict) -> int:
    return len(doc["paths"]["/"]["post"]["requestBody"]["content"]["application/json"]["schema"]["oneOf"])


def test_503_while_loading_and_while_draining(tiny_dir, serve):
    gate = threading.Event()

    async def main():
        async with serve(tiny_dir, wait_ready=False, chunk_overlap=16,
                         load_model=slow_loader(tiny_dir, 0.0, gate=gate)) as c:
            loading = [await c.get("/ready"), await c.post("/embed", json={"inputs": "hi"}), await c.get("/health")]
            info_loading = await c.get("/info")
            tei = [await c.post(path, json=body) for path, body in [
                ("/", {"inputs": "hi"}), ("/rerank", {"query": "q", "texts": ["a"]}), ("/decode", {"ids": [101]})]]
            early_doc = (await c.get("/openapi.json")).json()
            gate.set()
            await c.app.state.startup
            ready = await c.get("/ready")
            late_doc = (await c.get("/openapi.json")).json()
            c.app.state.engine.begin_drain()
            draining = [await c.get("/ready"), await c.post("/embed", json={"inputs": "hi"}), await c.get("/health")]
            return loading, info_loading, tei, early_doc, late_doc, ready, draining

    loading, info_loading, tei, early_doc, late_doc, ready, draining = asyncio.run(main())
    assert "loading" in error_of(loading[0], 503)["message"] and error_of(loading[1], 503)["code"] == "not_ready"
    # /info answers while loading; what depends on the device is not known yet
    assert info_loading.status_code == 200 and info_loading.json()["state"] == "loading"
    assert info_loading.json()["limits"]["max_padding_tokens"] is None
    assert all(error_of(r, 503)["code"] == "not_ready" for r in tei)
    # /openapi.json knows the model's limits only once it is loaded (and is not cached before)
    assert root_bodies(early_doc) == 4 and "/predict" in early_doc["paths"]
    assert root_bodies(late_doc) == 3 and "/predict" not in late_doc["paths"]
    assert loading[2].status_code == 200 and ready.status_code == 200
    assert "draining" in error_of(draining[0], 503)["message"]
    assert "shutting down" in error_of(draining[1], 503)["message"]
    assert draining[2].status_code == 200  # liveness is not readiness


def test_a_drain_serves_what_arrived_before_it_and_refuses_what_comes_after(tiny_dir, serve):
    # A request the server took in before SIGTERM (here still sending its body when the drain begins) is
    # accepted and must be answered 200, not 503; one that arrives after the drain began gets 503.
    body_half = asyncio.Event()

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            async def slow_body():
                yield b'{"inputs": ["taken in before'
                body_half.set()
                await asyncio.sleep(0.2)  # the drain begins meanwhile
                yield b' the drain", "and served"]}'

            early = asyncio.create_task(c.post("/embed", content=slow_body(),
                                               headers={"content-type": "application/json"}))
            await body_half.wait()
            c.app.state.engine.begin_drain()
            late = await c.post("/embed", json={"inputs": "too late"})
            return await early, late

    early, late = asyncio.run(main())
    assert early.status_code == 200, early.text
    assert len(early.json()) == 2
    assert "shutting down" in error_of(late, 503)["message"]


@pytest.mark.parametrize("first_hashes", [None, 4, 0])
def test_429_at_once_when_predicted_late_and_504_when_nothing_could_predict_it(tiny_dir, serve, metric,
                                                                                first_hashes):
    # The first input holds the model for 0.4 s; the second's deadline is 0.1 s. At the served hash
    # count the warm-up's speed probe (as long as the first input: the tiny model's 64 tokens, also
    # 0.4 s) measured the speed, so the second is refused at once; so it is behind an LSH count never run
    # before (4), predicted at the served count's speed. Behind exact mode never run before (0) there is
    # nothing to predict from: it is queued and outlives its deadline.
    started = threading.Event()

    async def main():
        async with serve(tiny_dir, chunk_overlap=16, load_model=slow_loader(tiny_dir, 0.4, started=started),
                         max_batch_requests=1, request_timeout=0.1) as c:
            started.clear()  # the warm-up's forwards set it
            first = asyncio.create_task(c.post("/embed", json={"inputs": "first " * 70, "hashes": first_hashes}))
            assert await asyncio.to_thread(started.wait, 10)  # the first holds the model: no race with a sleep
            late = await c.post("/embed", json={"inputs": "second one waits"})
            return (await first, late, metric(c, "yoso_failures_total", reason="deadline_exceeded"),
                    metric(c, "yoso_rejections_total", reason="predicted_wait"))

    first, late, deadline, rejected = asyncio.run(main())
    assert first.status_code == 200
    if first_hashes != 0:
        err = error_of(late, 429)
        assert err["code"] == "predicted_wait" and "deadline of 0.10 s" in err["message"]
        assert int(late.headers["retry-after"]) >= 1 and rejected == 1 and deadline == 0
    else:
        assert "request_timeout" in error_of(late, 504)["message"] and deadline == 1 and rejected == 0


def test_500_is_sanitised_and_the_traceback_goes_to_the_log(tiny_dir, serve, caplog):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16, load_model=slow_loader(tiny_dir, 0.0, fail=True)) as c:
            return await c.post("/embed", json={"inputs": "this input makes the forward fail"})

    with caplog.at_level(logging.ERROR, logger="yoso_serve.service"):
        r = asyncio.run(main())
    err = error_of(r, 500)
    assert "secret" not in r.text and "Traceback" not in r.text and err["code"] == "internal"
    assert any("secret internal detail" in (rec.exc_text or "") for rec in caplog.records)
    assert not any("makes the forward fail" in rec.getMessage() for rec in caplog.records)  # texts not logged


def test_a_disconnected_clients_inputs_are_dropped_not_run(tiny_dir, serve, metric):
    ran = []

    def load():
        model = slow_loader(tiny_dir, 0.3)()
        inner = model.embed
        model.embed = lambda ids, *a, **kw: (ran.append(ids.shape[0]), inner(ids, *a, **kw))[1]
        return model

    async def main():
        async with serve(tiny_dir, chunk_overlap=16, load_model=load, max_batch_requests=1) as c:
            engine = c.app.state.engine
            ran.clear()
            busy = asyncio.create_task(engine.embed(EmbedParams(["keeps the worker busy"])))
            await asyncio.sleep(0.05)

            async def gone_now():
                await asyncio.sleep(0.01)

            with pytest.raises(ClientGone):
                await engine.embed(EmbedParams(["nobody will read this", "nor this"]), gone_now)
            await busy
            await asyncio.sleep(0.1)
            return metric(c, "yoso_failures_total", reason="client_disconnected")

    dropped = asyncio.run(main())
    assert ran == [1] and dropped == 2


def test_500_from_a_route_bug_is_caught_at_the_edge(tiny_dir, serve, caplog, metric):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            async def broken(*_, **__):
                raise KeyError("secret route detail")

            c.app.state.engine.tokenize = broken
            r = await c.post("/tokenize", json={"inputs": "hi"})
            return r, metric(c, "yoso_failures_total", reason="internal")

    with caplog.at_level(logging.ERROR, logger="yoso_serve.service"):
        r, internal = asyncio.run(main())
    assert error_of(r, 500)["code"] == "internal" and "secret" not in r.text and internal == 1
    assert r.headers["x-request-id"]
    assert any("secret route detail" in (rec.exc_text or "") for rec in caplog.records)


def test_embed_pieces_on_a_model_that_pools_its_first_token_is_a_clear_422(tiny_dir, tmp_path, serve):
    """Pieces are means of token states: a CLS-pooled model has none to offer, and says where to go."""
    from yoso_serve.model import load_pretrained, save_pretrained

    model = load_pretrained(tiny_dir)
    model.config.pooling = "cls"
    cls_dir = save_pretrained(model, tmp_path / "cls")

    async def main():
        async with serve(cls_dir, chunk_overlap=16) as c:
            return await c.post("/embed_pieces", json={"inputs": "hi"}), await c.post("/embed", json={"inputs": "hi"})

    pieces, embed = asyncio.run(main())
    err = error_of(pieces, 422)
    assert "pools by its first token" in err["message"] and "/embed" in err["message"]
    assert embed.status_code == 200  # the model still serves everything else


def test_large_answers_are_built_off_the_event_loop():
    """/embed_all's and /embed_pieces' answers (a vector per token or piece, up to max_batch_tokens of them)
    become lists and JSON on a worker thread: on the loop they would stall /health and every other request."""
    from yoso_serve.service.responses import json_response_off_loop

    async def main():
        loop_thread = threading.get_ident()
        seen = []

        def build():
            seen.append(threading.get_ident())
            return [[0.5, 1.0]]

        response = await json_response_off_loop(build)
        return loop_thread, seen, response

    loop_thread, seen, response = asyncio.run(main())
    assert seen and seen[0] != loop_thread
    assert response.body == b"[[0.5,1.0]]" and response.media_type == "application/json"


@pytest.mark.parametrize("headers,param,words", [
    ({}, "content-type", "got no content-type"),
    ({"content-type": "application/x-www-form-urlencoded"}, "content-type",  # what curl -d sends by default
     "content-type: application/json; got content-type 'application/x-www-form-urlencoded'"),
    ({"content-type": "text/plain"}, "content-type", "got content-type 'text/plain'"),
    ({"content-type": "application/json", "content-encoding": "gzip"}, "content-encoding",
     "content-encoding 'gzip' is not supported"),
])
def test_415_for_a_body_that_is_not_plain_json(tiny_dir, serve, metric, headers, param, words):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            before = metric(c, "yoso_tokens_processed_total")
            refused = [await c.post(path, content=b'{"inputs": "hi"}', headers=headers) for path in ("/embed", "/")]
            fine = [await c.post("/embed", content=b'{"inputs": "hi"}', headers={"content-type": t})
                    for t in ("application/json", "Application/JSON; charset=utf-8", "application/vnd.api+json")]
            return refused, fine, metric(c, "yoso_tokens_processed_total") - before

    refused, fine, tokens = asyncio.run(main())
    for r in refused:
        err = error_of(r, 415)
        assert err["param"] == param and words in err["message"] and err["code"] == "unsupported_media_type", err
    assert [r.status_code for r in fine] == [200, 200, 200]
    assert tokens == 3 * 3  # [CLS] hi [SEP], three times: the refused ones ran nothing


def test_openai_route_honours_hashes_and_probes_answer_head(tiny_dir, serve):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            return (await c.post("/v1/embeddings", json={"input": "hi", "hashes": 0}),
                    await c.post("/v1/embeddings", json={"input": "hi", "hashes": 3}),
                    await c.post("/embed", json={"inputs": "hi", "hashes": 3}),
                    await c.post("/v1/embeddings", json={"input": "hi", "hashes": 1000}),
                    await c.head("/health"), await c.head("/ready"))

    exact, sampled, embed, bad, health, ready = asyncio.run(main())
    assert exact.headers["x-hashes"] == "0" and sampled.headers["x-hashes"] == "3"
    assert sampled.json()["data"][0]["embedding"] == pytest.approx(embed.json()[0], abs=1e-6)
    assert error_of(bad, 422)["param"] == "hashes"
    assert health.status_code == 200 and ready.status_code == 200 and health.content == b""


def test_openai_route_honours_truncate_and_long_input(tiny_dir, serve):
    """yoso-serve's own fields on /v1/embeddings (reachable through OpenAI's SDK as extra_body), as on /embed."""
    long = "word " * 100

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            return (await c.post("/v1/embeddings", json={"input": long}),
                    await c.post("/embed", json={"inputs": long}),
                    await c.post("/v1/embeddings", json={"input": ["a", long], "truncate": False}),
                    await c.post("/v1/embeddings", json={"input": long, "long_input": "chunk"}),
                    await c.post("/embed", json={"inputs": long, "long_input": "chunk"}),
                    await c.post("/v1/embeddings", json={"input": long, "long_input": "split"}))

    cut, cut_embed, refused, chunked, chunked_embed, bad = asyncio.run(main())
    assert cut.json()["data"][0]["embedding"] == pytest.approx(cut_embed.json()[0], abs=1e-6)
    err = error_of(refused, 422)
    assert err["param"] == "input" and "input 1 has 102 tokens" in err["message"], err
    assert chunked.json()["data"][0]["embedding"] == pytest.approx(chunked_embed.json()[0], abs=1e-6)
    assert chunked.json()["data"][0]["embedding"] != pytest.approx(cut.json()["data"][0]["embedding"], abs=1e-3)
    assert error_of(bad, 422)["param"] == "long_input"


def test_a_body_that_stops_arriving_is_a_408_and_frees_its_slot(tiny_dir, serve, metric, monkeypatch):
    """A client that sends part of its body and then nothing (slowloris) holds its connection and in-flight
    slot only until the body idle timeout; then a 408, and nothing runs."""
    from yoso_serve.service import middleware

    monkeypatch.setattr(middleware, "BODY_IDLE_TIMEOUT_S", 0.2)

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            before = metric(c, "yoso_tokens_processed_total")
            sent = []
            first = True

            async def receive():
                nonlocal first
                if first:
                    first = False
                    return {"type": "http.request", "body": b'{"inputs": "ab', "more_body": True}
                await asyncio.sleep(3600)  # the rest never comes

            async def send(message):
                sent.append(message)

            await asyncio.wait_for(c.app(embed_scope(), receive, send), 10)
            return (sent, metric(c, "yoso_requests_total", route="/embed", status="408"),
                    metric(c, "yoso_in_flight_requests"), metric(c, "yoso_tokens_processed_total") - before)

    sent, timed_out, in_flight, tokens = asyncio.run(main())
    assert sent[0]["status"] == 408 and timed_out == 1 and in_flight == 0 and tokens == 0
    body = json.loads(sent[1]["body"])["error"]
    assert body["code"] == "body_timeout" and "0.2 s" in body["message"]


def test_a_burst_of_tokenize_calls_cannot_hold_up_model_work(tiny_dir, serve):
    """/tokenize and /decode run on a thread of their own: while three /tokenize calls are stuck in the
    tokenizer, /embed's tokenisation (on the model work's pool, which admission counts) still runs."""
    gate, names = threading.Event(), []

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            tok = c.app.state.engine.model.tokenizer
            real = tok.encode_with_offsets

            def stuck(*args, **kwargs):
                names.append(threading.current_thread().name)
                gate.wait(20)
                return real(*args, **kwargs)

            tok.encode_with_offsets = stuck
            try:
                blocked = [asyncio.create_task(c.post("/tokenize", json={"inputs": f"text {i}"})) for i in range(3)]
                await asyncio.sleep(0.2)
                embed = await asyncio.wait_for(c.post("/embed", json={"inputs": "hello"}), 10)
            finally:
                gate.set()
            return embed, await asyncio.gather(*blocked)

    embed, tokenized = asyncio.run(main())
    assert embed.status_code == 200 and [r.status_code for r in tokenized] == [200, 200, 200]
    assert names and all(n.startswith("yoso-text") for n in names), names


def test_large_answers_are_json_made_in_small_pieces():
    """encode_json writes the values one json.dumps of the same lists writes (floats may be written positionally
    where json uses an exponent), in calls small enough that the event loop gets the GIL between them (one call on 130 MB of token states
    held it for 3 s)."""
    import numpy as np

    from yoso_serve.service import responses

    rng = np.random.default_rng(0)
    states = [rng.standard_normal((n, 5)).astype(np.float32) for n in (700, 0, 3)]
    pieces = [{"embedding": rng.standard_normal(40).astype(np.float32),
               "pieces": [{"embedding": row, "tokens": [0, 16], "chars": [0, 63]}
                          for row in rng.standard_normal((300, 40)).astype(np.float32)]}]
    tokens = [[{"id": i, "text": f"t{i}", "start": i, "stop": i + 1, "special": False} for i in range(600)], []]

    def plain(x):
        if isinstance(x, np.ndarray):
            return x.tolist()
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return [plain(v) for v in x] if isinstance(x, list) else x

    for value in (states, pieces, tokens, [[], {}, "x", None]):
        text, want = responses.encode_json(value), json.dumps(plain(value), separators=(",", ":"))
        assert json.loads(text) == json.loads(want) and " " not in text
    tiny = np.array([1e-5, -2.5e-7, 0.1, 3e38, -0.0, 7], dtype=np.float32)
    assert json.loads(responses.encode_json(tiny)) == tiny.tolist()  # float32 widened: the same float64 values
    assert responses.encode_json({"score": np.float32(0.25), "rows": np.zeros((2, 0))}) == '{"score":0.25,"rows":[[],[]]}'
    calls = []
    real = responses._dump_row
    try:
        responses._dump_row = lambda *a: calls.append(1) or real(*a)
        responses.encode_json(states)
    finally:
        responses._dump_row = real
    assert len(calls) >= 703  # a call per row: none holds the GIL for long


@pytest.mark.parametrize("path", ["/embed", "/", "/rerank", "/v1/embeddings"])
def test_an_empty_body_is_a_400_on_every_route(tiny_dir, serve, path):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            return await c.post(path, content=b"", headers={"content-type": "application/json"})

    err = error_of(asyncio.run(main()), 400)
    assert err["param"] == "body" and err["message"] == "the request body is empty; send a JSON object", err
