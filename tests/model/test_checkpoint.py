"""Checkpoint directories: round trips, fp16 storage, legacy keys, and every CheckpointError."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from yoso_serve.model import CheckpointError, EncoderConfig, load_pretrained, save_pretrained


@pytest.fixture()
def saved(kit, tmp_path):
    model = kit.tiny_model(seed=4, with_classifier=True, with_mlm=True, id2label={0: "a", 1: "b", 2: "c"})
    save_pretrained(model, tmp_path)
    return model, tmp_path


def test_save_load_round_trip_is_bit_identical(saved, kit):
    model, path = saved
    loaded = load_pretrained(path)
    assert not loaded.training
    original, restored = model.state_dict(), loaded.state_dict()
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[k], restored[k]) for k in original)
    assert loaded.id2label == {0: "a", 1: "b", 2: "c"}
    ids, mask = kit.pad_batch(kit.random_ids([6, 11]))
    with torch.no_grad():
        assert torch.equal(model.embed(ids, mask, hashes=8), loaded.embed(ids, mask, hashes=8))
        assert torch.equal(model.classify(ids, mask), loaded.classify(ids, mask))


def test_saved_keys_are_transformers_keys(saved):
    _, path = saved
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert "yoso.encoder.layer.1.attention.self.query.weight" in keys
    assert {"classifier.dense.weight", "classifier.out_proj.bias", "cls.predictions.bias",
            "cls.predictions.transform.LayerNorm.weight"} <= keys
    assert "cls.predictions.decoder.weight" not in keys  # tied to the word embeddings
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "yoso" and config["architectures"] == ["YosoForSequenceClassification"]


def test_fp16_storage_loads_to_fp32(saved, tmp_path):
    model, _ = saved
    save_pretrained(model, tmp_path / "half", dtype=torch.float16)
    with safe_open(str(tmp_path / "half" / "model.safetensors"), "pt") as f:
        assert f.get_slice("yoso.embeddings.word_embeddings.weight").get_dtype() == "F16"
    loaded = load_pretrained(tmp_path / "half")
    for key, value in model.state_dict().items():
        assert loaded.state_dict()[key].dtype == torch.float32
        assert torch.equal(loaded.state_dict()[key], value.half().float()), key


def test_pytorch_bin_bare_keys_and_legacy_buffers_load(saved, tmp_path):
    model, path = saved
    base = {k.removeprefix("yoso."): v for k, v in model.state_dict().items() if k.startswith("yoso.")}
    base["embeddings.position_ids"] = torch.arange(130)[None]  # written by old transformers versions
    out = tmp_path / "bin"
    out.mkdir()
    torch.save(base, out / "pytorch_model.bin")
    (out / "config.json").write_text((path / "config.json").read_text())
    loaded = load_pretrained(out)
    assert not loaded.has_classifier and not loaded.has_mlm_head and loaded.tokenizer is None
    assert torch.equal(loaded.yoso.embeddings.word_embeddings.weight, model.yoso.embeddings.word_embeddings.weight)


def test_load_to_dtype(saved):
    _, path = saved
    loaded = load_pretrained(path, dtype=torch.bfloat16)
    assert loaded.yoso.encoder.layer[0].attention.self.query.weight.dtype == torch.bfloat16


def test_missing_directory_and_files(tmp_path, saved):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(empty)
    (empty / "config.json").write_text((saved[1] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no weights"):
        load_pretrained(empty)


@pytest.mark.parametrize(("model_type", "message"), [("bert", "yoso-convert"), ("gpt2", "unsupported model_type")])
def test_unsupported_config(saved, model_type, message):
    _, path = saved
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(path)


def test_invalid_config_values(saved):
    _, path = saved
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "hash_code_len": 40}))
    with pytest.raises(CheckpointError, match="hash_code_len"):
        load_pretrained(path)


def test_shape_mismatch_names_key_and_shapes(saved):
    model, path = saved
    state = load_file(str(path / "model.safetensors"))
    state["yoso.encoder.layer.0.attention.self.key.weight"] = torch.zeros(32, 31)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_pretrained(path)
    assert "yoso.encoder.layer.0.attention.self.key.weight" in str(err.value)
    assert "(32, 31)" in str(err.value) and "(32, 32)" in str(err.value)


def test_missing_and_unexpected_weights(saved):
    model, path = saved
    state = load_file(str(path / "model.safetensors"))
    del state["yoso.encoder.layer.1.output.dense.bias"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing weights \['yoso.encoder.layer.1.output.dense.bias'\]"):
        load_pretrained(path)
    state["yoso.encoder.layer.1.output.dense.bias"] = torch.zeros(32)
    state["qa_outputs.weight"] = torch.zeros(2, 32)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="qa_outputs.weight"):
        load_pretrained(path)


def test_corrupt_safetensors(saved):
    _, path = saved
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read the weights"):
        load_pretrained(path)


def test_config_json_round_trip(tmp_path):
    config = EncoderConfig(hidden_size=64, num_attention_heads=4, conv_window=5, id2label={0: "x", 1: "y"},
                           hash_seed=9, pooling="cls", attention_backend="torch")
    config.to_json_file(tmp_path / "config.json")
    again = EncoderConfig.from_json_file(tmp_path / "config.json")
    assert again == config
    assert again.label2id == {"x": 0, "y": 1} and again.max_length == 4096
    with pytest.raises(ValueError, match="hidden_size"):
        EncoderConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="conv_window"):
        EncoderConfig(conv_window=4)
    with pytest.raises(ValueError, match="attention_backend"):
        EncoderConfig(attention_backend="tpu")


def test_weight_files_is_the_one_precedence_and_the_export_key_follows_it(saved, tmp_path):
    from yoso_serve.model.checkpoint import WEIGHTS_BIN, WEIGHTS_INDEX, WEIGHTS_SAFETENSORS, weight_files
    from yoso_serve.model.export_cache import export_key

    model, path = saved
    state = load_file(str(path / WEIGHTS_SAFETENSORS))
    torch.save(state, path / WEIGHTS_BIN)
    keys = sorted(state)
    half = len(keys) // 2
    for name, part in (("a.safetensors", keys[:half]), ("b.safetensors", keys[half:])):
        save_file({k: state[k] for k in part}, str(path / name))
    (path / WEIGHTS_INDEX).write_text(json.dumps({"weight_map": {k: "a.safetensors" if i < half else "b.safetensors"
                                                                 for i, k in enumerate(keys)}}))
    assert weight_files(path) == [path / WEIGHTS_SAFETENSORS]  # all three there: the single file wins
    before = export_key(path, 8)
    (path / WEIGHTS_BIN).write_bytes(b"not read")  # a file that does not win does not move the key
    assert export_key(path, 8) == before
    (path / WEIGHTS_SAFETENSORS).unlink()
    assert weight_files(path) == [path / WEIGHTS_INDEX, path / "a.safetensors", path / "b.safetensors"]
    assert export_key(path, 8) != before
    reloaded = load_pretrained(path).state_dict()  # the loader reads the shards
    assert all(torch.equal(v, reloaded[k]) for k, v in model.state_dict().items())
    (path / WEIGHTS_INDEX).unlink()
    assert weight_files(path) == [path / WEIGHTS_BIN]
    (path / WEIGHTS_BIN).unlink()
    with pytest.raises(CheckpointError, match="no weights in .*expected model.safetensors"):
        weight_files(path)
