"""Training data: plain text, JSONL or CSV, read as a stream; bad rows are counted and skipped.

Formats (picked by extension, or ``fmt=``):

* ``.txt`` (anything else): one example per non-empty line.
* ``.jsonl`` / ``.json``: one object per line, ``{"text": ..., "label": ...}`` or
  ``{"text": ..., "labels": [...]}`` for multi-label; other keys are ignored.
* ``.csv``: a header row naming ``text`` and ``label`` (or ``labels``, values separated by ``|``).

Files are read line by line and never held in memory whole; every line is decoded on its
own, so one bad byte costs one row, not the run. What was skipped and why is kept in a
:class:`RowReport` that the commands write into the run directory and print at the end.
"""

from __future__ import annotations

import csv
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
from torch.utils.data import Dataset

FORMATS = ("text", "jsonl", "csv")
LABEL_SEPARATOR = "|"


@dataclass(frozen=True)
class Example:
    """One row: its text and zero (unlabelled), one (single-label) or more (multi-label) labels."""

    text: str
    labels: tuple[str, ...] = ()


@dataclass
class RowReport:
    """Rows read, kept and skipped (per reason, with the first few locations)."""

    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    samples: list[str] = field(default_factory=list)
    max_samples: int = 10

    def skip(self, where: str, reason: str) -> None:
        self.skipped[reason] += 1
        if len(self.samples) < self.max_samples:
            self.samples.append(f"{where}: {reason}")

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def to_dict(self) -> dict:
        return {"kept": self.kept, "skipped": self.total_skipped, "reasons": dict(self.skipped),
                "first_skipped": list(self.samples)}

    def summary(self) -> str:
        if not self.total_skipped:
            return f"{self.kept} rows read, none skipped"
        reasons = ", ".join(f"{n} {r}" for r, n in self.skipped.most_common())
        return f"{self.kept} rows read, {self.total_skipped} skipped ({reasons})"


