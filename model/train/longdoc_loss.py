"""The loss of ``yoso-train longdoc`` as a list of terms (the command's docstring says what each is for).

:class:`LongDocLoss` runs the student over a step's crops, spans and short texts once, puts what it read in
a :class:`Step`, and sums ``weight × term(step)`` over its terms in order. A term is any object with a
``name``, a ``weight`` and ``__call__(step) -> (loss, logs)``; its loss is logged as ``<name>_loss``.
Adding a term is writing one such class and one line where the command builds the list."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from yoso_serve.model import EncoderModel
from yoso_serve.model.pieces import piece_means

from .teacher import pool


@dataclass
class Step:
    """One step as the terms see it: the batch, the student's unit vectors and the crops' token states."""

    batch: dict
    docs: torch.Tensor  # (B, D) unit vectors of the crops
    hidden: torch.Tensor  # (B, N, D) the crops' token states
    spans: torch.Tensor  # (S, D) unit vectors of the spans
    first: torch.Tensor  # (P, D) first sentences of the short pairs
    rest: torch.Tensor  # (P, D) the rest of their paragraphs
    short: torch.Tensor  # (S + 2P, D) every short text: spans, firsts, rests
    queue: torch.Tensor  # (Q, D) queued documents, less copies of this step's
    scale: torch.Tensor  # the learned inverse temperature
    span_doc: torch.Tensor  # (S,) each span's document in the batch


class Term(Protocol):
    name: str
    weight: float

    def __call__(self, step: Step) -> tuple[torch.Tensor, dict[str, float]]: ...


class SpanDocument:
    """Symmetric InfoNCE between spans and documents: span → its document among the batch's and the queue's;
    document → each of its spans among the batch's spans (its other spans masked). A step with no span
    gives a zero that keeps the graph."""

    name, weight = "long", 1.0

    def __call__(self, step: Step) -> tuple[torch.Tensor, dict[str, float]]:
        spans, docs, span_doc, scale = step.spans, step.docs, step.span_doc, step.scale
        n_spans = len(spans)
        if not n_spans:
            return docs.sum() * 0.0, {}
        q2d = F.cross_entropy(scale * spans @ torch.cat([docs, step.queue]).T, span_doc)
        logits = scale * docs[span_doc] @ spans.T  # (S, S): row r is the document of span r
        others = (span_doc[:, None] == span_doc[None, :]) & ~torch.eye(n_spans, dtype=torch.bool,
                                                                      device=logits.device)
        d2q = F.cross_entropy(logits.masked_fill(others, -1e4), torch.arange(n_spans, device=logits.device))
        return (q2d + d2q) / 2, {}


class ShortPairs:
    """Symmetric InfoNCE between a paragraph's first sentence and the rest of it (``--w-short``)."""

    name = "short"

    def __init__(self, weight: float) -> None:
        self.weight = weight

    def __call__(self, step: Step) -> tuple[torch.Tensor, dict[str, float]]:
        pair = step.scale * step.first @ step.rest.T
        target = torch.arange(len(pair), device=pair.device)
        return (F.cross_entropy(pair, target) + F.cross_entropy(pair.T, target)) / 2, {}


class Distill:
    """1 − cos between the student's and the teacher's embedding of every short text (``--w-distill``)."""

    name = "distill"

    def __init__(self, weight: float) -> None:
        self.weight = weight

    def __call__(self, step: Step) -> tuple[torch.Tensor, dict[str, float]]:
        return (1.0 - (step.short * F.normalize(step.batch["t_short"], dim=-1)).sum(-1)).mean(), {}


class SpanPiece:
    """Span → piece InfoNCE over the crops' pieces (``--w-segment``, pieces of ``--segment-tokens``)."""

    name = "segment"

    def __init__(self, weight: float, size: int) -> None:
        self.weight, self.size = weight, size

    def __call__(self, step: Step) -> tuple[torch.Tensor, dict[str, float]]:
        if not len(step.spans):
            return step.docs.sum() * 0.0, {}
        b = step.batch
        size = int(b.get("segment_tokens", self.size))
        loss, top1 = segment_loss(step.hidden, b["attention_mask"], step.spans, step.span_doc, b["span_lo"],
                                  b["span_hi"], step.scale, size)
        return loss, {"segment_top1": float(top1), "segment_tokens": size}


