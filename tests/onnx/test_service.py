"""The service with ``--runtime onnx``: same API, vectors of the torch runtime, the runtime shown."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pydantic import ValidationError

from yoso_serve.model import save_pretrained
from yoso_serve.service import ServeSettings
from yoso_serve.model.hybrid import HybridEncoderModel
from yoso_serve.model.onnx_runtime import load_onnx
from yoso_serve.model.served import ServedModel
from yoso_serve.service.runtimes import check_onnx_serving

TEXTS = ["the quick brown fox", "jumps over the lazy dog and keeps running far away", "short",
         " ".join(f"word{i}" for i in range(300))]  # the last is truncated to the model's 160 tokens


def _ask(model_dir, serve, **settings):
    async def main():
        async with serve(model_dir, **settings) as c:
            batch = await c.post("/embed", json={"inputs": TEXTS})
            # one request per text, sent together, so that the batcher pads them into shared batches
            singles = await asyncio.gather(*(c.post("/embed", json={"inputs": t}) for t in TEXTS))
            classified = await c.post("/classify", json={"inputs": TEXTS[:2], "raw_scores": True})
            wrong = await c.post("/embed", json={"inputs": "hello", "hashes": 4})
            pieces = await c.post("/embed_pieces", json={"inputs": TEXTS, "piece_tokens": 32})
            return {"batch": batch, "singles": singles, "classify": classified, "wrong": wrong, "pieces": pieces,
                    "info": await c.get("/info"), "metrics": await c.get("/metrics")}

    return asyncio.run(main())


def test_onnx_runtime_serves_the_torch_runtime_vectors(torch_dir, lsh_dir, serve):
    torch_run = _ask(torch_dir, serve, runtime="torch")
    onnx_run = _ask(lsh_dir, serve, runtime="onnx")
    assert onnx_run["batch"].status_code == 200 and onnx_run["batch"].headers["x-hashes"] == "16"
    expected = np.array(torch_run["batch"].json())
    np.testing.assert_allclose(np.array(onnx_run["batch"].json()), expected, atol=1e-3)
    singles = np.array([r.json()[0] for r in onnx_run["singles"]])
    np.testing.assert_allclose(singles, expected, atol=1e-3)
    torch_scores = [[s["score"] for s in row] for row in torch_run["classify"].json()]
    onnx_scores = [[s["score"] for s in row] for row in onnx_run["classify"].json()]
    np.testing.assert_allclose(onnx_scores, torch_scores, atol=1e-3)
    # pieces come from the graph's token states: the torch runtime's, and the document vector /embed's
    for got, want in zip(onnx_run["pieces"].json(), torch_run["pieces"].json()):
        assert [q["tokens"] for q in got["pieces"]] == [q["tokens"] for q in want["pieces"]]
        np.testing.assert_allclose([q["embedding"] for q in got["pieces"]], [q["embedding"] for q in want["pieces"]],
                                   atol=1e-3)
    np.testing.assert_allclose([d["embedding"] for d in onnx_run["pieces"].json()], expected, atol=1e-3)
    info = onnx_run["info"].json()
    assert info["runtime"] == "onnx" and info["backend"]["backend"] == "onnxruntime"
    assert info["backend"]["providers"] == ["CPUExecutionProvider"] and info["default_hashes"] == 16
    assert info["has_classifier"] and info["labels"] == ["negative", "neutral", "positive"]
    assert 'runtime="onnx"' in onnx_run["metrics"].text and 'backend="onnxruntime"' in onnx_run["metrics"].text
    # The graph fixes the hash count: asking for another is the client's error, naming the limit.
    assert onnx_run["wrong"].status_code == 422
    assert "16" in onnx_run["wrong"].json()["error"]["message"]
    assert torch_run["wrong"].status_code == 200  # torch takes any count up to --max-hashes


def test_onnx_runtime_refuses_a_torch_checkpoint_and_other_hash_defaults(torch_dir, lsh_dir):
    with pytest.raises(ValidationError, match="export-onnx"):
        ServeSettings(model=torch_dir, runtime="onnx")
    with pytest.raises(ValidationError, match="exported with 16"):
        ServeSettings(model=lsh_dir, runtime="onnx", hashes=8)


def test_serving_checks_name_the_fix(lsh_dir, tiny_model, tmp_path):
    check_onnx_serving(lsh_dir, 16)
    check_onnx_serving(lsh_dir, None)
    with pytest.raises(ValueError, match="needs --model"):
        check_onnx_serving(None)
    with pytest.raises(ValueError, match="yoso-train export-onnx --model"):
        check_onnx_serving(save_pretrained(tiny_model, tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="--hashes 8 but .* was exported with 16 hashes"):
        check_onnx_serving(lsh_dir, 8)


def test_every_runtime_has_the_interface_the_engine_serves(tiny_model, lsh_dir):
    onnx_model = load_onnx(lsh_dir)
    for model in (tiny_model, onnx_model, HybridEncoderModel(tiny_model, onnx_model)):
        assert isinstance(model, ServedModel), type(model).__name__
    assert [m.runtime for m in (tiny_model, onnx_model)] == ["torch", "onnx"]
    assert (tiny_model.fixed_hashes, onnx_model.fixed_hashes) == (None, 16)
