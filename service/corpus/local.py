"""The local engine: the corpus streamed through one in-process server engine.

The input is read as the work goes (never held whole); a bounded number of documents is in flight in
the engine at once, enough for its batcher to fill batches by its token budget; finished rows collect
into a part of ``part_rows`` rows, written to disk and forgotten. Memory is bounded whatever the
corpus: the documents in flight, one part's rows, and the set of ids seen (16 bytes each).
"""

from __future__ import annotations

import asyncio
from typing import Iterable

from .report import RunReport
from .sources import Admission, BadRow, Document
from .store import OutputStore
from .work import DocumentEmbedder

# Characters per token, to bound the text in flight before it is tokenised (English with WordPiece or BPE).
CHARS_PER_TOKEN = 4


def in_flight_limits(max_batch_tokens: int, max_batch_requests: int) -> tuple[int, int]:
    """(documents, characters) the job keeps in the engine at once: two full batches' worth, so that one
    batch is always queued while another runs."""
    return 2 * max_batch_requests, 2 * max_batch_tokens * CHARS_PER_TOKEN


class PartWriter:
    """Rows in, parts out: every ``part_rows`` rows become one part."""

    def __init__(self, store: OutputStore, part_rows: int, pieces: bool) -> None:
        self.store, self.part_rows, self.pieces = store, part_rows, pieces
        self.rows: list[dict] = []
        self.parts = 0

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.part_rows:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.store.write_part(self.rows, self.pieces)
            self.parts += 1
            self.rows = []


def run_local(embedder: DocumentEmbedder, rows: Iterable[Document | BadRow], admission: Admission,
              store: OutputStore, report: RunReport, *, part_rows: int) -> int:
    """Embed every admitted document of ``rows`` into parts of ``store``; returns the parts written."""
    writer = PartWriter(store, part_rows, embedder.pieces is not None)
    s = embedder.settings
    max_docs, max_chars = in_flight_limits(s.max_batch_tokens, s.max_batch_requests)
    asyncio.run(_stream(embedder, rows, admission, writer, report, max_docs, max_chars))
    writer.flush()
    return writer.parts


async def _stream(embedder: DocumentEmbedder, rows: Iterable[Document | BadRow], admission: Admission,
                  writer: PartWriter, report: RunReport, max_docs: int, max_chars: int) -> None:
    pending: dict[asyncio.Task, int] = {}  # task → characters of its text

    def settle(task: asyncio.Task) -> None:
        pending.pop(task)
        result = task.result()
        if isinstance(result, BadRow):
            report.bad(result)
            return
        writer.add(result)
        report.done(result["tokens"], result.get("truncated", False))

    async def wait_one() -> None:
        finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in finished:
            settle(task)

    for row in rows:
        if isinstance(row, BadRow):
            report.bad(row)
            continue
        doc = admission.check(row)
        if doc is None:  # written by an earlier run
            report.step()
            continue
        if isinstance(doc, BadRow):
            report.bad(doc)
            continue
        while pending and (len(pending) >= max_docs or sum(pending.values()) + len(doc.text) > max_chars):
            await wait_one()
        pending[asyncio.ensure_future(embedder.embed(doc))] = len(doc.text)
        await asyncio.sleep(0)  # let the engine take the request in before the next line is read
    while pending:
        await wait_one()
