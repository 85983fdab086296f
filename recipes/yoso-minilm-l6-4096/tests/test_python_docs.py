"""The Python documentation reader of the recipe: sections in order without navigation, topics, and the
held-out split by page."""

from __future__ import annotations

from corpus import is_heldout
from python_docs import HELDOUT_PERCENT, parse_page, topic_of


def test_pydocs_sections_and_split(tmp_path):
    page = tmp_path / "p.html"
    page.write_text(
        '<html><body><div class="sphinxsidebar"><p>nav</p></div><div class="body" role="main">'
        '<section id="top"><h1>Title<a class="headerlink" href="#top">¶</a></h1><p>Intro  text.</p>'
        '<script>var x = 1;</script>'
        '<section id="sub"><h2>Sub</h2><p>Inner <code>code</code> words.</p><pre>a = 1\nb = 2</pre></section>'
        '<p>After sub.</p></section></div><div class="footer">foot</div></body></html>')
    secs = parse_page(page)
    assert [(s.anchor, s.title) for s in secs] == [("top", "Title"), ("sub", "Sub")]
    assert secs[0].text == "Title\nIntro text.\nAfter sub."
    assert secs[1].text == "Sub\nInner code words.\na = 1 b = 2"
    assert topic_of("library/json.html") == "library" and topic_of("about.html") == "misc"
    picks = [is_heldout(f"library/m{i}.html", HELDOUT_PERCENT) for i in range(400)]
    assert picks == [is_heldout(f"library/m{i}.html", HELDOUT_PERCENT) for i in range(400)]
    assert 0.05 < sum(picks) / len(picks) < 0.15
