"""``TextTokenizer``: a fast ``tokenizers.Tokenizer`` with the few operations the service needs.

Loaded from ``tokenizer.json``, or built from ``vocab.txt`` (BERT WordPiece) or
``vocab.json`` + ``merges.txt`` (byte-level BPE, RoBERTa-style). Truncation is ours, not the
tokenizer file's: any truncation/padding stored in ``tokenizer.json`` is switched off, and
``encode`` cuts the content to ``max_length`` minus the special tokens, from the right or the
left, then wraps it (CLS/SEP or BOS/EOS, whatever the file's post-processor adds).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# Files that travel with the tokenizer (copied on save when they were present on load).
SIDE_FILES = ("special_tokens_map.json", "tokenizer_config.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "merges.txt")

_PROBE = "probe text"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_str(value) -> str | None:
    """A special token as written in tokenizer_config/special_tokens_map (plain or AddedToken dict)."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class TextTokenizer:
    """Wraps a ``tokenizers.Tokenizer``; ``specials`` maps names ("pad_token", ...) to token strings."""

    def __init__(self, tokenizer: Tokenizer, *, specials: dict[str, str] | None = None,
                 side_files: dict[str, dict] | None = None):
        self.tokenizer = tokenizer
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.specials = dict(specials or {})
        self.side_files = dict(side_files or {})
        self._prefix, self._suffix = self._find_wrap()

    # --- construction -----------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> "TextTokenizer":
        """Load from tokenizer.json, else vocab.txt (WordPiece), else vocab.json + merges.txt (BPE)."""
        path = Path(path)
        side = {name: _read_json(path / name) for name in SIDE_FILES if (path / name).is_file()}
        specials = {}
        for data in (side.get("tokenizer_config.json", {}), side.get("special_tokens_map.json", {})):
            for key, value in data.items():
                if key.endswith("_token") and isinstance(_token_str(value), str):
                    specials[key] = _token_str(value)
        if (path / "tokenizer.json").is_file():
            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        elif (path / "vocab.txt").is_file():
            lower = side.get("tokenizer_config.json", {}).get("do_lower_case", True)
            tok = cls._wordpiece(path / "vocab.txt", specials, lower)
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            tok = cls._byte_level_bpe(path / "vocab.json", path / "merges.txt", specials)
        else:
            raise FileNotFoundError(
                f"no tokenizer in {path}: expected tokenizer.json, vocab.txt, or vocab.json + merges.txt"
            )
        return cls(tok, specials=specials, side_files=side)

    @staticmethod
    def _wordpiece(vocab: Path, specials: dict[str, str], lowercase: bool) -> Tokenizer:
        unk = specials.setdefault("unk_token", "[UNK]")
        cls_tok = specials.setdefault("cls_token", "[CLS]")
        sep_tok = specials.setdefault("sep_token", "[SEP]")
        specials.setdefault("pad_token", "[PAD]")
        tok = Tokenizer(models.WordPiece.from_file(str(vocab), unk_token=unk))
        tok.normalizer = normalizers.BertNormalizer(lowercase=bool(lowercase))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        TextTokenizer._register_specials(tok, specials)
        tok.post_processor = processors.BertProcessing(
            (sep_tok, tok.token_to_id(sep_tok)), (cls_tok, tok.token_to_id(cls_tok))
        )
        return tok

    @staticmethod
    def _byte_level_bpe(vocab: Path, merges: Path, specials: dict[str, str]) -> Tokenizer:
        bos = specials.setdefault("bos_token", "<s>")
        eos = specials.setdefault("eos_token", "</s>")
        specials.setdefault("pad_token", "<pad>")
        specials.setdefault("unk_token", "<unk>")
        tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        TextTokenizer._register_specials(tok, specials)
        if tok.token_to_id(bos) is not None and tok.token_to_id(eos) is not None:
            tok.post_processor = processors.RobertaProcessing(
                (eos, tok.token_to_id(eos)), (bos, tok.token_to_id(bos)), trim_offsets=True, add_prefix_space=False
            )
        else:
            tok.post_processor = processors.ByteLevel(trim_offsets=True)
        return tok

    @staticmethod
    def _register_specials(tok: Tokenizer, specials: dict[str, str]) -> None:
        """Mark the vocabulary's special tokens as such: never split, skipped when decoding."""
        tok.add_special_tokens(sorted({t for t in specials.values() if tok.token_to_id(t) is not None}))

    def _find_wrap(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a single sequence."""
        bare = self.tokenizer.encode(_PROBE, add_special_tokens=False).ids
        full = self.tokenizer.encode(_PROBE, add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start:start + len(bare)] == bare:
                return full[:start], full[start + len(bare):]
        raise ValueError("the tokenizer's post-processor changes the content ids; cannot find its wrapping")

    # --- properties -------------------------------------------------------------------
    @property
    def num_special_tokens(self) -> int:
        """Special tokens added to one sequence (2 for BERT: [CLS] … [SEP])."""
        return len(self._prefix) + len(self._suffix)

    @property
    def pad_id(self) -> int:
        for name in (self.specials.get("pad_token"), "[PAD]", "<pad>"):
            if name is not None and self.tokenizer.token_to_id(name) is not None:
                return self.tokenizer.token_to_id(name)
        return 0

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # --- encoding ---------------------------------------------------------------------
    def wrap(self, ids: list[int]) -> list[int]:
        """Add the special tokens of a single sequence (CLS/SEP or BOS/EOS) around content ids."""
        return [*self._prefix, *ids, *self._suffix]

    def _truncate(self, ids: list, max_length: int | None, side: str, add_special_tokens: bool) -> list:
        if side not in ("right", "left"):
            raise ValueError(f"truncation_side must be 'right' or 'left', got {side!r}")
        if max_length is None:
            return ids
        room = max_length - (self.num_special_tokens if add_special_tokens else 0)
        if room < 1:
            raise ValueError(
                f"max_length {max_length} leaves no room for content after {self.num_special_tokens} special tokens"
            )
        if len(ids) <= room:
            return ids
        return ids[:room] if side == "right" else ids[len(ids) - room:]

    def encode(self, texts: list[str], *, max_length: int | None = None, truncation_side: str = "right",
               add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids per text; ``max_length`` counts special tokens (None = no truncation)."""
        out = []
        for enc in self.tokenizer.encode_batch(list(texts), add_special_tokens=False):
            ids = self._truncate(enc.ids, max_length, truncation_side, add_special_tokens)
            out.append(self.wrap(ids) if add_special_tokens else ids)
        return out

    def encode_with_offsets(self, texts: list[str], add_special_tokens: bool = True, *,
                            max_length: int | None = None, truncation_side: str = "right",
                            ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """(ids, character offsets) per text; special tokens get the offset (0, 0)."""
        out = []
        for enc in self.tokenizer.encode_batch(list(texts), add_special_tokens=False):
            pairs = self._truncate(list(zip(enc.ids, enc.offsets)), max_length, truncation_side, add_special_tokens)
            ids = [i for i, _ in pairs]
            offsets = [tuple(o) for _, o in pairs]
            if add_special_tokens:
                ids = self.wrap(ids)
                offsets = [(0, 0)] * len(self._prefix) + offsets + [(0, 0)] * len(self._suffix)
            out.append((ids, offsets))
        return out

    def decode_tokens(self, ids: list[int]) -> list[str]:
        """The token string of each id (e.g. "[CLS]", "##ing", "Ġthe")."""
        return [self.tokenizer.id_to_token(int(i)) for i in ids]

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json and the side files (special_tokens_map.json, tokenizer_config.json)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path / "tokenizer.json"))
        side = dict(self.side_files)
        side.setdefault("special_tokens_map.json", {k: v for k, v in self.specials.items()
                                                   if k != "additional_special_tokens"})
        for name, data in side.items():
            with open(path / name, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2)
                f.write("\n")
