"""Bucket cumulation in pure PyTorch (Zeng et al., 2021, eq. 9–10 and the weighted form of eq. 13–14).

The torch backend of :func:`~.yoso.yoso_attention` in LSH mode, and the semantics the C++ and CUDA
kernels implement (docs/cuda.md): for fixed hash codes, each key adds its value into its bucket's
row of a table, and each query reads its bucket's row back, one hash at a time.
"""

from __future__ import annotations

import torch

from .hashing import MAX_HASH_BITS

# Scratch tensors (hash tables, probability chunks) are cut to about this many fp32 values.
_CHUNK_BUDGET = 1 << 24


def _hash_rows(q_codes, k_codes, rows, offsets):
    """Flat table rows (int64) of one hash's queries and keys, the table height, and its sink rows.

    q_codes (n, Nq), k_codes (n, Nk) int32; table row = offset of the batch·head + code, and
    masked (negative) codes go to a sink row per batch·head, zeroed before reading. When
    2^τ + 1 rows exceed the tokens (large τ), the used rows are renumbered 0..U-1 so that
    the table never outgrows the tokens; keys still add in their order, so results match.
    """
    sink = rows - 1
    q_rows = (torch.where(q_codes < 0, sink, q_codes.long()) + offsets).reshape(-1)
    k_rows = (torch.where(k_codes < 0, sink, k_codes.long()) + offsets).reshape(-1)
    if rows <= q_codes.shape[1] + k_codes.shape[1]:
        return q_rows, k_rows, offsets.numel() * rows, offsets.reshape(-1) + sink
    used, inverse = torch.unique(torch.cat([k_rows, q_rows]), return_inverse=True)
    sinks = torch.nonzero(used % rows == sink).reshape(-1)
    return inverse[k_rows.numel() :], inverse[: k_rows.numel()], used.numel(), sinks


def _table_height(rows: int, nq: int, nk: int) -> int:
    """Rows one batch·head's table needs: 2^τ + 1, or at most the tokens when renumbered."""
    return min(rows, nq + nk)


def _check_cumulate_args(q_codes, k_codes, v, hash_bits, q_w=None, k_w=None) -> None:
    """ValueError naming the first way the arguments break the cumulation contract."""
    if not isinstance(hash_bits, int) or not 1 <= hash_bits <= MAX_HASH_BITS:
        raise ValueError(f"hash_bits must be an int in 1..{MAX_HASH_BITS}, got {hash_bits!r}")
    for name, codes in (("q_codes", q_codes), ("k_codes", k_codes)):
        if codes.dtype != torch.int32 or codes.dim() != 3:
            raise ValueError(f"{name} must be (BH, m, N) int32, got {tuple(codes.shape)} {codes.dtype}")
        if codes.numel() and int(codes.max()) >= 1 << hash_bits:
            raise ValueError(f"{name} holds a code ≥ 2**hash_bits = {1 << hash_bits}")
    bh, hashes, nq = q_codes.shape
    if k_codes.shape[:2] != (bh, hashes) or hashes == 0:
        raise ValueError(f"q_codes {tuple(q_codes.shape)} and k_codes {tuple(k_codes.shape)} need one BH and m ≥ 1")
    rows = {"v": (v, k_codes.shape[2]), "q_w": (q_w, nq), "k_w": (k_w, k_codes.shape[2])}
    for name, (x, length) in rows.items():
        if x is not None and (x.dtype != torch.float32 or x.dim() != 3 or x.shape[:2] != (bh, length)):
            raise ValueError(f"{name} must be ({bh}, {length}, D) float32, got {tuple(x.shape)} {x.dtype}")
    if q_w is not None and q_w.shape[2] != k_w.shape[2]:
        raise ValueError(f"q_w and k_w must share Dw, got {q_w.shape[2]} and {k_w.shape[2]}")


