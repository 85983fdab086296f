"""The recipe's corpora from offline documentation packages (Debian's ``*-doc``): the one HTML reader, the
one stable key hash and the one held-out split, and the long documents of long-document training and of the
deep-retrieval evaluation (python_docs.py builds the distillation data from the same reader and split).

Every page becomes a list of text blocks (paragraphs, list items, headings, code) in reading order,
read with the stdlib ``html.parser``; navigation bars, sidebars, scripts and styles are dropped. A page
longer than a model's positions is cut at block edges into consecutive *parts* of at most
``max_tokens`` tokens, each one document. Train / held-out is split by page (SHA-1 of the source and
path), so no page has parts on both sides; whole sources can also be kept out of training to measure
transfer.

Manual pages are never read. They are kept for independent evaluation, and several doc packages ship
the same pages rendered to HTML: every git-doc page named ``git*``/``scalar*`` (git's man pages),
postgresql-doc's ``sql-*``/``app-*`` reference pages (its man pages) and any page whose name is that of
an installed manual page are skipped, and nothing under ``/usr/share/man`` is a source.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

DOC_ROOT = Path("/usr/share/doc")
MAN_ROOT = Path("/usr/share/man")

_BLOCKS = {"p", "li", "dt", "dd", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "caption", "div",
           "blockquote", "section", "table", "ul", "ol", "dl", "br", "hr", "title", "td", "th"}
_SILENT = {"script", "style", "nav", "header", "footer", "head", "noscript", "svg", "button", "form"}
_HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
# containers (by class or id) that hold navigation, not prose; matched as whole words
_NAV = re.compile(r"\b(navheader|navfooter|sphinxsidebar|sidebar|related|headerlink|breadcrumbs?|toc|"
                  r"footer|header|menu|nav-chapters|nav-wrapper|rustdoc-toc|wy-nav-side|search)\b")


@dataclass
class Section:
    """One ``<section>`` of a page: its heading and only its own blocks (not its subsections')."""

    anchor: str
    title: str = ""
    paragraphs: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join([self.title, *self.paragraphs]).strip()


class _PageParser(html.parser.HTMLParser):
    """Text of a page's body as blocks, and the same blocks grouped by innermost ``<section>``; skips silent
    tags and navigation containers (depth-counted per tag name, so unclosed ``<p>`` or ``<li>`` inside them do
    not matter)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self.sections: list[Section] = []
        self._open: list[Section] = []
        self._buf: list[str] = []
        self._skip_tag: str | None = None
        self._skip_depth = 0
        self._in_heading = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skip_tag is not None:
            self._skip_depth += tag == self._skip_tag
            return
        a = dict(attrs)
        names = f"{a.get('class') or ''} {a.get('id') or ''} {a.get('role') or ''}".lower()
        if tag in _SILENT or (tag in {"div", "ul", "table", "a", "span", "p"} and _NAV.search(names)):
            self._flush()
            self._skip_tag, self._skip_depth = tag, 1
            return
        if tag in _BLOCKS:
            self._flush()
            self._in_heading = tag in _HEADINGS
        if tag == "section":
            self._open.append(Section(anchor=a.get("id") or ""))
            self.sections.append(self._open[-1])

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skip_tag is None and tag in _BLOCKS:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if self._skip_tag is not None:
            if tag == self._skip_tag:
                self._skip_depth -= 1
                if self._skip_depth == 0:
                    self._skip_tag = None
            return
        if tag in _BLOCKS:
            self._flush()
        if tag == "section" and self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        if self._skip_tag is None:
            self._buf.append(data)

    def _flush(self) -> None:
        # whitespace (the line breaks of code blocks too) collapses: the encoders see word pieces only
        text = " ".join("".join(self._buf).split())
        self._buf = []
        heading, self._in_heading = self._in_heading, False
        if not text:
            self._in_heading = heading  # a heading's text may follow an empty flush inside it
            return
        self.blocks.append(text)
        if self._open:
            sec = self._open[-1]
            if heading and not sec.title:
                sec.title = text
            else:
                sec.paragraphs.append(text)

    def close(self) -> None:
        super().close()
        self._flush()


def parse_html(markup: str) -> _PageParser:
    parser = _PageParser()
    parser.feed(markup)
    parser.close()
    return parser


def html_blocks(markup: str) -> list[str]:
    """The text blocks of an HTML page in reading order (whitespace collapsed, empty blocks dropped)."""
    return parse_html(markup).blocks


def html_sections(markup: str) -> list[Section]:
    """The non-empty ``<section>`` elements of an HTML page (Sphinx writes one per heading), in order."""
    return [s for s in parse_html(markup).sections if s.text]


def write_jsonl(path: Path, rows: list[dict]) -> int:
    """Write rows as JSON lines (UTF-8, one object per line); returns the row count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(rows)


@dataclass(frozen=True)
class Source:
    """One documentation package: where its HTML lies and which pages of it are prose."""

    name: str
    root: Path
    package: str
    keep: Callable[[str], bool] = lambda rel: True

    def pages(self, man_names: frozenset[str]) -> Iterator[tuple[str, Path]]:
        """(relative path, file) of every HTML page kept, sorted (the same order on every machine)."""
        for path in sorted(self.root.rglob("*.html")):
            rel = path.relative_to(self.root).as_posix()
            stem = Path(rel).name.split(".")[0]
            if any(part.startswith(("_", ".")) for part in rel.split("/")) or stem in _INDEX_PAGES:
                continue
            if stem in man_names or not self.keep(rel):
                continue
            yield rel, path


_INDEX_PAGES = {"genindex", "py-modindex", "search", "searchindex", "contents", "download", "print", "index",
                "toc", "404", "not_found", "bookindex", "settings", "help"}
_RUST_BOOKS = ("book/", "reference/", "nomicon/", "rust-by-example/", "edition-guide/", "embedded-book/",
               "rustc/", "rustdoc/", "unstable-book/")


def _not_git_man(rel: str) -> bool:
    return not Path(rel).name.startswith(("git", "scalar"))


def _not_pg_man(rel: str) -> bool:
    return not Path(rel).name.startswith(("sql-", "app-"))


SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("python", DOC_ROOT / "python3.11" / "html", "python3.11-doc"),
    Source("linux", DOC_ROOT / "linux-doc" / "html", "linux-doc"),
    Source("rust", DOC_ROOT / "rust-doc" / "html", "rust-doc", lambda rel: rel.startswith(_RUST_BOOKS)),
    Source("go", DOC_ROOT / "golang-1.19-doc" / "html", "golang-1.19-doc"),
    Source("debian-reference", DOC_ROOT / "debian-reference-en" / "docs", "debian-reference-en",
           lambda rel: ".en." in rel),
    Source("debian-handbook", DOC_ROOT / "debian-handbook" / "html" / "en-US", "debian-handbook"),
    Source("git", DOC_ROOT / "git-doc", "git-doc", _not_git_man),
    Source("sqlite", DOC_ROOT / "sqlite3", "sqlite3-doc"),
    Source("postgresql", DOC_ROOT / "postgresql-doc-15" / "html", "postgresql-doc-15", _not_pg_man),
    # the wider corpus of stage six (WIDE_SOURCES)
    Source("apache", DOC_ROOT / "apache2-doc" / "manual" / "en", "apache2-doc",
           lambda rel: not rel.startswith("programs/")),  # programs/: the httpd tools' manual pages
    Source("django", DOC_ROOT / "python-django-doc" / "html", "python-django-doc",
           lambda rel: not rel.startswith(("releases/", "ref/django-admin"))),  # django-admin: its manual page
    Source("node", DOC_ROOT / "nodejs" / "api", "nodejs-doc",
           lambda rel: rel not in ("all.html", "cli.html")),  # all: every page again; cli: what node(1) says
    Source("r", DOC_ROOT / "r-doc-html" / "manual", "r-doc-html"),
    Source("octave", DOC_ROOT / "octave" / "octave.html", "octave-doc"),
    Source("sphinx", DOC_ROOT / "sphinx-doc" / "html", "sphinx-doc", lambda rel: not rel.startswith("man/")),
    Source("flask", DOC_ROOT / "python-flask-doc" / "html", "python-flask-doc"),
    # seven more for WIDER_SOURCES: prose only (API pages generated one per function, release notes and the
    # redirect stubs are left out), and no page of CMake's manual/ and the references its manual pages include
    Source("sqlalchemy", DOC_ROOT / "python-sqlalchemy-doc" / "html", "python-sqlalchemy-doc",
           lambda rel: not rel.startswith("changelog/")),
    Source("pandas", DOC_ROOT / "python-pandas-doc" / "html", "python-pandas-doc",
           lambda rel: rel.startswith(("user_guide/", "getting_started/", "development/"))),
    Source("scipy", DOC_ROOT / "python-scipy-doc" / "html", "python-scipy-doc",
           lambda rel: rel.startswith(("tutorial/", "dev/"))),
    Source("pytest", DOC_ROOT / "python-pytest-doc" / "html", "python-pytest-doc",
           lambda rel: not rel.startswith(("announce/", "changelog"))),
    Source("gnuplot", DOC_ROOT / "gnuplot" / "htmldocs", "gnuplot-doc"),
    Source("vim", DOC_ROOT / "vim" / "html", "vim-doc", lambda rel: not rel.startswith("version")),
    Source("cmake", DOC_ROOT / "cmake-data" / "html", "cmake-doc", lambda rel: rel.startswith("guide/")),
)}


