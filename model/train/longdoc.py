"""``yoso-train longdoc``: contrastive long-document training, so that one pass over a whole document
finds what is deep inside it.

Each step takes ``--batch-size`` documents of one source (in-batch negatives of the same source are the
hard ones), cropped to the length of the curriculum's current stage, and ``--spans-per-doc`` spans of
each: a block (paragraph, list item) or one of its sentences, drawn uniformly over the document's
tokens. Losses, summed:

* long: symmetric InfoNCE between spans and documents (span → its document among the batch's and a
  queue of recent documents' embeddings; document → each of its spans among the batch's spans) with a
  learned temperature;
* short (``--w-short``): symmetric InfoNCE between the first sentence of a paragraph and the rest of it;
* distill (``--w-distill``): 1 − cos between the student's and the teacher's embedding of every short
  text (spans and short pairs), so short-text quality stays the teacher's;
* segment (``--w-segment``): span → piece InfoNCE over the crops' pieces;
* kernel (``--w-kernel``): each span's distribution over the documents (batch and queue) by their one
  vector, pulled (KL) towards the distribution a kernel mean over the documents' own pieces gives
  (:func:`kernel_logits`, without gradient). Scored that way, documents are found far more often than by
  their one vector (0.74–0.84 against 0.67 recall@1 on the source kept out), so the soft targets say which
  wrong documents deserve to come close.

Documents run at ``--doc-hashes`` (LSH, with the served projections unless ``--fresh-hashes``), short
texts at ``--query-hashes``; one count of each list is drawn per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from yoso_serve.model import EncoderModel, load_pretrained
from yoso_serve.model.encoder import POSITION_OFFSET
from yoso_serve.model.pieces import piece_means
from yoso_serve.model.argtypes import bounded

from .common import add_common_arguments, prepare_model, start, train_options
from .distill import fit_student, parse_hashes, set_hash_seeds
from .teacher import BertTeacher, pool
from .trainer import Trainer

# where one sentence ends and the next begins (the retrieval eval cuts its sentences here too)
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="YOSO checkpoint to start from")
    p.add_argument("--teacher", required=True, type=Path,
                   help="BERT-family teacher of the short-text term, or `init`: the starting --model, frozen "
                        "(holds short texts where the student starts; for machines without the teacher's weights)")
    p.add_argument("--data", required=True, type=Path, nargs="+",
                   help="document JSONL: {doc, source, blocks: [text, ...]} per line (longdocs.py writes it)")
    p.add_argument("--spans-per-doc", type=int, default=4)
    p.add_argument("--span-tokens", type=int, default=128, help="spans and short texts are cut to this")
    p.add_argument("--short-pairs", type=int, default=16, help="first-sentence → rest pairs per step")
    p.add_argument("--queue", type=int, default=128, help="recent document embeddings kept as extra negatives")
    p.add_argument("--curriculum", default="1024:0.3,2048:0.65,4096:1",
                   help="LENGTH:UNTIL,... documents are cropped to LENGTH tokens until that fraction of the steps")
    p.add_argument("--doc-hashes", default="32", help="hash counts of documents, one drawn per step (0 = exact)")
    p.add_argument("--query-hashes", default="0", help="hash counts of spans and short texts, one drawn per step")
    p.add_argument("--fresh-hashes", action="store_true",
                   help="draw new hash projections each step (default: the served projections)")
    p.add_argument("--temperature", type=bounded(float, 0, lo_open=True), default=0.05,
                   help="initial InfoNCE temperature (learned)")
    p.add_argument("--temperature-lr-scale", type=float, default=1.0,
                   help="learning rate of the temperature as a multiple of --lr (at the model's lr of ~2e-5 "
                        "AdamW moves its log by ~lr per step, so it stays where it starts)")
    p.add_argument("--neighbourhood", type=int, default=0,
                   help="draw a step's documents from this many consecutive documents of one source in key "
                        "order (parts of one page, pages of one section: hard negatives); 0 = the whole source")
    p.add_argument("--mined-neighbours", type=int, default=0,
                   help="K > 0: a step's documents are one document and --batch-size − 1 of its K nearest of the "
                        "same source by the teacher's embedding of their first --mine-tokens tokens (mined once at "
                        "the start); 0 (default) draws them as --neighbourhood says")
    p.add_argument("--mine-tokens", type=int, default=256, help="tokens of each document's opening that are mined")
    p.add_argument("--w-short", type=bounded(float, 0), default=1.0, help="weight of the short-pair InfoNCE")
    p.add_argument("--w-distill", type=bounded(float, 0), default=1.0,
                   help="weight of 1 − cos(student, teacher) on short texts")
    p.add_argument("--w-segment", type=bounded(float, 0), default=0.0,
                   help="weight of span → segment InfoNCE: each span against the mean token states of the "
                        "batch's --segment-tokens pieces, its positives the pieces of its own block (0 = off)")
    p.add_argument("--segment-tokens", default="128",
                   help="piece sizes of --w-segment, one drawn per step (e.g. 64,128): consecutive pieces of each "
                        "crop, as `eval --segment` cuts them")
    p.add_argument("--w-kernel", type=bounded(float, 0), default=0.0,
                   help="weight of the KL from the pieces' kernel-mean scores to the one vector's (0 = off)")
    p.add_argument("--kernel-beta", type=bounded(float, 0, lo_open=True), default=20.0,
                   help="sharpness β of the kernel mean over pieces, mean exp(β (cos − 1))")
    p.add_argument("--kernel-temperature", type=bounded(float, 0, lo_open=True), default=0.5,
                   help="the target's logits are the log kernel mean divided by this")
    p.add_argument("--kernel-tokens", type=bounded(int, 1), default=64, help="piece size of --w-kernel's kernel mean")
    p.add_argument("--cut-negatives", action="store_true",
                   help="each crop also read with its spans' blocks cut out: a negative for its own spans that "
                        "differs from their document only by them")
    p.add_argument("--cut-fixed", action="store_true",
                   help="with --cut-negatives, read the cut copies without gradient: a fixed negative that moves only "
                        "the spans and their whole documents, and keeps no activations for the copies")
    p.add_argument("--w-own-windows", type=bounded(float, 0), default=0.0,
                   help="weight of a pull of each crop's one-pass embedding towards the student's own "
                        "--own-window-tokens windows of it, each read alone (exact, no gradient), unit and averaged: "
                        "what chunking with the same model keeps, as a floor for the whole read")
    p.add_argument("--own-window-tokens", type=bounded(int, 16), default=240,
                   help="window size of --w-own-windows, specials included")
    p.add_argument("--train-positions-from", type=bounded(int, 0), default=0,
                   help="train only the position embeddings of token positions N and up (counted from 0), everything "
                        "else frozen: inputs of at most N tokens embed bit for bit as the starting model's (0 = train "
                        "everything)")
    p.add_argument("--save-fp16", action="store_true", help="store model/ in fp16 (the bundled format)")
    add_common_arguments(p, lr=2e-5, batch_size=4, epochs=1, dropout=0.0)


def parse_curriculum(text: str) -> list[tuple[int, float]]:
    """``"1024:0.3,4096:1"`` → [(1024, 0.3), (4096, 1.0)]: increasing fractions, the last one 1."""
    try:
        stages = [(int(a), float(b)) for a, b in (item.split(":") for item in text.split(",") if item.strip())]
    except ValueError:
        raise ValueError(f"--curriculum must be LENGTH:FRACTION,..., got {text!r}") from None
    fractions = [f for _, f in stages]
    if not stages or fractions != sorted(fractions) or fractions[-1] != 1.0 or any(n < 16 for n, _ in stages):
        raise ValueError(f"--curriculum needs lengths ≥ 16 and increasing fractions ending at 1, got {text!r}")
    return stages


def crop_length(stages: list[tuple[int, float]], step: int, total: int) -> int:
    """The document length of the curriculum stage that ``step`` (of ``total``) is in."""
    return next(n for n, until in stages if step < until * total or until == 1.0)


class DocCorpus:
    """Documents as token ids per block, grouped by source, and the short (first sentence, rest) pairs."""

    def __init__(self, rows: list[dict], tokenizer, span_tokens: int) -> None:
        self.tokenizer, self.span_tokens = tokenizer, span_tokens
        self.blocks: list[list[str]] = [r["blocks"] for r in rows]
        self.ids: list[list[list[int]]] = [tokenizer.encode(r["blocks"], add_special_tokens=False) for r in rows]
        self.keys = [r["doc"] for r in rows]
        by_source: dict[str, list[int]] = {}
        for i, r in enumerate(rows):
            by_source.setdefault(r["source"], []).append(i)
        self.by_source = by_source  # in file order (the draws of existing runs depend on it)
        self.in_key_order = {s: sorted(docs, key=lambda i: self.keys[i]) for s, docs in by_source.items()}
        pairs = []
        for blocks in self.blocks:
            for text in blocks:
                parts = SENTENCE_BREAK.split(text, maxsplit=1)
                if len(parts) == 2 and len(parts[0].split()) >= 5 and len(parts[1].split()) >= 12:
                    pairs.append((parts[0], parts[1]))
        self.pairs = pairs

    def source_weights(self, min_docs: int) -> dict[str, float]:
        """Sampling weight per source ∝ √(documents): large sources lead without drowning the small ones."""
        return {s: math.sqrt(len(d)) for s, d in sorted(self.by_source.items()) if len(d) >= min_docs}


class StepSlots(Dataset):
    """One item per micro-batch; what it holds is drawn in ``collate`` from the step's own RNG."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"slot": i}


