"""Retrieval tasks of ``yoso-train eval``: does reading a whole document at once pay?

* Deep retrieval: held-out documents of ``lo``–``hi`` tokens, each paired with one paragraph from its
  second half; the paragraph is the query, every document the corpus. Scored for the student in one
  pass (at the served hash setting), the teacher truncated to its positions, and the teacher over
  ``window``-token windows whose embeddings are averaged (what users of a 512-token model do), with
  the documents per second of each.
* Short retrieval: the first sentence of a paragraph is the query, the rest of every paragraph the
  corpus; student and teacher.

Metrics: recall@1 and MRR@10 by cosine similarity. Queries are drawn with a seeded RNG per document, so
every run and model sees the same pairs.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from yoso_serve.model import EncoderModel
from yoso_serve.model.hashes import AUTO_EXACT_BELOW, resolve_hashes
from yoso_serve.model.pieces import piece_means

from .data import SENTENCE_BREAK, pad
from .teacher import BertTeacher

QUERY_WORDS = 20  # a query paragraph has at least this many words
SENTENCE_WORDS = 8  # a query sentence (``unit="sentence"``) has at least this many


def _rng(seed: int, key: str) -> random.Random:
    return random.Random(seed * 1_000_003 + int.from_bytes(hashlib.sha1(key.encode()).digest()[:6], "big"))


def deep_pairs(rows: list[dict], *, lo: int, hi: int, max_docs: int, seed: int,
               draws: int = 1, unit: str = "paragraph", skip: int = 0) -> tuple[list[str], list[str]]:
    """(documents, queries): the first ``max_docs`` documents of ``lo``..``hi`` tokens that have a paragraph
    of at least QUERY_WORDS words starting in their second half, after passing over ``skip`` such documents
    (so that a file of more than ``max_docs`` gives a second, disjoint corpus); the query is one such
    paragraph, drawn per document, or with ``unit="sentence"`` one sentence of at least SENTENCE_WORDS words of
    such paragraphs (the paragraph itself where none has one; the same documents either way).
    With ``draws`` > 1 each document is queried that many times, draw d as ``seed + d`` draws it (so
    pooled draws score the mean of the separate seeds): query j belongs to document j % len(documents)."""
    if unit not in ("paragraph", "sentence"):
        raise ValueError(f"query unit must be 'paragraph' or 'sentence', got {unit!r}")
    if skip < 0:
        raise ValueError(f"documents to skip must be >= 0, got {skip}")
    docs, late_of = [], []
    for row in rows:
        if not lo <= row.get("tokens", 0) <= hi:
            continue
        words = [len(b.split()) for b in row["blocks"]]
        half, pos, late = sum(words) / 2, 0, []
        for block, n in zip(row["blocks"], words):
            if pos >= half and n >= QUERY_WORDS:
                late.append(block)
            pos += n
        if late and unit == "sentence":
            late = [x for block in late for x in SENTENCE_BREAK.split(block) if len(x.split()) >= SENTENCE_WORDS] or late
        if late and skip:
            skip -= 1
        elif late:
            docs.append("\n".join(row["blocks"]))
            late_of.append((row["doc"], late))
        if len(docs) == max_docs:
            break
    queries = [_rng(seed + d, key).choice(late) for d in range(draws) for key, late in late_of]
    return docs, queries


def short_pairs(rows: list[dict], *, max_pairs: int, seed: int) -> tuple[list[str], list[str]]:
    """(first sentences, rests) of paragraphs with a first sentence of ≥ 5 words and a rest of ≥ 12."""
    firsts, rests = [], []
    for row in rows:
        options = [parts for parts in (SENTENCE_BREAK.split(b, maxsplit=1) for b in row["blocks"])
                   if len(parts) == 2 and len(parts[0].split()) >= 5 and len(parts[1].split()) >= 12]
        if options:
            first, rest = _rng(seed, row["doc"]).choice(options)
            firsts.append(first)
            rests.append(rest)
        if len(firsts) == max_pairs:
            break
    return firsts, rests


def _ranks(sim: torch.Tensor) -> torch.Tensor:
    """(Q,) rank of each query's answer (0 = first) in (queries, documents) similarities where query j's
    answer is document j % n; ties count in the answer's favour."""
    right = sim[torch.arange(len(sim)), torch.arange(len(sim)) % sim.shape[1]]
    return (sim > right[:, None]).sum(1)


def _metrics(rank: torch.Tensor) -> dict[str, float]:
    rr = torch.where(rank < 10, 1.0 / (rank + 1).float(), torch.zeros_like(rank, dtype=torch.float))
    return {"recall_at_1": (rank == 0).float().mean().item(), "mrr_at_10": rr.mean().item()}


