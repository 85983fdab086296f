"""Ranks, Spearman and F1 against scipy (a dev dependency) and hand-computed values."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from yoso_serve.model.train.metrics import (
    average_ranks,
    multi_label_metrics,
    pairwise_upper,
    single_label_metrics,
    spearman,
)


def test_average_ranks_match_scipy_with_ties():
    x = torch.tensor([3.0, 1.0, 3.0, 2.0, 3.0, -1.0, 2.0])
    assert average_ranks(x).tolist() == stats.rankdata(x.numpy()).tolist()


def test_spearman_matches_scipy():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(200, generator=g)
    b = a + 0.7 * torch.randn(200, generator=g)
    b[::10] = b[0]  # ties
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a.numpy(), b.numpy()).statistic, abs=1e-12)
    assert spearman(a, a.exp()) == pytest.approx(1.0)  # monotone map: perfect rank agreement
    assert spearman(a, -a) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="equal length"):
        spearman(a, b[:5])


def test_pairwise_upper_is_the_cosine_of_each_pair():
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    assert pairwise_upper(x).tolist() == pytest.approx([0.0, 2 ** -0.5, 2 ** -0.5])


def test_single_label_metrics_by_hand():
    logits = torch.tensor([[2.0, 0, 0], [0, 2.0, 0], [0, 2.0, 0], [0, 0, 2.0]])
    targets = torch.tensor([0, 1, 0, 2])
    m = single_label_metrics(logits, targets, 3)
    # class 0: tp1 fn1 → 2/3; class 1: tp1 fp1 → 2/3; class 2: 1
    assert m["accuracy"] == pytest.approx(0.75)
    assert m["f1"] == pytest.approx((2 / 3 + 2 / 3 + 1) / 3)


def test_multi_label_metrics_by_hand():
    logits = torch.tensor([[1.0, -1.0, 1.0], [1.0, 1.0, -1.0]])
    targets = torch.tensor([[1.0, 0, 1], [1, 0, 0]])
    m = multi_label_metrics(logits, targets)
    assert m["accuracy"] == pytest.approx(0.5)  # one row exactly right
    assert m["f1"] == pytest.approx(2 * 3 / (2 * 3 + 1 + 0))  # tp 3, fp 1, fn 0
    assert m["macro_f1"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)
