"""Shared fixtures for the model tests: tiny configs, padded batches, the converted default model."""

from __future__ import annotations

import types

import pytest
import torch

from yoso_serve.model import EncoderConfig, EncoderModel
from yoso_serve.model.default import converted_minilm_dir

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
    type_vocab_size=2,
    hash_code_len=6,
    num_hash=16,
    pad_token_id=0,
)


def tiny_config(**overrides) -> EncoderConfig:
    return EncoderConfig(**{**TINY, **overrides})


def tiny_model(seed: int = 0, *, with_classifier=False, with_mlm=False, **overrides) -> EncoderModel:
    torch.manual_seed(seed)
    return EncoderModel(tiny_config(**overrides), with_classifier=with_classifier, with_mlm=with_mlm).eval()


def random_ids(lengths: list[int], *, vocab: int = TINY["vocab_size"], seed: int = 0) -> list[list[int]]:
    """Token ids avoiding 0 (the pad id), one list per length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def pad_batch(seqs: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad → input_ids (B, N) int64 and attention_mask (B, N) int64."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask


@pytest.fixture(scope="session")
def default_dir(tmp_path_factory):
    """all-MiniLM-L6-v2 converted as the default-model fallback does, once per session, in a private cache."""
    cache = tmp_path_factory.mktemp("yoso-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("YOSO_CACHE_DIR", str(cache))
        path = converted_minilm_dir()
    return path


@pytest.fixture(scope="session")
def kit():
    """The helpers above (test modules cannot import conftest under --import-mode=importlib)."""
    return types.SimpleNamespace(tiny_config=tiny_config, tiny_model=tiny_model, random_ids=random_ids,
                                 pad_batch=pad_batch, TINY=TINY)
