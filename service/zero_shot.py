"""Zero-shot classification: ``/classify`` with ``labels`` scores each text against the labels by the
cosine of their embeddings, so any embedding model classifies without a head. Also the softmax and
the ranking that head classification (engine.py) shares.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import numpy as np

from .errors import InvalidInput
from .params import ClassifyParams, EmbedParams, Output

# Cosine similarities are scaled by 1/0.05 before the softmax (the temperature contrastive sentence
# encoders are trained with), and for multi-label each label is sigmoid(20 * (cos - c)), c the model's
# score_center (config.json, measured per model by model/train/retrieval.py calibrate_center): the cosine
# that best tells related short texts from unrelated ones, which scores 0.5. Without one, 0.3: what the
# same measurement gives all-MiniLM-L6-v2 (0.29-0.33); the bundled model, trained further, has its own.
ZERO_SHOT_SCALE = 20.0
DEFAULT_SCORE_CENTER = 0.3


def calibrated(cosines: np.ndarray, center: float) -> np.ndarray:
    """Cosines as scores in (0, 1): sigmoid(ZERO_SHOT_SCALE (cos - center))."""
    return 1.0 / (1.0 + np.exp(-ZERO_SHOT_SCALE * (cosines - center)))

Embed = Callable[..., Awaitable[Output]]  # Engine.embed: (EmbedParams, watch) → normalised vectors


async def zero_shot_classify(p: ClassifyParams, watch, *, embed: Embed, check_texts: Callable[[list[str]], None],
                             max_labels: int, center: float = DEFAULT_SCORE_CENTER) -> Output:
    """Per input, ``[(label, score), ...]`` sorted by score, highest first; the labels' tokens and
    inference time are counted in the usage."""
    if not p.labels or any(not label.strip() for label in p.labels) or len(set(p.labels)) != len(p.labels):
        raise InvalidInput("labels must be a non-empty list of distinct, non-blank strings", param="labels")
    if len(p.labels) > max_labels:
        raise InvalidInput(f"{len(p.labels)} labels is above max_client_batch_size {max_labels}", param="labels")
    check_texts(p.texts)
    texts = await embed(EmbedParams(p.texts, truncation_direction=p.truncation_direction, hashes=p.hashes,
                                    long_input=p.long_input), watch)
    labels = await embed(EmbedParams(list(p.labels), hashes=p.hashes), watch)
    sims = texts.value @ labels.value.T  # (n_texts, n_labels) cosines: both sides normalised
    if p.raw_scores:
        scores = sims
    elif p.multi_label:
        scores = calibrated(sims, center)
    else:
        scores = softmax(ZERO_SHOT_SCALE * sims)
    usage = texts.usage
    usage.tokens += labels.usage.tokens
    usage.inference_ms += labels.usage.inference_ms
    return Output(ranked(scores, list(p.labels)), usage)


def softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (n, k) scores."""
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def ranked(scores: np.ndarray, labels: list[str]) -> list[list[tuple[str, float]]]:
    """Per row of (n, k) scores, ``(label, score)`` pairs sorted by score, highest first."""
    return [sorted(zip(labels, map(float, row)), key=lambda p: -p[1]) for row in scores]
