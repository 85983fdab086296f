"""Metrics without scipy or scikit-learn (both are dev extras at most): ranks, Spearman, F1."""

from __future__ import annotations

import torch


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """x: (n,) → ranks 1..n as float64, ties sharing their average rank (scipy's ``rankdata``)."""
    x = x.detach().double().flatten()
    order = torch.argsort(x, stable=True)
    sorted_x = x[order]
    # a new group starts wherever the sorted value changes
    starts = torch.ones_like(sorted_x, dtype=torch.bool)
    starts[1:] = sorted_x[1:] != sorted_x[:-1]
    group = torch.cumsum(starts.long(), 0) - 1  # (n,) group index per sorted position
    positions = torch.arange(1, len(x) + 1, dtype=torch.float64)
    counts = torch.zeros(int(group[-1]) + 1, dtype=torch.float64).index_add_(0, group, torch.ones_like(positions))
    sums = torch.zeros_like(counts).index_add_(0, group, positions)
    ranks = torch.empty_like(x)
    ranks[order] = (sums / counts)[group]
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two equally long 1-D tensors (Pearson of average ranks)."""
    if a.numel() != b.numel() or a.numel() < 2:
        raise ValueError(f"spearman needs two tensors of equal length >= 2, got {a.numel()} and {b.numel()}")
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = (ra.norm() * rb.norm()).item()
    return float((ra @ rb).item() / denom) if denom > 0 else 0.0


def pairwise_upper(x: torch.Tensor) -> torch.Tensor:
    """x: (n, D) → cosine similarity of every pair i < j, (n·(n-1)/2,) fp64."""
    x = torch.nn.functional.normalize(x.double(), dim=-1)
    sims = x @ x.T
    i, j = torch.triu_indices(len(x), len(x), offset=1)
    return sims[i, j]


def single_label_metrics(logits: torch.Tensor, targets: torch.Tensor, num_labels: int) -> dict[str, float]:
    """logits (n, C), targets (n,) int → accuracy and macro F1 (classes absent from both count 0 and
    are left out of the mean, as scikit-learn does with ``labels`` unset)."""
    pred = logits.argmax(-1)
    acc = (pred == targets).double().mean().item()
    f1s = []
    for c in range(num_labels):
        tp = ((pred == c) & (targets == c)).sum().item()
        fp = ((pred == c) & (targets != c)).sum().item()
        fn = ((pred != c) & (targets == c)).sum().item()
        if tp + fp + fn:
            f1s.append(2 * tp / (2 * tp + fp + fn))
    return {"accuracy": acc, "f1": sum(f1s) / len(f1s) if f1s else 0.0}


def multi_label_metrics(logits: torch.Tensor, targets: torch.Tensor, threshold: float = 0.0) -> dict[str, float]:
    """logits, targets (n, C) multi-hot → exact-match accuracy, micro F1, macro F1 (logit > threshold)."""
    pred = logits > threshold
    gold = targets > 0.5
    exact = (pred == gold).all(-1).double().mean().item()
    tp = (pred & gold).sum(0).double()
    fp = (pred & ~gold).sum(0).double()
    fn = (~pred & gold).sum(0).double()
    micro = (2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()).clamp_min(1)).item()
    present = (tp + fp + fn) > 0
    per = 2 * tp / (2 * tp + fp + fn).clamp_min(1)
    macro = per[present].mean().item() if present.any() else 0.0
    return {"accuracy": exact, "f1": micro, "macro_f1": macro}