def lsh_cumulate(q_codes: torch.Tensor, k_codes: torch.Tensor, v: torch.Tensor, hash_bits: int) -> torch.Tensor:
    """Bucket cumulation (eq. 9–10) averaged over hashes.

    q_codes: (BH, m, Nq) int32, k_codes: (BH, m, Nk) int32, negative = masked; v: (BH, Nk, Dv) fp32.
    Returns (BH, Nq, Dv) fp32: out[i] = (1/m) Σ_h Σ_j [k_codes[h, j] == q_codes[h, i]] v[j].
    Memory: one (BH, min(2^τ + 1, Nq + Nk), Dv) table reused per hash, never (N, m, Dv).
    """
    _check_cumulate_args(q_codes, k_codes, v, hash_bits)
    bh, hashes, nq = q_codes.shape
    nk, dv = v.shape[1], v.shape[2]
    rows = (1 << hash_bits) + 1  # the last row is a sink for masked codes, zeroed before reading
    out = torch.zeros(bh, nq, dv, dtype=torch.float32, device=v.device)
    chunk = max(1, _CHUNK_BUDGET // (_table_height(rows, nq, nk) * dv))
    for start in range(0, bh, chunk):
        stop = min(bh, start + chunk)
        offsets = torch.arange(stop - start, device=v.device)[:, None] * rows  # (n, 1)
        values = v[start:stop].reshape(-1, dv)  # (n·Nk, Dv)
        table = torch.empty((stop - start) * _table_height(rows, nq, nk), dv, dtype=torch.float32, device=v.device)
        picked = torch.empty((stop - start) * nq, dv, dtype=torch.float32, device=v.device)
        for h in range(hashes):
            q_rows, k_rows, height, sinks = _hash_rows(q_codes[start:stop, h], k_codes[start:stop, h], rows, offsets)
            table[:height].zero_()
            table.index_add_(0, k_rows, values)
            table.index_fill_(0, sinks, 0.0)
            # out= reuses one buffer: a fresh allocation per hash costs more than the gather
            torch.index_select(table, 0, q_rows, out=picked)
            out[start:stop] += picked.view(stop - start, nq, dv)
    return out.div_(hashes)


def lsh_weighted_cumulate(
    q_codes: torch.Tensor,
    k_codes: torch.Tensor,
    q_w: torch.Tensor,
    k_w: torch.Tensor,
    v: torch.Tensor,
    hash_bits: int,
) -> torch.Tensor:
    """Weighted bucket cumulation for the backward of eq. 13–14.

    q_codes: (BH, m, Nq) int32, k_codes: (BH, m, Nk) int32 (negative = masked);
    q_w: (BH, Nq, Dw), k_w: (BH, Nk, Dw), v: (BH, Nk, Dv), all fp32.
    Returns (BH, Nq, Dv) fp32: out[i] = (1/m) Σ_h Σ_j [codes equal] (q_w[i]·k_w[j]) v[j].
    Each bucket holds Σ_j k_w[j] ⊗ v[j] (a Dw×Dv table), so the cost is linear in N.
    """
    _check_cumulate_args(q_codes, k_codes, v, hash_bits, q_w, k_w)
    bh, hashes, nq = q_codes.shape
    nk, dw, dv = v.shape[1], q_w.shape[2], v.shape[2]
    rows = (1 << hash_bits) + 1
    width = dw * dv
    out = torch.zeros(bh, nq, dv, dtype=torch.float32, device=v.device)
    chunk = max(1, _CHUNK_BUDGET // (max(_table_height(rows, nq, nk), nk, nq) * width))
    for start in range(0, bh, chunk):
        stop = min(bh, start + chunk)
        n = stop - start
        offsets = torch.arange(n, device=v.device)[:, None] * rows
        outer = (k_w[start:stop, :, :, None] * v[start:stop, :, None, :]).reshape(n * nk, width)
        table = torch.empty(n * _table_height(rows, nq, nk), width, dtype=torch.float32, device=v.device)
        picked = torch.empty(n * nq, width, dtype=torch.float32, device=v.device)
        left = q_w[start:stop].reshape(n * nq, 1, dw)
        for h in range(hashes):
            q_rows, k_rows, height, sinks = _hash_rows(q_codes[start:stop, h], k_codes[start:stop, h], rows, offsets)
            table[:height].zero_()
            table.index_add_(0, k_rows, outer)
            table.index_fill_(0, sinks, 0.0)
            torch.index_select(table, 0, q_rows, out=picked)
            out[start:stop] += torch.bmm(left, picked.view(n * nq, dw, dv)).view(n, nq, dv)
    return out.div_(hashes)
