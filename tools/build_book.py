"""Turn the executed notebooks into a static HTML book that any browser can read.

Usage:
    python tools/build_book.py [OUT_DIR]               build (default OUT_DIR: build/book)
    python tools/build_book.py [OUT_DIR] --check       build, then check the links
    python tools/build_book.py [OUT_DIR] --check-only  check a book built earlier

The build writes one page per notebook in notebooks/ (NN_name.ipynb -> NN_name.html) and an
index.html that lists them in order, each with its title (the notebook's first "# " heading) and
the first paragraph under it. Nothing is executed: the pages show the outputs saved in the
notebooks (committed executed on a GPU). Links from one notebook to another, "NN_name.ipynb" or
"NN_name.ipynb#anchor", are pointed at the matching .html page, and every page gets a small
navigation bar at its top and bottom (contents, previous, next).

The pages load no script from the network: nbconvert's template would fetch require.js, MathJax,
mermaid and the widget manager from CDNs, so they are left out, and a widget's output shows the
picture or text saved next to it (a stepper saves its static twin, a PNG). The book reads offline.

The check makes sure the book is whole: every notebook has its page, the index links every page,
and every link that stays inside the book reaches a file that exists and, when it names an
anchor, an element with that id in the target page. Broken links are listed and the exit status
is 1.

Why nbconvert's HTMLExporter rather than Jupyter Book 2 / mystmd: nbconvert and nbformat already
come with JupyterLab, so the book needs nothing new. mystmd needs a Node.js toolchain and network
access when it is installed; this script works offline, on a 2-core CPU, and a teacher can
rebuild all the pages in seconds. (jinja2, used for the small template below, is one of
nbconvert's own dependencies.)
"""
from __future__ import annotations

import argparse
import html
import re
import sys
import time
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import jinja2
import nbformat
from nbconvert import HTMLExporter
from nbconvert.filters.markdown_mistune import markdown2html_mistune

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
DEFAULT_OUT = ROOT / "build" / "book"
INDEX = "index.html"

# nbconvert's JupyterLab template with the navigation bar added inside <main>, at both ends, and
# every script it would fetch from the network left out (require.js, MathJax, mermaid, the widget
# manager): the book must read offline, and no notebook needs them (no math, no diagrams; a
# stepper's output carries its picture as a PNG, which the page shows instead of the widget).
_PAGE_TEMPLATE = """\
{%- extends 'lab/index.html.j2' -%}
{% block html_head_js_requirejs %}{% endblock html_head_js_requirejs %}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{% block html_head_js_mathjax %}{% endblock html_head_js_mathjax %}
{% block html_head_js_mermaidjs %}{% endblock html_head_js_mermaidjs %}
{% block extra_css %}
<style type="text/css">
  nav.book-nav { display: flex; gap: 1.5em; align-items: baseline; flex-wrap: wrap;
                 padding: 0.6em 1em; margin: 0.5em 0; font-size: 14px;
                 font-family: var(--jp-ui-font-family, sans-serif);
                 background: var(--jp-layout-color2, #eee); border-radius: 4px; }
  nav.book-nav .book-nav-next { margin-left: auto; }
</style>
{% endblock extra_css %}
{% block body_header %}
{{ super() }}
{{ resources.book_nav }}
{% endblock body_header %}
{% block body_footer %}
{{ resources.book_nav }}
{{ super() }}
{% endblock body_footer %}
"""

# A link to a notebook of the book, in an href attribute of the rendered page. Markdown links are
# rendered to <a href="..."> before this runs; code shown as text is escaped and never matches.
_NOTEBOOK_HREF = re.compile(r"""\bhref=(["'])(?:\./)?(\d\d_[^"'/#?]*)\.ipynb(#[^"']*)?\1""")


@dataclass
class Page:
    notebook: Path
    title: str
    description: str

    @property
    def filename(self) -> str:
        return self.notebook.stem + ".html"


# ---------------------------------------------------------------------------------------------
# Reading the notebooks


