"""Every route, in-process, against a tiny random model loaded from disk; outputs checked against
the model called directly (the oracle), not just their shapes."""

from __future__ import annotations

import asyncio
import base64
import importlib.metadata
import re
import threading

import numpy as np
import pytest
import torch

from yoso_serve.model import load_pretrained

TEXTS = ["the quick brown fox", "jumps over the lazy dog and keeps running far away"]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_pretrained(tiny_dir)


def direct_embed(model, texts, *, hashes=None, pooling=None, max_length=64):
    """The oracle: each text alone through the model, no service code involved."""
    rows = []
    for ids in model.tokenizer.encode(texts, max_length=max_length):
        t = torch.tensor([ids])
        with torch.inference_mode():
            rows.append(model.embed(t, torch.ones_like(t), hashes=hashes, pooling=pooling)[0].numpy())
    return np.stack(rows)


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_embed_matches_the_model_and_reports_usage(tiny_dir, tiny, serve):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            r = await c.post("/embed", json={"inputs": TEXTS}, headers={"x-request-id": "abc-123"})
            raw = await c.post("/embed", json={"inputs": TEXTS[0], "normalize": False, "pooling": "cls",
                                               "hashes": 0})
            return r, raw

    r, raw = asyncio.run(main())
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    got = np.array(r.json())
    np.testing.assert_allclose(got, unit(direct_embed(tiny, TEXTS)), atol=1e-5)
    n_tokens = sum(len(ids) for ids in tiny.tokenizer.encode(TEXTS))
    assert int(r.headers["x-compute-tokens"]) == n_tokens and r.headers["x-hashes"] == "8"
    assert float(r.headers["x-inference-time"]) > 0 and float(r.headers["x-queue-time"]) >= 0
    np.testing.assert_allclose(np.array(raw.json()), direct_embed(tiny, TEXTS[:1], hashes=0, pooling="cls"),
                               atol=1e-5)
    assert raw.headers["x-hashes"] == "0" and len(raw.headers["x-request-id"]) == 32


def test_truncation_direction_keeps_the_named_side(tiny_dir, tiny, serve):
    long_text = " ".join(f"word{i}" for i in range(200))

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            return [np.array((await c.post("/embed", json={"inputs": long_text, "truncation_direction": side,
                                                           "normalize": False})).json()[0])
                    for side in ("right", "left")]

    right, left = asyncio.run(main())
    for side, got in (("right", right), ("left", left)):
        ids = tiny.tokenizer.encode([long_text], max_length=64, truncation_side=side)[0]
        t = torch.tensor([ids])
        with torch.inference_mode():
            want = tiny.embed(t, torch.ones_like(t))[0].numpy()
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert not np.allclose(right, left, atol=1e-3)


def test_embed_all_returns_each_texts_token_states(tiny_dir, tiny, serve):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            return await c.post("/embed_all", json={"inputs": TEXTS})

    r = asyncio.run(main())
    assert r.status_code == 200
    for text, states in zip(TEXTS, r.json()):
        ids = tiny.tokenizer.encode([text])[0]
        t = torch.tensor([ids])
        with torch.inference_mode():
            want = tiny.last_hidden(t, torch.ones_like(t))[0].numpy()
        np.testing.assert_allclose(np.array(states), want, atol=1e-5)