def man_page_names(root: Path = MAN_ROOT) -> frozenset[str]:
    """Names of the installed manual pages (``ls.1.gz`` → ``ls``): a doc page of the same name is skipped."""
    if not root.is_dir():
        return frozenset()
    return frozenset(p.name.split(".")[0] for p in root.glob("**/*.*") if p.is_file())


def dpkg_version(package: str) -> str | None:
    """The installed version of a Debian package (``dpkg-query``), or None where it is not installed or the
    machine has no dpkg."""
    try:
        done = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def package_versions(packages, query: Callable[[str], str | None] | None = None) -> dict[str, str | None]:
    """{package: installed version or None}, sorted by name: what a corpus was read from. A new version of a
    documentation package changes its pages, and with them the documents and every figure measured on them."""
    query = query or dpkg_version
    return {name: query(name) for name in sorted(set(packages))}


def key_hash(key: str) -> int:
    """A hash of ``key`` that is the same on every machine and run (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:4], "big")


def is_heldout(key: str, percent: int) -> bool:
    """Deterministic split by page: the same page is held out on every machine and run."""
    if not 0 <= percent < 100:
        raise ValueError(f"held-out percent must be in 0..99, got {percent}")
    return key_hash(key) % 100 < percent


def split_parts(blocks: list[str], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive runs of block indices whose summed token ``lengths`` stay within ``max_tokens``
    (a single longer block is a part of its own, cut later by the tokenizer)."""
    parts, cur, size = [], [], 0
    for i, n in enumerate(lengths):
        if cur and size + n > max_tokens:
            parts.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        parts.append(cur)
    return parts