def draw_spans(rng: random.Random, corpus: DocCorpus, doc: int, lo: int, hi: int, k: int,
               where: list[tuple[int, int]] | None = None) -> list[list[int]]:
    """Up to ``k`` distinct spans among the blocks inside token range [lo, hi) of ``doc``, each block
    weighted by its token count (uniform over the document's length); a span is its block or, one time in
    three, one of its sentences, cut to the span length. ``where``, if given, receives each span's block
    as a token range relative to ``lo`` (the draws are the same with or without it)."""
    starts, pos = [], 0
    for ids in corpus.ids[doc]:
        starts.append(pos)
        pos += len(ids)
    eligible = [b for b, s in enumerate(starts) if s >= lo and s + len(corpus.ids[doc][b]) <= hi
                and len(corpus.ids[doc][b]) >= 8]
    chosen: list[int] = []
    while eligible and len(chosen) < k:
        b = rng.choices(eligible, weights=[len(corpus.ids[doc][x]) for x in eligible])[0]
        eligible.remove(b)
        chosen.append(b)
        if where is not None:
            where.append((starts[b] - lo, starts[b] + len(corpus.ids[doc][b]) - lo))
    room = corpus.span_tokens - 2
    spans = []
    for b in chosen:
        ids = corpus.ids[doc][b]
        sentences = [s for s in SENTENCE_BREAK.split(corpus.blocks[doc][b]) if len(s.split()) >= 6]
        if len(sentences) > 1 and rng.random() < 1 / 3:
            ids = corpus.tokenizer.encode([rng.choice(sentences)], add_special_tokens=False)[0]
        if len(ids) > room:
            s = rng.randrange(len(ids) - room + 1)
            ids = ids[s:s + room]
        spans.append(corpus.tokenizer.wrap(ids))
    return spans


