"""Task heads on a YOSO encoder: sequence classification and masked-LM (used by :mod:`.encoder_model`).

State-dict layout is transformers': the encoder under ``yoso.``, the sequence classifier under
``classifier.`` (``dense``, ``out_proj``) and the masked-LM head under ``cls.predictions.``
(``transform.dense``, ``transform.LayerNorm``, ``bias``; the decoder is the word-embedding matrix,
tied, so it is not stored).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import EncoderConfig
from .linear import activation


class ClassificationHead(nn.Module):
    """First token → dropout → dense → act → dropout → out_proj (transformers' YosoClassificationHead)."""

    def __init__(self, config: EncoderConfig, num_labels: int):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.out_proj = nn.Linear(config.hidden_size, num_labels)
        self.act = activation(config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (B, N, hidden) → logits (B, num_labels)."""
        x = self.dropout(hidden[:, 0])
        x = self.dropout(self.act(self.dense(x)))
        return self.out_proj(x)


class PredictionTransform(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = activation(config.hidden_act)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class LMPrediction(nn.Module):
    """transform, then the tied decoder: logits = x · word_embeddingsᵀ + bias."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.transform = PredictionTransform(config)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        """hidden (B, N, hidden), word_embeddings (vocab, hidden) → logits (B, N, vocab)."""
        return F.linear(self.transform(hidden), word_embeddings, self.bias)


class MaskedLMHead(nn.Module):
    """Holds ``predictions`` so that keys read ``cls.predictions.…`` as in transformers."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.predictions = LMPrediction(config)

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        return self.predictions(hidden, word_embeddings)
