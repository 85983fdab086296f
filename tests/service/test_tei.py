"""TEI's routes in-process against tiny models, each checked against the model called directly:
POST / dispatch, /predict, /rerank (long documents included), /similarity, /decode, and the
deployment's limits in /openapi.json."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest
import torch

from yoso_serve.model import load_pretrained

TEXTS = ["the quick brown fox", "jumps over the lazy dog and keeps running far away"]
LABELS = ["negative", "neutral", "positive"]
# about 3x the tiny models' 64 tokens, so only chunking sees all of it
LONG = " ".join(f"paragraph {i} about hashing attention and foxes" for i in range(25))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_pretrained(tiny_dir)


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def direct_embed(model, texts, max_length=64):
    rows = []
    for ids in model.tokenizer.encode(texts, max_length=max_length):
        t = torch.tensor([ids])
        with torch.inference_mode():
            rows.append(model.embed(t, torch.ones_like(t))[0].numpy())
    return unit(np.stack(rows))


def direct_logits(model, texts):
    rows = []
    for ids in model.tokenizer.encode(texts, max_length=64):
        t = torch.tensor([ids])
        with torch.inference_mode():
            rows.append(model.classify(t, torch.ones_like(t))[0].numpy())
    return np.stack(rows)


def by_label(row):
    return np.array([{p["label"]: p["score"] for p in row}[name] for name in LABELS])


def test_root_embeds_or_compares_on_an_embedding_model(tiny_dir, tiny, serve, metric):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            single = await c.post("/", json={"inputs": TEXTS[0]})
            batch = await c.post("/", json={"inputs": TEXTS, "normalize": False})
            similar = await c.post("/", json={"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS}})
            route = await c.post("/similarity", json={"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS},
                                                      "parameters": {"truncation_direction": "left"}})
            return single, batch, similar, route, metric(c, "yoso_requests_total", route="/", status="200")

    single, batch, similar, route, counted = asyncio.run(main())
    want = direct_embed(tiny, TEXTS)
    np.testing.assert_allclose(np.array(single.json()), want[:1], atol=1e-5)
    assert np.linalg.norm(np.array(batch.json())[1]) != pytest.approx(1, abs=1e-3)  # normalize: false honoured
    np.testing.assert_allclose(unit(np.array(batch.json())), want, atol=1e-5)
    np.testing.assert_allclose(similar.json(), want @ want[0], atol=1e-5)
    assert similar.json()[0] == pytest.approx(1, abs=1e-5)
    np.testing.assert_allclose(route.json(), similar.json(), atol=1e-5)  # short texts: no side is cut
    n_tokens = sum(len(ids) for ids in tiny.tokenizer.encode([TEXTS[0], *TEXTS]))
    assert int(similar.headers["x-compute-tokens"]) == n_tokens and similar.headers["x-hashes"] == "8"
    assert counted == 3


def test_predict_single_batch_parameters_and_root_on_a_classifier(tiny_classifier_dir, serve):
    model = load_pretrained(tiny_classifier_dir)
    logits = direct_logits(model, TEXTS)
    soft = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)

    async def main():
        async with serve(tiny_classifier_dir, chunk_overlap=16) as c:
            bodies = {"single": {"inputs": TEXTS[0]},
                      "batch": {"inputs": [[t] for t in TEXTS]},
                      "raw": {"inputs": [[t] for t in TEXTS], "raw_scores": True},
                      "sigmoid": {"inputs": TEXTS[0], "parameters": {"function_to_apply": "sigmoid"}},
                      "none_top2": {"inputs": TEXTS[1], "parameters": {"function_to_apply": "none", "top_k": 2}},
                      "empty_parameters": {"inputs": TEXTS[0], "parameters": {}}}
            out = {k: await c.post("/predict", json=b) for k, b in bodies.items()}
            out["root"] = await c.post("/", json={"inputs": TEXTS[0]})
            return out

    r = asyncio.run(main())
    assert all(x.status_code == 200 for x in r.values()), {k: x.text for k, x in r.items()}
    single = r["single"].json()  # TEI: one text, one flat list, best first
    assert [list(p) for p in single] == [["score", "label"]] * 3
    assert [p["score"] for p in single] == sorted((p["score"] for p in single), reverse=True)
    np.testing.assert_allclose(by_label(single), soft[0], atol=1e-5)
    assert r["root"].json() == single
    for row, want in zip(r["batch"].json(), soft):
        np.testing.assert_allclose(by_label(row), want, atol=1e-5)
    for row, want in zip(r["raw"].json(), logits):
        np.testing.assert_allclose(by_label(row), want, atol=1e-5)
    # the Inference API form (with parameters) answers one text as a batch of one
    np.testing.assert_allclose(by_label(r["sigmoid"].json()[0]), 1 / (1 + np.exp(-logits[0])), atol=1e-5)
    top2 = r["none_top2"].json()[0]
    assert [p["label"] for p in top2] == [LABELS[i] for i in np.argsort(-logits[1])[:2]]
    np.testing.assert_allclose([p["score"] for p in top2], np.sort(logits[1])[::-1][:2], atol=1e-5)
    assert r["empty_parameters"].json() == [single]


def test_rerank_orders_by_similarity_and_chunks_long_documents(tiny_dir, tiny, serve):
    query = "a fox jumps"
    docs = ["taxes and invoices", TEXTS[0], LONG, TEXTS[1]]

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            ranked = await c.post("/rerank", json={"query": query, "texts": docs, "return_text": True})
            raw = await c.post("/rerank", json={"query": query, "texts": docs, "raw_scores": True})
            chunked = await c.post("/rerank", json={"query": query, "texts": docs, "long_input": "chunk",
                                                    "raw_scores": True})
            whole = await c.post("/embed", json={"inputs": LONG, "long_input": "chunk"})
            strict = await c.post("/rerank", json={"query": query, "texts": docs, "truncate": False})
            return ranked, raw, chunked, np.array(whole.json()[0]), strict

    ranked, raw, chunked, whole, strict = asyncio.run(main())
    cosines = direct_embed(tiny, docs) @ direct_embed(tiny, [query])[0]
    order = np.argsort(-cosines).tolist()
    assert [x["index"] for x in ranked.json()] == order
    assert [x["text"] for x in ranked.json()] == [docs[i] for i in order]
    np.testing.assert_allclose([x["score"] for x in ranked.json()],
                               1 / (1 + np.exp(-20 * (cosines[order] - 0.3))), atol=1e-4)
    assert all(set(x) == {"index", "score"} for x in raw.json())  # no text unless asked
    np.testing.assert_allclose([x["score"] for x in raw.json()], cosines[order], atol=1e-5)
    # the long document scored as a whole (every window), the others as before
    by_index = {x["index"]: x["score"] for x in chunked.json()}
    assert by_index[2] == pytest.approx(float(whole @ direct_embed(tiny, [query])[0]), abs=1e-5)
    assert by_index[2] != pytest.approx(cosines[2], abs=1e-4)
    np.testing.assert_allclose([by_index[i] for i in (0, 1, 3)], cosines[[0, 1, 3]], atol=1e-5)
    # every token of the long document ran (the truncated run had 64 of them), overlap on top
    long_tokens = len(tiny.tokenizer.encode([LONG])[0])
    assert int(chunked.headers["x-compute-tokens"]) - int(raw.headers["x-compute-tokens"]) > long_tokens - 64
    assert strict.status_code == 422 and "limit of 64" in strict.json()["error"]["message"]


def test_rerank_by_best_piece_scores_each_text_by_its_best_piece_and_names_it(tiny_dir, tiny, serve):
    query = "a fox jumps"
    docs = ["taxes and invoices", LONG, TEXTS[0]]

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            ranked = await c.post("/rerank", json={"query": query, "texts": docs, "piece_tokens": 16,
                                                   "raw_scores": True, "return_text": True})
            scored = await c.post("/rerank", json={"query": query, "texts": docs, "piece_tokens": 16})
            pieces = await c.post("/embed_pieces", json={"inputs": docs, "piece_tokens": 16})
            return ranked, scored, pieces

    ranked, scored, pieces = asyncio.run(main())
    q = direct_embed(tiny, [query])[0]
    sims = [np.array([p["embedding"] for p in doc["pieces"]]) @ q for doc in pieces.json()]
    best = np.array([s.max() for s in sims])
    order = np.argsort(-best, kind="stable").tolist()
    assert len(sims[1]) == 4  # the long document truncated to 64 tokens: four pieces, scored one by one
    assert [x["index"] for x in ranked.json()] == order and [x["text"] for x in ranked.json()] == [docs[i] for i in order]
    np.testing.assert_allclose([x["score"] for x in ranked.json()], best[order], atol=1e-5)
    np.testing.assert_allclose([x["score"] for x in scored.json()], 1 / (1 + np.exp(-20 * (best[order] - 0.3))),
                               atol=1e-4)
    for x in ranked.json():
        want = pieces.json()[x["index"]]["pieces"][int(np.argmax(sims[x["index"]]))]
        assert x["piece"] == {"tokens": want["tokens"], "chars": want["chars"]}
    assert best[1] > float(direct_embed(tiny, [LONG])[0] @ q)  # a piece beats the truncated whole here


def test_decode_inverts_tokenize(tiny_dir, serve):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            tokens = (await c.post("/tokenize", json={"inputs": TEXTS})).json()
            ids = [[t["id"] for t in row] for row in tokens]
            return ids, [(await c.post("/decode", json=b)).json() for b in (
                {"ids": ids}, {"ids": ids[0]}, {"ids": ids[0], "skip_special_tokens": False})]

    ids, (batch, single, specials) = asyncio.run(main())
    assert batch == TEXTS and single == TEXTS[:1]  # the tiny tokenizer lowercases; TEXTS are lowercase
    assert specials == [f"[CLS] {TEXTS[0]} [SEP]"] and ids[0][0] == 101


def test_openapi_states_the_deployments_limits(tiny_dir, tiny_classifier_dir, serve):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16, max_client_batch_size=4, max_hashes=16) as c:
            plain = (await c.get("/openapi.json")).json()
        async with serve(tiny_classifier_dir, chunk_overlap=16) as c:
            head = (await c.get("/openapi.json")).json()
        return plain, head

    plain, head = asyncio.run(main())
    for doc in (plain, head):  # every reference resolves (POST / declares its bodies by hand)
        refs = set(re.findall(r'"\$ref": "#/components/schemas/(\w+)"', json.dumps(doc)))
        assert refs and refs <= set(doc["components"]["schemas"]), refs - set(doc["components"]["schemas"])
    s = plain["components"]["schemas"]
    assert s["EmbedRequest"]["properties"]["inputs"]["oneOf"][1]["maxItems"] == 4
    assert s["RerankRequest"]["properties"]["texts"]["maxItems"] == 4
    assert s["SimilarityInput"]["properties"]["sentences"]["maxItems"] == 3
    assert s["EmbedRequest"]["properties"]["hashes"]["anyOf"][0] | {"description": ""} == {
        "type": "integer", "minimum": 0, "maximum": 16, "description": ""}
    assert s["OpenAIEmbeddingRequest"]["properties"]["dimensions"]["anyOf"][0]["maximum"] == 32
    assert s["EmbedPiecesRequest"]["properties"]["piece_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1,
                                                                             "maximum": 64}
    ids = s["DecodeRequest"]["properties"]["ids"]["oneOf"]
    assert "maxItems" not in ids[0] and ids[1]["maxItems"] == 4 and ids[0]["items"]["maximum"] == 30521
    # no head: /classify needs labels, /predict is not offered, and POST / takes /embed's or /similarity's body
    assert "labels" in s["ClassifyRequest"]["required"] and "/predict" not in plain["paths"]
    root = plain["paths"]["/"]["post"]["requestBody"]["content"]["application/json"]["schema"]["oneOf"]
    assert [r["$ref"].rsplit("/", 1)[1] for r in root] == ["EmbedRequest", "SimilarityRequest", "ZeroShotRequest"]
    h = head["components"]["schemas"]
    assert "labels" not in h["ClassifyRequest"].get("required", []) and "/predict" in head["paths"]
    root = head["paths"]["/"]["post"]["requestBody"]["content"]["application/json"]["schema"]["oneOf"]
    assert [r["$ref"].rsplit("/", 1)[1] for r in root] == ["PredictRequest", "ZeroShotRequest"]


def test_a_text_the_tokenizer_drops_whole_embeds_like_its_special_tokens(tiny_dir, serve):
    """Schemathesis found it: "\\x07" has no content token, and chunking divided by a zero weight (NaN)."""
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            cut = await c.post("/embed", json={"inputs": ["\x07", "ok"]})
            chunked = await c.post("/embed", json={"inputs": ["\x07", "ok"], "long_input": "chunk"})
            ranked = await c.post("/rerank", json={"query": "ok", "texts": ["\x07", "ok"], "long_input": "chunk"})
            return cut.json(), chunked.json(), ranked.json()

    cut, chunked, ranked = asyncio.run(main())
    assert np.isfinite(chunked).all()
    np.testing.assert_allclose(chunked, cut, atol=1e-5)
    assert [r["index"] for r in ranked] == [1, 0] and all(np.isfinite(r["score"]) for r in ranked)


@pytest.mark.parametrize("which", ["plain", "head"])
def test_root_answers_the_inference_apis_zero_shot_body_from_classify(tiny_dir, tiny_classifier_dir, serve, which):
    labels = ["the quick brown fox", "taxes", "bananas"]
    template = "this text is about {}"

    async def main():
        async with serve(tiny_dir if which == "plain" else tiny_classifier_dir, chunk_overlap=16) as c:
            got = {}
            for multi in (False, True):
                got[multi, None] = await c.post("/", json={"inputs": TEXTS[0], "parameters": {
                    "candidate_labels": labels, "multi_label": multi}})
                got[multi, template] = await c.post("/", json={"inputs": TEXTS[0], "parameters": {
                    "candidate_labels": labels, "multi_label": multi, "hypothesis_template": template}})
            want = {(multi, t): await c.post("/classify", json={
                "inputs": TEXTS[0], "multi_label": multi,
                "labels": [t.replace("{}", x) if t else x for x in labels]}) for multi, t in got}
            bad = await c.post("/", json={"inputs": TEXTS[0], "parameters": {"candidate_labels": ["a", "a"]}})
            return got, want, bad

    got, want, bad = asyncio.run(main())
    for key, r in got.items():
        names = dict(zip([key[1].replace("{}", x) if key[1] else x for x in labels], labels))
        assert r.status_code == 200, r.text
        assert r.json() == [{"label": names[w["label"]], "score": w["score"]} for w in want[key].json()[0]]
    assert got[False, None].json()[0]["label"] == labels[0]  # the label equal to the text wins
    assert bad.status_code == 422 and "candidate_labels must be distinct" in bad.json()["error"]["message"]


def test_scores_centre_on_the_models_score_center(tiny_dir, tiny, serve, tmp_path):
    """/rerank and zero-shot multi-label /classify score sigmoid(20 (cos - c)), c the model's score_center
    (config.json), 0.3 for a model without one; /info says which."""
    import shutil

    centred = tmp_path / "centred"
    shutil.copytree(tiny_dir, centred)
    config = json.loads((centred / "config.json").read_text())
    assert config.get("score_center") is None
    (centred / "config.json").write_text(json.dumps({**config, "score_center": 0.55}))
    query, docs, labels = "a fox jumps", TEXTS, ["animals", "money"]

    async def main(path):
        async with serve(path, chunk_overlap=16) as c:
            return ((await c.get("/info")).json()["score_center"],
                    (await c.post("/rerank", json={"query": query, "texts": docs})).json(),
                    (await c.post("/classify", json={"inputs": query, "labels": labels, "multi_label": True})).json())

    cosines = direct_embed(tiny, docs) @ direct_embed(tiny, [query])[0]
    label_cosines = direct_embed(tiny, labels) @ direct_embed(tiny, [query])[0]
    for path, center in ((tiny_dir, 0.3), (centred, 0.55)):
        info, ranks, classes = asyncio.run(main(path))
        assert info == center
        np.testing.assert_allclose([r["score"] for r in sorted(ranks, key=lambda r: r["index"])],
                                   1 / (1 + np.exp(-20 * (cosines - center))), atol=1e-4)
        by_label = {x["label"]: x["score"] for x in classes[0]}
        np.testing.assert_allclose([by_label[x] for x in labels], 1 / (1 + np.exp(-20 * (label_cosines - center))),
                                   atol=1e-4)