def test_embed_pieces_are_means_of_the_token_states_of_one_pass(tiny_dir, tiny, serve):
    text = "Reading the whole document at once: " + " ".join(f"part{i} of it," for i in range(8)) + " the end."

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            pieces = await c.post("/embed_pieces", json={"inputs": [text, TEXTS[0]], "piece_tokens": 16})
            raw = await c.post("/embed_pieces", json={"inputs": text, "piece_tokens": 16, "normalize": False})
            tokens = await c.post("/embed_pieces", json={"inputs": TEXTS[0], "piece_tokens": 1})
            embed = await c.post("/embed", json={"inputs": [text, TEXTS[0]]})
            default = await c.post("/embed_pieces", json={"inputs": text})
            return pieces, raw, tokens, embed, default

    pieces, raw, tokens, embed, default = asyncio.run(main())
    # without piece_tokens: 128, or the input length (64 here) when shorter: one piece, the whole input
    assert [p["tokens"] for p in default.json()[0]["pieces"]] == [[0, len(tiny.tokenizer.encode([text])[0])]]
    assert pieces.status_code == 200 and int(pieces.headers["x-compute-tokens"]) > 0
    body = pieces.json()
    # the document vector is /embed's, from the same pass
    np.testing.assert_allclose([d["embedding"] for d in body], embed.json(), atol=1e-5)
    for doc, got in ((text, body[0]), (TEXTS[0], body[1])):
        ids, offsets = tiny.tokenizer.encode_with_offsets([doc], max_length=64)[0]
        t = torch.tensor([ids])
        with torch.inference_mode():
            states = tiny.last_hidden(t, torch.ones_like(t))[0].numpy()
        bounds = [[a, min(a + 16, len(ids))] for a in range(0, len(ids), 16)]
        assert [p["tokens"] for p in got["pieces"]] == bounds  # cut from the first token, the last shorter
        want = np.stack([states[a:b].mean(0) for a, b in bounds])
        np.testing.assert_allclose([p["embedding"] for p in got["pieces"]], unit(want), atol=1e-5)
        # each piece's characters are its content tokens' text, in order, and the pieces tile the text
        for p, (a, b) in zip(got["pieces"], bounds):
            content = [o for o in offsets[a:b] if o != (0, 0)]
            assert p["chars"] == ([content[0][0], content[-1][1]] if content else [p["chars"][0]] * 2)
        starts = [p["chars"][0] for p in got["pieces"]]
        assert starts == sorted(starts) and got["pieces"][0]["chars"][0] == 0
        assert got["pieces"][-1]["chars"][1] == len(doc)
    assert text[slice(*body[0]["pieces"][1]["chars"])] == "it, part2 of it, part3 of it, part4 of it"  # tokens 16-31
    # normalize false: the plain means, the document vector /embed's normalize false
    plain = raw.json()[0]
    np.testing.assert_allclose(plain["embedding"], direct_embed(tiny, [text])[0], atol=1e-5)
    assert abs(np.linalg.norm(plain["pieces"][0]["embedding"]) - 1) > 1e-3
    # one token per piece: the token states themselves; the special tokens' pieces have no text
    one = tokens.json()[0]["pieces"]
    assert one[0]["chars"] == [0, 0] and one[-1]["chars"][0] == one[-1]["chars"][1] == len(TEXTS[0])
    assert len(one) == len(tiny.tokenizer.encode(TEXTS[:1])[0]) and one[1]["chars"] == [0, 3]



def test_embed_pieces_tokenizes_once_and_its_offsets_follow_left_truncation(tiny_dir, tiny, serve, monkeypatch):
    """One tokenisation gives the pass its ids and the pieces their characters, truncated on the side asked."""
    from yoso_serve.model import TextTokenizer

    calls = []
    for name in ("encode", "encode_with_offsets"):
        real = getattr(TextTokenizer, name)
        monkeypatch.setattr(TextTokenizer, name, lambda self, *a, _real=real, _name=name, **k: (
            calls.append(_name), _real(self, *a, **k))[1])
    text = " ".join(f"word{i}" for i in range(80))  # above the tiny model's 64 positions

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            calls.clear()
            return await c.post("/embed_pieces", json={"inputs": text, "piece_tokens": 16,
                                                       "truncation_direction": "left"})

    r = asyncio.run(main())
    assert r.status_code == 200 and calls == ["encode_with_offsets"]
    ids, offsets = tiny.tokenizer.encode_with_offsets([text], max_length=64, truncation_side="left")[0]
    t = torch.tensor([ids])
    with torch.inference_mode():
        states = tiny.last_hidden(t, torch.ones_like(t))[0].numpy()
    got = r.json()[0]["pieces"]
    np.testing.assert_allclose([p["embedding"] for p in got], unit(np.stack([states[a:a + 16].mean(0)
                                                                             for a in range(0, 64, 16)])), atol=1e-5)
    assert got[-1]["chars"][1] == len(text) and got[0]["chars"][0] == offsets[1][0] > 0  # the text's tail