def step_documents(rng: random.Random, corpus: DocCorpus, source: str, k: int, neighbourhood: int,
                   mined: dict[int, list[int]] | None = None) -> list[int]:
    """``k`` documents of ``source``: drawn from all of them, or with ``neighbourhood`` > 0 from that many
    consecutive ones in key order (a window placed at random), so that they are near each other; with
    ``mined`` (document → its nearest documents, :func:`mine_neighbours`), one document drawn from all and
    the other k − 1 from its nearest."""
    pool = corpus.by_source[source]
    if mined is not None:
        anchor = rng.choice(pool)
        return [anchor, *rng.sample(mined[anchor], k - 1)]
    if neighbourhood and len(pool) > neighbourhood:
        start = rng.randrange(len(pool) - neighbourhood + 1)
        pool = corpus.in_key_order[source][start:start + neighbourhood]
    return rng.sample(pool, k)


def mine_neighbours(corpus: DocCorpus, embed, *, k: int, tokens: int, pad_id: int,
                    device: torch.device) -> dict[int, list[int]]:
    """Each document's ``k`` nearest documents of its own source, by the cosine of ``embed`` (token ids,
    mask → vectors; the teacher) over each document's first ``tokens`` tokens: its title and opening,
    which say what it is about. These are the topics one-pass retrieval confuses, wherever they sit in
    the source's key order (`arrays` and `functions-array`)."""
    from .retrieval import batched  # retrieval imports this module

    heads = [corpus.tokenizer.wrap([t for ids in doc for t in ids][:tokens - 2]) for doc in corpus.ids]
    vecs = F.normalize(batched(embed, heads, pad_id=pad_id, token_budget=8192, device=device,
                               desc="mining neighbours").float(), dim=-1)
    out: dict[int, list[int]] = {}
    for docs in corpus.by_source.values():
        idx = torch.tensor(docs)
        sim = vecs[idx] @ vecs[idx].T
        sim.fill_diagonal_(-math.inf)
        top = sim.topk(min(k, len(docs) - 1), dim=1).indices
        for row, d in enumerate(docs):
            out[d] = [docs[j] for j in top[row].tolist()]
    return out