class _TextOnly(HTMLParser):
    """The text of an HTML fragment, tags dropped and entities decoded."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def _plain_text(markdown: str) -> str:
    parser = _TextOnly()
    parser.feed(markdown2html_mistune(markdown))
    parser.close()
    return " ".join("".join(parser.parts).split())


def title_and_description(nb) -> tuple[str | None, str]:
    """The first "# " heading of the notebook's markdown and the first paragraph after it."""
    title = None
    blocks: list[list[str]] = [[]]  # the markdown after the title, cut at blank lines
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        in_fence = False
        for line in cell.source.splitlines():
            fence = line.lstrip().startswith(("```", "~~~"))
            if title is None:
                if fence:
                    in_fence = not in_fence
                elif not in_fence and line.startswith("# "):
                    title = line[2:].strip().rstrip("#").strip()
                continue
            if fence or in_fence:
                if fence and not in_fence and blocks[-1]:
                    blocks.append([])
                if fence:
                    in_fence = not in_fence
                blocks[-1].append(line)  # a fenced block stays one block, blank lines and all
            elif line.strip():
                blocks[-1].append(line)
            elif blocks[-1]:
                blocks.append([])
        if title is not None and blocks[-1]:
            blocks.append([])  # a cell ends a paragraph
    for block in blocks:
        first = block[0].lstrip() if block else ""
        # Skip what is not a paragraph: headings, fences, lists, tables, quotes, raw HTML.
        if not block or first.startswith(("#", "```", "~~~", "|", ">", "<", "* ", "- ", "+ ")):
            continue
        if re.match(r"\d+[.)] ", first):
            continue
        text = _plain_text("\n".join(block))
        if text and text[-1] not in ".?!:;)\"'”’…":
            text += " …"  # the paragraph leads into a list or a figure: say it goes on
        return (_plain_text(title) if title else None), text
    return (_plain_text(title) if title else None), ""


def notebooks_in(notebooks_dir: Path) -> list[Path]:
    return sorted(p for p in Path(notebooks_dir).glob("*.ipynb") if p.is_file())


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def without_widgets(nb) -> int:
    """Drop every widget view from ``nb``'s outputs (a page can only show the other types an output
    carries: a stepper's PNG, or its text) and the saved widget state; return the views dropped.
    Changes this in-memory copy only."""
    dropped = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
                dropped += 1
    nb.metadata.pop("widgets", None)
    return dropped


def _has_outputs(nb) -> bool:
    code = [c for c in nb.cells if c.cell_type == "code"]
    return not code or any(c.get("execution_count") is not None or c.get("outputs") for c in code)


# ---------------------------------------------------------------------------------------------
# Building


def _nav(pages: list[Page], i: int) -> str:
    def link(page: Page, rel: str, arrow_left: str, arrow_right: str) -> str:
        return (f'<a href="{quote(page.filename)}" rel="{rel}">{arrow_left}'
                f"{html.escape(page.title)}{arrow_right}</a>")

    parts = [f'<a href="{INDEX}">Contents</a>']
    if i > 0:
        parts.append(f'<span class="book-nav-prev">{link(pages[i - 1], "prev", "← ", "")}</span>')
    if i + 1 < len(pages):
        parts.append(f'<span class="book-nav-next">{link(pages[i + 1], "next", "", " →")}</span>')
    return '<nav class="book-nav" aria-label="book navigation">' + " ".join(parts) + "</nav>"


