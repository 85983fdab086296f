"""``--write-docs`` of the bench scripts: replace one ``## `` section of docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_section(heading: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) the section under ``heading`` in ``doc``, leaving other sections alone."""
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n"
    section = f"{heading}\n\n{body.strip()}\n"
    if heading in text:
        start = text.index(heading)
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section + ("" if nxt == -1 else "\n" + text[nxt + 1:])
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc.write_text(text)
