"""The long-document corpus of the recipe: the HTML reader, parts cut at block edges, which packages are
sources (never manual pages), the held-out transfer sources and the package versions recorded with it."""

from __future__ import annotations

import json
import shutil

import pytest

import corpus


def test_html_blocks_keep_prose_in_order_and_drop_navigation():
    page = """<html><head><title>T</title><style>p {}</style></head><body>
      <div class="navheader"><p>Prev</p><p>Next <a href="x">up</a></p></div>
      <div class="body" role="main"><h1>Heading<a class="headerlink">¶</a></h1>
      <p>First   paragraph
         spans lines.<p>Second, unclosed.
      <ul><li>item one</li><li>item two</li></ul><pre>code  block</pre><script>var x;</script></div>
      <footer>© someone</footer></body></html>"""
    assert corpus.html_blocks(page) == ["Heading", "First paragraph spans lines.", "Second, unclosed.",
                                          "item one", "item two", "code block"]


def test_parts_cut_at_block_edges_within_the_budget():
    assert corpus.split_parts(["a", "b", "c", "d"], [3, 3, 5, 1], 6) == [[0, 1], [2, 3]]
    assert corpus.split_parts(["a", "b"], [9, 1], 6) == [[0], [1]]  # an oversized block stands alone
    rows = corpus.page_documents("s", "p.html", ["a", "b", "c"], [30, 30, 5], max_tokens=60, min_tokens=10)
    assert [(r["doc"], r["blocks"], r["tokens"]) for r in rows] == [("s/p.html#0", ["a", "b"], 60)]


def test_manual_pages_are_never_sources(tmp_path):
    root = tmp_path / "doc"
    for rel in ("user-manual.html", "git-add.html", "gittutorial.html", "howto/a.html", "_static/x.html"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("<p>text</p>")
    git = corpus.Source("git", root, "git-doc", corpus.SOURCES["git"].keep)
    assert [rel for rel, _ in git.pages(frozenset())] == ["howto/a.html", "user-manual.html"]
    assert [rel for rel, _ in git.pages(frozenset({"a"}))] == ["user-manual.html"]  # named like a man page
    assert not corpus.SOURCES["postgresql"].keep("sql-select.html")
    assert not corpus.SOURCES["postgresql"].keep("app-psql.html")
    assert corpus.SOURCES["postgresql"].keep("tutorial-join.html")
    # the wider corpus: pages that render a manual page (or repeat every page) are dropped
    dropped = {"apache": "programs/htpasswd.html", "django": "ref/django-admin.html", "sphinx": "man/sphinx-build.html",
               "node": "cli.html"}
    for name, rel in dropped.items():
        assert not corpus.SOURCES[name].keep(rel), name
    assert not corpus.SOURCES["node"].keep("all.html")
    kept = {"apache": "mod/mod_rewrite.html", "django": "topics/db/queries.html", "sphinx": "usage/quickstart.html",
            "node": "fs.html", "r": "R-intro.html", "octave": "Basic-Vectorization.html", "flask": "tutorial/views.html"}
    for name, rel in kept.items():
        assert corpus.SOURCES[name].keep(rel), name
    # and the next seven: prose pages only, none of CMake's manual/ (its manual pages) or what they include
    dropped = {"cmake": ["manual/cmake.1.html", "command/add_library.html", "module/FindBoost.html"],
               "pandas": ["advanced.html", "reference/api/pandas.DataFrame.html", "whatsnew/v1.5.0.html"],
               "scipy": ["reference/generated/scipy.fft.fft.html", "release.1.10.0.html"],
               "sqlalchemy": ["changelog/changelog_14.html"], "pytest": ["announce/release-7.2.0.html"],
               "vim": ["version9.html"]}
    for name, rels in dropped.items():
        assert not any(corpus.SOURCES[name].keep(rel) for rel in rels), name
    kept = {"cmake": "guide/tutorial/index.html", "pandas": "user_guide/groupby.html", "scipy": "tutorial/fft.html",
            "sqlalchemy": "orm/quickstart.html", "pytest": "how-to/fixtures.html", "vim": "usr_05.html",
            "gnuplot": "loadpaths.html"}
    for name, rel in kept.items():
        assert corpus.SOURCES[name].keep(rel), name
    assert set(corpus.WIDER_SOURCES) >= set(corpus.WIDE_SOURCES) >= set(corpus.TRAIN_SOURCES)
    assert not set(corpus.WIDER_SOURCES) & set(corpus.TRANSFER_SOURCES)
    # the packages no stage trains on are exactly those of the wider corpus that stage six's lacks
    assert set(corpus.UNSEEN_SOURCES) == {"sqlalchemy", "pandas", "scipy", "pytest", "gnuplot", "vim", "cmake"}
    assert not set(corpus.UNSEEN_SOURCES) & {*corpus.WIDE_SOURCES, *corpus.TRANSFER_SOURCES}
    man = tmp_path / "man"
    (man / "man1").mkdir(parents=True)
    (man / "man1" / "ls.1.gz").write_bytes(b"")
    assert corpus.man_page_names(man) == frozenset({"ls"})


def test_training_and_transfer_sources_must_not_overlap(tmp_path):
    with pytest.raises(ValueError, match="both trained on and kept out"):
        corpus.prepare_corpus(tmp_path, None, train_sources=("python",), transfer_sources=("python",))


def test_missing_documentation_packages_are_named_together_before_any_reading(tmp_path, monkeypatch):
    sources = {n: corpus.Source(n, tmp_path / n, f"{n}-doc") for n in ("a", "b", "t")}
    monkeypatch.setattr(corpus, "SOURCES", sources)
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match=r"a not found; install them with `apt-get install -y a-doc`"):
        next(corpus.read_source(sources["a"], None, max_tokens=4000, min_tokens=64))  # one source: the same check
    monkeypatch.setattr(corpus, "read_source", lambda *a, **kw: pytest.fail("read before the check"))
    with pytest.raises(ValueError, match=r"not found; install them with `apt-get install -y t-doc a-doc`"):
        corpus.prepare_corpus(tmp_path / "out", None, train_sources=("t", "b"), transfer_sources=("a",))
    with pytest.raises(ValueError, match="unknown source 'zz'"):
        corpus.prepare_corpus(tmp_path / "out", None, train_sources=("zz", "t"), transfer_sources=("a",))