def detect_format(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    return {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}.get(suffix, "text")


def _decoded_lines(path: Path, report: RowReport) -> Iterator[tuple[int, str]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError:
                report.skip(f"{path}:{lineno}", "not UTF-8")


def _labels(value: object, *, split: bool) -> tuple[str, ...] | None:
    """Normalise a label cell/field to a tuple of strings; None when it is not a label."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (str, int)):
        text = str(value).strip()
        parts = [p.strip() for p in text.split(LABEL_SEPARATOR)] if split else [text]
        return tuple(parts) if all(parts) else None
    if isinstance(value, list) and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
        return tuple(str(v).strip() for v in value)
    return None


def _check(text: object, labels: tuple[str, ...] | None, need_labels: bool) -> str | None:
    """The reason a row is unusable, or None when it is fine."""
    if not isinstance(text, str) or not text.strip():
        return "missing or empty text"
    if need_labels and labels is None:
        return "missing or invalid label"
    return None


def iter_examples(paths: str | Path | Sequence[str | Path], report: RowReport, *, fmt: str | None = None,
                  need_labels: bool = False) -> Iterator[Example]:
    """Stream the examples of one or more files; unusable rows are recorded in ``report``."""
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"data file not found: {path}")
        kind = fmt or detect_format(path)
        if kind not in FORMATS:
            raise ValueError(f"data format must be one of {FORMATS}, got {kind!r}")
        reader = {"text": _iter_text, "jsonl": _iter_jsonl, "csv": _iter_csv}[kind]
        for example in reader(path, report, need_labels):
            report.kept += 1
            yield example


def _iter_text(path: Path, report: RowReport, need_labels: bool) -> Iterator[Example]:
    if need_labels:
        raise ValueError(f"{path}: plain text has no labels; use JSONL or CSV for classification")
    for _, line in _decoded_lines(path, report):
        if line.strip():
            yield Example(line.strip())


def _iter_jsonl(path: Path, report: RowReport, need_labels: bool) -> Iterator[Example]:
    for lineno, line in _decoded_lines(path, report):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            report.skip(f"{path}:{lineno}", "invalid JSON")
            continue
        if not isinstance(row, dict):
            report.skip(f"{path}:{lineno}", "not a JSON object")
            continue
        raw = row["labels"] if "labels" in row else row.get("label")
        labels = _labels(raw, split=False) if raw is not None else None
        reason = _check(row.get("text"), labels, need_labels)
        if reason:
            report.skip(f"{path}:{lineno}", reason)
            continue
        yield Example(row["text"], labels or ())


def _iter_csv(path: Path, report: RowReport, need_labels: bool) -> Iterator[Example]:
    lines = (line for _, line in _decoded_lines(path, report))
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None:
        return
    header = [h.strip() for h in header]
    if "text" not in header:
        raise ValueError(f"{path}: CSV header must name a 'text' column, got {header}")
    ti = header.index("text")
    li = header.index("labels") if "labels" in header else header.index("label") if "label" in header else None
    row_no = 1
    while True:
        row_no += 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as err:  # the reader recovers on the next line
            report.skip(f"{path}:row {row_no}", f"malformed CSV ({err})")
            continue
        if not row:
            continue
        if len(row) != len(header):
            report.skip(f"{path}:row {row_no}", "wrong number of columns")
            continue
        labels = _labels(row[li], split=True) if li is not None and row[li].strip() else None
        reason = _check(row[ti], labels, need_labels)
        if reason:
            report.skip(f"{path}:row {row_no}", reason)
            continue
        yield Example(row[ti], labels or ())


class TokenizedDataset(Dataset):
    """Token ids (without padding) and optional label targets, one entry per example.

    ``targets`` is a (num_examples,) int64 tensor (single-label) or a
    (num_examples, num_labels) float tensor of 0/1 (multi-label).
    """

    def __init__(self, ids: list[torch.Tensor], targets: torch.Tensor | None = None) -> None:
        if targets is not None and len(targets) != len(ids):
            raise ValueError(f"{len(ids)} examples but {len(targets)} targets")
        self.ids = ids
        self.targets = targets

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        item = {"input_ids": self.ids[i]}
        if self.targets is not None:
            item["labels"] = self.targets[i]
        return item


def tokenize(texts: Iterable[str], tokenizer, *, max_length: int, chunk: int = 1024) -> list[torch.Tensor]:
    """Encode a stream of texts in chunks → one int32 tensor per text (compact in memory)."""
    out: list[torch.Tensor] = []
    buf: list[str] = []

    def flush() -> None:
        out.extend(torch.tensor(ids, dtype=torch.int32) for ids in tokenizer.encode(buf, max_length=max_length))
        buf.clear()

    for text in texts:
        buf.append(text)
        if len(buf) >= chunk:
            flush()
    if buf:
        flush()
    return out


def label_targets(examples: Sequence[Example], label2id: dict[str, int], *, multi_label: bool) -> torch.Tensor:
    """Class indices (N,) int64, or multi-hot (N, num_labels) float32 for multi-label."""
    if multi_label:
        targets = torch.zeros(len(examples), len(label2id))
        for i, ex in enumerate(examples):
            targets[i, [label2id[x] for x in ex.labels]] = 1.0
        return targets
    return torch.tensor([label2id[ex.labels[0]] for ex in examples], dtype=torch.long)


def split_train_val(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded shuffle of range(n) cut into (train, validation) index lists."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise ValueError(f"{n} examples are too few for a validation split of {val_fraction}")
    return sorted(order[n_val:]), sorted(order[:n_val])


def pad_batch(items: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Collate: right-pad ``input_ids`` → (B, N) int64 and ``attention_mask`` (B, N) int64."""
    n = max(len(it["input_ids"]) for it in items)
    ids = torch.full((len(items), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), n), dtype=torch.long)
    for i, it in enumerate(items):
        k = len(it["input_ids"])
        ids[i, :k] = it["input_ids"]
        mask[i, :k] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if "labels" in items[0]:
        batch["labels"] = torch.stack([it["labels"] for it in items])
    return batch


# A sentence ends at . ! or ? followed by space and a capital, digit, quote or bracket: the short texts of
# longdoc and retrieval's sentence queries cut blocks here.
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask
