"""The static HTML book (tools/build_book.py): every notebook gets a page, the index lists them,
and the link check passes on the real book and fails on a planted broken link."""
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _load_tool():
    spec = importlib.util.spec_from_file_location("build_book", ROOT / "tools" / "build_book.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # before running it: its dataclass looks the module up
    spec.loader.exec_module(module)
    return module


book = _load_tool()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The real book, built once for this module (converting the notebooks takes ~10 s)."""
    out = tmp_path_factory.mktemp("book")
    pages = book.build(out, quiet=True)
    return out, pages


def test_every_notebook_has_a_page(built):
    out, pages = built
    assert len(NOTEBOOKS) == 9
    assert [p.notebook.name for p in pages] == [nb.name for nb in NOTEBOOKS]
    for nb in NOTEBOOKS:
        page = out / (nb.stem + ".html")
        assert page.is_file(), page
        text = page.read_text(encoding="utf-8")
        assert 'class="book-nav"' in text and 'href="index.html"' in text
        # The saved outputs are there (every notebook draws at least one figure), not re-run.
        assert "data:image/png;base64," in text


def test_index_lists_all_eight_in_order(built):
    out, pages = built
    index = (out / "index.html").read_text(encoding="utf-8")
    linked = re.findall(r'<li><a href="([^"]+\.html)">', index)
    assert linked == [nb.stem + ".html" for nb in NOTEBOOKS]
    for page in pages:
        assert page.title.startswith(page.notebook.stem[:2] + " · "), page.title
        assert len(page.description) > 40 and "**" not in page.description
        assert page.description in index.replace("&#x27;", "'")


def test_prev_next_navigation(built):
    out, _ = built
    first = (out / (NOTEBOOKS[0].stem + ".html")).read_text(encoding="utf-8")
    second = (out / (NOTEBOOKS[1].stem + ".html")).read_text(encoding="utf-8")
    last = (out / (NOTEBOOKS[-1].stem + ".html")).read_text(encoding="utf-8")
    assert 'rel="prev"' not in first and f'href="{NOTEBOOKS[1].stem}.html" rel="next"' in first
    assert f'href="{NOTEBOOKS[0].stem}.html" rel="prev"' in second
    assert f'href="{NOTEBOOKS[2].stem}.html" rel="next"' in second
    assert 'rel="next"' not in last


def test_link_check_passes(built):
    out, _ = built
    problems, links = book.check(out)
    assert problems == []
    assert links > 8  # the index, the navigation bars and the headings' own anchors


def test_link_check_reports_planted_broken_links(built, tmp_path, capsys):
    out = tmp_path / "book"
    shutil.copytree(built[0], out)
    good = NOTEBOOKS[1].stem + ".html"
    (out / "planted.html").write_text(
        "<!DOCTYPE html><html><body>"
        '<a href="99_missing.html">no such page</a>'
        f'<a href="{good}#no-such-heading">no such anchor</a>'
        f'<a href="{good}">fine</a>'
        '<a href="https://example.org/x.html">external, not checked</a>'
        '<a href="#nowhere">no such anchor here</a>'
        '<h2 id="here">here</h2><a href="#here">fine</a>'
        "</body></html>", encoding="utf-8")
    (out / NOTEBOOKS[-1].with_suffix(".html").name).unlink()

    problems, _ = book.check(out)
    text = "\n".join(problems)
    assert len(problems) == 6, text
    assert 'planted.html: href="99_missing.html": no file 99_missing.html' in text
    assert (f'planted.html: href="{good}#no-such-heading": '
            'no element with id "no-such-heading"') in text
    assert 'planted.html: href="#nowhere": no element with id "nowhere" in planted.html' in text
    assert f"missing page: {NOTEBOOKS[-1].stem}.html" in text
    assert "index.html does not link" not in text  # the index still links it: that link is broken
    assert f'index.html: href="{NOTEBOOKS[-1].stem}.html": no file' in text
    # The page before it links it from its navigation bar, at the top and the bottom: once here.
    assert f'{NOTEBOOKS[-2].stem}.html: href="{NOTEBOOKS[-1].stem}.html": no file' in text

    # The command line exits 1 and lists the broken links.
    assert book.main([str(out), "--check-only"]) == 1
    err = capsys.readouterr().err
    assert "book check FAILED: 6 problem(s)" in err and "99_missing.html" in err


def test_links_between_notebooks_point_at_pages(tmp_path):
    """Markdown links to NN_name.ipynb (with or without #anchor) become links to NN_name.html."""
    src = tmp_path / "notebooks"
    src.mkdir()
    first = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(
            "# 00 · First\n\nSee [the second](01_second.ipynb) and its "
            "[details](01_second.ipynb#2.-Details), or [a missing one](02_gone.ipynb#x)."),
        nbformat.v4.new_code_cell("print('[not a link](01_second.ipynb)')"),
    ])
    second = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(
            "# 01 · Second\n\n* a list first\n\n```python\nx = 1\n\ny = 2\n```\n\n"
            "Then a paragraph:"),
        nbformat.v4.new_markdown_cell("## 2. Details\n\nBack to [the first](./00_first.ipynb)."),
    ])
    nbformat.write(first, src / "00_first.ipynb")
    nbformat.write(second, src / "01_second.ipynb")

    out = tmp_path / "book"
    pages = book.build(out, src, quiet=True)
    assert [(p.title, p.description) for p in pages] == [
        ("00 · First", "See the second and its details, or a missing one."),
        ("01 · Second", "Then a paragraph:"),
    ]
    page = (out / "00_first.html").read_text(encoding="utf-8")
    assert 'href="01_second.html"' in page and 'href="01_second.html#2.-Details"' in page
    assert "[not a link](01_second.ipynb)" in page  # code shown as text is left alone
    assert 'href="00_first.html"' in (out / "01_second.html").read_text(encoding="utf-8")

    problems, _ = book.check(out, src)
    assert problems == ['00_first.html: href="02_gone.html#x": no file 02_gone.html']
