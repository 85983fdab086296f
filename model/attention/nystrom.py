"""Nyströmformer attention (Xiong et al., 2021): softmax through m landmarks.

``softmax(Q K̃ᵀ) · pinv(softmax(Q̃ K̃ᵀ)) · softmax(Q̃ Kᵀ) V`` with landmarks Q̃, K̃ the means of m
contiguous segments of Q and K, and the pseudo-inverse by the paper's Newton–Schulz style
iteration (6 steps): O(N·m) time and memory. Q and K are each scaled by D^(-1/4) (so the
logits are q·k/√D). Segments cover a row's *real* tokens only (segment s of a text of L tokens
holds positions ⌈s·L/m⌉ … ⌈(s+1)·L/m⌉ − 1), and a text shorter than m uses L one-token landmarks, whose
unused landmark rows and columns are zero, which the iteration leaves zero: a text's output is
the same alone or padded in a batch. Unlike the paper's code, the iteration's starting scale is
taken per (batch row, head), not over the whole batch, for the same reason. The optional
depthwise convolution over V (``nystrom_conv``, the paper's "skip connection") adds a learned
local term, padded values zeroed first.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import MASKED_LOGIT, AttentionCore, check_qkv, real_tokens, register, zero_padded_keys, zero_padded_queries

PINV_ITERATIONS = 6


def landmark_weights(valid: torch.Tensor, landmarks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """valid (B, N) bool → averaging matrix (B, m, N) fp32 and landmark validity (B, m) bool."""
    lengths = valid.sum(dim=1)  # (B,)
    used = lengths.clamp(max=landmarks)  # m_eff per row: one-token landmarks for short texts
    positions = torch.arange(valid.shape[1], device=valid.device)
    segment = positions[None, :] * used[:, None] // lengths.clamp_min(1)[:, None]  # (B, N)
    segment = segment.masked_fill(~valid, -1)
    onehot = (segment[:, None, :] == torch.arange(landmarks, device=valid.device)[None, :, None]).float()
    used_landmarks = torch.arange(landmarks, device=valid.device)[None, :] < used[:, None]
    return onehot / onehot.sum(dim=2, keepdim=True).clamp_min(1.0), used_landmarks


def iterative_pinv(mat: torch.Tensor, iterations: int = PINV_ITERATIONS) -> torch.Tensor:
    """Approximate Moore–Penrose inverse of (..., m, m) row-stochastic matrices (Nyströmformer eq. 14)."""
    eye = torch.eye(mat.shape[-1], device=mat.device, dtype=mat.dtype)
    scale = mat.sum(dim=-2).amax(dim=-1).clamp_min(1e-12)[..., None, None]  # ‖K‖₁ per matrix
    inv = mat.transpose(-1, -2) / scale
    for _ in range(iterations):
        kv = mat @ inv
        inv = 0.25 * inv @ (13 * eye - kv @ (15 * eye - kv @ (7 * eye - kv)))
    return inv


def _kernels(q, k, valid, landmarks):
    """The three softmax factors (B, H, N, m), (B, H, m, m), (B, H, m, N), fp32."""
    scale = q.shape[-1] ** -0.25
    q, k = q.float() * scale, k.float() * scale
    weights, lm_valid = landmark_weights(valid, landmarks)  # (B, m, N), (B, m)
    q_lm, k_lm = weights[:, None] @ q, weights[:, None] @ k  # (B, H, m, D)
    lm_cols = ~lm_valid[:, None, None, :]
    lm_rows = lm_valid[:, None, :, None].float()
    k1 = torch.softmax((q @ k_lm.transpose(-1, -2)).masked_fill(lm_cols, MASKED_LOGIT), dim=-1)
    k2 = torch.softmax((q_lm @ k_lm.transpose(-1, -2)).masked_fill(lm_cols, MASKED_LOGIT), dim=-1) * lm_rows
    k3 = torch.softmax((q_lm @ k.transpose(-1, -2)).masked_fill(~valid[:, None, None, :], MASKED_LOGIT), dim=-1)
    return k1, k2, k3 * lm_rows


def nystrom_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                      *, landmarks: int = 64, iterations: int = PINV_ITERATIONS) -> torch.Tensor:
    """q, k, v: (B, H, N, D) fp32|fp16|bf16; key_mask (B, N) bool or None → (B, H, N, D), fp32 inside."""
    check_qkv(q, k, v, key_mask)
    if landmarks < 1:
        raise ValueError(f"landmarks must be >= 1, got {landmarks}")
    k1, k2, k3 = _kernels(q, k, real_tokens(key_mask, q), landmarks)
    out = k1 @ (iterative_pinv(k2, iterations) @ (k3 @ v.float()))  # (B, H, N, D), never N×N
    return zero_padded_queries(out, key_mask).to(q.dtype)


def nystrom_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                          *, landmarks: int = 64, iterations: int | None = PINV_ITERATIONS) -> torch.Tensor:
    """Readable twin, one text at a time on its real tokens with explicit segment means.

    ``iterations=None`` uses the exact ``torch.linalg.pinv``: with m ≥ N this is softmax attention.
    """
    check_qkv(q, k, v, key_mask)
    n, scale = q.shape[2], q.shape[-1] ** -0.25
    lengths = [n] * q.shape[0] if key_mask is None else key_mask.sum(dim=1).tolist()
    rows = []
    for b, length in enumerate(lengths):
        qb, kb, vb = (x[b, :, :length].float() for x in (q, k, v))  # (H, L, D)
        qb, kb = qb * scale, kb * scale
        m = min(landmarks, length)
        bounds = [-(-s * length // m) for s in range(m + 1)]  # ⌈s·L/m⌉
        q_lm = torch.stack([qb[:, lo:hi].mean(dim=1) for lo, hi in zip(bounds, bounds[1:])], dim=1)
        k_lm = torch.stack([kb[:, lo:hi].mean(dim=1) for lo, hi in zip(bounds, bounds[1:])], dim=1)
        k2 = torch.softmax(q_lm @ k_lm.transpose(-1, -2), dim=-1)
        inv = torch.linalg.pinv(k2) if iterations is None else iterative_pinv(k2, iterations)
        out = torch.softmax(qb @ k_lm.transpose(-1, -2), dim=-1) @ inv @ (
            torch.softmax(q_lm @ kb.transpose(-1, -2), dim=-1) @ vb)
        rows.append(torch.nn.functional.pad(out, (0, 0, 0, n - length))[None])
    return torch.cat(rows).to(q.dtype)


@register
class NystromAttention(AttentionCore):
    """Nyström landmarks, optional depthwise conv over V (key ``conv.weight``, one (w × 1) kernel per head)."""

    name = "nystrom"

    def __init__(self, config, seed: int):
        super().__init__(config, seed)
        self.landmarks = config.nystrom_landmarks
        window = config.nystrom_conv
        self.conv = None if window is None else nn.Conv2d(
            self.heads, self.heads, kernel_size=(window, 1), padding=(window // 2, 0), bias=False, groups=self.heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_mask: torch.Tensor | None) -> torch.Tensor:
        out = nystrom_attention(q, k, v, key_mask, landmarks=self.landmarks)
        if self.conv is not None:
            out = zero_padded_queries(out + self.conv(zero_padded_keys(v, key_mask)), key_mask)
        return out
