"""Linformer attention (Wang et al., 2020): keys and values projected along the sequence to k rows.

``softmax(q (E k)ᵀ / √D) (F v)`` with learned E, F ∈ R^{k×n}: O(N·k) time and memory. The
projections have one column per position, so ``max_position_embeddings`` is also the longest
input the layer can take (checked with a ValueError naming the limit); an input of N < n
positions uses the first N columns, as the reference implementations do. Padded keys and
values are zeroed *before* projecting, so the padding adds nothing to E k and F v and a text
gives the same output alone or padded in a batch. ``linformer_shared_kv`` uses E for both
(the paper's key-value sharing). E and F start as the paper's JL projections, N(0, 1/k).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import AttentionCore, check_qkv, register, zero_padded_keys, zero_padded_queries


def _check_projection(proj: torch.Tensor, n: int) -> None:
    if proj.dim() != 2 or proj.shape[1] < n:
        raise ValueError(f"sequence length {n} exceeds the Linformer projection length {proj.shape[-1]} "
                         f"(max_position_embeddings): E, F are (k, n) with one column per position")


def linformer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                        proj_k: torch.Tensor, proj_v: torch.Tensor) -> torch.Tensor:
    """q, k, v: (B, H, N, D); key_mask (B, N) bool or None; proj_k, proj_v: (k, n ≥ N) → (B, H, N, D)."""
    check_qkv(q, k, v, key_mask)
    n = q.shape[2]
    _check_projection(proj_k, n)
    _check_projection(proj_v, n)
    e, f = proj_k[:, :n].to(q.dtype), proj_v[:, :n].to(q.dtype)
    k_low = torch.einsum("kn,bhnd->bhkd", e, zero_padded_keys(k, key_mask))  # (B, H, k, D)
    v_low = torch.einsum("kn,bhnd->bhkd", f, zero_padded_keys(v, key_mask))  # (B, H, k, D)
    return zero_padded_queries(F.scaled_dot_product_attention(q, k_low, v_low), key_mask)


def linformer_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                            proj_k: torch.Tensor, proj_v: torch.Tensor) -> torch.Tensor:
    """Readable twin: build E·K and F·V with explicit per-row loops over real tokens, fp32 inside."""
    check_qkv(q, k, v, key_mask)
    n = q.shape[2]
    _check_projection(proj_k, n)
    lengths = [n] * q.shape[0] if key_mask is None else key_mask.sum(dim=1).tolist()
    rows = []
    for b, length in enumerate(lengths):
        e, f = proj_k[:, :length].float(), proj_v[:, :length].float()
        k_low = e @ k[b, :, :length].float()  # (H, k, D)
        v_low = f @ v[b, :, :length].float()
        scores = q[b, :, :length].float() @ k_low.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (H, L, k)
        out = torch.softmax(scores, dim=-1) @ v_low
        rows.append(F.pad(out, (0, 0, 0, n - length))[None])
    return torch.cat(rows).to(q.dtype)


@register
class LinformerAttention(AttentionCore):
    """Learned (k, max_position_embeddings) projections E (keys) and F (values, or E when shared)."""

    name = "linformer"

    def __init__(self, config, seed: int):
        super().__init__(config, seed)
        k, n = config.linformer_k, config.max_position_embeddings
        self.proj_k = nn.Parameter(torch.randn(k, n) / math.sqrt(k))
        self.proj_v = None if config.linformer_shared_kv else nn.Parameter(torch.randn(k, n) / math.sqrt(k))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_mask: torch.Tensor | None) -> torch.Tensor:
        proj_v = self.proj_k if self.proj_v is None else self.proj_v
        return linformer_attention(q, k, v, key_mask, self.proj_k, proj_v)