def score_ranks(queries: torch.Tensor, corpus: torch.Tensor) -> torch.Tensor:
    """Each query's rank of its answer, corpus row j % len(corpus), by cosine similarity."""
    return _ranks(F.normalize(queries, dim=-1) @ F.normalize(corpus, dim=-1).T)


def scores(queries: torch.Tensor, corpus: torch.Tensor) -> dict[str, float]:
    """Query j's answer is corpus row j % len(corpus) (row j with one query per row): recall@1 and MRR@10
    by cosine similarity."""
    return _metrics(score_ranks(queries, corpus))


def best_part_ranks(queries: torch.Tensor, parts: torch.Tensor, owner: torch.Tensor, n_docs: int) -> torch.Tensor:
    """Each query's rank of its answer, document j % n_docs, a document scoring the best cosine of its parts
    (rows of ``parts``, document ``owner[i]``)."""
    sim = F.normalize(queries, dim=-1) @ F.normalize(parts, dim=-1).T  # (Q, parts)
    return _ranks(torch.full((len(queries), n_docs), -2.0).scatter_reduce(
        1, owner.expand(len(queries), -1), sim, reduce="amax"))


def best_part_scores(queries: torch.Tensor, parts: torch.Tensor, owner: torch.Tensor, n_docs: int) -> dict[str, float]:
    """Multi-vector retrieval: a document's score is the best cosine of its parts (rows of ``parts``,
    document ``owner[i]``) with the query; query j's answer is document j % n_docs. recall@1 and MRR@10."""
    return _metrics(best_part_ranks(queries, parts, owner, n_docs))


MARGIN_RESAMPLES = 2000


def paired_margin(ranks_a: torch.Tensor, ranks_b: torch.Tensor, n_docs: int, *,
                  resamples: int = MARGIN_RESAMPLES, seed: int = 0) -> dict[str, float]:
    """recall@1 of method A minus method B on the same queries (query j asks for document j % n_docs), with
    a 95 % percentile-bootstrap interval that resamples documents, a document's queries together: the draws
    of one document stand or fall together, so resampling queries alone would make the interval too narrow."""
    return pooled_margin([(ranks_a == 0, ranks_b == 0, n_docs)], resamples=resamples, seed=seed)


def pooled_margin(corpora: list[tuple], *, resamples: int = MARGIN_RESAMPLES,
                  seed: int = 0) -> dict[str, float]:
    """:func:`paired_margin` over several corpora at once, each ``(hits_a, hits_b, n_docs)`` (a query's hit, a
    list or tensor of 0/1: its document ranked first; query j asks for document j % n_docs of its own corpus):
    the difference over all
    their queries, and a bootstrap that resamples each corpus's documents within it (a stratified bootstrap:
    every resample keeps each corpus's size, as the corpora were drawn separately)."""
    if not corpora:
        raise ValueError("no corpus to pool")
    gen = torch.Generator().manual_seed(seed)
    diff_sum, boot_total, boot_count, n_queries = 0.0, torch.zeros(resamples), torch.zeros(resamples), 0
    for hits_a, hits_b, n_docs in corpora:
        a, b = torch.as_tensor(hits_a, dtype=torch.float), torch.as_tensor(hits_b, dtype=torch.float)
        if a.shape != b.shape or a.dim() != 1 or len(a) == 0 or n_docs < 1:
            raise ValueError(f"paired hits must have one shape and a query, got {tuple(a.shape)} and "
                             f"{tuple(b.shape)} over {n_docs} documents")
        diff = a - b
        doc = torch.arange(len(diff)) % n_docs
        total = torch.zeros(n_docs).index_add_(0, doc, diff)
        count = torch.zeros(n_docs).index_add_(0, doc, torch.ones_like(diff))
        pick = torch.randint(n_docs, (resamples, n_docs), generator=gen)
        boot_total += total[pick].sum(1)
        boot_count += count[pick].sum(1)
        diff_sum += diff.sum().item()
        n_queries += len(diff)
    low, high = torch.quantile(boot_total / boot_count.clamp_min(1), torch.tensor([0.025, 0.975])).tolist()
    return {"recall_at_1": diff_sum / n_queries, "ci95_low": low, "ci95_high": high}