def _index_html(pages: list[Page]) -> str:
    items = "\n".join(
        f'  <li><a href="{quote(p.filename)}">{html.escape(p.title)}</a>'
        f'<p>{html.escape(p.description)}</p></li>'
        for p in pages
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8" />
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>paged-attention: the notebooks</title>
<style type="text/css">
  body {{ font-family: system-ui, sans-serif; max-width: 50em; margin: 2em auto; padding: 0 1em;
         line-height: 1.5; color: #222; }}
  ol {{ list-style: none; padding: 0; }}
  li {{ margin: 1.2em 0; }}
  li > a {{ font-size: 1.15em; font-weight: 600; }}
  li > p {{ margin: 0.3em 0 0; }}
  .note {{ color: #555; font-size: 0.9em; }}
</style>
</head>
<body>
<h1 id="contents">paged-attention: the notebooks</h1>
<p class="note">Static pages made from the executed notebooks in <code>notebooks/</code> by
<code>tools/build_book.py</code>; the outputs are the ones saved in the notebooks. To run the code
yourself, clone the repository and run <code>make lab</code>.</p>
<ol>
{items}
</ol>
</body>
</html>
"""


def _exporter() -> HTMLExporter:
    return HTMLExporter(
        template_name="lab",
        template_file="book_page.html.j2",
        extra_loaders=[jinja2.DictLoader({"book_page.html.j2": _PAGE_TEMPLATE})],
        embed_images=True,  # images in markdown become data URIs: one file per page
    )


def build(out_dir: Path = DEFAULT_OUT, notebooks_dir: Path = NOTEBOOKS,
          quiet: bool = False) -> list[Page]:
    """Write one page per notebook and index.html into out_dir; return the pages in order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))

    paths = notebooks_in(notebooks_dir)
    if not paths:
        raise SystemExit(f"no notebooks in {notebooks_dir}")
    read = [nbformat.read(p, as_version=4) for p in paths]
    pages = []
    for path, nb in zip(paths, read):
        title, description = title_and_description(nb)
        pages.append(Page(path, title or path.stem, description))
        if not _has_outputs(nb):
            print(f"warning: {path.name} has no saved outputs (run tools/run_notebooks.py first)",
                  file=sys.stderr)

    exporter = _exporter()
    for i, (page, nb) in enumerate(zip(pages, read)):
        start = time.perf_counter()
        nb.metadata["title"] = page.title  # the page's <title>; only this in-memory copy changes
        without_widgets(nb)
        body, _ = exporter.from_notebook_node(nb, resources={
            "metadata": {"name": page.notebook.stem, "path": str(page.notebook.parent)},
            "book_nav": _nav(pages, i),
        })
        body = _NOTEBOOK_HREF.sub(lambda m: f"href={m[1]}{m[2]}.html{m[3] or ''}{m[1]}", body)
        (out_dir / page.filename).write_text(body, encoding="utf-8")
        say(f"  {page.filename}  ({time.perf_counter() - start:.1f} s)")
    (out_dir / INDEX).write_text(_index_html(pages), encoding="utf-8")
    return pages


# ---------------------------------------------------------------------------------------------
# Checking


class _Links(HTMLParser):
    """The ids (and <a name=...>) a page defines and the hrefs of its links."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if value is None:
                continue
            if key == "id" or (key == "name" and tag == "a"):
                self.ids.add(value)
                self.ids.add(unquote(value))  # nbconvert writes heading ids percent-encoded
            elif key == "href" and tag in ("a", "area"):
                self.hrefs.append(value)


def _scan(path: Path, cache: dict[Path, _Links]) -> _Links:
    if path not in cache:
        parser = _Links()
        parser.feed(path.read_text(encoding="utf-8"))
        parser.close()
        cache[path] = parser
    return cache[path]


def check(out_dir: Path = DEFAULT_OUT, notebooks_dir: Path = NOTEBOOKS) -> tuple[list[str], int]:
    """Return (problems, links checked); no problems means the book is whole."""
    out_dir = Path(out_dir).resolve()
    problems: list[str] = []
    cache: dict[Path, _Links] = {}

    expected = [p.stem + ".html" for p in notebooks_in(notebooks_dir)]
    for name in expected:
        if not (out_dir / name).is_file():
            problems.append(f"missing page: {name} (for notebooks/{name[:-5]}.ipynb)")
    index = out_dir / INDEX
    if not index.is_file():
        problems.append(f"missing {INDEX}")
    else:
        linked = {unquote(urlsplit(h).path) for h in _scan(index, cache).hrefs}
        problems += [f"{INDEX} does not link {name}" for name in expected if name not in linked]

    links = 0
    for page in sorted(out_dir.rglob("*.html")):
        where = page.relative_to(out_dir).as_posix()
        for href in _scan(page, cache).hrefs:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith("//"):
                continue  # outside the book: not ours to check
            links += 1
            if parts.path:
                target = (page.parent / unquote(parts.path)).resolve()
                if not target.is_relative_to(out_dir):
                    problems.append(f'{where}: href="{href}" leads out of the book')
                    continue
                if not target.is_file():
                    missing = target.relative_to(out_dir).as_posix()
                    problems.append(f'{where}: href="{href}": no file {missing}')
                    continue
            else:
                target = page
            anchor = unquote(parts.fragment)
            if anchor and target.suffix == ".html" and anchor not in _scan(target, cache).ids:
                problems.append(f'{where}: href="{href}": no element with id "{anchor}" '
                                f"in {target.relative_to(out_dir).as_posix()}")
    # A link repeated on a page (the navigation bar is at both ends) is reported once.
    return list(dict.fromkeys(problems)), links


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_OUT,
                    help="where the pages go (default: build/book)")
    ap.add_argument("--notebooks", type=Path, default=NOTEBOOKS,
                    help="folder of executed notebooks (default: notebooks/)")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="build, then check every page and link")
    group.add_argument("--check-only", action="store_true", help="check a book built earlier")
    args = ap.parse_args(argv)

    if not args.check_only:
        start = time.perf_counter()
        pages = build(args.out_dir, args.notebooks)
        took = time.perf_counter() - start
        print(f"{args.out_dir}: {len(pages)} pages and {INDEX} in {took:.1f} s")
    if args.check or args.check_only:
        problems, links = check(args.out_dir, args.notebooks)
        if problems:
            print(f"book check FAILED: {len(problems)} problem(s) in {args.out_dir}",
                  file=sys.stderr)
            for p in problems:
                print(f"  {p}", file=sys.stderr)
            return 1
        print(f"book check ok: every notebook has a page, {INDEX} links them all, "
              f"{links} internal links resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