def test_openai_embeddings_float_base64_and_dimensions(tiny_dir, tiny, serve):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            f = await c.post("/v1/embeddings", json={"input": TEXTS, "model": "mine", "user": "u1"})
            b = await c.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})
            d = await c.post("/v1/embeddings", json={"input": TEXTS[0], "dimensions": 8})
            too_big = await c.post("/v1/embeddings", json={"input": TEXTS[0], "dimensions": 33})
            return f, b, d, too_big

    f, b, d, too_big = asyncio.run(main())
    body = f.json()
    assert body["object"] == "list" and body["model"] == "mine"
    assert [e["index"] for e in body["data"]] == [0, 1]
    n_tokens = sum(len(ids) for ids in tiny.tokenizer.encode(TEXTS))
    assert body["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    floats = np.array([e["embedding"] for e in body["data"]], dtype=np.float32)
    np.testing.assert_allclose(floats, unit(direct_embed(tiny, TEXTS)), atol=1e-5)
    decoded = np.stack([np.frombuffer(base64.b64decode(e["embedding"]), dtype="<f4") for e in b.json()["data"]])
    np.testing.assert_array_equal(decoded, floats)
    short = np.array(d.json()["data"][0]["embedding"])
    np.testing.assert_allclose(short, unit(floats[0, :8]), atol=1e-5)  # truncate, then renormalise
    assert too_big.status_code == 422 and too_big.json()["error"]["param"] == "dimensions"


def test_classify_with_head_softmax_sigmoid_and_logits(tiny_classifier_dir, serve):
    model = load_pretrained(tiny_classifier_dir)
    ids = model.tokenizer.encode(TEXTS)
    logits = []
    for row in ids:
        t = torch.tensor([row])
        with torch.inference_mode():
            logits.append(model.classify(t, torch.ones_like(t))[0].numpy())
    logits = np.stack(logits)

    async def main():
        async with serve(tiny_classifier_dir, chunk_overlap=16) as c:
            return [(await c.post("/classify", json={"inputs": TEXTS, **extra})).json()
                    for extra in ({}, {"multi_label": True}, {"raw_scores": True})]

    soft, multi, raw = asyncio.run(main())
    names = ["negative", "neutral", "positive"]
    expected = {"soft": np.exp(logits) / np.exp(logits).sum(1, keepdims=True),
                "multi": 1 / (1 + np.exp(-logits)), "raw": logits}
    for got, want in ((soft, expected["soft"]), (multi, expected["multi"]), (raw, expected["raw"])):
        for row, want_row in zip(got, want):
            scores = [s["score"] for s in row]
            assert scores == sorted(scores, reverse=True)
            by_label = {s["label"]: s["score"] for s in row}
            np.testing.assert_allclose([by_label[n] for n in names], want_row, atol=1e-5)


def test_zero_shot_classify_ranks_by_cosine(tiny_dir, tiny, serve):
    labels = ["the quick brown fox", "bananas and apples", "taxes"]

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            soft = await c.post("/classify", json={"inputs": TEXTS[0], "labels": labels})
            raw = await c.post("/classify", json={"inputs": TEXTS[0], "labels": labels, "raw_scores": True})
            return soft.json()[0], raw.json()[0]

    soft, raw = asyncio.run(main())
    cos = unit(direct_embed(tiny, [TEXTS[0]])) @ unit(direct_embed(tiny, labels)).T
    assert soft[0]["label"] == "the quick brown fox"  # identical text: cosine 1
    np.testing.assert_allclose({s["label"]: s["score"] for s in raw}["taxes"], cos[0, 2], atol=1e-5)
    assert abs(sum(s["score"] for s in soft) - 1) < 1e-5


def test_tokenize_offsets_point_into_the_text(tiny_dir, serve):
    text = "Héllo, wörld of YOSO"

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            with_specials = (await c.post("/tokenize", json={"inputs": text})).json()[0]
            bare = (await c.post("/tokenize", json={"inputs": [text], "add_special_tokens": False})).json()[0]
            return with_specials, bare

    tokens, bare = asyncio.run(main())
    assert tokens[0] == {"id": 101, "text": "[CLS]", "start": 0, "stop": 0, "special": True}
    assert tokens[-1]["text"] == "[SEP]" and tokens[-1]["special"]
    assert tokens[1:-1] == bare and not any(t["special"] for t in bare)
    for t in bare:
        assert t["text"] == text[t["start"]:t["stop"]]
    assert bare[0]["text"] == "Héllo"


def test_info_health_ready_metrics_docs(tiny_dir, serve):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16, max_hashes=64) as c:
            await c.post("/embed", json={"inputs": "hello"})
            return {p: await c.get(p) for p in ("/info", "/health", "/ready", "/metrics", "/docs", "/openapi.json")}

    r = asyncio.run(main())
    info = r["/info"].json()
    assert info["max_input_length"] == 64 and info["default_hashes"] == 8 and info["max_hashes"] == 64
    assert info["backend"]["backend"] in ("cpp", "torch") and info["device"] == "cpu" and info["runtime"] == "torch"
    assert info["config"]["hidden_size"] == 32 and info["limits"]["max_batch_tokens"] == 16384
    assert info["limits"]["max_padding_tokens"] == 64  # the CPU default, resolved for the device
    assert r["/health"].json() == {"status": "ok"} and r["/ready"].json() == {"status": "ready"}
    text = r["/metrics"].text
    for name in ("yoso_requests_total", "yoso_request_duration_seconds_bucket", "yoso_queue_items",
                 "yoso_queue_tokens", "yoso_queue_wait_seconds_bucket", "yoso_tokenize_duration_seconds_bucket",
                 "yoso_inference_duration_seconds_bucket", "yoso_batch_size_bucket", "yoso_batch_tokens_bucket",
                 "yoso_input_length_tokens_bucket", "yoso_tokens_processed_total", "yoso_in_flight_requests",
                 "yoso_model_info", "yoso_ready 1.0"):
        assert name in text, name
    assert 'yoso_requests_total{route="/embed",status="200"} 1.0' in text
    # the input-length buckets stop at the model's input limit (64), not at a fixed 4096
    buckets = re.findall(r'yoso_input_length_tokens_bucket\{le="([^"]+)"\}', text)
    assert buckets[-2:] == ["64.0", "+Inf"] and "128.0" not in buckets
    # and a batch's padded tokens never pass --max-batch-tokens
    assert re.findall(r'yoso_batch_tokens_bucket\{le="([^"]+)"\}', text)[-2:] == ["16384.0", "+Inf"]
    # the version is the installed distribution's, wherever it is shown
    version = importlib.metadata.version("yoso-serve")
    assert info["version"] == version and r["/openapi.json"].json()["info"]["version"] == version
    assert 'hashes="8"' in text and 'device="cpu"' in text
    # admission: both refusal reasons exist from the start; the warm-up's speed probe measured hashes 8
    assert 'yoso_rejections_total{reason="predicted_wait"} 0.0' in text and 'reason="queue_full"} 0.0' in text
    assert 'yoso_throughput_padded_tokens_per_second{hashes="8"}' in text
    assert r["/docs"].status_code == 200 and "/v1/embeddings" in r["/openapi.json"].json()["paths"]


def test_embed_pieces_pools_on_the_forwards_thread_not_the_event_loops(tiny_dir, serve, monkeypatch):
    """The pieces' reductions (torch) run on the forward's thread: on the event loop's thread a long input started
    a second OpenMP team, and with more OpenMP threads than cores every later forward ran slower."""
    from yoso_serve.service import engine as engine_module
    from yoso_serve.service import outputs

    threads = []
    real = outputs.piece_vectors

    def recording(hidden, size):
        threads.append(threading.current_thread())
        return real(hidden, size)

    monkeypatch.setattr(engine_module, "piece_vectors", recording)

    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            r = await c.post("/embed_pieces", json={"inputs": ["a b c d e f", "g h"], "piece_tokens": 2})
            return r, threading.current_thread()

    r, loop_thread = asyncio.run(main())
    assert r.status_code == 200 and len(threads) == 2
    assert all(t is not loop_thread and t.name == "yoso-batcher" for t in threads)
