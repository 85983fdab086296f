"""Sparse Transformer attention (Child et al., 2019), bidirectional form of its two patterns.

Each head attends to the union of two index sets (the paper's "merged" head), with stride l:

* ``strided``: the neighbours ``|i − j| < l`` and every l-th position ``(i − j) mod l = 0``;
* ``fixed``: its own block ``⌊i/l⌋ = ⌊j/l⌋`` and the summary positions ``j mod l ≥ l − c``
  of every block, c = max(1, l // 8) (the paper found c ∈ {8, 16, 32} good for l ∈ {128, 256}).

The paper's patterns are causal (j ≤ i); an encoder sees both sides, so here the sets are
symmetric. Cost per query: 3l + N/l keys (strided, O(N·√N) at l ≈ √N) or l + c·N/l (fixed).
The softmax runs over the union in one pass (each key counted once), query blocks in groups
so that the logits stay under ``_LOGIT_BUDGET`` values. Positions are absolute and inputs are
right-padded, so a text's allowed keys do not depend on the padding after it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import MASKED_LOGIT, AttentionCore, check_qkv, real_tokens, register, zero_padded_queries

PATTERNS = ("strided", "fixed")
_LOGIT_BUDGET = 1 << 24


def summary_width(stride: int) -> int:
    """c, the summary positions per block of the fixed pattern."""
    return max(1, stride // 8)


def sparse_mask(n: int, pattern: str, stride: int, device=None) -> torch.Tensor:
    """(n, n) bool: True where query i may attend to key j."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    if pattern == "strided":
        return ((i - j).abs() < stride) | ((i - j) % stride == 0)
    if pattern == "fixed":
        return (i // stride == j // stride) | (j % stride >= stride - summary_width(stride))
    raise ValueError(f"sparse_pattern must be one of {PATTERNS}, got {pattern!r}")


def _blocks(x: torch.Tensor, stride: int) -> torch.Tensor:
    """(B, H, N, D) → (B, H, C, l, D), N padded with zeros to C·l."""
    b, h, n, d = x.shape
    x = F.pad(x, (0, 0, 0, (-n) % stride))
    return x.view(b, h, -1, stride, d)


def _neighbour_blocks(x: torch.Tensor) -> torch.Tensor:
    """(B, H, C, l, ...) → (B, H, C, 3l, ...): blocks c−1, c, c+1 (zeros past the ends)."""
    pad = [0, 0] * (x.dim() - 3) + [1, 1]
    padded = F.pad(x, pad)
    return torch.cat([padded[:, :, :-2], padded[:, :, 1:-1], padded[:, :, 2:]], dim=3)


def _keys(pattern: str, stride: int, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor):
    """Per query block: (local keys, values, their positions) and (global keys, values, positions)."""
    kb, vb = _blocks(k, stride), _blocks(v, stride)  # (B, H, C, l, D)
    pos = torch.arange(kb.shape[2] * stride, device=k.device).view(-1, stride)  # (C, l)
    valid_b = F.pad(valid, (0, (-valid.shape[1]) % stride)).view(valid.shape[0], -1, stride)  # (B, C, l)
    if pattern == "strided":
        local = (_neighbour_blocks(kb), _neighbour_blocks(vb), _neighbour_blocks(pos[None, None] + 1)[0, 0] - 1)
        glob = (kb.transpose(2, 3), vb.transpose(2, 3), pos.t())  # column o of the (C, l) grid: (B, H, l, C, D)
        return local, glob, valid_b
    width = summary_width(stride)
    local = (kb, vb, pos)
    glob = (kb[:, :, :, stride - width :].flatten(2, 3), vb[:, :, :, stride - width :].flatten(2, 3),
            pos[:, stride - width :].reshape(-1))
    return local, glob, valid_b


def _strided_logits(qg, qp, sl, keys, stride):
    """Group of query blocks, strided pattern: (local logits, ok) over 3l neighbours, (global logits, ok) over C."""
    (lk, _, lpos), (gk, _, gpos), valid_b, local_valid = keys
    lpos_g = lpos[sl]  # (G, 3l)
    l_ok = ((qp[:, :, None] - lpos_g[:, None, :]).abs() < stride) & (lpos_g[:, None, :] >= 0)
    l_ok = l_ok[None] & local_valid[:, sl, None, :]  # (B, G, l, 3l)
    g_logits = torch.einsum("bhgod,bhotd->bhgot", qg, gk)  # (B, H, G, l, C): column o of the grid
    g_ok = (gpos[None, :, :] != qp[:, :, None]) & valid_b.transpose(1, 2)[:, None]  # (B, G, l, C); self is local
    return qg @ lk[:, :, sl].transpose(-1, -2), l_ok, g_logits, g_ok


def _fixed_logits(qg, qp, sl, keys, stride):
    """Group of query blocks, fixed pattern: (local logits, ok) over the own block, (global, ok) over summaries."""
    (lk, _, _), (gk, _, gpos), valid_b, _ = keys
    l_ok = valid_b[:, sl, None, :].expand(-1, -1, stride, -1)  # (B, G, l, l)
    g_logits = torch.einsum("bhgod,bhsd->bhgos", qg, gk)  # (B, H, G, l, C·c)
    own_block = (gpos[None, :] // stride) == (qp[:, :1] // stride)  # (G, C·c): already in the local part
    g_valid = valid_b[:, :, stride - summary_width(stride) :].flatten(1)  # (B, C·c)
    g_ok = (~own_block[None, :, None, :]) & g_valid[:, None, None, :]  # (B, G, 1, C·c)
    return qg @ lk[:, :, sl].transpose(-1, -2), l_ok, g_logits, g_ok


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                     *, pattern: str = "strided", stride: int = 128) -> torch.Tensor:
    """q, k, v: (B, H, N, D) fp32|fp16|bf16; key_mask (B, N) bool or None → (B, H, N, D)."""
    check_qkv(q, k, v, key_mask)
    if pattern not in PATTERNS or stride < 1:
        raise ValueError(f"pattern must be one of {PATTERNS} and stride >= 1, got {pattern!r}, {stride}")
    b, h, n, d = q.shape
    valid = real_tokens(key_mask, q)
    (lk, lv, lpos), (gk, gv, gpos), valid_b = _keys(pattern, stride, k, v, valid)
    qb = _blocks(q, stride) / math.sqrt(d)  # (B, H, C, l, D)
    blocks = qb.shape[2]
    # (B, C, 3l): validity of blocks c−1, c, c+1 (False past the ends)
    local_valid = F.pad(valid, (stride, 2 * stride + (-n) % stride)).unfold(1, 3 * stride, stride)[:, :blocks]
    keys = ((lk, lv, lpos), (gk, gv, gpos), valid_b, local_valid)
    qpos = torch.arange(blocks * stride, device=q.device).view(blocks, stride)  # (C, l)
    per_block = stride * (lk.shape[3] + (gk.shape[3] if pattern == "strided" else gk.shape[2])) * b * h
    group = max(1, _LOGIT_BUDGET // max(1, per_block))
    logits_of = _strided_logits if pattern == "strided" else _fixed_logits
    outs = []
    for c0 in range(0, blocks, group):
        sl = slice(c0, c0 + group)
        local, l_ok, glob, g_ok = logits_of(qb[:, :, sl], qpos[sl], sl, keys, stride)
        logits = torch.cat([local.masked_fill(~l_ok[:, None], MASKED_LOGIT),
                            glob.masked_fill(~g_ok[:, None], MASKED_LOGIT)], dim=-1)  # one softmax over the union
        w_local, w_glob = torch.softmax(logits, dim=-1).split([local.shape[-1], glob.shape[-1]], dim=-1)
        if pattern == "strided":
            outs.append(w_local @ lv[:, :, sl] + torch.einsum("bhgot,bhotd->bhgod", w_glob, gv))
        else:
            outs.append(w_local @ lv[:, :, sl] + w_glob @ gv[:, :, None])  # (B, H, G, l, D)
    out = torch.cat(outs, dim=2).flatten(2, 3)[:, :, :n]  # (B, H, N, D)
    return zero_padded_queries(out, key_mask)


def sparse_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                         *, pattern: str = "strided", stride: int = 128) -> torch.Tensor:
    """Readable twin: dense (N, N) pattern mask ∧ key mask, softmax, fp32 inside."""
    check_qkv(q, k, v, key_mask)
    n = q.shape[2]
    allowed = sparse_mask(n, pattern, stride, q.device)[None, None] & real_tokens(key_mask, q)[:, None, None, :]
    scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v.float()
    return zero_padded_queries(out, key_mask).to(q.dtype)


@register
class SparseAttention(AttentionCore):
    """Fixed-pattern sparse softmax attention; no parameters of its own."""

    name = "sparse"

    def __init__(self, config, seed: int):
        super().__init__(config, seed)
        self.pattern = config.sparse_pattern
        self.stride = config.sparse_stride

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_mask: torch.Tensor | None) -> torch.Tensor:
        return sparse_attention(q, k, v, key_mask, pattern=self.pattern, stride=self.stride)
