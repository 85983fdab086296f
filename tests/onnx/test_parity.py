"""ONNX Runtime (CPU provider) against PyTorch on the same inputs: exact mode within 1e-4, LSH mode
within 1e-3, padded batches included, on shapes the trace never saw (it ran on a 2 × 8 batch)."""

from __future__ import annotations

import pytest
import torch

from yoso_serve.model import load_pretrained
from yoso_serve.model.export import export_onnx
from yoso_serve.model.onnx_runtime import OnnxEncoderModel, load_onnx

LENGTHS = [37, 150, 1, 64, 99]  # awkward sizes, one single token, one near max_position_embeddings


def _batch(model, padded, lengths=LENGTHS, seed=0):
    tok = model.tokenizer
    return padded(lengths, pad=tok.pad_id, vocab=tok.vocab_size, seed=seed)


def _real(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return hidden * mask[:, :, None]  # padded positions' states are not part of the contract


@pytest.mark.parametrize(("fixture", "hashes", "tol"), [("lsh_dir", 16, 1e-3), ("exact_dir", 0, 1e-4)])
def test_hidden_embedding_and_logits_match_torch(request, tiny_model, padded, fixture, hashes, tol):
    onnx = load_onnx(request.getfixturevalue(fixture))
    ids, mask = _batch(tiny_model, padded)
    with torch.inference_mode():
        hidden = tiny_model.last_hidden(ids, mask, hashes=hashes)
        pooled = tiny_model.embed(ids, mask, hashes=hashes)
        logits = tiny_model.classify(ids, mask, hashes=hashes)
    assert onnx.fixed_hashes == hashes
    torch.testing.assert_close(_real(onnx.last_hidden(ids, mask), mask), _real(hidden, mask), atol=tol, rtol=0)
    torch.testing.assert_close(onnx.embed(ids, mask, hashes=hashes), pooled, atol=tol, rtol=0)
    torch.testing.assert_close(onnx.classify(ids, mask), logits, atol=tol, rtol=0)
    # The two modes really differ, so a graph that ignored the hash count could not pass both.
    with torch.inference_mode():
        other = tiny_model.embed(ids, mask, hashes=16 - hashes)
    assert (onnx.embed(ids, mask) - other).abs().max() > 100 * tol


def test_cls_pooling_conv_and_gaussian_hashes_match_torch(conv_cls_model, conv_cls_dir, padded):
    onnx = OnnxEncoderModel(conv_cls_dir)
    ids, mask = _batch(conv_cls_model, padded, [12, 77, 3], seed=1)
    with torch.inference_mode():
        for pooling in ("cls", "mean"):  # cls comes from the graph, mean is pooled from its hidden states
            expected = conv_cls_model.embed(ids, mask, hashes=8, pooling=pooling)
            torch.testing.assert_close(onnx.embed(ids, mask, pooling=pooling), expected, atol=1e-3, rtol=0)
    assert not onnx.has_classifier
    with pytest.raises(ValueError, match="no classification head"):
        onnx.classify(ids, mask)


def test_int8_hashing_exports_and_matches_torch(int8_model, tmp_path, padded):
    """A model with hash_int8: the graph quantizes q and k rows and holds the int8 planes."""
    model = int8_model
    onnx = load_onnx(export_onnx(model, tmp_path, hashes=16))
    ids, mask = _batch(model, padded)
    with torch.inference_mode():
        expected = model.embed(ids, mask, hashes=16)
        for layer in model.encoder.encoder.layer:
            layer.attention.self.core.int8_hash = False
        fp32 = model.embed(ids, mask, hashes=16)
    got = onnx.embed(ids, mask)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
    # the graph really hashes in int8: far closer to the int8 model than to the same weights hashing in fp32
    assert (got - expected).abs().max() * 10 < (got - fp32).abs().max()


def test_a_text_gives_the_same_output_alone_and_padded_in_a_batch(lsh_dir, tiny_model, padded):
    onnx = load_onnx(lsh_dir)
    ids, mask = _batch(tiny_model, padded)
    batch = onnx.embed(ids, mask)
    for row, n in enumerate(LENGTHS):
        alone = onnx.embed(ids[row : row + 1, :n], mask[row : row + 1, :n])
        torch.testing.assert_close(alone[0], batch[row], atol=1e-5, rtol=0)


def test_without_a_mask_every_token_is_real(lsh_dir, tiny_model, padded):
    onnx = load_onnx(lsh_dir)
    ids, _ = _batch(tiny_model, padded, [40, 40])
    with torch.inference_mode():
        expected = tiny_model.embed(ids, None)
    torch.testing.assert_close(onnx.embed(ids), expected, atol=1e-3, rtol=0)


def test_a_reloaded_checkpoint_exports_to_the_same_vectors(tiny_model, tmp_path, padded):
    """Export from a directory (the CLI's path) gives the vectors of the model that was saved."""
    from yoso_serve.model import save_pretrained
    from yoso_serve.model.export import export_onnx

    out = export_onnx(save_pretrained(tiny_model, tmp_path / "ckpt"), tmp_path / "onnx", hashes=4)
    ids, mask = _batch(tiny_model, padded, [20, 9])
    with torch.inference_mode():
        expected = load_pretrained(tmp_path / "ckpt").embed(ids, mask, hashes=4)
    torch.testing.assert_close(load_onnx(out).embed(ids, mask), expected, atol=1e-3, rtol=0)


def test_the_default_model_matches_torch(tmp_path):
    """The shipped encoder (MiniLM-L6 converted to YOSO, 32 hashes of 8 bits) on real text."""
    from yoso_serve.model import default_model_dir
    from yoso_serve.model.export import export_onnx

    model = load_pretrained(default_model_dir())
    onnx = load_onnx(export_onnx(model, tmp_path))
    texts = ["The quick brown fox jumps over the lazy dog.", "YOSO attention samples buckets with LSH.",
             "Short."]
    rows = model.tokenizer.encode(texts)
    ids = torch.full((3, max(map(len, rows))), model.tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    with torch.inference_mode():
        expected = torch.nn.functional.normalize(model.embed(ids, mask), dim=-1)
    got = torch.nn.functional.normalize(onnx.embed(ids, mask), dim=-1)
    assert onnx.fixed_hashes == 32
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)


def _cuda_provider() -> bool:
    import onnxruntime

    return torch.cuda.is_available() and "CUDAExecutionProvider" in onnxruntime.get_available_providers()


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_provider(), reason="needs an NVIDIA GPU and onnxruntime-gpu")
def test_cuda_provider_matches_torch(lsh_dir, tiny_model, padded):
    onnx = load_onnx(lsh_dir, device="cuda")
    assert onnx.providers[0] == "CUDAExecutionProvider"
    ids, mask = _batch(tiny_model, padded)
    with torch.inference_mode():
        expected = tiny_model.embed(ids, mask)
    torch.testing.assert_close(onnx.embed(ids.cuda(), mask.cuda()), expected, atol=1e-3, rtol=0)
