"""yoso-embed's vectors are the server's, bit for bit: /embed with long_input "chunk", and /embed_pieces with --pieces."""

from __future__ import annotations

from yoso_serve.service.corpus import embed_corpus


def test_vectors_are_embed_bit_for_bit_chunked_past_the_model_length(tmp_path, tiny_model, corpus_kit):
    k = corpus_kit
    docs = k.texts(24, seed=1, low=1, high=200)  # the tiny model's 64 positions: most of these are chunked
    src = k.write_jsonl(tmp_path / "c.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(docs)])
    out = tmp_path / "out"
    m = embed_corpus([src], out, model=tiny_model, part_rows=5, progress=False, **k.TINY_SETTINGS)
    assert m["state"] == "complete" and m["counts"]["documents"] == 24 and m["counts"]["parts"] == 5
    rows = k.read_output(out)
    answers = k.server_answers(tiny_model, k.TINY_SETTINGS, "/embed",
                               [{"inputs": [t], "long_input": "chunk"} for t in docs])
    windows = set()
    for i, answer in enumerate(answers):
        assert answer.status_code == 200, answer.text
        row = rows[f"d{i}"]
        assert k.same_bits(row["vector"], answer.json()[0]), f"d{i}"
        assert row["hashes"] == answer.headers["x-hashes"] and row["tokens"] == int(answer.headers["x-compute-tokens"])
        windows.add(row["hashes"])
    assert {"0", "8", "8+0"} <= windows  # exact, LSH and mixed chunked documents were all compared


def test_pieces_are_embed_pieces_bit_for_bit(tmp_path, tiny_model, corpus_kit):
    k = corpus_kit
    docs = k.texts(12, seed=2, low=1, high=120)
    src = k.write_jsonl(tmp_path / "c.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(docs)])
    out = tmp_path / "out"
    m = embed_corpus([src], out, model=tiny_model, pieces=16, progress=False, **k.TINY_SETTINGS)
    rows = k.read_output(out)
    answers = k.server_answers(tiny_model, k.TINY_SETTINGS, "/embed_pieces",
                               [{"inputs": [t], "piece_tokens": 16} for t in docs])
    tok = __import__("yoso_serve.model", fromlist=["TextTokenizer"]).TextTokenizer.from_dir(tiny_model)
    for i, answer in enumerate(answers):
        assert answer.status_code == 200, answer.text
        (want,) = answer.json()
        row = rows[f"d{i}"]
        assert k.same_bits(row["vector"], want["embedding"])
        assert len(row["piece_vectors"]) == len(want["pieces"])
        for vec, tokens, chars, piece in zip(row["piece_vectors"], row["piece_tokens"], row["piece_chars"],
                                             want["pieces"]):
            assert k.same_bits(vec, piece["embedding"]) and tokens == piece["tokens"] and chars == piece["chars"]
        assert row["truncated"] == (len(tok.encode([docs[i]])[0]) > 64)
    assert 0 < m["counts"]["truncated"] < 12  # long texts are read up to the model's length, and marked


def test_bundled_model_at_default_settings_is_embed_bit_for_bit(tmp_path, corpus_kit):
    """The README's command: the bundled model, every setting at the server's default (auto exact crossover,
    dense dtype as this CPU picks it), a document past the default crossover."""
    k = corpus_kit
    docs = ["What is YOSO attention?", "Linear-cost attention by hashing", " ".join(k.texts(1, seed=3, low=400,
                                                                                          high=400))]
    src = k.write_jsonl(tmp_path / "c.jsonl", [{"id": i, "text": t} for i, t in enumerate(docs)])
    embed_corpus([src], tmp_path / "out", progress=False)
    rows = k.read_output(tmp_path / "out")
    (answer,) = k.server_answers(None, {}, "/embed", [{"inputs": docs, "long_input": "chunk"}])
    assert len(answer.json()[0]) == 384
    for i, vector in enumerate(answer.json()):
        assert k.same_bits(rows[str(i)]["vector"], vector)
    assert rows["2"]["hashes"] == "32" and rows["0"]["hashes"] == "0"
