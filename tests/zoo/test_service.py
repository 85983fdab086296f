"""A softmax-attention checkpoint served through the real app: /embed works, /info says what it is,
and a per-request hash count (a YOSO-only knob) is refused with 422 in the one error shape."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch

from yoso_serve.model import EncoderConfig, EncoderModel, TextTokenizer, load_pretrained, save_pretrained
from yoso_serve.model.default import minilm_dir
from yoso_serve.service import ServeSettings, create_app

SHAPE = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def softmax_dir(tmp_path_factory):
    torch.manual_seed(0)
    tokenizer = TextTokenizer.from_dir(minilm_dir())
    config = EncoderConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=64, type_vocab_size=2,
                           pad_token_id=tokenizer.pad_id, attention_type="softmax", use_expectation=False, num_hash=8)
    model = EncoderModel(config, tokenizer=tokenizer).eval()
    return save_pretrained(model, tmp_path_factory.mktemp("softmax"))


async def _session(model_dir, requests):
    app = create_app(ServeSettings(model=model_dir, chunk_overlap=16, dense_dtype="fp32"))  # the oracles' precision
    async with app.router.lifespan_context(app):
        await app.state.startup
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return [await (client.get(path) if body is None else client.post(path, json=body))
                    for path, body in requests]


def test_softmax_checkpoint_serves_and_refuses_hashes(softmax_dir):
    texts = ["attention is all you need", "a much longer second text, so that the batch is padded for real"]
    info, ok, hashed, zero = asyncio.run(_session(softmax_dir, [
        ("/info", None),
        ("/embed", {"inputs": texts}),
        ("/embed", {"inputs": texts, "hashes": 8}),
        ("/embed", {"inputs": texts, "hashes": 0}),
    ]))
    assert info.status_code == 200 and info.json()["config"]["attention_type"] == "softmax"
    assert info.json()["default_hashes"] == 0
    assert ok.status_code == 200, ok.text
    served = np.array(ok.json())
    # the same vectors as the model computes directly, one text at a time
    model = load_pretrained(softmax_dir)
    for row, text in zip(served, texts):
        ids = torch.tensor(model.tokenizer.encode([text]))
        with torch.no_grad():
            direct = torch.nn.functional.normalize(model.embed(ids, torch.ones_like(ids)), dim=-1)[0].numpy()
        np.testing.assert_allclose(row, direct, atol=1e-5)
    for refused in (hashed, zero):
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert set(error) == SHAPE and error["param"] == "hashes"
        assert "attention_type=yoso" in error["message"] and "softmax" in error["message"]


def test_a_server_wide_hash_count_is_refused_at_start_for_a_softmax_model(softmax_dir):
    async def main():
        app = create_app(ServeSettings(model=softmax_dir, chunk_overlap=16, hashes=4))
        async with app.router.lifespan_context(app):
            with pytest.raises(ValueError, match="--hashes only applies to attention_type=yoso"):
                await app.state.startup
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.get("/ready"), await client.get("/info")

    ready, info = asyncio.run(main())
    assert ready.status_code == 503 and info.json()["state"] == "failed"
