"""The pieces of a document read in one pass: consecutive ``size``-token runs of its sequence, cut from
position 0 (the first special token), each summarised by the mean of its token states.

One rule for the three places that use it: the piece loss of ``yoso-train longdoc``, the piece rows of
``yoso-train eval``, and the service's ``/embed_pieces``; what is served is what was trained and measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sums(hidden: torch.Tensor, attention_mask: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden: (B, N, D) → the sums (B, k, D) and real-token counts (B, k) of its consecutive ``size``-token
    pieces, k = ⌈N / size⌉, cut from position 0; a piece past a row's end counts 0 tokens."""
    b, n, d = hidden.shape
    k = -(-n // size)
    w = attention_mask.to(hidden.dtype).unsqueeze(-1)
    sums = F.pad(hidden * w, (0, 0, 0, k * size - n)).view(b, k, size, d).sum(2)
    counts = F.pad(w, (0, 0, 0, k * size - n)).view(b, k, size).sum(2)
    return sums, counts


def piece_means(hidden: torch.Tensor, attention_mask: torch.Tensor,
                size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From one :func:`segment_sums`: the mean over each row's real tokens (B, D) (mean pooling), each
    piece's mean (B, k, D; zero for a piece past a row's end) and each piece's real-token count (B, k)."""
    sums, counts = segment_sums(hidden, attention_mask, size)
    whole = sums.sum(1) / counts.sum(1, keepdim=True).clamp_min(1.0)
    return whole, sums / counts.clamp_min(1.0)[:, :, None], counts


def piece_bounds(n_tokens: int, size: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` token positions of the pieces :func:`segment_sums` cuts a sequence of
    ``n_tokens`` into."""
    return [(a, min(a + size, n_tokens)) for a in range(0, n_tokens, size)]
