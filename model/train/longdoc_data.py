"""The documents of ``yoso-train longdoc`` and what a step draws from them: the curriculum of crop lengths,
the corpus of tokenised blocks, the spans and short texts a step takes, and documents near in key order. Shared by the command and the evaluations (read_documents)."""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path

from torch.utils.data import Dataset

from .data import SENTENCE_BREAK


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


def step_documents(rng: random.Random, corpus: DocCorpus, source: str, k: int, neighbourhood: int) -> list[int]:
    """``k`` documents of ``source``: drawn from all of them, or with ``neighbourhood`` > 0 from that many
    consecutive ones in key order (a window placed at random), so that they are near each other."""
    pool = corpus.by_source[source]
    if neighbourhood and len(pool) > neighbourhood:
        start = rng.randrange(len(pool) - neighbourhood + 1)
        pool = corpus.in_key_order[source][start:start + neighbourhood]
    return rng.sample(pool, k)


def is_document(row) -> bool:
    """A row of a document JSONL (recipes/yoso-minilm-l6-4096/corpus.py writes them): checked up front, as a
    bad row would otherwise fail mid-training."""
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


def hash_key(key: str) -> int:
    """A stable 62-bit id of a document key (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big") >> 2
