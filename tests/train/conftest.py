"""Tiny real models for the training tests: a random BERT (written by transformers, a dev
extra) as teacher, and its conversion as the YOSO student. Small enough for seconds per run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

WORDS = ("alpha beta gamma delta python module function class return value list dict string number "
         "file path error raise import loop while for if else true false none object method type").split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_tiny_bert(path: Path, *, max_positions: int = 64, seed: int = 0) -> Path:
    from transformers import BertConfig, BertModel

    path.mkdir(parents=True, exist_ok=True)
    vocab = SPECIALS + WORDS + list("abcdefghijklmnopqrstuvwxyz") + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "mask_token": "[MASK]"}))
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=max_positions, pad_token_id=0)
    BertModel(config, add_pooling_layer=False).save_pretrained(path)
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return path


def sentences(n: int, seed: int = 0, lo: int = 4, hi: int = 12) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny-bert")


@pytest.fixture(scope="session")
def tiny_yoso(tiny_bert, tmp_path_factory) -> Path:
    from yoso_serve.model import convert_bert_to_yoso

    return convert_bert_to_yoso(tiny_bert, tmp_path_factory.mktemp("yoso") / "tiny-yoso", max_positions=128,
                                num_hash=8, hash_code_len=4)


@pytest.fixture(scope="session")
def topic_data(tmp_path_factory) -> Path:
    """A separable two-topic task: every text about alpha/beta is "greek", python/module is "code"."""
    rng = random.Random(1)
    rows = []
    for i in range(48):
        label = ("greek", "code")[i % 2]
        pool = ("alpha", "beta", "gamma", "delta") if label == "greek" else ("python", "module", "function", "class")
        rows.append({"text": " ".join(rng.choice(pool) for _ in range(rng.randint(3, 8))), "label": label})
    return write_jsonl(tmp_path_factory.mktemp("data") / "topics.jsonl", rows)


@pytest.fixture(name="sentences")
def sentences_fixture():
    """The ``sentences`` helper (test modules cannot import conftest under importlib mode)."""
    return sentences


@pytest.fixture(name="write_jsonl")
def write_jsonl_fixture():
    return write_jsonl


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine spinning OpenMP workers cost seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
