"""Parity with transformers' YOSO models in both directions (exact mode, unpadded inputs).

transformers' YOSO ignores the padding mask (it turns the 0/1 mask into all ones), so parity is
checked on batches without padding; our masking is tested in test_encoder.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from yoso_serve.model import load_pretrained, save_pretrained

HF_TINY = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    type_vocab_size=2,
    hash_code_len=6,
    use_expectation=True,
    pad_token_id=0,
)
HF_CLASSES = {
    "base": transformers.YosoModel,
    "classifier": transformers.YosoForSequenceClassification,
    "mlm": transformers.YosoForMaskedLM,
}


def randomize(model: torch.nn.Module) -> None:
    """Weights well away from the 0.02-std init, so that heads' outputs are O(1) and any slip shows."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "LayerNorm.weight" in name else 0.15 * noise)


def hf_outputs(model, kind: str, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return out.last_hidden_state if kind == "base" else out.logits


def our_outputs(model, kind: str, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if kind == "classifier":
            return model.classify(ids, mask)
        if kind == "mlm":
            return model.mlm_logits(ids, mask)
        return model.last_hidden(ids, mask)


@pytest.fixture(scope="module")
def ids(kit):
    return torch.tensor(kit.random_ids([19, 19, 19], seed=11))


@pytest.mark.parametrize("conv_window", [None, 3])
@pytest.mark.parametrize("kind", ["base", "classifier", "mlm"])
def test_transformers_checkpoint_loads_with_same_outputs(kind, conv_window, ids, tmp_path):
    torch.manual_seed(0)
    config = transformers.YosoConfig(**HF_TINY, conv_window=conv_window, num_labels=3)
    theirs = HF_CLASSES[kind](config).eval()
    randomize(theirs)
    theirs.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.has_classifier == (kind == "classifier")
    assert ours.has_mlm_head == (kind == "mlm")
    assert ours.config.default_hashes == 0
    expected = hf_outputs(theirs, kind, ids)
    torch.testing.assert_close(our_outputs(ours, kind, ids), expected, atol=1e-4, rtol=1e-4)
    assert expected.abs().mean() > 0.1  # not a trivially small output


@pytest.mark.parametrize("kind", ["base", "classifier", "mlm"])
def test_our_checkpoint_loads_in_transformers(kind, kit, ids, tmp_path):
    labels = {0: "neg", 1: "pos"} if kind == "classifier" else None
    ours = kit.tiny_model(seed=2, with_classifier=kind == "classifier", with_mlm=kind == "mlm",
                          use_expectation=True, max_position_embeddings=64, conv_window=5, id2label=labels)
    randomize(ours)
    save_pretrained(ours, tmp_path)
    theirs = HF_CLASSES[kind].from_pretrained(tmp_path).eval()
    if kind == "classifier":
        assert theirs.config.id2label == labels
    expected = our_outputs(ours, kind, ids)
    torch.testing.assert_close(hf_outputs(theirs, kind, ids), expected, atol=1e-4, rtol=1e-4)
    assert expected.abs().mean() > 0.1


def test_our_config_json_is_a_transformers_yoso_config(kit, tmp_path):
    ours = kit.tiny_model(hash_seed=7, pooling="cls", num_hash=12)
    save_pretrained(ours, tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(config).__name__ == "YosoConfig"
    assert (config.num_hash, config.hash_code_len, config.hash_seed, config.pooling) == (12, 6, 7, "cls")
