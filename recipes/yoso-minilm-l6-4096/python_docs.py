"""The distillation data: the Python documentation (Debian package python3.11-doc) as passages, long
documents and topic labels.

Pages are read into sections (heading + its own blocks) by corpus.py's HTML reader and split into train /
held-out by page with its split, so no page has sections on both sides and the held-out numbers measure
text the student never saw.
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterator

from corpus import Section, html_sections, is_heldout, write_jsonl

DEFAULT_HTML_ROOT = Path("/usr/share/doc/python3.11/html")
HELDOUT_PERCENT = 10
PASSAGE_WORDS = 160  # ≈ 200–250 word pieces: under the teacher's 256-token training length
LONG_TOKENS = (2048, 4000)  # held-out "long documents" (special tokens leave room under 4096)
TOPIC_CAP = 60  # sections per topic in the classification training set: balanced, and CPU-sized
MIN_TOPIC_HELDOUT = 8

# Index and search pages are lists of links, not prose.
_SKIP_PAGES = ("genindex", "py-modindex", "search", "contents", "download")


def parse_page(path: Path) -> list[Section]:
    """The non-empty sections of one Sphinx HTML page, in document order."""
    return html_sections(path.read_text(encoding="utf-8", errors="replace"))


def topic_of(rel: str) -> str:
    """The documentation area a page belongs to: its top-level folder (``library``, ``c-api``, ...)."""
    parts = rel.split("/")
    return parts[0] if len(parts) > 1 else "misc"


def iter_pages(root: Path = DEFAULT_HTML_ROOT) -> Iterator[tuple[str, list[Section]]]:
    """(relative path, sections) for every prose page under ``root``, sorted for determinism."""
    if not root.is_dir():
        raise ValueError(
            f"Python documentation not found at {root}; install it with `apt-get install -y python3.11-doc`"
        )
    for path in sorted(root.rglob("*.html")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("_", "includes/")) or Path(rel).stem.startswith(_SKIP_PAGES):
            continue
        sections = parse_page(path)
        if sections:
            yield rel, sections


def passages(text_blocks: list[str], words: int = PASSAGE_WORDS) -> list[str]:
    """Pack consecutive paragraphs into passages of at most ``words`` words (long ones are cut)."""
    out, cur = [], []
    for block in text_blocks:
        toks = block.split()
        while toks:
            room = words - len(cur)
            if room <= 0:
                out.append(" ".join(cur))
                cur, room = [], words
            cur.extend(toks[:room])
            toks = toks[room:]
    if len(cur) >= 8:
        out.append(" ".join(cur))
    return out


def long_documents(pages, tokenizer, lo: int, hi: int) -> list[dict]:
    """Pages as consecutive sections whose token count lands in [lo, hi] (pages cut at a section edge)."""
    docs = []
    for rel, sections in pages:
        text, n = "", 0
        for sec in sections:
            candidate = (text + "\n" + sec.text).strip()
            m = len(tokenizer.encode([candidate])[0])
            if m > hi:
                break
            text, n = candidate, m
        if n >= lo:
            docs.append({"text": text, "doc": rel, "tokens": n})
    return docs


def prepare_data(out: Path, html_root: Path, tokenizer) -> dict:
    """Write the JSONL files of the distillation, eval and finetune stages; returns (and saves) their row counts."""
    split: dict[str, list] = {"train": [], "heldout": []}
    for rel, sections in iter_pages(html_root):
        split["heldout" if is_heldout(rel, HELDOUT_PERCENT) else "train"].append((rel, sections))
    counts = {}
    for side, pages in split.items():
        rows = [{"text": p, "doc": rel} for rel, secs in pages for p in passages([s.text for s in secs])]
        counts[f"{side}_passages"] = write_jsonl(out / f"{side}_passages.jsonl", rows)
        counts[f"{side}_long"] = write_jsonl(out / f"{side}_long.jsonl", long_documents(pages, tokenizer, *LONG_TOKENS))
    topics = {side: [{"text": s.text, "label": topic_of(rel), "doc": rel} for rel, secs in pages for s in secs
                     if len(s.text.split()) >= 20 and topic_of(rel) != "misc"] for side, pages in split.items()}
    held = Counter(r["label"] for r in topics["heldout"])
    keep = sorted(t for t, n in held.items() if n >= MIN_TOPIC_HELDOUT)
    by_topic = defaultdict(list)
    for row in topics["train"]:
        if row["label"] in keep:
            by_topic[row["label"]].append(row)
    rng = random.Random(0)
    train_rows = []
    for label in keep:
        rows = by_topic[label]
        rng.shuffle(rows)
        train_rows.extend(rows[:TOPIC_CAP])
    rng.shuffle(train_rows)
    counts["topics_train"] = write_jsonl(out / "topics_train.jsonl", train_rows)
    counts["topics_heldout"] = write_jsonl(out / "topics_heldout.jsonl",
                                           [r for r in topics["heldout"] if r["label"] in keep])
    counts["topics"] = keep
    counts["pages"] = {side: len(pages) for side, pages in split.items()}
    (out / "counts.json").write_text(json.dumps(counts, indent=2) + "\n")
    return counts
