"""Reading a corpus: JSONL files, Parquet files and folders of text files, streamed one document at a time.

Every row the input holds comes out once, either as a :class:`Document` (an id and its text) or as a
:class:`BadRow` saying what is wrong with it and where (``file:line`` in JSONL, ``file#row=N`` in
Parquet, the file's path in a folder). Nothing here stops on bad input: an unreadable file is one bad
row, an invalid line another. :class:`Admission` then drops what must not be embedded (a duplicate id,
an id already written by an earlier run), so both engines see the same documents.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
PARQUET_BATCH_ROWS = 1024
_COUNT_CHUNK = 1 << 20


class CorpusError(ValueError):
    """A job that cannot run as asked (a missing input, a refused output folder, a bad option); the
    message says how to fix it. Bad rows are never this: they are counted and skipped."""


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    where: str  # the row's location in the input


@dataclass(frozen=True)
class BadRow:
    kind: str  # invalid_json, invalid_utf8, not_an_object, missing_id, invalid_id, missing_text, empty_text,
    #            duplicate_id, unreadable_file, embed_failed
    where: str
    message: str
    id: str | None = None

    def as_dict(self) -> dict:
        return {"kind": self.kind, "where": self.where, "id": self.id, "message": self.message}


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # "jsonl", "parquet" or "folder"


def plan_sources(inputs: Iterable[str | os.PathLike]) -> list[Source]:
    """Each input path with the reader for it: a folder (its text files), a JSONL or a Parquet file by its
    suffix. Raises CorpusError for a path that does not exist or whose kind is unknown."""
    sources = []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            sources.append(Source(path, "folder"))
        elif not path.exists():
            raise CorpusError(f"--input {path}: no such file or folder")
        elif path.suffix.lower() in JSONL_SUFFIXES:
            sources.append(Source(path, "jsonl"))
        elif path.suffix.lower() in PARQUET_SUFFIXES:
            sources.append(Source(path, "parquet"))
        else:
            raise CorpusError(f"--input {path}: not a folder, and its suffix is none of "
                              f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)} (JSONL or Parquet); a folder is "
                              "read as text files, one document each")
    if not sources:
        raise CorpusError("no --input given")
    return sources


def read_documents(sources: list[Source], id_field: str, text_field: str) -> Iterator[Document | BadRow]:
    """Every row of every source, in order, as a Document or a BadRow."""
    for source in sources:
        if source.kind == "folder":
            yield from _read_folder(source.path)
        elif source.kind == "jsonl":
            yield from _read_jsonl(source.path, id_field, text_field)
        else:
            yield from _read_parquet(source.path, id_field, text_field)


def count_rows(sources: list[Source]) -> int:
    """About how many rows :func:`read_documents` will yield (lines, Parquet rows, files): the progress
    bar's total. Cheap: newlines are counted in 1 MiB reads, Parquet from its footer."""
    total = 0
    for source in sources:
        try:
            if source.kind == "folder":
                total += sum(1 for _ in _folder_files(source.path))
            elif source.kind == "parquet":
                import pyarrow.parquet as pq

                total += pq.ParquetFile(source.path).metadata.num_rows
            else:
                with open(source.path, "rb") as f:
                    last = b"\n"
                    while chunk := f.read(_COUNT_CHUNK):
                        total += chunk.count(b"\n")
                        last = chunk[-1:]
                    total += last != b"\n"
        except (OSError, ValueError):
            total += 1  # read as one bad row
    return total


def _text_problem(text, where: str, doc_id: str) -> BadRow | None:
    if not isinstance(text, str):
        return BadRow("missing_text", where, "no text" if text is None else
                      f"the text is a {type(text).__name__}, not a string", doc_id)
    if not text.strip():
        return BadRow("empty_text", where, "the text is empty or only whitespace", doc_id)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, from a JSON escape such as "\ud800"
        return BadRow("invalid_utf8", where, f"the text holds a lone surrogate at character {exc.start}", doc_id)
    return None


def _id_of(value, where: str, id_field: str) -> str | BadRow:
    if value is None:
        return BadRow("missing_id", where, f"no {id_field!r} field")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return BadRow("invalid_id", where, f"the id is a {type(value).__name__}; ids are strings or integers")
    doc_id = str(value)
    if not doc_id:
        return BadRow("invalid_id", where, "the id is an empty string")
    try:
        doc_id.encode("utf-8")
    except UnicodeEncodeError:
        return BadRow("invalid_id", where, "the id holds a lone surrogate")
    return doc_id


def _read_jsonl(path: Path, id_field: str, text_field: str) -> Iterator[Document | BadRow]:
    try:
        f = open(path, "rb")
    except OSError as exc:
        yield BadRow("unreadable_file", str(path), f"cannot open: {exc.strerror or exc}")
        return
    with f:
        lineno = 0
        try:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue  # a blank line holds no row
                yield _jsonl_row(raw, f"{path}:{lineno}", id_field, text_field)
        except OSError as exc:
            yield BadRow("unreadable_file", f"{path}:{lineno + 1}", f"read failed: {exc.strerror or exc}")


def _jsonl_row(raw: bytes, where: str, id_field: str, text_field: str) -> Document | BadRow:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadRow("invalid_utf8", where, f"not UTF-8 at byte {exc.start} of the line")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return BadRow("invalid_json", where, f"{exc.msg} at column {exc.colno}")
    except RecursionError:
        return BadRow("invalid_json", where, "nested too deeply")
    if not isinstance(row, dict):
        return BadRow("not_an_object", where, f"the line is a JSON {type(row).__name__}, not an object")
    doc_id = _id_of(row.get(id_field), where, id_field)
    if isinstance(doc_id, BadRow):
        return doc_id
    return _text_problem(row.get(text_field), where, doc_id) or Document(doc_id, row[text_field], where)


def _read_parquet(path: Path, id_field: str, text_field: str) -> Iterator[Document | BadRow]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
    except (OSError, pa.ArrowException) as exc:
        yield BadRow("unreadable_file", str(path), f"not a readable Parquet file: {exc}")
        return
    missing = [c for c in (id_field, text_field) if c not in names]
    if missing:
        yield BadRow("unreadable_file", str(path), f"no column {' or '.join(map(repr, missing))} (columns: "
                     f"{', '.join(names)}); pick them with --id-field and --text-field")
        return
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[id_field, text_field]):
            for doc_id, text in zip(_strings(batch.column(0)), _strings(batch.column(1))):
                yield _parquet_row(doc_id, text, f"{path}#row={row}", id_field)
                row += 1
    except (OSError, pa.ArrowException) as exc:
        yield BadRow("unreadable_file", f"{path}#row={row}", f"read failed: {exc}")


def _strings(column) -> list:
    """A string column's values decoded one by one (bytes that are not UTF-8 stay bytes, a bad row later),
    other columns as they are: pyarrow would fail the whole batch on one bad value."""
    import pyarrow as pa

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
            or pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        return column.to_pylist()
    out = []
    for raw in column.cast(pa.large_binary()).to_pylist():
        if raw is None:
            out.append(None)
            continue
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(raw)
    return out


def _parquet_row(doc_id, text, where: str, id_field: str) -> Document | BadRow:
    if isinstance(doc_id, bytes):
        return BadRow("invalid_utf8", where, "the id is not UTF-8")
    doc_id = _id_of(doc_id, where, id_field)
    if isinstance(doc_id, BadRow):
        return doc_id
    if isinstance(text, bytes):
        return BadRow("invalid_utf8", where, "the text is not UTF-8", doc_id)
    return _text_problem(text, where, doc_id) or Document(doc_id, text, where)


def _folder_files(root: Path) -> Iterator[Path]:
    """Every file under ``root``, sorted, hidden files and folders (a leading dot) left out."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                yield Path(folder) / name


def _read_folder(root: Path) -> Iterator[Document | BadRow]:
    for path in _folder_files(root):
        doc_id = path.relative_to(root).as_posix()
        try:
            raw = path.read_bytes()
        except OSError as exc:
            yield BadRow("unreadable_file", str(path), f"cannot read: {exc.strerror or exc}", doc_id)
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield BadRow("invalid_utf8", str(path), f"not UTF-8 at byte {exc.start}", doc_id)
            continue
        yield _text_problem(text, str(path), doc_id) or Document(doc_id, text, str(path))


def id_key(doc_id: str) -> bytes:
    """16 bytes standing for an id in the sets of ids seen and written (a collision needs ~2^64 ids)."""
    return hashlib.blake2b(doc_id.encode("utf-8"), digest_size=16).digest()


class Admission:
    """Which documents a run embeds: not one whose id came earlier in this run's input (a duplicate, a
    bad row), and not one an earlier run already wrote (``done``: the keys of the ids in the output,
    skipped and counted). The first time a written id comes by it is skipped; a second time it is a
    duplicate, exactly as in a run that was never interrupted."""

    def __init__(self, done: set[bytes]) -> None:
        self.done = done
        self.seen: set[bytes] = set()
        self.skipped = 0

    def check(self, doc: Document) -> Document | BadRow | None:
        """The document to embed, a BadRow (duplicate id), or None (written by an earlier run)."""
        key = id_key(doc.id)
        if key in self.seen:
            return BadRow("duplicate_id", doc.where, "this id came earlier in the input; the first is kept",
                          doc.id)
        self.seen.add(key)
        if key in self.done:
            self.skipped += 1
            return None
        return doc