def test_transfer_documents_of_several_sources_are_mixed(tmp_path, monkeypatch):
    # deep_pairs takes the first N eligible documents: with several sources kept out, the transfer file must not
    # be one source after another, or the eval's corpus is its first source alone
    names = ("a", "b", "c", "t")
    monkeypatch.setattr(corpus, "SOURCES", {n: corpus.Source(n, tmp_path / n, f"{n}-doc") for n in names})
    for n in names:
        (tmp_path / n).mkdir()
    monkeypatch.setattr(corpus, "dpkg_version", lambda package: f"{package[0]}-1.0")
    monkeypatch.setattr(corpus, "read_source", lambda source, tok, **kw: (
        {"doc": f"{source.name}/p{i}#0", "source": source.name, "page": f"{source.name}/p{i}", "blocks": ["x"],
         "tokens": 2000} for i in range(40)))
    corpus.prepare_corpus(tmp_path / "mixed", None, train_sources=("t",), transfer_sources=("a", "b", "c"),
                            heldout_percent=0)
    rows = [json.loads(line) for line in (tmp_path / "mixed" / "transfer_docs.jsonl").read_text().splitlines()]
    # the counts name the package versions the corpus was read from
    assert json.loads((tmp_path / "mixed" / "counts.json").read_text())["packages"] == {
        "a-doc": "a-1.0", "b-doc": "b-1.0", "c-doc": "c-1.0", "t-doc": "t-1.0"}
    assert sorted(r["doc"] for r in rows) == sorted(f"{n}/p{i}#0" for n in "abc" for i in range(40))
    assert {r["source"] for r in rows[:15]} == {"a", "b", "c"}
    again = tmp_path / "again"
    corpus.prepare_corpus(again, None, train_sources=("t",), transfer_sources=("a", "b", "c"), heldout_percent=0)
    assert (again / "transfer_docs.jsonl").read_text() == (tmp_path / "mixed" / "transfer_docs.jsonl").read_text()
    # one source kept out (PostgreSQL) and the training files keep their page order
    corpus.prepare_corpus(tmp_path / "one", None, train_sources=("t",), transfer_sources=("a",), heldout_percent=0)
    for side, src in (("transfer", "a"), ("train", "t")):
        docs = [json.loads(line)["doc"] for line in (tmp_path / "one" / f"{side}_docs.jsonl").read_text().splitlines()]
        assert docs == [f"{src}/p{i}#0" for i in range(40)]


def test_package_versions_from_dpkg_or_none(monkeypatch):
    assert corpus.package_versions(["b", "a", "b"], query=lambda p: "2.0" if p == "a" else None) == {
        "a": "2.0", "b": None}
    # a machine without dpkg, or a package not installed: None, never an error
    monkeypatch.setenv("PATH", "/nonexistent")
    assert corpus.dpkg_version("postgresql-doc-15") is None


@pytest.mark.skipif(not shutil.which("dpkg-query"), reason="needs dpkg (Debian)")
def test_dpkg_version_of_an_installed_and_a_missing_package():
    assert corpus.dpkg_version("dpkg")  # dpkg itself is always installed where dpkg-query is
    assert corpus.dpkg_version("no-such-package-yoso") is None
