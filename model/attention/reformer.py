"""Reformer LSH attention (Kitaev et al., 2020), shared-QK, multi-round, bidirectional.

Per round r (``reformer_n_hashes`` rounds): bucket every token by ``argmax([xR; −xR])`` with a
seeded Gaussian R of shape (D, b/2), sort by (bucket, position), cut the sorted sequence into
chunks of ``reformer_bucket_size`` and let each query attend to the keys of its own bucket in
its own chunk and the previous one. b = 2·⌈L / bucket_size⌉ for a text of L real tokens, so a
bucket holds bucket_size / 2 tokens on average and a chunk pair covers it. Keys are the
queries, unit-normalised (shared QK: the layer's ``key`` projection is not used), so the
logits are ``q_i · q_j / ‖q_j‖``; a query attends to itself only when it has no other key
(logit − 10⁵, the paper's m_ij). The rounds are combined as in the paper: each round's output
is weighted by exp(z_r − z) of its log-sum-exp z_r, and a key found in N_ij rounds has its
logit lowered by log N_ij, so the result is exactly softmax over the union of the rounds'
key sets. :func:`reformer_attention_ref` computes that union softmax densely.

Padding: padded tokens sort after every real one and are never keys; the number of buckets
follows each text's own length and the first chunk has no previous chunk (no wrap-around to
the padding at the end), so a text's buckets, order and chunks do not depend on its batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import MASKED_LOGIT, AttentionCore, check_qkv, real_tokens, register, zero_padded_queries

SELF_LOGIT = -1e5
_HASH_BUDGET = 1 << 22


def rotation_columns(max_length: int, bucket_size: int) -> int:
    """b/2 for the longest text: the rotation columns a layer must hold."""
    return max(1, math.ceil(max_length / bucket_size))


def make_rotations(seed: int, n_hashes: int, heads: int, head_dim: int, columns: int) -> torch.Tensor:
    """(n_hashes, H, D, columns) fp32 Gaussian rotations from a generator seeded by ``seed``."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn(n_hashes, heads, head_dim, columns, generator=gen)


