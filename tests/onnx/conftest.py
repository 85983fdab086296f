"""Shared fixtures for the ONNX tests: tiny models exported once per session, padded batches.

Each export costs about a second; the directories are session-scoped so every test reads them.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import torch
import yoso_testkit as testkit

from yoso_serve.model import EncoderConfig, EncoderModel, TextTokenizer
from yoso_serve.model.default import minilm_dir
from yoso_serve.model.export import export_onnx

# yoso_testkit's tiny encoder on MiniLM's vocabulary, LSH by default, with room for 160 tokens
TINY = dict(testkit.TINY, max_position_embeddings=160, hash_seed=11, use_expectation=False)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _tiny_model(seed: int = 0, *, labels=None, **overrides) -> EncoderModel:
    torch.manual_seed(seed)
    tokenizer = TextTokenizer.from_dir(minilm_dir())
    config = EncoderConfig(**{**TINY, "vocab_size": tokenizer.vocab_size, "pad_token_id": tokenizer.pad_id,
                              "id2label": labels, **overrides})
    return EncoderModel(config, with_classifier=labels is not None, tokenizer=tokenizer).eval()


def _padded(lengths: list[int], *, pad: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch of random ids (never the pad id) with the given real lengths."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(pad + 1, vocab, (n,), generator=gen)
        mask[row, :n] = 1
    return ids, mask


@pytest.fixture(scope="session")
def tiny_model() -> EncoderModel:
    """LSH (16 hashes of 6 bits), classification head with three labels, mean pooling."""
    return _tiny_model(labels=LABELS)


@pytest.fixture(scope="session")
def lsh_dir(tiny_model, tmp_path_factory) -> Path:
    return export_onnx(tiny_model, tmp_path_factory.mktemp("onnx-lsh"))


@pytest.fixture(scope="session")
def exact_dir(tiny_model, tmp_path_factory) -> Path:
    return export_onnx(tiny_model, tmp_path_factory.mktemp("onnx-exact"), hashes=0)


@pytest.fixture(scope="session")
def conv_cls_model() -> EncoderModel:
    """YOSO-C (conv_window 5), cls pooling, Gaussian hyperplanes, no classifier."""
    return _tiny_model(1, conv_window=5, pooling="cls", use_fast_hash=False, hash_code_len=5)


@pytest.fixture
def int8_model() -> EncoderModel:
    """The tiny encoder hashing in int8 (hash_int8), no classifier."""
    return _tiny_model(2, hash_int8=True)


@pytest.fixture(scope="session")
def conv_cls_dir(conv_cls_model, tmp_path_factory) -> Path:
    return export_onnx(conv_cls_model, tmp_path_factory.mktemp("onnx-conv"), hashes=8)


@pytest.fixture
def padded():
    return _padded


@pytest.fixture
def make_tiny_model():
    """``make_tiny_model(seed=0, labels=None, **config_overrides)``: a fresh tiny model, TINY's config."""
    return _tiny_model


@pytest.fixture(scope="session")
def torch_dir(tiny_model, tmp_path_factory) -> Path:
    """The checkpoint ``lsh_dir`` was exported from, for the torch runtime."""
    from yoso_serve.model import save_pretrained

    return save_pretrained(tiny_model, tmp_path_factory.mktemp("torch-ckpt"))


@asynccontextmanager
async def _serving(model_dir: Path, **overrides):
    """The app on ``model_dir`` with its lifespan running and ready, and an in-process httpx client
    (httpx.ASGITransport does not run the lifespan; tests/service/conftest.py does the same). auto's
    exact switch is off and the dense layers fp32 unless asked for: the torch side is the LSH oracle of the ONNX
    graph, which runs fp32 (auto, bf16 where the CPU has it, is asked for where a test compares it)."""
    from yoso_serve.service import ServeSettings, create_app

    app = create_app(ServeSettings(model=model_dir, **{"auto_exact_below": 0, "dense_dtype": "fp32", **overrides}))
    async with app.router.lifespan_context(app):
        await app.state.startup
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            yield client


@pytest.fixture
def serve():
    return _serving
