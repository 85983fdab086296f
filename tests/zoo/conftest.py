"""Fixtures for the attention zoo: tiny configs per type, padded batches, real Q/K/V of the default model."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
import torch
import yoso_testkit as testkit
from yoso_testkit import TINY, pad_batch, random_ids

from yoso_serve.model import EncoderConfig, EncoderModel, convert_bert_to_yoso, load_pretrained
from yoso_serve.model.default import DEFAULT_SETTINGS, minilm_dir

ROOT = Path(__file__).resolve().parents[2]
TYPES = ("yoso", "softmax", "linformer", "reformer", "linear", "sparse", "nystrom")
# Per-type settings small enough that the tiny inputs (up to 64 tokens) cross several blocks,
# chunks or segments, so that the batching and masking paths are really taken.
SMALL = {
    "yoso": dict(use_expectation=False),
    "linformer": dict(linformer_k=16),
    "reformer": dict(reformer_bucket_size=8, reformer_n_hashes=2),
    "sparse": dict(sparse_stride=8),
    "nystrom": dict(nystrom_landmarks=8, nystrom_conv=3),
}
QKV_LAYER = 2
QKV_TOKENS = 512


def tiny_config(attention_type: str, **overrides) -> EncoderConfig:
    return testkit.tiny_config(**{"attention_type": attention_type, **SMALL.get(attention_type, {}), **overrides})


def tiny_model(attention_type: str, seed: int = 0, *, with_classifier: bool = False, **overrides) -> EncoderModel:
    return testkit.tiny_model(seed, with_classifier=with_classifier, **{"attention_type": attention_type,
                                                                          **SMALL.get(attention_type, {}), **overrides})


def project_text() -> str:
    """Real English text that every checkout has: the README and the docs."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file())


def layer_qkv(model: EncoderModel, ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
    """(B, H, N, D) Q, K, V computed by ``layer``'s own linears during a forward of ``model``."""
    grabbed = {}
    attention = model.encoder.encoder.layer[layer].attention.self
    hooks = [getattr(attention, name).register_forward_hook(
        lambda _m, _i, out, name=name: grabbed.__setitem__(name, out)) for name in ("query", "key", "value")]
    try:
        with torch.no_grad():
            model.last_hidden(ids, torch.ones_like(ids))
    finally:
        for hook in hooks:
            hook.remove()
    return tuple(attention.split_heads(grabbed[name]).contiguous() for name in ("query", "key", "value"))


@pytest.fixture(scope="session")
def converted_dir(tmp_path_factory) -> Path:
    """all-MiniLM-L6-v2 converted as default_model_dir() converts it (not a bundled distilled model:
    its weights were trained for YOSO, while MiniLM's own attention, the reference here, is softmax)."""
    return convert_bert_to_yoso(minilm_dir(), tmp_path_factory.mktemp("minilm") / "yoso", **DEFAULT_SETTINGS)


@pytest.fixture(scope="session")
def real_qkv(converted_dir):
    """Q, K, V (1, 12, 512, 32) of layer 2 of converted MiniLM (run with softmax attention) on the docs."""
    model = load_pretrained(converted_dir)
    softmax_model = EncoderModel(dataclasses.replace(model.config, attention_type="softmax")).eval()
    softmax_model.load_state_dict(model.state_dict())
    ids = model.tokenizer.encode([project_text()], max_length=QKV_TOKENS)[0]
    assert len(ids) == QKV_TOKENS, "the project's docs should hold at least 512 tokens"
    return layer_qkv(softmax_model, torch.tensor([ids]), QKV_LAYER)


@pytest.fixture(scope="session")
def kit():
    """The helpers above (test modules cannot import conftest under --import-mode=importlib)."""
    return types.SimpleNamespace(TYPES=TYPES, TINY=TINY, tiny_config=tiny_config, tiny_model=tiny_model,
                                 random_ids=random_ids, pad_batch=pad_batch, layer_qkv=layer_qkv,
                                 project_text=project_text)
