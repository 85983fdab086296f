"""BERT → YOSO conversion: the packaged MiniLM against its teacher, key mapping, CLI, default model."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from yoso_serve.model import CheckpointError, convert_bert_to_yoso, default_model_dir, load_pretrained
from yoso_serve.model import default as default_module
from yoso_serve.model.convert import main
from yoso_serve.model.default import minilm_dir

SENTENCES = [
    "A man is playing a guitar on stage.",
    "The stock market fell sharply on Monday after the announcement.",
    "Cats are small domesticated carnivorous mammals.",
    "How do I bake sourdough bread at home?",
    "The quantum computer solved the problem in seconds.",
    "I love this movie.",
    "Heavy rain caused flooding in the northern districts overnight.",
    "She signed the contract before the deadline.",
]


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask[..., None].to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1)


def test_minilm_conversion_tracks_the_teacher(default_dir, kit):
    model = load_pretrained(default_dir)
    ids, mask = kit.pad_batch(model.tokenizer.encode(SENTENCES), model.tokenizer.pad_id)
    teacher = transformers.BertModel.from_pretrained(str(minilm_dir()), attn_implementation="eager").eval()
    with torch.no_grad():
        expected = mean_pool(teacher(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
        exact = model.embed(ids, mask, hashes=0)
        lsh = model.embed(ids, mask)  # the default: 32 hashes
    cosine = F.cosine_similarity(exact, expected)
    # Pairwise similarities between texts are reported, not asserted: without distillation the
    # converted model keeps each text near its teacher vector more than it keeps the fine geometry.
    ours, theirs = F.normalize(exact, dim=-1), F.normalize(expected, dim=-1)
    pairs = torch.triu_indices(len(SENTENCES), len(SENTENCES), offset=1)
    sims = torch.stack([(ours @ ours.T)[pairs[0], pairs[1]], (theirs @ theirs.T)[pairs[0], pairs[1]]])
    print(f"\nMiniLM→YOSO, cosine to the teacher: exact mean {cosine.mean():.3f} min {cosine.min():.3f}; "
          f"LSH-32 mean {F.cosine_similarity(lsh, expected).mean():.3f}; "
          f"pairwise-similarity correlation {torch.corrcoef(sims)[0, 1]:.3f}")
    assert cosine.mean() >= 0.8 and cosine.min() >= 0.75


def test_minilm_conversion_layout(default_dir):
    config = json.loads((default_dir / "config.json").read_text())
    assert (config["max_position_embeddings"], config["pooling"], config["use_expectation"]) == (4096, "mean", False)
    assert (config["num_hash"], config["hash_code_len"], config["type_vocab_size"]) == (32, 8, 2)
    for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json", "tokenizer_config.json"):
        assert (default_dir / name).is_file(), name
    assert json.loads((default_dir / "tokenizer_config.json").read_text())["model_max_length"] == 4096
    ours = load_file(str(default_dir / "model.safetensors"))
    bert = load_file(str(minilm_dir() / "model.safetensors"))
    table, learned = ours["yoso.embeddings.position_embeddings.weight"], bert["embeddings.position_embeddings.weight"]
    assert table.shape == (4098, 384)
    for start in range(2, 4098, 512):  # shifted by 2, then the 512 learned rows tiled
        assert torch.equal(table[start:start + 512], learned)
    assert torch.equal(ours["yoso.encoder.layer.5.output.dense.weight"], bert["encoder.layer.5.output.dense.weight"])
    assert not any(k.startswith(("pooler", "yoso.pooler")) for k in ours)


def test_conversion_fallback_converts_once(default_dir, monkeypatch):
    monkeypatch.setenv("YOSO_CACHE_DIR", str(default_dir.parent))

    def refuse(*args, **kwargs):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(default_module, "convert_bert_to_yoso", refuse)
    monkeypatch.setattr(default_module, "BUNDLED_DIR", default_dir.parent / "no-bundled-model")
    assert default_model_dir() == default_dir
    assert default_dir.name == "yoso-minilm-l6-4096"
    assert not [p for p in default_dir.parent.iterdir() if p.name.startswith(".")]  # no scratch left behind


def test_default_model_dir_prefers_a_bundled_model(tmp_path, monkeypatch):
    bundled = tmp_path / "bundled" / "distilled"
    bundled.mkdir(parents=True)
    (bundled / "config.json").write_text("{}")
    monkeypatch.setattr(default_module, "BUNDLED_DIR", tmp_path / "bundled")
    assert default_model_dir() == bundled


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    """A random BertForMaskedLM (keys under ``bert.``, MLM head under ``cls.``) with a tokenizer."""
    path = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=40)
    transformers.BertForMaskedLM(config).save_pretrained(path)
    (path / "vocab.txt").write_text((minilm_dir() / "vocab.txt").read_text())
    return path


def test_cli_converts_bert_with_mlm_head(tiny_bert_dir, tmp_path, capsys):
    assert main(["--from", str(tiny_bert_dir), "--out", str(tmp_path / "out"), "--max-positions", "100"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    model = load_pretrained(tmp_path / "out")
    assert model.has_mlm_head and model.config.max_length == 100 and model.tokenizer.num_special_tokens == 2
    bert = load_file(str(tiny_bert_dir / "model.safetensors"))
    torch.testing.assert_close(model.cls.predictions.transform.dense.weight,
                               bert["cls.predictions.transform.dense.weight"], rtol=0, atol=0)
    table = model.yoso.embeddings.position_embeddings.weight
    learned = bert["bert.embeddings.position_embeddings.weight"]
    assert torch.equal(table[2:42], learned) and torch.equal(table[82:102], learned[:20])
    ids = torch.tensor([model.tokenizer.encode(["word " * 90])[0]])
    assert ids.shape[1] == 92
    with torch.no_grad():
        assert torch.isfinite(model.mlm_logits(ids, torch.ones_like(ids), hashes=0)).all()


def test_convert_rejects_other_models(tmp_path, tiny_bert_dir):
    with pytest.raises(CheckpointError, match="no config.json"):
        convert_bert_to_yoso(tmp_path, tmp_path / "out")
    config = json.loads((tiny_bert_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="cannot convert model_type 'gpt2'"):
        convert_bert_to_yoso(tmp_path, tmp_path / "out")
    with pytest.raises(SystemExit) as exit_info:
        main(["--from", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2


def test_sentence_transformers_layout_and_cls_pooling(tiny_bert_dir, tmp_path):
    """modules.json points at the transformer folder and at a cls-pooling config."""
    src = tmp_path / "st"
    (src / "0_Transformer").mkdir(parents=True)
    (src / "1_Pooling").mkdir()
    for item in tiny_bert_dir.iterdir():
        (src / "0_Transformer" / item.name).write_bytes(item.read_bytes())
    (src / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    (src / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    model = load_pretrained(convert_bert_to_yoso(src, tmp_path / "out", max_positions=64))
    assert model.config.pooling == "cls"
    ids = torch.tensor(model.tokenizer.encode(["a short text"]))
    with torch.no_grad():
        torch.testing.assert_close(model.embed(ids, torch.ones_like(ids)), model.last_hidden(ids)[:, 0])