def lsh_buckets(x: torch.Tensor, rotations: torch.Tensor, valid: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """x (B, H, N, D), rotations (r, H, D, M), valid (B, N) → buckets (B, H, r, N) int64.

    Text b uses the first ⌈L_b / bucket_size⌉ columns; padded tokens get a bucket above all others.
    """
    half = torch.clamp(torch.div(valid.sum(dim=1) + bucket_size - 1, bucket_size, rounding_mode="floor"), min=1)
    cols = int(half.max())
    if cols > rotations.shape[-1]:
        raise ValueError(f"{int(valid.sum(dim=1).max())} tokens need {cols} rotation columns; this layer holds "
                         f"{rotations.shape[-1]} (max_position_embeddings / reformer_bucket_size)")
    rot = rotations[..., :cols].to(x.dtype)
    unused = (torch.arange(cols, device=x.device)[None, :] >= half[:, None])[:, None, None, None, :]
    b, h, n, _ = x.shape
    # b/2 grows with N, so the scores are cut along N to stay under _HASH_BUDGET values
    step = max(1, _HASH_BUDGET // max(1, b * h * rot.shape[0] * cols))
    out = []
    for start in range(0, n, step):
        scores = torch.einsum("bhnd,rhdc->bhrnc", x[:, :, start : start + step], rot)  # (B, H, r, n', b/2)
        top, top_at = scores.masked_fill(unused, float("-inf")).max(dim=-1)
        low, low_at = scores.masked_fill(unused, float("inf")).min(dim=-1)
        out.append(torch.where(top >= -low, top_at, cols + low_at))  # argmax of [xR; −xR]
    return torch.cat(out, dim=-1).masked_fill(~valid[:, None, None, :], 2 * cols)


def _previous(x: torch.Tensor) -> torch.Tensor:
    """(B, H, C, c, ...) → the previous chunk's entries (chunk 0 gets the last chunk's; masked by callers)."""
    return x.roll(1, dims=2)


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, H, Np) or (B, H, Np, D) at positions idx (B, H, C, w) → (B, H, C, w) or (B, H, C, w, D)."""
    b, h = idx.shape[:2]
    flat = idx.reshape(b, h, -1)
    if x.dim() == 3:
        return x.gather(2, flat).view(idx.shape)
    return x.gather(2, flat[..., None].expand(-1, -1, -1, x.shape[-1])).view(*idx.shape, x.shape[-1])


def _rounds_found(pos, key_pos, buckets, chunk_of) -> torch.Tensor:
    """N_ij (B, H, C, c, 2c): in how many rounds key j is in query i's bucket and chunk window."""
    found = torch.zeros(*pos.shape, key_pos.shape[-1], device=pos.device)
    for r in range(buckets.shape[2]):
        ci, cj = _gather(chunk_of[:, :, r], pos)[..., None], _gather(chunk_of[:, :, r], key_pos)[..., None, :]
        same = _gather(buckets[:, :, r], pos)[..., None] == _gather(buckets[:, :, r], key_pos)[..., None, :]
        found += (same & ((cj == ci) | (cj == ci - 1))).float()
    return found


def _one_round(q, k_hat, v, valid, pos, buckets, chunk_of, bucket_r):
    """Round output (B, H, C, c, D) and log-sum-exp (B, H, C, c) for queries at sorted positions pos."""
    key_pos = torch.cat([pos, _previous(pos)], dim=-1)  # (B, H, C, 2c): own chunk, then the previous one
    has_prev = torch.arange(pos.shape[2], device=q.device)[None, None, :, None] > 0
    in_window = torch.cat([torch.ones_like(pos, dtype=torch.bool), has_prev.expand_as(pos)], dim=-1)
    key_ok = _gather(valid[:, None, :].expand(*pos.shape[:2], -1), key_pos) & in_window
    allowed = (_gather(bucket_r, pos)[..., None] == _gather(bucket_r, key_pos)[..., None, :]) & key_ok[..., None, :]
    logits = _gather(q, pos) @ _gather(k_hat, key_pos).transpose(-1, -2)  # (B, H, C, c, 2c)
    # −log N_ij makes the rounds add up to one softmax over their union; self only when alone.
    logits = logits - _rounds_found(pos, key_pos, buckets, chunk_of).clamp_min(1).log()
    logits = logits + SELF_LOGIT * (pos[..., None] == key_pos[..., None, :])
    logits = logits.masked_fill(~allowed, MASKED_LOGIT)
    return torch.softmax(logits, dim=-1) @ _gather(v, key_pos), logits.logsumexp(dim=-1)


def reformer_attention(q: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                       rotations: torch.Tensor, *, bucket_size: int = 64) -> torch.Tensor:
    """q, v: (B, H, N, D) fp32|fp16|bf16; key_mask (B, N) bool or None; rotations (r, H, D, M) → (B, H, N, D)."""
    check_qkv(q, q, v, key_mask)
    b, h, n, d = q.shape
    pad = (-n) % bucket_size
    valid = F.pad(real_tokens(key_mask, q), (0, pad))  # (B, Np)
    q, v = F.pad(q.float(), (0, 0, 0, pad)), F.pad(v.float(), (0, 0, 0, pad))
    n_pad = n + pad
    buckets = lsh_buckets(q, rotations, valid, bucket_size)  # (B, H, r, Np)
    order = (buckets * n_pad + torch.arange(n_pad, device=q.device)).argsort(dim=-1)  # sorted slot → position
    slots = order.argsort(dim=-1)  # position → sorted slot
    chunk_of = slots // bucket_size  # (B, H, r, Np): the chunk of each position in each round
    k_hat = F.normalize(q, dim=-1)
    outs, lses = [], []
    for r in range(buckets.shape[2]):
        pos = order[:, :, r].view(b, h, -1, bucket_size)  # (B, H, C, c)
        out, lse = _one_round(q, k_hat, v, valid, pos, buckets, chunk_of, buckets[:, :, r])
        outs.append(out.reshape(b, h, n_pad, d).gather(2, slots[:, :, r, :, None].expand(-1, -1, -1, d)))
        lses.append(lse.reshape(b, h, n_pad).gather(2, slots[:, :, r]))
    weights = torch.softmax(torch.stack(lses, dim=2), dim=2)  # (B, H, r, Np): exp(z_r − z)
    out = (weights[..., None] * torch.stack(outs, dim=2)).sum(dim=2)[:, :, :n]
    return zero_padded_queries(out, key_mask)


def reformer_attention_ref(q: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                           rotations: torch.Tensor, *, bucket_size: int = 64) -> torch.Tensor:
    """Dense twin: softmax over ∪_r {same bucket, own or previous chunk} minus self (unless alone), fp32."""
    check_qkv(q, q, v, key_mask)
    n = q.shape[2]
    valid = real_tokens(key_mask, q)
    buckets = lsh_buckets(q.float(), rotations, valid, bucket_size)  # (B, H, r, N)
    slots = torch.empty_like(buckets)
    slots.scatter_(-1, torch.sort(buckets, dim=-1, stable=True).indices,
                   torch.arange(n, device=q.device).expand_as(buckets).contiguous())
    chunk = slots // bucket_size  # (B, H, r, N)
    same = buckets[..., :, None] == buckets[..., None, :]  # (B, H, r, N, N)
    near = (chunk[..., None, :] == chunk[..., :, None]) | (chunk[..., None, :] == chunk[..., :, None] - 1)
    union = (same & near).any(dim=2) & valid[:, None, None, :]  # (B, H, N, N)
    eye = torch.eye(n, dtype=torch.bool, device=q.device)
    others = union & ~eye
    keys = torch.where(others.any(dim=-1, keepdim=True), others, eye)
    logits = q.float() @ F.normalize(q.float(), dim=-1).transpose(-1, -2)
    out = torch.softmax(logits.masked_fill(~keys, float("-inf")), dim=-1) @ v.float()
    return zero_padded_queries(out, key_mask)


def shared_qk_attention_ref(q: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """What LSH approximates: shared-QK softmax over all real keys but self (unless alone), fp32."""
    n = q.shape[2]
    valid = real_tokens(key_mask, q)[:, None, None, :]
    eye = torch.eye(n, dtype=torch.bool, device=q.device)
    others = valid & ~eye
    keys = torch.where(others.any(dim=-1, keepdim=True), others, eye)
    logits = q.float() @ F.normalize(q.float(), dim=-1).transpose(-1, -2)
    out = torch.softmax(logits.masked_fill(~keys, float("-inf")), dim=-1) @ v.float()
    return zero_padded_queries(out, key_mask)


@register
class ReformerAttention(AttentionCore):
    """LSH attention with seeded rotations, rebuilt from the seed (never saved).

    The rotations are a plain fp32 tensor, not a buffer, so that ``model.to(torch.float16)`` does
    not round them: a half-precision model hashes with exactly its fp32 twin's rotations.
    """

    name = "reformer"

    def __init__(self, config, seed: int):
        super().__init__(config, seed)
        self.bucket_size = config.reformer_bucket_size
        columns = rotation_columns(config.max_position_embeddings, self.bucket_size)
        rotations = make_rotations(seed, config.reformer_n_hashes, self.heads, self.head_dim, columns)
        self.rotations = rotations

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_mask: torch.Tensor | None) -> torch.Tensor:
        if self.rotations.device != q.device:
            self.rotations = self.rotations.to(q.device)
        return reformer_attention(q, v, key_mask, self.rotations, bucket_size=self.bucket_size).to(q.dtype)
