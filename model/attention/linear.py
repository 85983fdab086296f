"""Linear attention (Katharopoulos et al., 2020): the kernel φ(x) = elu(x) + 1 in place of exp.

``out_i = φ(q_i)·S / φ(q_i)·z`` with ``S = Σ_j φ(k_j)ᵀ v_j`` (D×D) and ``z = Σ_j φ(k_j)``: the
sums over keys are taken once, so time is O(N·D²) and memory O(N·D + D²). Padded keys are
dropped from both sums (φ(k_j) zeroed), padded query rows are zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionCore, check_qkv, register, zero_padded_keys, zero_padded_queries

# Guards the normaliser φ(q)·z, which is > 0 for any real key (φ > 0) but 0 with none.
EPS = 1e-6


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1 > 0, elementwise."""
    return F.elu(x) + 1.0


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """q, k, v: (B, H, N, D) fp32|fp16|bf16; key_mask (B, N) bool or None → (B, H, N, D)."""
    check_qkv(q, k, v, key_mask)
    phi_q = feature_map(q)
    phi_k = zero_padded_keys(feature_map(k), key_mask)
    kv = torch.einsum("bhnd,bhne->bhde", phi_k, v)  # (B, H, D, Dv)
    z = phi_k.sum(dim=2)  # (B, H, D)
    numerator = torch.einsum("bhnd,bhde->bhne", phi_q, kv)  # (B, H, N, Dv)
    denominator = torch.einsum("bhnd,bhd->bhn", phi_q, z)[..., None]  # (B, H, N, 1)
    return zero_padded_queries(numerator / (denominator + EPS), key_mask)


def linear_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Readable twin: the (B, H, N, N) kernel matrix φ(Q)φ(K)ᵀ, row-normalised, fp32 inside."""
    check_qkv(q, k, v, key_mask)
    weights = feature_map(q.float()) @ feature_map(k.float()).transpose(-1, -2)  # (B, H, N, N)
    if key_mask is not None:
        weights = weights * key_mask.float()[:, None, None, :]
    out = weights @ v.float() / (weights.sum(dim=-1, keepdim=True) + EPS)
    return zero_padded_queries(out, key_mask).to(q.dtype)


@register
class LinearAttention(AttentionCore):
    """elu+1 linear attention; no parameters of its own."""

    name = "linear"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_mask: torch.Tensor | None) -> torch.Tensor:
        return linear_attention(q, k, v, key_mask)
