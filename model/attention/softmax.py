"""Softmax attention (BERT's): ``softmax(q kᵀ / √D) v`` over the real keys.

:func:`softmax_attention` runs torch's ``scaled_dot_product_attention`` (fused, O(N) memory on
the flash/efficient paths); :func:`softmax_attention_ref` writes the N×N matrix out. With this
core a BERT checkpoint converted by ``yoso-convert`` computes exactly what BERT computes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import AttentionCore, check_qkv, register, zero_padded_queries


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                      *, dropout_p: float = 0.0) -> torch.Tensor:
    """q, k, v: (B, H, N, D) fp32|fp16|bf16; key_mask (B, N) bool or None → (B, H, N, D), q's dtype."""
    check_qkv(q, k, v, key_mask)
    attn_mask = None if key_mask is None else key_mask.to(device=q.device, dtype=torch.bool)[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    return zero_padded_queries(out, key_mask)


def softmax_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Readable twin of :func:`softmax_attention`: the dense (B, H, N, N) weights, fp32 inside."""
    check_qkv(q, k, v, key_mask)
    scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, N, N)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask.bool()[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float()
    return zero_padded_queries(out, key_mask).to(q.dtype)


@register
class SoftmaxAttention(AttentionCore):
    """Full softmax attention; attention-probability dropout in training, as in BERT."""

    name = "softmax"

    def __init__(self, config, seed: int):
        super().__init__(config, seed)
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_mask: torch.Tensor | None) -> torch.Tensor:
        return softmax_attention(q, k, v, key_mask, dropout_p=self.dropout_p if self.training else 0.0)
