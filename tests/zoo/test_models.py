"""Encoders of every attention type: padding, checkpoints, the hashes rule, config limits, BERT parity."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from yoso_serve.model import EncoderConfig, EncoderModel, load_pretrained, save_pretrained
from yoso_serve.model.config import ATTENTION_TYPES
from yoso_serve.model.default import minilm_dir

NON_YOSO = [t for t in ATTENTION_TYPES if t != "yoso"]
LENGTHS = [7, 50, 23]


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_text_alone_equals_text_padded_in_a_batch(attention_type, kit):
    model = kit.tiny_model(attention_type)
    seqs = kit.random_ids(LENGTHS)
    ids, mask = kit.pad_batch(seqs)
    with torch.no_grad():
        batched = model.last_hidden(ids, mask)
        garbage = ids.masked_fill(mask == 0, 5)  # real ids under the padding must not leak in
        real = mask.bool()
        torch.testing.assert_close(model.last_hidden(garbage, mask)[real], batched[real], atol=1e-5, rtol=1e-5)
        for row, seq in enumerate(seqs):
            alone = model.last_hidden(torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))
            torch.testing.assert_close(batched[row, : len(seq)], alone[0], atol=1e-5, rtol=1e-5)
    assert batched.shape == (3, 50, 32)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_checkpoint_round_trip(attention_type, kit, tmp_path):
    model = kit.tiny_model(attention_type, seed=4, with_classifier=True, id2label={0: "a", 1: "b"})
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert loaded.config == model.config and loaded.config.attention_type == attention_type
    ids, mask = kit.pad_batch(kit.random_ids([30, 12], seed=2))
    with torch.no_grad():
        torch.testing.assert_close(loaded.classify(ids, mask), model.classify(ids, mask), atol=0, rtol=0)
        torch.testing.assert_close(loaded.last_hidden(ids, mask), model.last_hidden(ids, mask), atol=0, rtol=0)
    extra = {"linformer": {"proj_k", "proj_v"}, "nystrom": {"conv.weight"}}.get(attention_type, set())
    own = {k.split("attention.self.core.")[1] for k in loaded.state_dict() if ".core." in k}
    assert own == extra  # Reformer's rotations are rebuilt from the seed, not stored


@pytest.mark.parametrize("attention_type", NON_YOSO)
def test_hashes_only_apply_to_yoso(attention_type, kit):
    model = kit.tiny_model(attention_type)
    assert model.config.default_hashes == 0
    ids, mask = kit.pad_batch(kit.random_ids([9]))
    with torch.no_grad():
        default = model.last_hidden(ids, mask)
        torch.testing.assert_close(model.last_hidden(ids, mask, hashes=0), default, atol=0, rtol=0)
        with pytest.raises(ValueError, match=f"hashes=8 only applies to attention_type=yoso.*'{attention_type}'"):
            model.embed(ids, mask, hashes=8)


def test_linformer_shared_kv_has_one_projection(kit):
    shared = kit.tiny_model("linformer", linformer_shared_kv=True)
    keys = [k for k in shared.state_dict() if ".core." in k]
    assert keys == [f"yoso.encoder.layer.{i}.attention.self.core.proj_k" for i in range(2)]
    assert tuple(shared.state_dict()[keys[0]].shape) == (16, 128)  # (k, max_position_embeddings)


@pytest.mark.parametrize("overrides,message", [
    (dict(attention_type="performer"), "attention_type must be one of"),
    (dict(attention_type="linformer", linformer_k=129), r"linformer_k \(129\) must be <= max_position_embeddings"),
    (dict(reformer_bucket_size=0), "reformer_bucket_size must be >= 1"),
    (dict(reformer_n_hashes=0), "reformer_n_hashes must be >= 1"),
    (dict(sparse_pattern="dilated"), "sparse_pattern must be one of"),
    (dict(sparse_stride=0), "sparse_stride must be >= 1"),
    (dict(nystrom_landmarks=0), "nystrom_landmarks must be >= 1"),
    (dict(nystrom_conv=4), "nystrom_conv must be an odd positive int"),
    (dict(attention_type="softmax", conv_window=3), "conv_window .* only applies to attention_type=yoso"),
])
def test_config_limits(overrides, message, kit):
    with pytest.raises(ValueError, match=message):
        EncoderConfig(**{**kit.TINY, **overrides})


def test_config_json_carries_the_attention_settings(kit, tmp_path):
    config = kit.tiny_config("sparse", sparse_pattern="fixed", sparse_stride=16, reversible=True)
    config.to_json_file(tmp_path / "config.json")
    assert EncoderConfig.from_json_file(tmp_path / "config.json") == config


def test_softmax_conversion_of_bert_is_bert(converted_dir, kit):
    """MiniLM (a BERT) converted, switched to softmax attention, equals transformers' BertModel."""
    src = minilm_dir()
    bert = transformers.BertModel.from_pretrained(src, attn_implementation="eager").eval()
    converted = load_pretrained(converted_dir)
    ours = EncoderModel(dataclasses.replace(converted.config, attention_type="softmax")).eval()
    ours.load_state_dict(converted.state_dict())
    text = kit.project_text()
    seqs = converted.tokenizer.encode([text[:3000], text[5000:5400]], max_length=512)
    ids, mask = kit.pad_batch(seqs)
    with torch.no_grad():
        expected = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours.last_hidden(ids, mask)
        yoso = converted.last_hidden(ids, mask, hashes=0)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=2e-4, rtol=2e-4)
    assert (yoso[real] - expected[real]).abs().max() > 0.1  # the oracle tells attention types apart
    assert max(len(s) for s in seqs) == 512 and min(len(s) for s in seqs) < 200


def test_reformer_rotations_stay_fp32_and_seeded(kit):
    from yoso_serve.model.attention.reformer import make_rotations, rotation_columns
    from yoso_serve.model.encoder import layer_seed

    model = kit.tiny_model("reformer", hash_seed=3).to(torch.bfloat16)
    core = model.yoso.encoder.layer[1].attention.self.core
    expected = make_rotations(layer_seed(3, 1), 2, 4, 8, rotation_columns(128, 8))
    assert core.rotations.dtype == torch.float32 and torch.equal(core.rotations, expected)
    ids, mask = kit.pad_batch(kit.random_ids([40, 25]))
    with torch.no_grad():
        assert torch.isfinite(model.last_hidden(ids, mask).float()).all()