@torch.no_grad()
def batched(embed_ids: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], seqs: list[list[int]], *,
            pad_id: int, token_budget: int, device: torch.device, desc: str) -> torch.Tensor:
    """Embed token sequences in length-sorted batches of at most ``token_budget`` padded tokens."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    bar = tqdm(total=len(seqs), desc=desc, unit="text", dynamic_ncols=True, leave=False)
    s = 0
    while s < len(order):
        e = s + 1
        while e < len(order) and (e - s + 1) * len(seqs[order[e]]) <= token_budget:
            e += 1
        chunk = order[s:e]
        ids, mask = pad([seqs[i] for i in chunk], pad_id)
        for i, v in zip(chunk, embed_ids(ids.to(device), mask.to(device)).float().cpu()):
            out[i] = v
        bar.update(len(chunk))
        s = e
    bar.close()
    return torch.stack(out)


def cut_windows(seqs: list[list[int]], tok, window: int) -> tuple[list[int], list[list[int]]]:
    """(owner, windows): each content-id sequence cut into consecutive windows of at most ``window`` tokens
    with the tokenizer's specials (``tok.wrap``), an empty sequence into one window; owner[i] is the index of
    window i's sequence."""
    size = window - tok.num_special_tokens
    owner, out = [], []
    for d, ids in enumerate(seqs):
        for s in range(0, max(1, len(ids)), size):
            owner.append(d)
            out.append(tok.wrap(ids[s:s + size]))
    return owner, out