def page_documents(source: str, rel: str, blocks: list[str], lengths: list[int], *, max_tokens: int,
                   min_tokens: int) -> list[dict]:
    """One page → its parts as document rows ``{doc, source, page, blocks, tokens}``."""
    rows = []
    for k, idx in enumerate(split_parts(blocks, lengths, max_tokens)):
        tokens = sum(lengths[i] for i in idx)
        if tokens >= min_tokens:
            rows.append({"doc": f"{source}/{rel}#{k}", "source": source, "page": f"{source}/{rel}",
                         "blocks": [blocks[i] for i in idx], "tokens": tokens})
    return rows


def check_installed(sources: Iterable[Source]) -> None:
    """ValueError naming every source whose pages are not installed, with the one ``apt-get`` line for them all."""
    missing = [s for s in sources if not s.root.is_dir()]
    if missing:
        raise ValueError(f"{', '.join(str(s.root) for s in missing)} not found; install them with "
                         f"`apt-get install -y {' '.join(dict.fromkeys(s.package for s in missing))}`")


def read_source(source: Source, tokenizer, *, max_tokens: int, min_tokens: int,
                man_names: frozenset[str] = frozenset(), max_pages: int = 0) -> Iterator[dict]:
    """Document rows of one source; ``tokenizer.encode(list[str], add_special_tokens=False)`` counts tokens."""
    check_installed([source])
    for n, (rel, path) in enumerate(source.pages(man_names)):
        if max_pages and n >= max_pages:
            break
        blocks = html_blocks(path.read_text(encoding="utf-8", errors="replace"))
        if not blocks:
            continue
        lengths = [len(ids) for ids in tokenizer.encode(blocks, add_special_tokens=False)]
        yield from page_documents(source.name, rel, blocks, lengths, max_tokens=max_tokens, min_tokens=min_tokens)


