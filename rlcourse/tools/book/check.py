"""The checks of the built web book (``make book`` runs them; so does ``tests/test_book.py``).

:func:`check_site` lists every problem of a site built by :mod:`rlcourse.tools.book`: a page
missing or out of course order along previous/next, a page search does not index, a notebook's
figure missing from its page, a notebook page without the link to its notebook and how to run it,
and, on every page (:func:`page_problems`), a link, anchor, image, stylesheet or script that points
at nothing, raw ``$...$`` maths, a LaTeX macro outside maths, a macro MathJax does not know (it
would show it in red), or a Python traceback.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from rlcourse.tools.book.build import ROOT, is_picture, mathjax_dir, site_pages, static_outputs

_RAW_DOLLAR = re.compile(r"(?<![\\\w])\$[^$\s][^$\n]*\$")
_MACRO = re.compile(r"\\([A-Za-z]+)")


@lru_cache(maxsize=1)
def mathjax_macros() -> frozenset[str]:
    """Every name MathJax's TeX input defines or autoloads (a generous list: object keys and strings)."""
    code = (mathjax_dir() / "tex-mml-chtml.js").read_text(encoding="utf-8")
    return frozenset(re.findall(r'[{,]"?(?:\\\\)?([A-Za-z]+)"?:', code)
                     + re.findall(r'"(?:\\\\)?([A-Za-z]+)"', code))


def _visible_text(soup) -> str:
    """The prose a reader sees: without code, maths, scripts and styles."""
    for tag in soup(["script", "style", "pre", "code", "textarea"]) + soup.select(".math"):
        tag.decompose()
    return soup.get_text(" ")


def page_problems(page: Path, html_dir: Path, soups: dict) -> list[str]:
    """What is wrong on one built page: links, anchors, images, maths, tracebacks.

    ``soups`` maps each page of the site to its parsed HTML (the anchors of links are looked up
    there); this page's soup loses its code and maths on the way (the last check reads the prose).
    """
    soup, name, problems = soups[page], page.relative_to(html_dir), []
    for tag, attr in (("a", "href"), ("img", "src"), ("link", "href"), ("script", "src")):
        for t in soup.find_all(tag):
            url = t.get(attr)
            if not url or re.match(r"^(https?:|mailto:|javascript:|data:)", url):
                continue
            path, _, fragment = url.partition("#")
            target = (page.parent / path.split("?")[0]).resolve() if path else page.resolve()
            if not target.exists():
                problems.append(f"{name}: <{tag} {attr}={url!r}> points at nothing")
            elif fragment and target in soups and not soups[target].find(id=fragment):
                problems.append(f"{name}: link {url!r} names an anchor its page does not have")
    if "Traceback (most recent call last)" in soup.get_text() or soup.select(".output.traceback, .output.error"):
        problems.append(f"{name}: shows a Python traceback")
    unknown = {m for t in soup.select(".math") for m in _MACRO.findall(t.get_text())} - mathjax_macros()
    if unknown:
        problems.append(f"{name}: maths uses macros MathJax does not know: {sorted(unknown)}")
    prose = _visible_text(soup)
    for pattern, what in ((_RAW_DOLLAR, "raw $...$ maths"), (_MACRO, "a LaTeX macro outside maths")):
        hit = pattern.search(prose)
        if hit:
            problems.append(f"{name}: shows {what}: {prose[max(0, hit.start() - 40):hit.end() + 40]!r}")
    return problems


def _figures(nb: dict) -> int:
    """The pictures a notebook's page must show: its figures, and a widget's saved picture."""
    return sum(1 for c in nb["cells"] for o in static_outputs(nb, c.get("outputs", [])) if is_picture(o))


def check_site(html_dir: Path, root: Path = ROOT) -> list[str]:
    """Every problem found in the built site, as sentences (empty when the site is sound)."""
    from bs4 import BeautifulSoup

    html_dir, docs = html_dir.resolve(), site_pages(root)
    problems = [f"missing page {d}.html" for d in docs if not (html_dir / f"{d}.html").exists()]
    if problems:
        return problems
    soups = {page: BeautifulSoup(page.read_text(), "html.parser")
             for page in sorted(html_dir.rglob("*.html")) if "_static" not in page.parts}
    order, page = ["index"], html_dir / "index.html"
    while (nxt := soups[page].select_one("a.right-next")) and len(order) <= len(soups):
        page = (page.parent / nxt["href"].partition("#")[0]).resolve()
        order.append(page.relative_to(html_dir).with_suffix("").as_posix())
    if order != docs:
        problems.append(f"previous/next walks {order}, expected {docs}")
    index = (html_dir / "searchindex.js").read_text() if (html_dir / "searchindex.js").exists() else ""
    problems += [f"search does not index {d}" for d in docs if f'"{d}"' not in index]
    for doc in (d for d in docs if d.startswith(("course/", "exercises/"))):
        soup = soups[html_dir / f"{doc}.html"]
        figures = _figures(json.loads((root / f"{doc}.ipynb").read_text()))
        if len(soup.select(".cell_output img")) != figures:
            problems.append(f"{doc}.html shows {len(soup.select('.cell_output img'))} figures; "
                            f"its notebook has {figures}")
        if not soup.select('a[href$=".ipynb"]') or "make lab" not in soup.get_text():
            problems.append(f"{doc}.html has no link to its notebook or no 'how to run it'")
    for page in soups:  # last: page_problems strips code and maths from each soup
        problems += page_problems(page, html_dir, soups)
    return problems