def kernel_logits(spans: torch.Tensor, pieces: torch.Tensor, valid: torch.Tensor, beta: float) -> torch.Tensor:
    """log of the kernel mean, mean over a document's valid pieces of exp(β (cos − 1)), of every span
    (S, D; unit rows) against every document's pieces (C, K, D; unit rows, ``valid`` (C, K) marks real
    ones): (S, C). A document without a valid piece scores -inf."""
    sim = torch.einsum("sd,ckd->sck", spans, pieces)
    total = (beta * (sim - 1.0)).masked_fill(~valid, float("-inf")).logsumexp(-1)
    return total - valid.sum(-1).clamp_min(1).log()


def pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


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


def is_document(row) -> bool:
    """A row of longdocs.py's JSONL: checked up front, as a bad row would otherwise fail mid-training."""
    blocks = row.get("blocks") if isinstance(row, dict) else None
    tokens = row.get("tokens", 0) if isinstance(row, dict) else None
    return (isinstance(blocks, list) and bool(blocks) and all(isinstance(b, str) for b in blocks)
            and isinstance(row.get("doc"), str) and isinstance(row.get("source"), str)
            and isinstance(tokens, int) and not isinstance(tokens, bool))


def read_documents(paths: list[Path], option: str = "--data") -> list[dict]:
    rows = []
    for path in paths:
        if not path.is_file():
            raise ValueError(f"{option}: {path} not found")
        for n, line in enumerate(path.open(encoding="utf-8"), 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not is_document(row):
                raise ValueError(f"{option}: {path}:{n}: not a document row "
                                 f"{{doc: str, source: str, blocks: [str, ...], tokens: int}}")
            rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    for name in ("spans_per_doc", "span_tokens", "short_pairs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_size < 2 or args.queue < 0 or not args.temperature > 0:
        raise ValueError("--batch-size must be >= 2 (in-batch negatives), --queue >= 0, --temperature > 0")
    if args.neighbourhood and args.neighbourhood < args.batch_size:
        raise ValueError(f"--neighbourhood must be 0 or >= --batch-size ({args.batch_size}), got {args.neighbourhood}")
    if args.mined_neighbours and (args.neighbourhood or args.mined_neighbours < args.batch_size - 1):
        raise ValueError(f"--mined-neighbours must be 0 or >= --batch-size - 1 ({args.batch_size - 1}), and not "
                         f"with --neighbourhood; got {args.mined_neighbours}")
    if args.cut_fixed and not args.cut_negatives:
        raise ValueError("--cut-fixed fixes the copies of --cut-negatives; pass both")
    if args.mine_tokens < 8:
        raise ValueError(f"--mine-tokens must be >= 8, got {args.mine_tokens}")
    if args.w_segment < 0:
        raise ValueError(f"--w-segment must be >= 0, got {args.w_segment}")
    try:
        segment_sizes = [int(x) for x in args.segment_tokens.split(",")]
    except ValueError:
        segment_sizes = []
    if not segment_sizes or min(segment_sizes) < 1:
        raise ValueError(f"--segment-tokens must be piece sizes >= 1 separated by commas, got {args.segment_tokens!r}")
    if not args.temperature_lr_scale > 0:
        raise ValueError(f"--temperature-lr-scale must be > 0, got {args.temperature_lr_scale}")
    stages = parse_curriculum(args.curriculum)
    doc_hashes = parse_hashes(args.doc_hashes, "--doc-hashes")
    query_hashes = parse_hashes(args.query_hashes, "--query-hashes")
    session = start(args, "longdoc")
    student = load_pretrained(args.model, device=session.device)
    if student.tokenizer is None:
        raise ValueError("the student checkpoint has no tokenizer files")
    if stages[-1][0] > student.config.max_length:
        raise ValueError(f"--curriculum reaches {stages[-1][0]} tokens; the model has {student.config.max_length}")
    if args.train_positions_from:  # checked before the teacher and the corpus load
        train_positions_only(student.encoder, args.train_positions_from)
    teacher = (FrozenStart(load_pretrained(args.model, device=session.device)) if str(args.teacher) == INIT_TEACHER
               else BertTeacher.from_dir(args.teacher, device=session.device))
    tok = student.tokenizer
    corpus = DocCorpus(read_documents(args.data), tok, min(args.span_tokens, teacher.max_positions))
    weights = corpus.source_weights(args.batch_size)
    if not weights:
        raise ValueError(f"--data: no source has --batch-size ({args.batch_size}) documents")
    if len(corpus.pairs) < args.short_pairs:
        raise ValueError(f"--data: {len(corpus.pairs)} short pairs, fewer than --short-pairs {args.short_pairs}")
    mined = (mine_neighbours(corpus, teacher.embed, k=args.mined_neighbours,
                             tokens=min(args.mine_tokens, teacher.max_positions), pad_id=tok.pad_id,
                             device=session.device) if args.mined_neighbours else None)
    prepare_model(args, student.encoder, student.config.num_hidden_layers)
    module = LongDocLoss(student, temperature=args.temperature, queue=args.queue,
                         weights=(args.w_short, args.w_distill), w_segment=args.w_segment,
                         segment=segment_sizes[0], w_kernel=args.w_kernel, kernel_beta=args.kernel_beta,
                         kernel_temperature=args.kernel_temperature, kernel_tokens=args.kernel_tokens,
                         max_tokens=stages[-1][0], w_own_windows=args.w_own_windows, cut_fixed=args.cut_fixed)
    sources = list(weights)
    trainer: Trainer

    def collate(items: list[dict]) -> dict:
        rng = random.Random(args.seed * 1_000_003 + trainer.step * 997 + trainer.batch_in_epoch)
        length = crop_length(stages, trainer.step, trainer.total_steps) - 2
        source = rng.choices(sources, weights=[weights[s] for s in sources])[0]
        docs, spans, span_doc, keys, where, cuts, cut_doc, flats = [], [], [], [], [], [], [], []
        for d in step_documents(rng, corpus, source, args.batch_size, args.neighbourhood, mined):
            total = sum(len(ids) for ids in corpus.ids[d])
            lo = rng.randrange(total - length + 1) if total > length else 0
            flat = [t for ids in corpus.ids[d] for t in ids][lo:lo + length]
            before = len(where)
            for span in draw_spans(rng, corpus, d, lo, lo + length, args.spans_per_doc, where):
                spans.append(span)
                span_doc.append(len(docs))
            if args.cut_negatives and len(where) > before:
                cut = set().union(*(range(a, z) for a, z in where[before:]))
                cuts.append(tok.wrap([t for i, t in enumerate(flat) if i not in cut]))
                cut_doc.append(len(docs))
            docs.append(tok.wrap(flat))
            flats.append(flat)
            keys.append(corpus.keys[d])
        pairs = rng.sample(corpus.pairs, args.short_pairs)
        room = corpus.span_tokens
        short = spans + tok.encode([a for a, _ in pairs], max_length=room) + tok.encode([b for _, b in pairs], max_length=room)
        ids, mask = pad(docs, tok.pad_id)
        short_ids, short_mask = pad(short, tok.pad_id)
        batch = {"input_ids": ids, "attention_mask": mask, "short_ids": short_ids, "short_mask": short_mask,
                 "span_doc": torch.tensor(span_doc, dtype=torch.long), "n_pairs": torch.tensor(len(pairs)),
                 # each span's block as sequence positions of its crop (+ 1: the crop starts with [CLS])
                 "span_lo": torch.tensor([a + 1 for a, _ in where], dtype=torch.long),
                 "span_hi": torch.tensor([z + 1 for _, z in where], dtype=torch.long),
                 "doc_keys": torch.tensor([hash_key(k) for k in keys]),
                 "doc_hashes": torch.tensor(rng.choice(doc_hashes)), "query_hashes": torch.tensor(rng.choice(query_hashes)),
                 "fresh_seed": torch.tensor(rng.randrange(1, 1 << 30))}
        if args.w_own_windows:  # each crop cut as retrieval.cut_windows cuts a document for a chunker
            from .retrieval import cut_windows  # retrieval imports this module

            owner, windows = cut_windows(flats, tok, args.own_window_tokens)
            batch["win_ids"], batch["win_mask"] = pad(windows, tok.pad_id)
            batch["win_doc"] = torch.tensor(owner, dtype=torch.long)
        if cuts:
            batch["cut_ids"], batch["cut_mask"] = pad(cuts, tok.pad_id)
            batch["cut_doc"] = torch.tensor(cut_doc, dtype=torch.long)
        if args.w_segment and len(segment_sizes) > 1:  # drawn last: the draws above stay those of one size
            batch["segment_tokens"] = torch.tensor(rng.choice(segment_sizes))
        return batch

    def prepare(batch: dict) -> dict:
        batch = {k: v.to(session.device) for k, v in batch.items()}
        if args.fresh_hashes:
            set_hash_seeds(student, int(batch["fresh_seed"]))
        with torch.no_grad():
            batch["t_short"] = teacher.embed(batch["short_ids"], batch["short_mask"])
        return batch

    options = dataclasses.replace(train_options(args), lr_scales=(("log_scale", args.temperature_lr_scale),),
                                  no_decay=(POSITION_WEIGHT,) if args.train_positions_from else ())
    options.batch_size = 1  # one slot per micro-batch; --batch-size documents are drawn inside it
    slots = max(1, sum(len(d) for d in corpus.by_source.values()) // args.batch_size)
    trainer = Trainer(module, StepSlots(slots), collate, prepare, options=options, run=session.run,
                      dist_=session.dist, device=session.device)
    return fit_student(trainer, student, session, args, "longdoc", lambda: (
        f"{len(corpus.keys)} documents from {len(weights)} sources ({', '.join(sources)}), "
        f"{len(corpus.pairs)} short pairs, {trainer.total_steps} steps, curriculum {stages}"))


INIT_TEACHER = "init"
POSITION_WEIGHT = "embeddings.position_embeddings.weight"


def train_positions_only(encoder: torch.nn.Module, first: int) -> None:
    """Freeze every parameter of ``encoder`` but the position embeddings of token positions ``first`` and up.
    The rows below get a zero gradient (so AdamW leaves them exactly as they are, with no weight decay on the
    table: ``POSITION_WEIGHT`` goes in ``no_decay``): an input of at most ``first`` tokens never reads a
    trained row, so it embeds bit for bit as before, at every hash count."""
    table, rows = encoder.embeddings.position_embeddings.weight, encoder.embeddings.max_positions
    if not 0 < first < rows:
        raise ValueError(f"--train-positions-from must be in 1..{rows - 1} (the model has {rows} positions), "
                         f"got {first}")
    for p in encoder.parameters():
        p.requires_grad_(False)
    table.requires_grad_(True)
    keep = torch.zeros(table.shape[0], 1, dtype=table.dtype, device=table.device)
    keep[first + POSITION_OFFSET:] = 1
    table.register_hook(lambda grad: grad * keep)


class FrozenStart:
    """``--teacher init``: the starting model, frozen, as the teacher of the short-text term. Short texts
    (at most ``max_positions`` tokens, as a BERT teacher's) are embedded exactly, as the student embeds them
    in training and ``auto`` serves them, so the distillation term holds the student's short-text embeddings
    where they started instead of pulling them to another model's."""

    max_positions = 512

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval().requires_grad_(False)

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids, attention_mask, hashes=0)


def hash_key(key: str) -> int:
    """A stable 62-bit id of a document key (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big") >> 2
