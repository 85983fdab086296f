"""Batching under concurrency, determinism and long-document chunking, with real models."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from yoso_serve.model import load_pretrained

SENTENCES = [f"sentence number {i} talks about {topic}" for i, topic in
             enumerate(["cats", "the stock market", "rain in spring", "compilers", "long documents",
                        "attention kernels", "bread", "a football match"])]


def test_concurrent_requests_really_batch(tiny_dir, serve, metric):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16, max_wait_ms=50) as c:
            rs = await asyncio.gather(*(c.post("/embed", json={"inputs": s}) for s in SENTENCES))
            batches = metric(c, "yoso_batch_size_count")
            singles = metric(c, "yoso_batch_size_bucket", le="1.0")
            return rs, batches, singles

    rs, batches, singles = asyncio.run(main())
    assert all(r.status_code == 200 for r in rs)
    assert batches - singles >= 1  # at least one batch of more than one input ran
    assert batches < 1 + len(SENTENCES)  # fewer forwards than requests (warm-up included)


@pytest.mark.parametrize("hashes", [32, 0])
def test_same_text_same_vector_across_calls_and_batch_compositions(default_dir, serve, hashes):
    target = "Determinism: the same text gives the same vector every time."
    others = ["short", "a considerably longer companion sentence that changes the padding of the batch " * 3]

    async def main():
        async with serve(default_dir, max_wait_ms=30) as c:
            alone = [(await c.post("/embed", json={"inputs": target, "hashes": hashes})).json()[0] for _ in range(2)]
            in_request = (await c.post("/embed", json={"inputs": [others[1], target, others[0]],
                                                       "hashes": hashes})).json()[1]
            crowd = await asyncio.gather(*(c.post("/embed", json={"inputs": t, "hashes": hashes})
                                           for t in [others[1], target, others[0], target]))
            return alone, in_request, [crowd[1].json()[0], crowd[3].json()[0]]

    alone, in_request, crowded = asyncio.run(main())
    assert alone[0] == alone[1]  # bitwise across calls
    for other in [in_request, *crowded]:
        np.testing.assert_allclose(other, alone[0], atol=2e-5)  # padded beside other texts: same vector


def _chunk_oracle(model, text, max_len, overlap):
    """Token-weighted mean of each window's pooled vector, computed straight from the model, exact
    (YOSO-E): the server batches the windows and this runs them one by one, and under LSH a float
    difference of the batch shape can flip a hash code near a hyperplane (3e-3 on the default model)."""
    tok = model.tokenizer
    ids = tok.encode([text], add_special_tokens=False)[0]
    window = max_len - tok.num_special_tokens
    total, weight, start, covered, computed = 0, 0, 0, 0, 0
    while True:
        stop = min(start + window, len(ids))
        t = torch.tensor([tok.wrap(ids[start:stop])])
        computed += t.shape[1]
        with torch.inference_mode():
            row = model.embed(t, torch.ones_like(t), hashes=0)[0].numpy()
        total, weight = total + (stop - covered) * row, weight + (stop - covered)
        covered = stop
        if stop == len(ids):
            break
        start = stop - overlap
    return total / weight, len(ids), computed


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_long_input_chunk_on_a_document_three_times_the_max(tiny_dir, default_dir, serve, which):
    model_dir, max_len, overlap, extra = ((tiny_dir, 64, 16, {}) if which == "tiny"
                                         else (default_dir, 128, 32, {"max_input_length": 128}))
    model = load_pretrained(model_dir)
    words = [f"topic{i % 17} detail{i}" for i in range(400)]
    n_words = 1
    while len(model.tokenizer.encode([" ".join(words[:n_words])], add_special_tokens=False)[0]) < 3 * max_len:
        n_words += 1
    text = " ".join(words[:n_words])  # 3x the max, in tokens
    want, n_tokens, computed = _chunk_oracle(model, text, max_len, overlap)
    assert 3 * max_len <= n_tokens < 3 * max_len + 8

    async def main():
        async with serve(model_dir, chunk_overlap=overlap, **extra) as c:
            chunked = await c.post("/embed", json={"inputs": text, "long_input": "chunk", "normalize": False,
                                                   "hashes": 0})
            normed = await c.post("/embed", json={"inputs": [text, "short"], "long_input": "chunk", "hashes": 0})
            cut = await c.post("/embed", json={"inputs": text, "normalize": False, "hashes": 0})
            return chunked, normed, cut

    chunked, normed, cut = asyncio.run(main())
    got = np.array(chunked.json()[0])
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert int(chunked.headers["x-compute-tokens"]) == computed  # every window, overlap and specials included
    np.testing.assert_allclose(normed.json()[0], want / np.linalg.norm(want), atol=1e-4)
    assert not np.allclose(np.array(cut.json()[0]), want, atol=1e-3)  # truncation sees only the start


def test_the_model_loads_on_a_thread_that_ends_before_serving(tiny_dir, serve):
    """No thread but the batcher keeps an OpenMP team of torch's: the load runs on a thread of its own
    that is gone once the app is ready (a live one, like an executor's, slowed every forward ~1.5×)."""
    import threading

    from yoso_serve.model import load_pretrained

    seen = []

    def load():
        seen.append(threading.current_thread())
        return load_pretrained(tiny_dir)

    async def main():
        async with serve(tiny_dir, chunk_overlap=16, load_model=load) as c:
            return (await c.post("/embed", json={"inputs": "hello"})).status_code

    assert asyncio.run(main()) == 200
    assert len(seen) == 1 and seen[0] is not threading.main_thread()
    seen[0].join(timeout=10)  # an executor's worker would never end
    assert seen[0].name == "yoso-load" and not seen[0].is_alive()


def test_a_load_error_still_fails_the_start(tiny_dir, serve):
    def load():
        raise OSError("disk on fire")

    async def main():
        async with serve(tiny_dir, chunk_overlap=16, load_model=load, wait_ready=False) as c:
            try:
                await c.app.state.startup
            except OSError as exc:
                return str(exc), c.app.state.engine.state, c.app.state.engine.failure
            return None

    assert asyncio.run(main()) == ("disk on fire", "failed", "OSError: disk on fire")


PARAGRAPHS = [
    "To bake a loaf of sourdough bread, feed the starter the night before, mix flour, water and salt in the "
    "morning, fold the dough every half hour, let it rise until it is airy, shape it, proof it in a basket and "
    "bake it in a very hot covered pot for forty minutes until the crust is deep brown.",
    "Jupiter is the largest planet of the solar system. It is a gas giant made mostly of hydrogen and helium, "
    "with a great red spot that is a storm larger than the Earth, dozens of moons including Europa and "
    "Ganymede, and faint rings discovered by the Voyager probes.",
    "A TCP connection starts with a three-way handshake: the client sends a SYN segment, the server answers "
    "with SYN-ACK and the client acknowledges it. Sequence numbers, retransmission timers and a sliding window "
    "give reliable, ordered delivery and flow control over an unreliable network.",
    "Tomatoes need six to eight hours of sun a day, rich well-drained soil and regular deep watering. Stake "
    "or cage the plants, pinch out the side shoots, mulch to keep the roots cool and feed them with a "
    "potassium-rich fertiliser once the first fruits set.",
    "A fugue opens with a single voice stating the subject; a second voice answers it a fifth higher while "
    "the first continues in counterpoint, and further voices enter in turn. Episodes modulate between keys "
    "before the subject returns, often in stretto near the end.",
]


def test_embed_pieces_of_the_default_model_find_the_paragraph_a_question_is_about(default_dir, serve):
    """The served piece vectors of the bundled model, one pass over a document of five topics: a question
    on one paragraph scores a piece of that paragraph best, and the pieces are 128 tokens by default."""
    document = "\n\n".join(PARAGRAPHS)
    spans, at = [], 0
    for p in PARAGRAPHS:
        spans.append((at, at + len(p)))
        at += len(p) + 2
    questions = ["how long should the dough bake in the pot", "which moons orbit the biggest gas planet",
                 "what does the server reply to a SYN segment", "how much sunlight do tomato plants need",
                 "how does the second voice answer the subject"]

    async def main():
        async with serve(default_dir) as c:
            doc = await c.post("/embed_pieces", json={"inputs": document, "piece_tokens": 64})
            default = await c.post("/embed_pieces", json={"inputs": document})
            q = await c.post("/embed", json={"inputs": questions})
            # /rerank by pieces: the document against one paragraph of it alone, per question
            ranked = [await c.post("/rerank", json={"query": question, "texts": [document, PARAGRAPHS[(i + 1) % 5]],
                                                    "piece_tokens": 64, "raw_scores": True})
                      for i, question in enumerate(questions)]
            return doc.json()[0], default.json()[0], np.array(q.json()), [r.json() for r in ranked]

    doc, default, q, ranked = asyncio.run(main())
    assert all(b - a <= 128 for a, b in (p["tokens"] for p in default["pieces"]))
    assert default["pieces"][0]["tokens"] == [0, 128] and len(default["pieces"]) >= 3
    pieces = np.array([p["embedding"] for p in doc["pieces"]])
    for i, question in enumerate(questions):
        best = doc["pieces"][int(np.argmax(pieces @ q[i]))]
        lo, hi = best["chars"]
        assert lo < spans[i][1] and hi > spans[i][0], (question, document[lo:hi])  # it overlaps the paragraph
        # /rerank names the same piece, ranks the document above the other topic's paragraph, by that cosine
        top = ranked[i][0]
        assert top["index"] == 0 and top["piece"] == {"tokens": best["tokens"], "chars": best["chars"]}
        assert top["score"] == pytest.approx(float((pieces @ q[i]).max()), abs=1e-5)