def segment_loss(hidden: torch.Tensor, mask: torch.Tensor, spans: torch.Tensor, span_doc: torch.Tensor,
                 span_lo: torch.Tensor, span_hi: torch.Tensor, scale: torch.Tensor,
                 size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each span against every ``size``-token piece of the batch's crops (pieces cut from position 0, as
    ``eval --segment`` cuts them); its positives are the pieces of its own document that overlap its block
    [span_lo, span_hi) (sequence positions). Returns the multi-positive InfoNCE and, without gradient, how
    often a span's best piece is a positive."""
    _, means, counts = piece_means(hidden, mask, size)
    b, k, d = means.shape
    pieces = F.normalize(means, dim=-1).reshape(b * k, d)
    start = torch.arange(k, device=hidden.device) * size
    overlap = (start[None, :] < span_hi[:, None]) & (start[None, :] + size > span_lo[:, None])  # (S, k)
    positive = torch.zeros(len(spans), b, k, dtype=torch.bool, device=hidden.device)
    positive[torch.arange(len(spans), device=hidden.device), span_doc] = overlap
    valid = (counts > 0).reshape(b * k)
    positive = positive.reshape(len(spans), b * k) & valid
    logits = (scale * spans @ pieces.T).masked_fill(~valid, -1e4)
    loss = (logits.logsumexp(-1) - logits.masked_fill(~positive, -1e4).logsumexp(-1)).mean()
    with torch.no_grad():
        top1 = positive.gather(1, logits.argmax(-1, keepdim=True)).float().mean()
    return loss, top1


class LongDocLoss(nn.Module):
    """Student forward and the weighted sum of ``terms``; holds the student's encoder, the temperature and
    the queue of recent documents."""

    def __init__(self, student: EncoderModel, *, temperature: float, queue: int, terms: list[Term]) -> None:
        super().__init__()
        if any(t.name == SpanPiece.name for t in terms) and student.config.pooling != "mean":
            raise ValueError("--w-segment needs a mean-pooling student (segments are means of token states)")
        self.terms = terms
        self.student = student.encoder
        self.pooling = student.config.pooling
        self.log_scale = nn.Parameter(torch.tensor(math.log(1.0 / temperature)))
        dim = student.config.hidden_size
        self.register_buffer("queue", torch.zeros(queue, dim))
        self.register_buffer("queue_keys", torch.full((queue,), -1, dtype=torch.long))

    def embed_states(self, ids: torch.Tensor, mask: torch.Tensor, hashes: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.student(ids, mask, hashes=hashes).float()  # (B, N, D)
        return F.normalize(pool(hidden, mask, self.pooling), dim=-1), hidden

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        docs, hidden = self.embed_states(batch["input_ids"], batch["attention_mask"], int(batch["doc_hashes"]))
        short = self.embed_states(batch["short_ids"], batch["short_mask"], int(batch["query_hashes"]))[0]
        n_spans, n_pairs = len(batch["span_doc"]), int(batch["n_pairs"])
        stale = (self.queue_keys[None, :] == batch["doc_keys"][:, None]).any(0) | (self.queue_keys < 0)
        step = Step(batch, docs, hidden, short[:n_spans], short[n_spans:n_spans + n_pairs],
                    short[n_spans + n_pairs:], short, self.queue[~stale], self.log_scale.exp().clamp(max=100.0),
                    batch["span_doc"])
        loss, logs = None, {}
        for term in self.terms:
            value, extra = term(step)
            loss = value * term.weight if loss is None else loss + term.weight * value
            logs |= {f"{term.name}_loss": float(value.detach()), **extra}
        self.push(docs.detach(), batch["doc_keys"])
        with torch.no_grad():
            top1 = (step.spans @ docs.T).argmax(-1).eq(step.span_doc).float().mean() if n_spans else torch.zeros(())
        return loss, {**logs, "temperature": float(1.0 / step.scale.detach()), "span_top1": float(top1)}

    @torch.no_grad()
    def push(self, docs: torch.Tensor, keys: torch.Tensor) -> None:
        """FIFO: the newest documents enter at the front."""
        if not len(self.queue):
            return
        n = min(len(docs), len(self.queue))
        self.queue.copy_(torch.cat([docs[:n], self.queue[:-n]]))
        self.queue_keys.copy_(torch.cat([keys[:n], self.queue_keys[:-n]]))
