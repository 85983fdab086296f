"""The losses of ``yoso-train longdoc`` (the command's docstring says what each term is): the student's
forward over a step's crops, spans and short texts, and each weighted term of the sum."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from yoso_serve.model import EncoderModel
from yoso_serve.model.pieces import piece_means

from .teacher import pool


def kernel_logits(spans: torch.Tensor, pieces: torch.Tensor, valid: torch.Tensor, beta: float) -> torch.Tensor:
    """log of the kernel mean, mean over a document's valid pieces of exp(β (cos − 1)), of every span
    (S, D; unit rows) against every document's pieces (C, K, D; unit rows, ``valid`` (C, K) marks real
    ones): (S, C). A document without a valid piece scores -inf."""
    sim = torch.einsum("sd,ckd->sck", spans, pieces)
    total = (beta * (sim - 1.0)).masked_fill(~valid, float("-inf")).logsumexp(-1)
    return total - valid.sum(-1).clamp_min(1).log()


class LongDocLoss(nn.Module):
    """Student forward and the three losses; holds the student's encoder, the temperature and the queue."""

    def __init__(self, student: EncoderModel, *, temperature: float, queue: int, weights: tuple[float, float],
                 w_segment: float = 0.0, segment: int = 128, w_kernel: float = 0.0, kernel_beta: float = 20.0,
                 kernel_temperature: float = 0.5, kernel_tokens: int = 64, max_tokens: int = 4096,
                 w_own_windows: float = 0.0, cut_fixed: bool = False) -> None:
        super().__init__()
        self.w_own_windows, self.cut_fixed = w_own_windows, cut_fixed
        self.student = student.encoder
        self.pooling = student.config.pooling
        self.w_short, self.w_distill = weights
        if w_segment and student.config.pooling != "mean":
            raise ValueError("--w-segment needs a mean-pooling student (segments are means of token states)")
        self.w_segment, self.segment = w_segment, segment
        if w_kernel and student.config.pooling != "mean":
            raise ValueError("--w-kernel needs a mean-pooling student (its pieces are means of token states)")
        self.w_kernel, self.kernel_beta, self.kernel_temperature = w_kernel, kernel_beta, kernel_temperature
        self.kernel_tokens = kernel_tokens
        self.log_scale = nn.Parameter(torch.tensor(math.log(1.0 / temperature)))
        dim = student.config.hidden_size
        self.register_buffer("queue", torch.zeros(queue, dim))
        self.register_buffer("queue_keys", torch.full((queue,), -1, dtype=torch.long))
        # with --w-kernel, the queued documents' unit piece vectors (empty otherwise)
        k = -(-max_tokens // kernel_tokens) if w_kernel else 0
        self.register_buffer("queue_pieces", torch.zeros(queue if w_kernel else 0, k, dim))
        self.register_buffer("queue_piece_valid", torch.zeros(queue if w_kernel else 0, k, dtype=torch.bool))

    def unit_pieces(self, hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each crop's unit --kernel-tokens piece vectors, padded to the queue's piece count, and which are real."""
        _, means, counts = piece_means(hidden.detach(), mask, self.kernel_tokens)
        room = self.queue_pieces.shape[1]
        if means.shape[1] > room:
            raise ValueError(f"a crop has {means.shape[1]} pieces of {self.kernel_tokens} tokens, more than {room}")
        means = F.pad(F.normalize(means, dim=-1), (0, 0, 0, room - means.shape[1]))
        return means, F.pad(counts > 0, (0, room - counts.shape[1]))

    def kernel_loss(self, spans: torch.Tensor, docs: torch.Tensor, pieces: torch.Tensor, valid: torch.Tensor,
                    scale: torch.Tensor, span_doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KL(target ‖ student) over the candidate documents (rows of ``docs``, their pieces ``pieces``): the
        target the softmax of the pieces' log kernel mean / --kernel-temperature. Returns the loss and, without
        gradient, how often the target ranks a span's own document first."""
        with torch.no_grad():
            target = kernel_logits(spans.detach(), pieces, valid, self.kernel_beta) / self.kernel_temperature
            target = target.log_softmax(-1)
            top1 = target.argmax(-1).eq(span_doc).float().mean()
        student = (scale * spans @ docs.T).log_softmax(-1)
        return (target.exp() * (target - student)).sum(-1).mean(), top1

    def embed(self, ids: torch.Tensor, mask: torch.Tensor, hashes: int) -> torch.Tensor:
        return self.embed_states(ids, mask, hashes)[0]

    def embed_states(self, ids: torch.Tensor, mask: torch.Tensor, hashes: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.student(ids, mask, hashes=hashes).float()  # (B, N, D)
        return F.normalize(pool(hidden, mask, self.pooling), dim=-1), hidden

    def segment_loss(self, hidden: torch.Tensor, mask: torch.Tensor, spans: torch.Tensor, span_doc: torch.Tensor,
                     span_lo: torch.Tensor, span_hi: torch.Tensor, scale: torch.Tensor,
                     size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each span against every ``size``-token piece of the batch's crops (pieces cut from position 0,
        as ``eval --segment`` cuts them); its positives are the pieces of its own document that overlap its
        block [span_lo, span_hi) (sequence positions). Returns the multi-positive InfoNCE and, without
        gradient, how often a span's best piece is a positive."""
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

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        docs, hidden = self.embed_states(batch["input_ids"], batch["attention_mask"], int(batch["doc_hashes"]))
        short = self.embed(batch["short_ids"], batch["short_mask"], int(batch["query_hashes"]))  # (S + 2P, D)
        n_spans, n_pairs = len(batch["span_doc"]), int(batch["n_pairs"])
        spans, first, rest = short[:n_spans], short[n_spans:n_spans + n_pairs], short[n_spans + n_pairs:]
        scale = self.log_scale.exp().clamp(max=100.0)
        span_doc = batch["span_doc"]  # (S,) index of each span's document in the batch
        logs: dict[str, float] = {}
        # span → document: the batch's documents, then the queue (minus copies of this batch's documents)
        stale = (self.queue_keys[None, :] == batch["doc_keys"][:, None]).any(0) | (self.queue_keys < 0)
        queue = self.queue[~stale]
        if self.w_kernel:
            pieces, valid = self.unit_pieces(hidden, batch["attention_mask"])
        if n_spans:
            logits = scale * spans @ torch.cat([docs, queue]).T
            if "cut_ids" in batch:  # a span's own document with its blocks cut out: the nearest negative
                with torch.set_grad_enabled(torch.is_grad_enabled() and not self.cut_fixed):
                    cuts = self.embed(batch["cut_ids"], batch["cut_mask"], int(batch["doc_hashes"]))
                cut = scale * spans @ cuts.T
                with torch.no_grad():  # how often a span prefers its whole document to the document without it
                    own = batch["cut_doc"][None, :] == span_doc[:, None]
                    own_cut = cut.masked_fill(~own, -math.inf).amax(-1)  # every span's document has its cut copy
                    logs["cut_win"] = float((logits.gather(1, span_doc[:, None])[:, 0] > own_cut).float().mean())
                logits = torch.cat([logits, cut], dim=1)
            q2d = F.cross_entropy(logits, span_doc)
            # document → span: each span against every span of the batch but its document's other spans
            logits = scale * docs[span_doc] @ spans.T  # (S, S): row r is the document of span r
            others = (span_doc[:, None] == span_doc[None, :]) & ~torch.eye(n_spans, dtype=torch.bool,
                                                                          device=logits.device)
            d2q = F.cross_entropy(logits.masked_fill(others, -1e4), torch.arange(n_spans, device=logits.device))
            loss_long = (q2d + d2q) / 2
        else:  # no block of the step's crops fits a span: the step trains on its short texts alone
            loss_long = docs.sum() * 0.0
        pair = scale * first @ rest.T
        target = torch.arange(n_pairs, device=pair.device)
        loss_short = (F.cross_entropy(pair, target) + F.cross_entropy(pair.T, target)) / 2
        loss_distill = (1.0 - (short * F.normalize(batch["t_short"], dim=-1)).sum(-1)).mean()
        loss = loss_long + self.w_short * loss_short + self.w_distill * loss_distill
        if self.w_own_windows and "win_ids" in batch:
            target = self.own_windows(batch["win_ids"], batch["win_mask"], batch["win_doc"], len(docs))
            loss_own = (1.0 - (docs * target).sum(-1)).mean()
            loss = loss + self.w_own_windows * loss_own
            logs["own_windows_loss"] = float(loss_own.detach())
        if self.w_kernel and n_spans:
            loss_kernel, kernel_top1 = self.kernel_loss(
                spans, torch.cat([docs, queue]), torch.cat([pieces, self.queue_pieces[~stale]]),
                torch.cat([valid, self.queue_piece_valid[~stale]]), scale, span_doc)
            loss = loss + self.w_kernel * loss_kernel
            logs |= {"kernel_loss": float(loss_kernel.detach()), "kernel_top1": float(kernel_top1)}
        self.push(docs.detach(), batch["doc_keys"], *((pieces, valid) if self.w_kernel else ()))
        if self.w_segment and n_spans:
            size = int(batch.get("segment_tokens", self.segment))
            loss_segment, segment_top1 = self.segment_loss(hidden, batch["attention_mask"], spans, span_doc,
                                                           batch["span_lo"], batch["span_hi"], scale, size)
            loss = loss + self.w_segment * loss_segment
            logs |= {"segment_loss": float(loss_segment.detach()), "segment_top1": float(segment_top1),
                     "segment_tokens": size}
        with torch.no_grad():
            top1 = (spans @ docs.T).argmax(-1).eq(span_doc).float().mean() if n_spans else torch.zeros(())
        return loss, {"long_loss": float(loss_long.detach()), "short_loss": float(loss_short.detach()),
                      "distill_loss": float(loss_distill.detach()), "temperature": float(1.0 / scale.detach()),
                      "span_top1": float(top1), **logs}

    @torch.no_grad()
    def own_windows(self, ids: torch.Tensor, mask: torch.Tensor, owner: torch.Tensor, n_docs: int) -> torch.Tensor:
        """(n_docs, D) unit targets: the student's embeddings of the windows (each read alone and exact, as
        ``auto`` serves a window under its crossover of 288 tokens), unit, summed per crop and normalised; no
        gradient flows into them."""
        vecs = self.embed(ids, mask, 0)
        out = torch.zeros(n_docs, vecs.shape[1], device=vecs.device).index_add_(0, owner, vecs)
        return F.normalize(out, dim=-1)

    @torch.no_grad()
    def push(self, docs: torch.Tensor, keys: torch.Tensor, pieces: torch.Tensor | None = None,
             valid: torch.Tensor | None = None) -> None:
        """FIFO: the newest documents enter at the front (with their pieces, under --w-kernel)."""
        if not len(self.queue):
            return
        n = min(len(docs), len(self.queue))
        self.queue.copy_(torch.cat([docs[:n], self.queue[:-n]]))
        self.queue_keys.copy_(torch.cat([keys[:n], self.queue_keys[:-n]]))
        if pieces is not None and len(self.queue_pieces):
            self.queue_pieces.copy_(torch.cat([pieces[:n], self.queue_pieces[:-n]]))
            self.queue_piece_valid.copy_(torch.cat([valid[:n], self.queue_piece_valid[:-n]]))
