"""Real training text from the Python documentation (Debian package python3.11-doc).

Sphinx HTML → sections (heading + its own paragraphs) with the stdlib ``html.parser``.
Train / held-out is split by *document* (a hash of the page path), so no page has
sections on both sides and the held-out numbers measure text the student never saw.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

DEFAULT_HTML_ROOT = Path("/usr/share/doc/python3.11/html")

# Index and search pages are lists of links, not prose.
_SKIP_PAGES = ("genindex", "py-modindex", "search", "contents", "download")
_BLOCKS = {"p", "li", "dt", "dd", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "caption", "div"}
_HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
_SILENT = {"script", "style"}


@dataclass
class Section:
    """One ``<section>`` of a page: its heading and only its own paragraphs (not subsections)."""

    anchor: str
    title: str = ""
    paragraphs: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join([self.title, *self.paragraphs]).strip()


class _SectionParser(html.parser.HTMLParser):
    """Collects the text of ``div.body`` grouped by innermost ``<section>``, in document order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[Section] = []
        self._stack: list[Section] = []
        self._body_depth = 0  # div nesting inside div.body; 0 = outside the body
        self._silent = 0  # inside script/style/headerlink
        self._buf: list[str] = []
        self._in_heading = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "div" and self._body_depth == 0:
            if "body" in (a.get("class") or "").split():
                self._body_depth = 1
            return
        if self._body_depth == 0:
            return
        if tag == "div":
            self._body_depth += 1
        if tag in _SILENT or (tag == "a" and "headerlink" in (a.get("class") or "")):
            self._silent += 1
            return
        if tag == "section":
            self._flush()
            sec = Section(anchor=a.get("id") or "")
            self._stack.append(sec)
            self.sections.append(sec)
        elif tag in _BLOCKS:
            self._flush()
            self._in_heading = tag in _HEADINGS
        elif tag == "br":
            self._buf.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if self._body_depth == 0:
            return
        if tag in _SILENT or (tag == "a" and self._silent):
            self._silent = max(0, self._silent - 1)
            return
        if tag == "section":
            self._flush()
            if self._stack:
                self._stack.pop()
        elif tag in _BLOCKS:
            self._flush()
        if tag == "div":
            self._body_depth -= 1

    def handle_data(self, data: str) -> None:
        if self._body_depth and not self._silent:
            self._buf.append(data)

    def _flush(self) -> None:
        # whitespace (including the line breaks of code blocks) collapses: the encoders see word pieces only
        text = " ".join("".join(self._buf).split())
        self._buf = []
        if not text or not self._stack:
            self._in_heading = False
            return
        sec = self._stack[-1]
        if self._in_heading and not sec.title:
            sec.title = text
        else:
            sec.paragraphs.append(text)
        self._in_heading = False


def parse_page(path: Path) -> list[Section]:
    """The non-empty sections of one Sphinx HTML page, in document order."""
    parser = _SectionParser()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    parser.close()
    return [s for s in parser.sections if s.text]


def topic_of(rel: str) -> str:
    """The documentation area a page belongs to: its top-level folder (``library``, ``c-api``, ...)."""
    parts = rel.split("/")
    return parts[0] if len(parts) > 1 else "misc"


def is_heldout(rel: str, heldout_percent: int = 10) -> bool:
    """Deterministic document-level split: the same page is held out on every machine and run."""
    if not 0 < heldout_percent < 100:
        raise ValueError(f"heldout_percent must be in 1..99, got {heldout_percent}")
    digest = hashlib.sha1(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < heldout_percent


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


def write_jsonl(path: Path, rows: list[dict]) -> int:
    """Write rows as JSON lines (UTF-8, one object per line); returns the row count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(rows)
