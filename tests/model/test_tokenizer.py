"""TextTokenizer: the three on-disk formats, truncation, offsets, special tokens."""

from __future__ import annotations

import json

import pytest
import transformers
from tokenizers import ByteLevelBPETokenizer

from yoso_serve.model import TextTokenizer
from yoso_serve.model.default import minilm_dir

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "##s", "dog", ",", "."]
TEXTS = ["The cat sat on the mats.", "A dog, the cat.", "Tokenizers handle long documents; YOSO attends to them."]


@pytest.fixture()
def wordpiece_dir(tmp_path):
    (tmp_path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    return tmp_path


@pytest.fixture(scope="module")
def minilm():
    return TextTokenizer.from_dir(minilm_dir())


@pytest.fixture()
def bpe_dir(tmp_path):
    trainer = ByteLevelBPETokenizer()
    corpus = ["the cat sat on the mat", "the dog sat on the log", "cats and dogs"] * 20
    trainer.train_from_iterator(corpus, vocab_size=300, min_frequency=1,
                                special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    trainer.save_model(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merges.txt", "vocab.json"]
    return tmp_path


def test_wordpiece_from_vocab_txt(wordpiece_dir):
    tok = TextTokenizer.from_dir(wordpiece_dir)
    ids = tok.encode(["The cat sat on the mats."])[0]
    assert tok.decode_tokens(ids) == ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "##s", ".", "[SEP]"]
    assert tok.encode(["zebra"])[0] == [2, 1, 3]  # unknown word → [UNK]
    assert (tok.num_special_tokens, tok.pad_id, tok.vocab_size) == (2, 0, len(WORDS))
    assert tok.wrap([7, 8]) == [2, 7, 8, 3]


def test_tokenizer_json_matches_transformers(minilm):
    reference = transformers.AutoTokenizer.from_pretrained(str(minilm_dir()))
    assert minilm.encode(TEXTS) == [reference(t)["input_ids"] for t in TEXTS]
    assert minilm.pad_id == reference.pad_token_id and minilm.vocab_size == reference.vocab_size


def test_vocab_txt_and_tokenizer_json_agree(minilm, tmp_path):
    (tmp_path / "vocab.txt").write_text((minilm_dir() / "vocab.txt").read_text())
    assert TextTokenizer.from_dir(tmp_path).encode(TEXTS) == minilm.encode(TEXTS)


def test_file_truncation_and_padding_are_switched_off(minilm):
    # MiniLM's tokenizer.json pads and truncates to 128; our encode does neither unless asked
    long_text = "word " * 300
    assert len(minilm.encode([long_text])[0]) == 302
    assert len(minilm.encode(["short"])[0]) == 3


def test_byte_level_bpe_from_vocab_and_merges(bpe_dir):
    tok = TextTokenizer.from_dir(bpe_dir)
    reference = ByteLevelBPETokenizer(str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt"))
    ids = tok.encode(["the cat sat on the mat"])[0]
    bos, eos = reference.token_to_id("<s>"), reference.token_to_id("</s>")
    assert ids == [bos, *reference.encode("the cat sat on the mat").ids, eos]
    assert tok.num_special_tokens == 2 and tok.pad_id == reference.token_to_id("<pad>")
    assert "Ġcat" in tok.decode_tokens(ids)
    assert tok.tokenizer.decode(ids) == "the cat sat on the mat"


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncation_side_and_max_length(minilm, side):
    full = minilm.encode([TEXTS[2]])[0]
    cut = minilm.encode([TEXTS[2]], max_length=6, truncation_side=side)[0]
    assert len(cut) == 6 and cut[0] == full[0] and cut[-1] == full[-1]
    content = full[1:-1]
    assert cut[1:-1] == (content[:4] if side == "right" else content[-4:])
    assert minilm.encode([TEXTS[0]], max_length=500) == minilm.encode([TEXTS[0]])
    bare = minilm.encode([TEXTS[2]], max_length=3, add_special_tokens=False)[0]
    assert bare == content[:3]


def test_truncation_errors(minilm):
    with pytest.raises(ValueError, match="no room"):
        minilm.encode(["text"], max_length=2)
    with pytest.raises(ValueError, match="truncation_side"):
        minilm.encode(["text"], max_length=5, truncation_side="middle")


def test_offsets_point_into_the_text(minilm):
    (ids, offsets), = minilm.encode_with_offsets([TEXTS[2]])
    assert ids == minilm.encode([TEXTS[2]])[0]
    assert offsets[0] == (0, 0) and offsets[-1] == (0, 0)
    for token, (start, end) in zip(minilm.decode_tokens(ids)[1:-1], offsets[1:-1]):
        assert TEXTS[2][start:end].lower() == token.removeprefix("##")
    (cut, cut_offsets), = minilm.encode_with_offsets([TEXTS[2]], max_length=5, truncation_side="left")
    assert cut == minilm.encode([TEXTS[2]], max_length=5, truncation_side="left")[0]
    assert cut_offsets[1:-1] == offsets[-4:-1]


def test_save_and_reload(minilm, tmp_path):
    minilm.save(tmp_path)
    again = TextTokenizer.from_dir(tmp_path)
    assert again.encode(TEXTS) == minilm.encode(TEXTS)
    assert json.loads((tmp_path / "special_tokens_map.json").read_text())["cls_token"] == "[CLS]"
    assert (tmp_path / "tokenizer_config.json").is_file()


def test_no_tokenizer_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        TextTokenizer.from_dir(tmp_path)
