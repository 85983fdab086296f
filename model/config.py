"""The encoder's configuration: one dataclass, stored with the weights as ``config.json``.

The fields are transformers' ``YosoConfig`` (so a directory we write loads in
``transformers.YosoModel``) plus ours: the hash seed, the pooling of :meth:`embed`, the
attention backend, the attention type with its per-type settings (model/attention/) and the
reversible-layer training option (model/reversible.py). Unknown keys in a ``config.json`` (for example
``transformers_version`` or ``dtype``) are ignored on load.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLINGS = ("mean", "cls")
ATTENTION_BACKENDS = ("auto", "torch", "cpp", "cuda")
ATTENTION_TYPES = ("yoso", "softmax", "linformer", "reformer", "linear", "sparse", "nystrom")
SPARSE_PATTERNS = ("strided", "fixed")
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu", "swish", "tanh")

# Sequences longer than this run the feed-forward block in chunks of FFN_CHUNK_SIZE positions
# (Reformer's chunked FFN) when ``chunk_size_feed_forward`` is 0: the (B, N, intermediate)
# activation is the largest tensor of a layer, and chunking bounds it without changing a bit
# of the result (the FFN is position-wise).
FFN_CHUNK_THRESHOLD = 4096
FFN_CHUNK_SIZE = 1024


@dataclass
class EncoderConfig:
    """Hyper-parameters of a YOSO encoder; the defaults are transformers' ``YosoConfig`` defaults."""

    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 4096
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | None = 2
    use_expectation: bool = True
    hash_code_len: int = 9
    num_hash: int = 64
    conv_window: int | None = None
    use_fast_hash: bool = True
    lsh_backward: bool = True
    id2label: dict[int, str] | None = None
    label2id: dict[str, int] | None = None
    problem_type: str | None = None
    # ours
    hash_seed: int = 0
    # LSH codes from int8 rows and planes (kernels/hashing.py): ~3x faster hashing on AVX-512 VNNI CPUs;
    # a model is trained or checked with the setting it is served with.
    hash_int8: bool = False
    pooling: str = "mean"
    # The cosine the service scores 0.5 in /rerank and zero-shot multi-label /classify: sigmoid(20 (cos - c)).
    # Measured per model (model/train/retrieval.py calibrate_center); None = 0.3, MiniLM-like encoders' value.
    score_center: float | None = None
    attention_backend: str = "auto"
    attention_type: str = "yoso"
    # 0 = automatic (see FFN_CHUNK_THRESHOLD); n > 0 = always chunk by n positions.
    chunk_size_feed_forward: int = 0
    # Per-type settings, read only by their attention_type. Defaults follow the papers' own
    # choices for BERT-size models: Linformer k = 256 (on par with softmax at n = 512–1024),
    # E and F per layer unless shared; Reformer chunks of 64 (b = 2N/64 buckets, the paper's
    # 2·l/n_buckets chunking) and 4 hash rounds (the paper: 8 match full attention, 2 train
    # well); Sparse Transformer stride l = 128 (≈ √N at N = 16384; fixed pattern: l // 8
    # summary positions per block); Nyströmformer 64 landmarks, no convolution (a kernel size
    # here adds the paper's depthwise conv over V; it must be trained).
    linformer_k: int = 256
    linformer_shared_kv: bool = False
    reformer_bucket_size: int = 64
    reformer_n_hashes: int = 4
    sparse_pattern: str = "strided"
    sparse_stride: int = 128
    nystrom_landmarks: int = 64
    nystrom_conv: int | None = None
    # Reformer's reversible residual layers (a training option that trades recomputation for
    # activation memory); it changes the block's math to pre-LN, see model/reversible.py.
    reversible: bool = False

    def __post_init__(self) -> None:
        if self.id2label is not None:
            self.id2label = {int(k): str(v) for k, v in self.id2label.items()}
            if self.label2id is None:
                self.label2id = {v: k for k, v in self.id2label.items()}
        if self.label2id is not None:
            self.label2id = {str(k): int(v) for k, v in self.label2id.items()}
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field outside its allowed range."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.score_center is not None and not -1.0 <= self.score_center <= 1.0:
            raise ValueError(f"score_center is a cosine, in [-1, 1]; got {self.score_center}")
        if not 1 <= self.hash_code_len <= 16:
            raise ValueError(f"hash_code_len must be in 1..16, got {self.hash_code_len}")
        if self.hash_int8 and self.hidden_size // self.num_attention_heads > 1024:
            raise ValueError(f"hash_int8 takes head dimensions <= 1024, got "
                             f"{self.hidden_size // self.num_attention_heads}")
        if self.num_hash < 0:
            raise ValueError(f"num_hash must be >= 0, got {self.num_hash}")
        if self.conv_window is not None and (self.conv_window < 1 or self.conv_window % 2 == 0):
            raise ValueError(f"conv_window must be an odd positive int or None, got {self.conv_window}")
        if self.chunk_size_feed_forward < 0:
            raise ValueError(f"chunk_size_feed_forward must be >= 0, got {self.chunk_size_feed_forward}")
        checks = (("pooling", POOLINGS), ("attention_backend", ATTENTION_BACKENDS),
                  ("attention_type", ATTENTION_TYPES), ("hidden_act", ACTIVATIONS),
                  ("sparse_pattern", SPARSE_PATTERNS))
        for name, allowed in checks:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        self._validate_attention_settings()

    def _validate_attention_settings(self) -> None:
        for name in ("linformer_k", "reformer_bucket_size", "reformer_n_hashes", "sparse_stride",
                     "nystrom_landmarks"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.nystrom_conv is not None and (self.nystrom_conv < 1 or self.nystrom_conv % 2 == 0):
            raise ValueError(f"nystrom_conv must be an odd positive int or None, got {self.nystrom_conv}")
        if self.conv_window is not None and self.attention_type != "yoso":
            raise ValueError(f"conv_window (YOSO-C) only applies to attention_type=yoso, not "
                             f"{self.attention_type!r} (nystrom has nystrom_conv)")
        # E and F have one column per position: max_position_embeddings is the longest input, and a
        # projection to more rows than positions compresses nothing.
        if self.attention_type == "linformer" and self.linformer_k > self.max_position_embeddings:
            raise ValueError(f"linformer_k ({self.linformer_k}) must be <= max_position_embeddings "
                             f"({self.max_position_embeddings}), the fixed input length of the projections")

    @property
    def default_hashes(self) -> int:
        """Hashes used when a call does not say: 0 (exact YOSO-E) if use_expectation else num_hash.

        Always 0 for attention types other than yoso: they have no hash count (0 = "none").
        """
        return 0 if self.use_expectation or self.attention_type != "yoso" else self.num_hash

    @property
    def max_length(self) -> int:
        """Longest input in tokens, special tokens included."""
        return self.max_position_embeddings

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_labels(self) -> int | None:
        return None if self.id2label is None else len(self.id2label)

    def ffn_chunk_size(self, seq_len: int) -> int:
        """Positions per feed-forward chunk for a sequence of ``seq_len``; 0 = no chunking."""
        if self.chunk_size_feed_forward:
            return self.chunk_size_feed_forward
        return FFN_CHUNK_SIZE if seq_len > FFN_CHUNK_THRESHOLD else 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EncoderConfig":
        """Build from a (transformers-style) dict; keys that are not fields are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        if isinstance(known.get("eos_token_id"), list):
            known["eos_token_id"] = known["eos_token_id"][0] if known["eos_token_id"] else None
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        """A transformers-compatible dict (``model_type`` "yoso"); None labels are left out."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("id2label", "label2id", "problem_type"):
            if data[name] is None:
                del data[name]
        if self.id2label is not None:
            data["id2label"] = {str(k): v for k, v in self.id2label.items()}
        data["model_type"] = "yoso"
        data["tie_word_embeddings"] = True
        return data

    @classmethod
    def from_json_file(cls, path: str | Path) -> "EncoderConfig":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_json_file(self, path: str | Path, *, architectures: list[str] | None = None) -> None:
        data = self.to_dict()
        if architectures:
            data["architectures"] = list(architectures)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dict(sorted(data.items())), f, indent=2)
            f.write("\n")