TRAIN_SOURCES = ("python", "linux", "rust", "go", "debian-reference", "debian-handbook", "git", "sqlite")
WIDE_SOURCES = (*TRAIN_SOURCES, "apache", "django", "node", "r", "octave", "sphinx", "flask")
WIDER_SOURCES = (*WIDE_SOURCES, "sqlalchemy", "pandas", "scipy", "pytest", "gnuplot", "vim", "cmake")
TRANSFER_SOURCES = ("postgresql",)  # never trained on: deep retrieval on it measures transfer
# The sources of WIDER_SOURCES that no stage of the bundled model trains on: a second measure of transfer,
# seven packages at once where PostgreSQL is one.
UNSEEN_SOURCES = tuple(s for s in WIDER_SOURCES if s not in WIDE_SOURCES)


def prepare_corpus(out: Path, tokenizer, *, train_sources=TRAIN_SOURCES, transfer_sources=TRANSFER_SOURCES,
                   heldout_percent: int = 5, max_tokens: int = 4000, min_tokens: int = 64) -> dict:
    """Write ``train_docs.jsonl`` (training sources, pages not held out), ``heldout_docs.jsonl`` (their
    held-out pages) and ``transfer_docs.jsonl`` (whole sources kept out of training); returns the counts."""
    overlap = set(train_sources) & set(transfer_sources)
    if overlap:
        raise ValueError(f"sources both trained on and kept out: {sorted(overlap)}")
    names = (*train_sources, *transfer_sources)
    unknown = [name for name in names if name not in SOURCES]
    if unknown:
        raise ValueError(f"unknown source {unknown[0]!r}; known: {', '.join(SOURCES)}")
    check_installed(SOURCES[name] for name in names)  # all at once, before minutes of reading the others
    man = man_page_names()
    split: dict[str, list[dict]] = {"train": [], "heldout": [], "transfer": []}
    for name in names:
        for row in read_source(SOURCES[name], tokenizer, max_tokens=max_tokens, min_tokens=min_tokens, man_names=man):
            side = "transfer" if name in transfer_sources else \
                "heldout" if is_heldout(row["page"], heldout_percent) else "train"
            split[side].append(row)
    if len(transfer_sources) > 1:
        # The evals take the first N eligible documents of the file (``retrieval.deep_pairs``). In source order
        # those would be the first source's alone; in this fixed mixed order any prefix samples every source
        # in proportion to its documents.
        split["transfer"].sort(key=lambda row: key_hash(row["doc"]))
    counts: dict = {}
    for side, rows in split.items():
        counts[f"{side}_docs"] = write_jsonl(out / f"{side}_docs.jsonl", rows)
        counts[f"{side}_tokens"] = sum(r["tokens"] for r in rows)
        counts[f"{side}_by_source"] = {s: sum(r["source"] == s for r in rows) for s in sorted({r["source"] for r in rows})}
    counts["manual_page_names_skipped_against"] = len(man)
    counts["packages"] = package_versions(SOURCES[name].package for name in (*train_sources, *transfer_sources))
    (out / "counts.json").write_text(json.dumps(counts, indent=2) + "\n")
    return counts
