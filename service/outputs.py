"""Shaping outputs: the model's rows back into what a route answers: chunked windows pooled into one
vector per document (a token-weighted mean), pieces of one pass with their bounds, head scores. Pure
functions over arrays."""

from __future__ import annotations

import numpy as np
import torch

from yoso_serve.model.pieces import piece_bounds, piece_means

from .inputs import char_bounds
from .zero_shot import ranked, softmax


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` scaled to unit length (a zero row stays zero)."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def pooled_documents(n_texts: int, owners: list[int], weights: list[int], rows: list[np.ndarray], *,
                     dimensions: int | None, normalize: bool) -> np.ndarray:
    """(n_texts, d) float32: each text the ``weights``-weighted mean of its windows' rows (``owners``: the
    text each row belongs to), cut to ``dimensions``, normalised if asked."""
    vectors = np.zeros((n_texts, rows[0].shape[0]), dtype=np.float32)
    total = np.zeros(n_texts, dtype=np.float32)
    for i, w, row in zip(owners, weights, rows):
        vectors[i] += w * row
        total[i] += w
    vectors /= total[:, None]
    if dimensions is not None:
        vectors = np.ascontiguousarray(vectors[:, :dimensions])
    return unit_rows(vectors) if normalize else vectors


def piece_vectors(hidden: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """One input's token states (n, d) → (its mean (d,), the mean of each consecutive ``size``-token piece
    (k, d)), by model/pieces.py's :func:`piece_means`. Torch ops: the engine runs this on the forward's own
    thread. On the event loop's thread the reduction of a long input started a second OpenMP team there, and
    with more OpenMP threads than cores every later forward's threads stopped spinning between parallel
    regions: a short request took 37 ms instead of 27 from then on (2 cores)."""
    whole, means, _ = piece_means(torch.from_numpy(hidden)[None], torch.ones(1, len(hidden)), size)
    return whole[0].numpy(), means[0].numpy()


def document_pieces(vectors: tuple[np.ndarray, np.ndarray], n_tokens: int, offsets: list[tuple[int, int]],
                    size: int, normalize: bool):
    """One input's :func:`piece_vectors` as ``(vector (d,), pieces (k, d), [(tok_a, tok_b)], [(char_a, char_b)])``:
    its pooled embedding and the mean token state of each consecutive ``size``-token piece of its
    ``n_tokens`` tokens."""
    vector, pieces = vectors
    if normalize:
        vector, pieces = unit_rows(vector), unit_rows(pieces)
    bounds = piece_bounds(n_tokens, size)
    return vector, pieces, bounds, char_bounds(offsets, bounds)


def head_scores(logits: np.ndarray, id2label: dict[int, str], *, raw_scores: bool, multi_label: bool):
    """Per input, ``[(label, score), ...]`` highest first: logits as they are, sigmoids or a softmax."""
    if raw_scores:
        scores = logits
    elif multi_label:
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        scores = softmax(logits)
    return ranked(scores, [id2label.get(i, str(i)) for i in range(logits.shape[1])])