class Embedders:
    """The three ways to embed a document compared here, each from texts to (n, D)."""

    def __init__(self, student: EncoderModel, teacher: BertTeacher, *, hashes: int | str, window: int,
                 device: torch.device, token_budget: int = 8192) -> None:
        self.student, self.teacher, self.hashes, self.window = student, teacher, hashes, window
        self.tok, self.device, self.budget = student.tokenizer, device, token_budget

    def _run(self, fn, seqs: list[list[int]], desc: str) -> torch.Tensor:
        return batched(fn, seqs, pad_id=self.tok.pad_id, token_budget=self.budget, device=self.device, desc=desc)

    def student_one_pass(self, texts: list[str]) -> torch.Tensor:
        """One pass per text at ``hashes``: a count, or "auto" resolved per text by its own length as the
        server's default does (exact below the crossover, the model's count above)."""
        return self.student_parts(texts, 0)[0]

    def student_parts(self, texts: list[str], segment: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pooled (n, D), parts (P, D), owner (P,)): each text's embedding as :meth:`student_one_pass`
        and, from the same pass, the mean token state of each consecutive ``segment``-token piece of it
        (none when ``segment`` is 0): the one-pass model's multi-vector form."""
        return self._student(self.tok.encode(texts, max_length=self.student.config.max_length), segment)

    def _student(self, seqs: list[list[int]], segment: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`student_parts` of token-id sequences (specials included)."""
        counts = [resolve_hashes(self.student.config, self.hashes, source="request", exact_below=AUTO_EXACT_BELOW,
                                 n_tokens=len(s)) for s in seqs]
        k = -(-max(len(s) for s in seqs) // segment) if segment else 0
        out = torch.empty(len(seqs), 1 + k, self.student.config.hidden_size)
        for count in sorted(set(counts)):
            rows = [i for i, c in enumerate(counts) if c == count]
            out[rows] = self._run(lambda i, m: self._pool(i, m, count, segment, k), [seqs[i] for i in rows],
                                  f"student, hashes={count}")
        n_parts = [-(-len(s) // segment) if segment else 0 for s in seqs]
        owner = torch.tensor([d for d, n in enumerate(n_parts) for _ in range(n)], dtype=torch.long)
        parts = torch.cat([out[d, 1:1 + n] for d, n in enumerate(n_parts)]) if k else out.new_zeros(0, out.shape[2])
        return out[:, 0], parts, owner

    def _pool(self, ids: torch.Tensor, mask: torch.Tensor, count: int, segment: int, k: int) -> torch.Tensor:
        """(B, 1 + k, D): row 0 the model's own pooled embedding, rows 1.. the segment means (zero past the end)."""
        if not segment:
            return self.student.embed(ids, mask, hashes=count)[:, None]
        if self.student.config.pooling != "mean":
            raise ValueError("segments of the one-pass student need mean pooling")
        hidden = self.student.last_hidden(ids, mask, hashes=count)
        pooled, means, _ = piece_means(hidden, mask, segment)  # the mean over all tokens, from the same sums
        means = F.pad(means, (0, 0, 0, k - means.shape[1]))  # the batch may be shorter than the longest text
        return torch.cat([pooled[:, None], means], dim=1)

    def teacher_truncated(self, texts: list[str]) -> torch.Tensor:
        seqs = self.tok.encode(texts, max_length=self.teacher.max_positions)
        return self._run(self.teacher.embed, seqs, "teacher truncated")

    def teacher_windowed(self, texts: list[str]) -> torch.Tensor:
        """Mean of the unit embeddings of consecutive ``window``-token windows (specials included)."""
        return self.teacher_windows(texts)[0]

    def teacher_windows(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(windowed (n, D), windows (P, D), owner (P,)): :meth:`teacher_windowed` and the unit window
        embeddings it averages, each window also a vector of its own (chunks indexed one by one)."""
        return self._windows(texts, lambda seqs: self._run(self.teacher.embed, seqs, "teacher windows"))

    def student_windowed(self, texts: list[str]) -> torch.Tensor:
        """The student as a chunker: :meth:`teacher_windowed` with the student reading each window alone, at
        ``hashes`` per window as :meth:`student_one_pass` resolves it. Against the one pass it says what
        reading the whole document adds over chunking with the same model."""
        return self._windows(texts, lambda seqs: self._student(seqs, 0)[0])[0]

    def _windows(self, texts: list[str], embed: Callable[[list[list[int]]], torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(averaged (n, D), windows (P, D), owner (P,)): ``embed`` of each text's consecutive ``window``-token
        windows, unit length, and their sum per text (a mean, up to the cosine's scale)."""
        owner, seqs = cut_windows(self.tok.encode(texts, add_special_tokens=False), self.tok, self.window)
        vecs = F.normalize(embed(seqs), dim=-1)
        out = torch.zeros(len(texts), vecs.shape[1])
        owner_t = torch.tensor(owner, dtype=torch.long)
        out.index_add_(0, owner_t, vecs)
        return out, vecs, owner_t


def deep_retrieval(emb: Embedders, docs: list[str], queries: list[str], *,
                   segment: int = 0, own_windows: bool = False) -> tuple[list[dict], list[dict], dict]:
    """(rows, margins, hits). One row per method: recall@1, MRR@10, documents per second (document embedding time
    only). The three single-vector rows come first (one vector per document: what the task is about). With
    ``segment`` > 0, two multi-vector rows follow, from the same passes: the teacher's windows indexed
    one by one and the student's ``segment``-token pieces of its one pass, a document scoring its best
    part (:func:`best_part_scores`).

    With ``own_windows``, a fourth single-vector row: the student over the same windows, each read alone,
    averaged (:meth:`Embedders.student_windowed`), the student used as a chunker would use it.

    margins: the student's recall@1 minus the teacher's on the same queries, with its 95 % interval
    (:func:`paired_margin`): one vector against the averaged windows, with ``segment`` the pieces
    against the windows indexed one by one, and with ``own_windows`` the one pass against its own averaged
    windows (what reading the whole document adds).

    hits: the corpus size and, per method, each query's hit (1: its document ranked first), from which
    :func:`pooled_margin` pools the margins of several corpora."""
    rows, parts, ranks = [], {}, {}
    s_queries = emb.student_one_pass(queries)
    t_queries = emb.teacher_truncated(queries)

    def student(texts: list[str]) -> torch.Tensor:
        pooled, *parts["student"] = emb.student_parts(texts, segment)
        return pooled

    def windowed(texts: list[str]) -> torch.Tensor:
        pooled, *parts["teacher"] = emb.teacher_windows(texts)
        return pooled

    methods = [("student, one pass", student, s_queries),
               (f"teacher, {emb.window}-token windows averaged", windowed, t_queries),
               (f"teacher, truncated at {emb.teacher.max_positions}", emb.teacher_truncated, t_queries)]
    if own_windows:
        methods.append((f"student, {emb.window}-token windows averaged", emb.student_windowed, s_queries))
    speed = {}
    for name, fn, q in methods:
        t0 = time.perf_counter()
        d = fn(docs)
        speed[name] = len(docs) / (time.perf_counter() - t0)
        ranks[name] = score_ranks(q, d)
        rows.append({"method": name, "docs": len(docs), "queries": len(q), **_metrics(ranks[name]),
                     "docs_per_s": speed[name]})
    pairs = [(methods[0][0], methods[1][0])]
    if segment:
        for name, who, base, q in ((f"multi-vector: teacher, each {emb.window}-token window, best", "teacher",
                                    methods[1][0], t_queries),
                                   (f"multi-vector: student, one pass, each {segment}-token segment, best", "student",
                                    methods[0][0], s_queries)):
            ranks[name] = best_part_ranks(q, *parts[who], len(docs))
            rows.append({"method": name, "docs": len(docs), "queries": len(q), **_metrics(ranks[name]),
                         "docs_per_s": speed[base]})
        pairs.append((rows[-1]["method"], rows[-2]["method"]))
    if own_windows:
        pairs.append((methods[0][0], methods[3][0]))
    margins = [{"student": a, "teacher": b, "docs": len(docs), "queries": len(queries),
                **paired_margin(ranks[a], ranks[b], len(docs))} for a, b in pairs]
    hits = {"docs": len(docs), **{name: (r == 0).int().tolist() for name, r in ranks.items()}}
    return rows, margins, hits


def short_retrieval(emb: Embedders, firsts: list[str], rests: list[str]) -> tuple[list[dict], dict]:
    """Each paragraph's first sentence asks for the rest of it among all the rests, student and teacher: (a row of
    recall@1 and MRR@10 each, {"pairs": n, "student": hits, "teacher": hits, "student_cosines": ...}, a pair's hit
    1 where its rest ranked first), the hits for pairing two evals of the same pairs (:func:`pooled_margin`, one
    pair a document); ``student_cosines`` the student's related and unrelated cosines (:func:`pair_cosines`, 6
    decimals) and its score centre: how far zero-shot scores move between two evals (bench/paired_evals.py)."""
    a, b = F.normalize(emb.student_one_pass(firsts), dim=-1), F.normalize(emb.student_one_pass(rests), dim=-1)
    ranks = {"student": score_ranks(a, b),
             "teacher": score_ranks(emb.teacher_truncated(firsts), emb.teacher_truncated(rests))}
    rows = [{"method": who, "pairs": len(firsts), **_metrics(r)} for who, r in ranks.items()]
    cos = {name: [round(float(c), 6) for c in pair] for name, pair in zip(("related", "unrelated"), pair_cosines(a, b))}
    center = getattr(emb.student.config, "score_center", None)
    return rows, {"pairs": len(firsts), **{who: (r == 0).int().tolist() for who, r in ranks.items()},
                  "student_cosines": {**cos, "score_center": center}}


def pair_cosines(firsts: torch.Tensor, rests: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit rows of first sentences and of their rests (n, D) → (related, unrelated) cosines (n,): each first with
    its own rest, and with the next pair's rest (another document's, one pair a document)."""
    return (firsts * rests).sum(-1), (firsts * rests.roll(1, 0)).sum(-1)


def score_center(related: torch.Tensor, unrelated: torch.Tensor) -> float:
    """The cosine that best tells related pairs from unrelated ones: the threshold (a multiple of 0.01) with the
    lowest mean of the two error rates, the middle one where several tie. The service maps cosines to scores in
    (0, 1) as sigmoid(20 (cos − centre)) (/rerank, zero-shot /classify with multi_label), so this cosine scores
    0.5 and a score above 0.5 says "more likely related than not" for pairs like these."""
    candidates = torch.arange(-100, 101, dtype=torch.float64) / 100
    missed = (related.double()[None, :] < candidates[:, None]).double().mean(1)
    passed = (unrelated.double()[None, :] >= candidates[:, None]).double().mean(1)
    error = (missed + passed) / 2
    best = (error == error.min()).nonzero().flatten()
    return round(float(candidates[best].mean()), 2)


def calibrate_center(model: EncoderModel, rows: list[dict], *, pairs: int = 300, seed: int = 0,
                     device: torch.device = torch.device("cpu")) -> dict:
    """:func:`score_center` of ``model`` at the served setting ("auto") on short pairs of ``rows`` (documents):
    related = a paragraph's first sentence and the rest of it; unrelated = the same first sentence and the rest
    of the next document's paragraph (one pair per document, so never the same document)."""
    firsts, rests = short_pairs(rows, max_pairs=pairs, seed=seed)
    if len(firsts) < 2:
        raise ValueError(f"calibration needs paragraphs from at least 2 documents, got {len(firsts)}")
    emb = Embedders(model, None, hashes="auto", window=model.config.max_length, device=device)
    a = F.normalize(emb.student_one_pass(firsts), dim=-1)
    b = F.normalize(emb.student_one_pass(rests), dim=-1)
    related, unrelated = pair_cosines(a, b)
    center = score_center(related, unrelated)
    return {"score_center": center, "pairs": len(firsts),
            "related_median": round(float(related.median()), 3), "unrelated_median": round(float(unrelated.median()), 3),
            "related_above": round(float((related >= center).double().mean()), 3),
            "unrelated_above": round(float((unrelated >= center).double().mean()), 3)}
