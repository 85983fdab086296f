"""score_center: the cosine the service scores 0.5 in /rerank and zero-shot multi-label /classify, measured
per model (retrieval.calibrate_center) and written into its config.json by the pipeline's serve-settings."""

from __future__ import annotations

import pytest
import torch

from yoso_serve.model import EncoderConfig
from yoso_serve.model.train import retrieval


def test_score_center_splits_related_from_unrelated():
    related = torch.tensor([0.50, 0.60, 0.70, 0.80])
    unrelated = torch.tensor([0.10, 0.20, 0.30, 0.40])
    # every threshold in (0.40, 0.50] separates them: the middle of those, on the 0.01 grid
    assert retrieval.score_center(related, unrelated) == pytest.approx(0.455, abs=0.006)
    # shifted together, the centre moves with them: it is the model's, not a constant
    assert retrieval.score_center(related + 0.2, unrelated + 0.2) == pytest.approx(0.655, abs=0.006)
    # overlap: the threshold with the fewest errors of either kind
    assert retrieval.score_center(torch.tensor([0.3, 0.6, 0.7, 0.8]), torch.tensor([0.1, 0.2, 0.35, 0.5])) \
        == pytest.approx(0.55, abs=0.006)


def test_config_takes_a_cosine_only():
    assert EncoderConfig(score_center=0.43).score_center == 0.43
    with pytest.raises(ValueError, match="score_center is a cosine"):
        EncoderConfig(score_center=1.5)
